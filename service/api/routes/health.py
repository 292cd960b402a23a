"""GET /healthz (liveness) and GET /readyz (readiness), open even when an API key is set."""

from __future__ import annotations

from fastapi import APIRouter

from service.api.deps import StateDep
from service.api.openapi import error_responses
from service.api.schemas.responses import StatusResponse

router = APIRouter(tags=["operations"])


@router.get("/healthz", responses=error_responses(503))
async def healthz(state: StateDep) -> StatusResponse:
    """200 while the process can serve (loading and draining included); 503 if its engine died."""
    state.check_alive()
    return StatusResponse(status="ok")


@router.get("/readyz", responses=error_responses(503))
async def readyz(state: StateDep) -> StatusResponse:
    """200 once the models are loaded and warm; 503 (error body) while loading, draining or failed."""
    state.engine_for_request()
    return StatusResponse(status="ready")
