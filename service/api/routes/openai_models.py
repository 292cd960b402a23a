"""GET /v1/models: the resident models in OpenAI's list shape, with what `/models` says of positions,
then the `--alias` names (`service.requests.model_names`), each with its model's card and TARGET."""

from __future__ import annotations

from fastapi import APIRouter

from service.api.deps import AliasesDep, EngineDep
from service.api.openai_runs import created_now
from service.api.openapi import openai_errors
from service.api.schemas.openai import OpenAIModel, OpenAIModelList
from service.engine.types import ModelInfo

router = APIRouter(tags=["openai"])


@router.get("/v1/models", responses=openai_errors())
async def list_models(engine: EngineDep, aliases: AliasesDep) -> OpenAIModelList:
    created = created_now()

    def card(name: str, info: ModelInfo, target: str | None = None) -> OpenAIModel:
        return OpenAIModel(
            id=name,
            created=created,
            scheme=info.scheme,
            native_context=info.native_context,
            max_context=info.max_context,
            supported_scalings=list(info.supported_scalings),
            root=info.name,
            target=target,
        )

    models = [card(info.name, info) for info in engine.models()]
    for name, named in aliases.named.items():  # each checked at start-up: its model is resident
        models.append(card(name, engine.resolve_model(named.model, None), aliases.targets[name]))
    return OpenAIModelList(data=models)
