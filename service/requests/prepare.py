"""From a validated request body to what the engine runs: model, token ids and scaling.

Checks that need the chosen model (scheme support for a scaling, vocabulary, context length) are
the catalog's (`service.engine.catalog`), the same functions the engine runs at submission; they
are made here in the order a user would want them reported: which model, then how it is scaled,
then whether the input fits.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pe_runtime import RopeScaling
from service.engine.catalog import MIN_SCORED_TOKENS, check_room, check_scaling_supported, check_tokens
from service.engine.types import Engine, ModelInfo
from service.requests.bodies import GenerateRequest, InferenceInput, ModelSelection
from service.requests.errors import ErrorKind, RequestError

RESUME_FIELD = "resume_from"


@dataclass(frozen=True)
class Target:
    """The model and scaling a request runs with (None: the model's default scaling)."""

    model: ModelInfo
    scaling: RopeScaling | None


@dataclass(frozen=True)
class PreparedInput:
    target: Target
    tokens: tuple[int, ...]
    resumed: tuple[int, ...] = ()  # a resumed stream's tokens, which its client holds (`resume_from`)


def resolve_target(engine: Engine, body: ModelSelection) -> Target:
    """`model` / `pe` to a resident model, and `pe_scaling` to a scaling that model can apply."""
    model = engine.resolve_model(body.model, body.pe)
    requested = body.pe_scaling
    if requested is None:
        return Target(model=model, scaling=None)
    check_scaling_supported(model, requested.type)
    scaling = RopeScaling.from_hf(requested.to_hf(), max_position_embeddings=model.native_context)
    return Target(model=model, scaling=scaling)


def prepare_input(
    engine: Engine, body: InferenceInput, *, new_tokens: int, min_tokens: int = 1
) -> PreparedInput:
    """Resolve everything a request needs; raises RequestError / EngineError / PEConfigError (all 4xx).

    Whether the scaling can run at the total length is the engine's call, made when the request is
    submitted (`Engine.submit` raises the same errors as `Engine.resolve_pe`).
    """
    if (body.prompt is None) == (body.tokens is None):
        raise RequestError(
            ErrorKind.INVALID, "Exactly one of 'prompt' and 'tokens' is required.", param="prompt"
        )
    target = resolve_target(engine, body)
    field = "prompt" if body.prompt is not None else "tokens"
    given = body.prompt if body.prompt is not None else body.tokens
    assert given is not None
    tokens = input_tokens(engine, target.model, given, field=field, minimum=min_tokens)
    check_room(target.model, len(tokens), field=field, new_tokens=new_tokens)
    return PreparedInput(target=target, tokens=tokens)


def prepare_generation(engine: Engine, body: GenerateRequest, *, stream: bool) -> PreparedInput:
    """`prepare_input` for a generation, with the tokens a resumed stream's client already holds.

    `resume_from` continues a stream, so a generation that does not stream cannot have one; it
    holds at most `max_new_tokens` tokens of the model's vocabulary.
    """
    prepared = prepare_input(engine, body, new_tokens=body.max_new_tokens)
    if body.resume_from is None:
        return prepared
    if not stream:
        message = "Only a streamed generation can be resumed: resume_from needs stream: true."
        raise RequestError(ErrorKind.INVALID, message, param=RESUME_FIELD)
    held = tuple(body.resume_from.tokens)
    field = f"{RESUME_FIELD}.tokens"
    if len(held) > body.max_new_tokens:
        message = f"{field} holds {len(held)} tokens, more than max_new_tokens ({body.max_new_tokens})."
        raise RequestError(ErrorKind.INVALID, message, param=field)
    check_tokens(prepared.target.model, held, field=field, minimum=1)
    return replace(prepared, resumed=held)


def prepare_scored(engine: Engine, body: InferenceInput) -> PreparedInput:
    """A text to score: `MIN_SCORED_TOKENS` at least (the first has no prefix), nothing generated."""
    return prepare_input(engine, body, new_tokens=0, min_tokens=MIN_SCORED_TOKENS)


def input_tokens(
    engine: Engine, model: ModelInfo, given: str | list[int], *, field: str, minimum: int = 1
) -> tuple[int, ...]:
    """Text encoded as a document (BOS first), or token ids checked against the vocabulary."""
    tokens = tuple(engine.tokenize(model.name, given)) if isinstance(given, str) else tuple(given)
    check_tokens(model, tokens, field=field, minimum=minimum)
    return tokens
