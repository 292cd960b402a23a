"""From a request body to what the engine runs: model, token ids, scaling and rule, and the
names the body gave them.

Nothing here checks the input against the model: every such rule (scheme support for a scaling or
a rule, vocabulary, context length) is the catalog's (`service.engine.catalog`) and runs once, when
the request is submitted, naming fields as `PreparedInput.names` says the body wrote them. What
runs here is what turns the body into that request: which model, parsing the configuration,
encoding text.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from pe_runtime import PEConfigError, RopeScaling
from service.engine.catalog import check_tokens
from service.engine.errors import EngineError
from service.engine.types import ATTENTION_FIELD, SCALING_FIELD, Engine, FieldNames, ModelInfo
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
    # The configuration fields that name set (`NAME@SPEC`, an `--alias`): their errors name `model`.
    set_by_name: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        """The model's name in responses: as the request asked for it."""
        return self.asked if self.asked is not None else self.model.name

    def field_names(
        self, *, tokens: str, length: str | None = None, new_tokens: str = "max_new_tokens"
    ) -> FieldNames:
        """How a route's body names its input and bound, for the engine's errors."""
        return FieldNames(
            tokens=tokens,
            length=length,
            new_tokens=new_tokens,
            model=self.asked,
            set_by_model=self.set_by_name,
        )


@dataclass(frozen=True)
class PreparedInput:
    target: Target
    tokens: tuple[int, ...]
    names: FieldNames  # how the body named the input, for the errors of the checks at submission
    resumed: tuple[int, ...] = ()  # a resumed stream's tokens, which its client holds (`resume_from`)


def resolve_target(engine: Engine, body: ModelSelection, aliases: ModelAliases = NO_ALIASES) -> Target:
    """`model` / `pe` to a resident model, and `pe_scaling` and `pe_attention` parsed to a scaling
    and a rule. `model` may set the two itself (`NAME@SPEC`, an `--alias`:
    `service.requests.model_names`); what it sets is parsed here as the fields are, and whether the
    model can apply them is checked at submission, with the rest."""
    named = resolve_name(engine, body.model, aliases)
    model = engine.resolve_model(named.model, body.pe)
    asked = body.model if body.model not in (None, model.name) else None
    wanted_rule = merged_field(body.model, named.attention, body.pe_attention, ATTENTION_FIELD)
    requested = merged_field(body.model, named.scaling, body.pe_scaling, SCALING_FIELD)
    with set_by_name(body.model, named.attention is not None):
        attention = parse_rule(wanted_rule)
    scaling = None
    if requested is not None:
        with set_by_name(body.model, named.scaling is not None):
            scaling = RopeScaling.from_hf(requested.to_hf(), max_position_embeddings=model.native_context)
    set_fields = ((SCALING_FIELD, named.scaling), (ATTENTION_FIELD, named.attention))
    return Target(
        model=model,
        scaling=scaling,
        attention=attention,
        asked=asked,
        set_by_name=tuple(field for field, value in set_fields if value is not None),
    )


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
            resolved = resolve_target(engine, ModelSelection.model_validate({"model": name}), aliases)
            with set_by_name(name, True):  # what the alias sets, checked as a request's would be
                engine.resolve_pe(resolved.model.name, resolved.scaling, 1, resolved.attention)
        except (RequestError, EngineError, PEConfigError) as error:
            message = error.message if isinstance(error, RequestError | EngineError) else str(error)
            raise ModelNameError(f"{ALIAS_FLAG} {name}={target}: {message}") from None
        except ModelNameError as error:
            raise ModelNameError(f"{ALIAS_FLAG} {name}={target}: {error}") from None


def parse_rule(requested: Mapping[str, Any] | None) -> AttentionRule | None:
    """The request's `pe_attention` as a rule (None: none asked, or plain standard, which the fast
    paths run as no rule at all); errors name `pe_attention.<field>`."""
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
    return None if rule == StandardAttention() else rule


def prepare_input(engine: Engine, body: InferenceInput, aliases: ModelAliases = NO_ALIASES) -> PreparedInput:
    """Resolve everything a request needs; raises RequestError / EngineError / PEConfigError (all 4xx)."""
    if (body.prompt is None) == (body.tokens is None):
        raise RequestError(
            ErrorKind.INVALID, "Exactly one of 'prompt' and 'tokens' is required.", param="prompt"
        )
    target = resolve_target(engine, body, aliases)
    field = "prompt" if body.prompt is not None else "tokens"
    given = body.prompt if body.prompt is not None else body.tokens
    assert given is not None
    return prepare_for(engine, target, given, field=field)


def prepare_for(
    engine: Engine,
    target: Target,
    given: str | list[int],
    *,
    field: str,
    new_tokens_field: str = "max_new_tokens",
    length_field: str | None = None,
) -> PreparedInput:
    """One input for a resolved target, as every route prepares it (the OpenAI routes too, with
    their own field names): text encoded as a document, ids as given; `length_field` names the
    input where its length is in question (default `field`)."""
    tokens = tuple(engine.tokenize(target.model.name, given)) if isinstance(given, str) else tuple(given)
    names = target.field_names(tokens=field, length=length_field, new_tokens=new_tokens_field)
    return PreparedInput(target=target, tokens=tokens, names=names)


def prepare_generation(
    engine: Engine, body: GenerateRequest, *, stream: bool, aliases: ModelAliases = NO_ALIASES
) -> PreparedInput:
    """`prepare_input` for a generation, with the tokens a resumed stream's client already holds.

    `resume_from` continues a stream, so a generation that does not stream cannot have one; it
    holds at most `max_new_tokens` tokens (of the model's vocabulary: checked at submission).
    """
    prepared = prepare_input(engine, body, aliases=aliases)
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
    return replace(prepared, resumed=held)


def prepare_scored(engine: Engine, body: InferenceInput, aliases: ModelAliases = NO_ALIASES) -> PreparedInput:
    """A text to score (at least `MIN_SCORED_TOKENS`, checked at submission), nothing generated."""
    return prepare_input(engine, body, aliases=aliases)


def checked_ids(model: ModelInfo, tokens: list[int], *, field: str) -> tuple[int, ...]:
    """Token ids a route reads without running them (the tokenizer's decode), checked against
    the vocabulary, the one rule they meet."""
    check_tokens(model, tokens, field=field, minimum=0)
    return tuple(tokens)
