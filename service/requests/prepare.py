"""From a validated request body to what the engine runs: model, token ids and scaling.

Checks that need the chosen model (scheme support for a scaling, vocabulary, context length) are
the catalog's (`service.engine.catalog`), the same functions the engine runs at submission; they
are made here in the order a user would want them reported: which model, then how it is scaled,
then whether the input fits.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from pe_runtime import PEConfigError, RopeScaling
from service.engine.catalog import (
    MIN_SCORED_TOKENS,
    check_attention_supported,
    check_room,
    check_scaling_supported,
    check_tokens,
)
from service.engine.errors import EngineError
from service.engine.types import ATTENTION_FIELD, SCALING_FIELD, Engine, ModelInfo
from service.model.attention_rules import AttentionRule, StandardAttention, parse_attention
from service.requests.bodies import GenerateRequest, InferenceInput, ModelSelection
from service.requests.errors import ErrorKind, RequestError
from service.requests.model_names import (
    ALIAS_FLAG,
    NO_ALIASES,
    ModelAliases,
    ModelNameError,
    merged_field,
    resolve_name,
    set_by_name,
)

RESUME_FIELD = "resume_from"


@dataclass(frozen=True)
class Target:
    """The model, scaling and attention rule a request runs with (None: the model's default
    scaling; standard attention)."""

    model: ModelInfo
    scaling: RopeScaling | None
    attention: AttentionRule | None = None
    # The model name as the request wrote it, where that is not the model's own (an alias).
    asked: str | None = None

    @property
    def name(self) -> str:
        """The model's name in responses: as the request asked for it."""
        return self.asked if self.asked is not None else self.model.name


@dataclass(frozen=True)
class PreparedInput:
    target: Target
    tokens: tuple[int, ...]
    resumed: tuple[int, ...] = ()  # a resumed stream's tokens, which its client holds (`resume_from`)


def resolve_target(engine: Engine, body: ModelSelection, aliases: ModelAliases = NO_ALIASES) -> Target:
    """`model` / `pe` to a resident model, and `pe_scaling` and `pe_attention` to a scaling and a
    rule that model can apply. `model` may set the two itself (`NAME@SPEC`, an `--alias`:
    `service.requests.model_names`); what it sets is resolved here as the fields are."""
    named = resolve_name(engine, body.model, aliases)
    model = engine.resolve_model(named.model, body.pe)
    asked = body.model if body.model not in (None, model.name) else None
    wanted_rule = merged_field(body.model, named.attention, body.pe_attention, ATTENTION_FIELD)
    requested = merged_field(body.model, named.scaling, body.pe_scaling, SCALING_FIELD)
    with set_by_name(body.model, named.attention is not None):
        attention = resolve_attention(model, wanted_rule)
    scaling = None
    if requested is not None:
        with set_by_name(body.model, named.scaling is not None):
            check_scaling_supported(model, requested.type)
            scaling = RopeScaling.from_hf(requested.to_hf(), max_position_embeddings=model.native_context)
    if named.scaling is not None or named.attention is not None:
        # What the model checks beyond each field (LongRoPE's lists against its rotary dimension,
        # a rule against the scaling) is checked at submission, naming the fields; checked here
        # for what a name set, so that its errors name `model`.
        with set_by_name(body.model, True):
            engine.resolve_pe(model.name, scaling, 1, attention)
    return Target(model=model, scaling=scaling, attention=attention, asked=asked)


def resolve_model_name(engine: Engine, name: str | None, aliases: ModelAliases = NO_ALIASES) -> ModelInfo:
    """The resident model a name stands for, whatever configuration it sets (the tokenizer routes)."""
    return engine.resolve_model(resolve_name(engine, name, aliases).model, None)


def check_aliases(engine: Engine, aliases: ModelAliases) -> None:
    """At start-up, once the models are loaded: every `--alias` names a resident model, takes no
    resident model's name, and sets what its model can apply, or ModelNameError names the flag."""
    resident = {info.name for info in engine.models()}
    for name, target in aliases.targets.items():
        try:
            if name in resident:
                raise ModelNameError(f"{name!r} is a resident model's name")
            resolve_target(engine, ModelSelection.model_validate({"model": name}), aliases)
        except (RequestError, EngineError, PEConfigError) as error:
            message = error.message if isinstance(error, RequestError | EngineError) else str(error)
            raise ModelNameError(f"{ALIAS_FLAG} {name}={target}: {message}") from None
        except ModelNameError as error:
            raise ModelNameError(f"{ALIAS_FLAG} {name}={target}: {error}") from None


def resolve_attention(model: ModelInfo, requested: Mapping[str, Any] | None) -> AttentionRule | None:
    """The request's `pe_attention` as a validated rule the model's scheme applies; errors name
    `pe_attention.<field>`."""
    if requested is None:
        return None
    try:
        rule = parse_attention(requested)
    except PEConfigError as error:
        raise RequestError(
            ErrorKind.INVALID,
            f"{ATTENTION_FIELD}.{error.field}: {error.message}",
            param=f"{ATTENTION_FIELD}.{error.field}",
        ) from None
    check_attention_supported(model, rule)
    return None if rule == StandardAttention() else rule  # plain standard: the fast paths run it


def prepare_input(
    engine: Engine,
    body: InferenceInput,
    *,
    new_tokens: int,
    min_tokens: int = 1,
    aliases: ModelAliases = NO_ALIASES,
) -> PreparedInput:
    """Resolve everything a request needs; raises RequestError / EngineError / PEConfigError (all 4xx).

    Whether the scaling can run at the total length is the engine's call, made when the request is
    submitted (`Engine.submit` raises the same errors as `Engine.resolve_pe`).
    """
    if (body.prompt is None) == (body.tokens is None):
        raise RequestError(
            ErrorKind.INVALID, "Exactly one of 'prompt' and 'tokens' is required.", param="prompt"
        )
    target = resolve_target(engine, body, aliases)
    field = "prompt" if body.prompt is not None else "tokens"
    given = body.prompt if body.prompt is not None else body.tokens
    assert given is not None
    return prepare_for(engine, target, given, field=field, new_tokens=new_tokens, min_tokens=min_tokens)


def prepare_for(
    engine: Engine,
    target: Target,
    given: str | list[int],
    *,
    field: str,
    new_tokens: int,
    new_tokens_field: str = "max_new_tokens",
    min_tokens: int = 1,
    room_field: str | None = None,
) -> PreparedInput:
    """One input for a resolved target, as every route prepares it (the OpenAI routes too, with their
    own field names): text encoded as a document or ids checked against the vocabulary, then the
    room it leaves for `new_tokens` (`room_field` names the input there, default `field`)."""
    tokens = input_tokens(engine, target.model, given, field=field, minimum=min_tokens)
    check_room(
        target.model,
        len(tokens),
        field=room_field or field,
        new_tokens=new_tokens,
        new_tokens_field=new_tokens_field,
        attention=target.attention,
    )
    return PreparedInput(target=target, tokens=tokens)


def prepare_generation(
    engine: Engine, body: GenerateRequest, *, stream: bool, aliases: ModelAliases = NO_ALIASES
) -> PreparedInput:
    """`prepare_input` for a generation, with the tokens a resumed stream's client already holds.

    `resume_from` continues a stream, so a generation that does not stream cannot have one; it
    holds at most `max_new_tokens` tokens of the model's vocabulary.
    """
    prepared = prepare_input(engine, body, new_tokens=body.max_new_tokens, aliases=aliases)
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


def prepare_scored(engine: Engine, body: InferenceInput, aliases: ModelAliases = NO_ALIASES) -> PreparedInput:
    """A text to score: `MIN_SCORED_TOKENS` at least (the first has no prefix), nothing generated."""
    return prepare_input(engine, body, new_tokens=0, min_tokens=MIN_SCORED_TOKENS, aliases=aliases)


def input_tokens(
    engine: Engine, model: ModelInfo, given: str | list[int], *, field: str, minimum: int = 1
) -> tuple[int, ...]:
    """Text encoded as a document (BOS first), or token ids checked against the vocabulary."""
    tokens = tuple(engine.tokenize(model.name, given)) if isinstance(given, str) else tuple(given)
    check_tokens(model, tokens, field=field, minimum=minimum)
    return tokens
