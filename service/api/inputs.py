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
    field = "prompt" if body.prompt is not None else "tokens"
    tokens = input_tokens(engine, model, body.prompt if body.prompt is not None else body.tokens, field=field)
    check_lengths(model, tokens, field=field, new_tokens=new_tokens, min_tokens=min_tokens)
    return PreparedInput(model=model, tokens=tokens, scaling=scaling)


def input_tokens(
    engine: Engine, model: ModelInfo, given: str | list[int] | None, *, field: str
) -> tuple[int, ...]:
    """Text encoded as a document (BOS first), or token ids checked against the vocabulary."""
    assert given is not None
    if isinstance(given, str):
        return tuple(engine.encode(model.name, given))
    for index, token in enumerate(given):
        if token >= model.vocab_size:
            vocabulary = f"0..{model.vocab_size - 1}"
            message = f"{field}.{index}: id {token} is outside the vocabulary of {model.name} ({vocabulary})."
            raise APIError(422, message, param=f"{field}.{index}")
    return tuple(given)


def check_lengths(
    model: ModelInfo,
    tokens: tuple[int, ...],
    *,
    field: str,
    new_tokens: int,
    min_tokens: int = 1,
    new_tokens_field: str = "max_new_tokens",
) -> None:
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
        limit = f"the max_context of {model.name} ({model.max_context})"
        message = f"{new_tokens_field} ({new_tokens}) exceeds {limit}."
        raise APIError(422, message, param=new_tokens_field)


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
