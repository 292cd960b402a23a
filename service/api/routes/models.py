"""GET /models: the resident models, their schemes, contexts and the scalings each accepts."""

from __future__ import annotations

from fastapi import APIRouter

from service.api.deps import EngineDep
from service.api.openapi import error_responses
from service.requests.convert import model_card
from service.requests.responses import ModelsResponse

router = APIRouter(tags=["models"])


@router.get("/models", responses=error_responses(401, 503))
async def list_models(engine: EngineDep) -> ModelsResponse:
    return ModelsResponse(models=[model_card(info) for info in engine.models()])
