"""GET /healthz (liveness) and GET /readyz (readiness), open even when an API key is set."""

from __future__ import annotations

from fastapi import APIRouter

from service.api.deps import StateDep
from service.api.routes.responses import error_responses
from service.api.schemas.responses import StatusResponse

router = APIRouter(tags=["operations"])


@router.get("/healthz")
async def healthz() -> StatusResponse:
    """200 while the process serves HTTP at all; orchestrators restart it when this fails."""
    return StatusResponse(status="ok")


@router.get("/readyz", responses=error_responses(503))
async def readyz(state: StateDep) -> StatusResponse:
    """200 once the models are loaded and warm; 503 (error body) while loading, draining or failed."""
    state.engine_for_request()
    return StatusResponse(status="ready")
