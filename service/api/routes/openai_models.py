"""GET /v1/models: the resident models in OpenAI's list shape, with what `/models` says of positions."""

from __future__ import annotations

from fastapi import APIRouter

from service.api.deps import EngineDep
from service.api.openai_runs import created_now
from service.api.openapi import openai_errors
from service.api.schemas.openai import OpenAIModel, OpenAIModelList

router = APIRouter(tags=["openai"])


@router.get("/v1/models", responses=openai_errors())
async def list_models(engine: EngineDep) -> OpenAIModelList:
    created = created_now()
    return OpenAIModelList(
        data=[
            OpenAIModel(
                id=info.name,
                created=created,
                scheme=info.scheme,
                native_context=info.native_context,
                max_context=info.max_context,
                supported_scalings=list(info.supported_scalings),
            )
            for info in engine.models()
        ]
    )
