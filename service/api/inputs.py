"""From a validated request body to what the engine runs: model, token ids and scaling.

Checks that need the chosen model (scheme support for a scaling, vocabulary, context length) are
made here, in the order a user would want them reported: which model, then how it is scaled,
then whether the input fits.
"""

from __future__ import annotations

from dataclasses import dataclass

from pe_runtime import RopeScaling
from service.api.errors import SCALING_FIELD, APIError
from service.api.schemas.requests import InferenceInput
from service.api.schemas.scaling import PEScaling
from service.engine.types import Engine, ModelInfo


@dataclass(frozen=True)
class PreparedInput:
    model: ModelInfo
    tokens: tuple[int, ...]
    scaling: RopeScaling | None


def prepare_input(
    engine: Engine, body: InferenceInput, *, new_tokens: int, min_tokens: int = 1
) -> PreparedInput:
    """Resolve everything a request needs; raises APIError / EngineError / PEConfigError (all 4xx).

    Whether the scaling can run at the total length is the engine's call, made when the request is
    submitted (`Engine.submit` raises the same errors as `Engine.resolve_pe`).
    """
    if (body.prompt is None) == (body.tokens is None):
        raise APIError(422, "Exactly one of 'prompt' and 'tokens' is required.", param="prompt")
    model = engine.resolve_model(body.model, body.pe)
    scaling = scaling_for(model, body.pe_scaling)
    tokens = _tokens(engine, model, body)
    field = "prompt" if body.prompt is not None else "tokens"
    if len(tokens) < min_tokens:
        raise APIError(
            422, f"{field} must have at least {min_tokens} tokens, got {len(tokens)}.", param=field
        )
    # The input alone over the context is the input's fault, not max_new_tokens' (which /score has
    # not even got); prompt plus max_new_tokens over it is the engine's check, naming max_new_tokens.
    room = model.max_context - (1 if new_tokens else 0)
    if len(tokens) > room:
        needs = ", which must also hold at least one generated token" if new_tokens else ""
        message = f"{field} is {len(tokens)} tokens; the max_context of {model.name} is {model.max_context}"
        raise APIError(422, f"{message}{needs}.", param=field)
    if new_tokens > model.max_context:
        message = (
            f"max_new_tokens ({new_tokens}) exceeds the max_context of {model.name} ({model.max_context})."
        )
        raise APIError(422, message, param="max_new_tokens")
    return PreparedInput(model=model, tokens=tokens, scaling=scaling)


def scaling_for(model: ModelInfo, requested: PEScaling | None) -> RopeScaling | None:
    """The request's scaling for this model, or None for the model's own default."""
    if requested is None:
        return None
    if requested.type not in model.supported_scalings:
        supported = ", ".join(model.supported_scalings) or "none"
        message = (
            f"Scaling {requested.type!r} is not supported by the {model.scheme!r} scheme of model "
            f"{model.name!r}; supported: {supported}."
        )
        raise APIError(422, message, param=f"{SCALING_FIELD}.type")
    return RopeScaling.from_hf(requested.to_hf(), max_position_embeddings=model.native_context)


def _tokens(engine: Engine, model: ModelInfo, body: InferenceInput) -> tuple[int, ...]:
    if body.tokens is None:
        assert body.prompt is not None
        return tuple(engine.encode(model.name, body.prompt))
    for index, token in enumerate(body.tokens):
        if token >= model.vocab_size:
            vocabulary = f"0..{model.vocab_size - 1}"
            message = f"tokens.{index}: id {token} is outside the vocabulary of {model.name} ({vocabulary})."
            raise APIError(422, message, param=f"tokens.{index}")
    return tuple(body.tokens)
