"""GET /healthz (liveness) and GET /readyz (readiness), open even when an API key is set."""

from __future__ import annotations

from fastapi import APIRouter

from service.api.deps import StateDep
from service.api.openapi import error_responses
from service.requests.responses import StatusResponse

router = APIRouter(tags=["operations"])


@router.get("/healthz")
async def healthz() -> StatusResponse:
    """Always 200 while the process answers HTTP (loading and draining included)."""
    return StatusResponse(status="ok")


@router.get("/readyz", responses=error_responses(503))
async def readyz(state: StateDep) -> StatusResponse:
    """200 once the models are loaded and warm, else 503 with the reason in the error body.

    The reasons: still loading, draining, the load failed, or the engine worker died.
    """
    state.engine_for_request()
    return StatusResponse(status="ready")
