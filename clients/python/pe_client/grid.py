"""Grids of lengths, scalings and attention rules for the context-extension lab, checked before
anything is sent.

A scaling SPEC is `none` or `TYPE:key=value,key=value` with the `pe_scaling` fields; several
values of one key (`factor=2|4|8`) expand into one scaling each. An attention SPEC is written the
same way with the `pe_attention` fields (`self_extend:group_size=4|8,window=512`). Types and keys
are checked by the SDK's own models; the ranges a lab run could not use are checked here, and the
lengths and scaling types against the model's card, so a bad grid fails with a message naming the
culprit instead of after some of its cells have already run.

A model may be named with its configuration, as the server reads it (`NAME@SPEC[@SPEC]`, or an
`--alias` name listed by `GET /v1/models`): what the name sets stands for that axis of the grid, and
the grid may not give the same axis too.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar, get_args

from pydantic import BaseModel, ValidationError

from pe_client.attention import AttentionType, PEAttention, parse_attention
from pe_client.errors import PEServeError
from pe_client.scaling import PEScaling, ScalingType, parse_scaling
from pe_client.types import ModelInfo

# Long field names shortened in labels; the JSON output keeps the full scaling.
_SHORT_KEYS = {"original_max_position_embeddings": "orig", "short_factor": "short", "long_factor": "long"}

ScalingSpec = str | PEScaling
"""A SPEC string (which may expand to several scalings) or a typed scaling."""

AttentionSpec = str | PEAttention
"""An attention SPEC string (which may expand to several rules) or a typed rule."""

Configuration = tuple[PEScaling, PEAttention | None]
"""What one lab cell runs under: a scaling, and an attention rule or None (the field left out)."""

_Parsed = TypeVar("_Parsed", bound=BaseModel)

MODEL_SEPARATOR = "@"
"""Between a model name and the SPECs it carries: `zoo-rope@yarn:factor=2@self_extend:...`."""
_SCALING_TYPES: tuple[str, ...] = get_args(ScalingType)
_ATTENTION_TYPES: tuple[str, ...] = get_args(AttentionType)


class GridError(PEServeError, ValueError):
    """A lab grid that cannot run: a bad SPEC, an out-of-range value, a length over `max_context`."""


def parse_specs(specs: Iterable[ScalingSpec]) -> list[PEScaling]:
    """Every scaling the SPECs name, in order, each once."""
    scalings: list[PEScaling] = []
    for spec in specs:
        for scaling in _expand(spec, parse_scaling, "scaling") if isinstance(spec, str) else [spec]:
            _check_ranges(scaling)
            if scaling not in scalings:
                scalings.append(scaling)
    if not scalings:
        raise GridError("no scaling given (scalings=, --scaling; or a model name that sets one, NAME@SPEC)")
    return scalings


def parse_attention_specs(specs: Iterable[AttentionSpec]) -> list[PEAttention]:
    """Every attention rule the SPECs name, in order, each once."""
    rules: list[PEAttention] = []
    for spec in specs:
        for rule in _expand(spec, parse_attention, "attention") if isinstance(spec, str) else [spec]:
            if rule not in rules:
                rules.append(rule)
    return rules


def configurations(
    scalings: Sequence[ScalingSpec] | None,
    attentions: Sequence[AttentionSpec] | None,
    named: NamedConfiguration | None = None,
    *,
    model: str | None = None,
) -> list[Configuration]:
    """Every scaling crossed with every attention rule (scalings outer); no rules given (None or
    empty) means one configuration per scaling that sends no `pe_attention` at all.

    `named` is what the model name `model` sets: its scaling is the grid's one scaling, its rule
    the grid's one rule, and the grid giving that axis too is an error (`check_named`).
    """
    named = named or NamedConfiguration()
    check_named(scalings, attentions, named, model)
    axis: list[PEScaling] = [named.scaling] if named.scaling is not None else parse_specs(scalings or [])
    rules: list[PEAttention | None] = (
        [named.attention] if named.attention is not None else [*parse_attention_specs(attentions or [])]
    ) or [None]
    return [(scaling, rule) for scaling in axis for rule in rules]


def check_grid(
    scalings: Sequence[ScalingSpec] | None, attentions: Sequence[AttentionSpec] | None, model: str | None
) -> None:
    """What can be refused before any request: the grid's SPECs, the SPECs the model name carries
    itself (`NAME@SPEC`), and the two setting the same axis. An alias's own SPECs are known only
    from `GET /v1/models`, so `configurations` checks them again once the name is resolved."""
    if scalings:
        parse_specs(scalings)
    parse_attention_specs(attentions or [])
    if model is not None and MODEL_SEPARATOR in model:
        _, specs = split_model_name(model)
        check_named(scalings, attentions, NamedConfiguration().extended(specs, model), model)


def check_named(
    scalings: Sequence[ScalingSpec] | None,
    attentions: Sequence[AttentionSpec] | None,
    named: NamedConfiguration,
    model: str | None,
) -> None:
    """A model name that sets the scaling (or the rule) and a grid that gives scalings (or rules)
    too: one configuration named in two places, which the server would refuse on every request."""
    if named.scaling is not None and scalings:
        raise GridError(
            f"the model name {model!r} sets the scaling ({label(named.scaling)}) and the grid gives "
            "scalings too (--scaling); give the scaling in one place"
        )
    if named.attention is not None and attentions:
        raise GridError(
            f"the model name {model!r} sets the attention rule ({label(named.attention)}) and the grid "
            "gives rules too (--attention); give the rule in one place"
        )


@dataclass(frozen=True)
class NamedConfiguration:
    """What a model name's SPECs set: a scaling, an attention rule (None: the name sets none)."""

    scaling: PEScaling | None = None
    attention: PEAttention | None = None

    def extended(self, specs: Iterable[str], model: str) -> NamedConfiguration:
        """This configuration with more SPECs, each filling the field its type names (as the server
        reads a name); a second scaling or a second rule is an error naming `model`."""
        named = self
        for spec in specs:
            kind = spec.partition(":")[0].strip()
            if kind in _SCALING_TYPES:
                (scaling,) = _one(spec, parse_scaling, "scaling", model)
                _check_ranges(scaling)
                if named.scaling is not None:
                    raise GridError(
                        f"model {model!r}: two scaling SPECs ({label(named.scaling)} and {spec!r})"
                    )
                named = replace(named, scaling=scaling)
            elif kind in _ATTENTION_TYPES:
                (rule,) = _one(spec, parse_attention, "attention", model)
                if named.attention is not None:
                    raise GridError(
                        f"model {model!r}: two attention SPECs ({label(named.attention)} and {spec!r})"
                    )
                named = replace(named, attention=rule)
            else:
                raise GridError(
                    f"model {model!r}: {spec!r} is no SPEC: its type {kind!r} is neither a scaling "
                    f"({', '.join(_SCALING_TYPES)}) nor an attention rule ({', '.join(_ATTENTION_TYPES)})"
                )
        return named


@dataclass(frozen=True)
class ModelTarget:
    """The model a lab run talks to: the resident model's card (its lengths, scalings and
    tokenizer), the name its requests carry (as given), and what that name sets."""

    card: ModelInfo
    name: str
    named: NamedConfiguration = NamedConfiguration()

    def request_fields(self, configuration: Configuration) -> dict[str, object]:
        """`model`, `pe_scaling` and `pe_attention` of a request under `configuration`: what the
        name sets travels in the name alone (the server refuses it twice)."""
        scaling, attention = configuration
        return {
            "model": self.name,
            "pe_scaling": None if self.named.scaling is not None else scaling,
            "pe_attention": None if self.named.attention is not None else attention,
        }


def split_model_name(name: str) -> tuple[str, list[str]]:
    """`NAME@SPEC@SPEC` as NAME and its SPECs (none for a plain name)."""
    base, *specs = (part.strip() for part in name.split(MODEL_SEPARATOR))
    if not base:
        raise GridError(f"model {name!r}: no model name before the first {MODEL_SEPARATOR!r}")
    if not all(specs):
        raise GridError(
            f"model {name!r}: an empty SPEC (two {MODEL_SEPARATOR!r} in a row, or one at the end)"
        )
    return base, specs


def _one(spec: str, parse: Callable[[object], _Parsed], kind: str, model: str) -> list[_Parsed]:
    """A model name's SPEC, which names one configuration: no `a|b` alternatives."""
    parsed = _expand(spec, parse, kind)
    if len(parsed) != 1:
        raise GridError(f"model {model!r}: {spec!r} names {len(parsed)} {kind}s; a model name takes one")
    return parsed


def _expand(spec: str, parse: Callable[[object], _Parsed], kind: str) -> list[_Parsed]:
    """The objects a SPEC names: one per combination of its `|` alternatives, built by `parse`."""
    scaling_type, _, assignments = spec.strip().partition(":")
    keys: list[str] = []
    choices: list[list[object]] = []
    for assignment in filter(None, (part.strip() for part in assignments.split(","))):
        key, equals, values = assignment.partition("=")
        if not equals or not key.strip() or not values.strip():
            raise GridError(f"{kind} {spec!r}: expected key=value, got {assignment!r}")
        keys.append(key.strip())
        choices.append([_value(value.strip()) for value in values.split("|")])
    expanded = []
    for combination in itertools.product(*choices):
        fields = {"type": scaling_type.strip(), **dict(zip(keys, combination, strict=True))}
        try:
            expanded.append(parse(fields))
        except ValidationError as exc:
            raise GridError(f"{kind} {spec!r}: {_first_problem(exc, kind)}") from exc
    return expanded


def _value(text: str) -> object:
    """`true`/`false`, an integer, a number, a `;`-separated list of them (LongRoPE's factors, as
    the server reads a model name's SPEC), or the text itself (for `dynamic_mode=hf`)."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    if ";" in text:
        return [_value(part.strip()) for part in text.split(";") if part.strip()]
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            continue
    return text


def _first_problem(exc: ValidationError, kind: str) -> str:
    error = exc.errors()[0]
    where = ".".join(str(part) for part in error["loc"][1:] if not isinstance(part, int)) or "type"
    if error["type"] == "union_tag_invalid":
        expected = error["ctx"]["expected_tags"]
        return f"unknown {kind} type {error['input'].get('type')!r} (expected {expected})"
    return f"{where}: {error['msg']}"


def _check_ranges(scaling: PEScaling) -> None:
    """Factors below 1 would shrink the context (the server refuses them); other numbers must be
    finite and positive, lengths at least 1."""
    for name, value in scaling.model_dump(exclude_none=True).items():
        values = value if isinstance(value, list) else [value]
        for number in values:
            if isinstance(number, bool) or not isinstance(number, int | float):
                continue
            if not math.isfinite(number) or number < 0 or (number == 0 and name != "mscale"):
                raise GridError(f"{label(scaling)}: {name} must be a finite positive number, got {number}")
            if name == "factor" and number < 1:
                raise GridError(f"{label(scaling)}: factor must be at least 1, got {number:g}")


def check_lengths(lengths: Sequence[int], card: ModelInfo) -> list[int]:
    """Distinct lengths, ascending, each between 2 (one predicted token) and the model's `max_context`."""
    if not lengths:
        raise GridError("no length given")
    for length in lengths:
        if length < 2:
            raise GridError(f"length {length}: a scored prefix needs at least 2 tokens")
        if length > card.max_context:
            raise GridError(
                f"length {length} is above {card.name}'s max_context {card.max_context} "
                "(the server's --max-context)"
            )
    return sorted(set(lengths))


def check_supported(grid: Sequence[Configuration], card: ModelInfo) -> None:
    """Every scaling and attention rule of the grid is one the model's scheme applies (its card's
    `supported_scalings` and `supported_attention`)."""
    for scaling, rule in grid:
        if scaling.type not in card.supported_scalings:
            raise GridError(
                f"{card.name} ({card.scheme}) does not take {scaling.type} scaling; "
                f"it supports {', '.join(card.supported_scalings)}"
            )
        if rule is not None and rule.type not in card.supported_attention:
            raise GridError(
                f"{card.name} ({card.scheme}) does not apply {rule.type} attention; "
                f"it supports {', '.join(card.supported_attention)}"
            )


def pick_model(
    cards: Sequence[ModelInfo], model: str | None, aliases: Mapping[str, str] | None = None
) -> ModelTarget:
    """What `model` names, as the server resolves it: None the server's default (the first model
    loaded), a resident model's name, an `--alias` name (`aliases`: each alias's TARGET, from
    `GET /v1/models`), or either of those followed by `@SPEC`s. The target carries the name as
    given and what its SPECs (an alias's first) set."""
    if not cards:
        raise GridError("the server has no model")
    if model is None:
        return ModelTarget(cards[0], cards[0].name)
    by_name = {card.name: card for card in cards}
    if model in by_name:
        return ModelTarget(by_name[model], model)
    aliases = aliases or {}
    base, specs = (model, []) if model in aliases else split_model_name(model)
    named = NamedConfiguration()
    if base in aliases:
        base, alias_specs = split_model_name(aliases[base])
        named = named.extended(alias_specs, model)
    if base not in by_name:
        known = [*by_name, *aliases]
        raise GridError(f"no model {model!r} on the server (it has {', '.join(known)})")
    return ModelTarget(by_name[base], model, named.extended(specs, model))


def needs_aliases(cards: Sequence[ModelInfo], model: str | None) -> bool:
    """Whether `model` may be an alias (or an alias with SPECs): neither the default, nor a
    resident model's name, nor one followed by SPECs. Only then is `GET /v1/models` read."""
    if model is None or model in {card.name for card in cards}:
        return False
    return model.partition(MODEL_SEPARATOR)[0].strip() not in {card.name for card in cards}


def label(scaling: PEScaling | PEAttention) -> str:
    """A short name for tables and legends: `none`, `yarn x4`, plus any field besides the factor
    (a list of factors as its one value when uniform, else its range); attention rules alike
    (`self_extend (group_size=4,window=512)`)."""
    fields = scaling.model_dump(exclude_none=True, exclude={"type", "factor"})
    factor = getattr(scaling, "factor", None)
    text = scaling.type if factor is None else f"{scaling.type} x{factor:g}"
    extras = ",".join(f"{_SHORT_KEYS.get(key, key)}={_short(value)}" for key, value in fields.items())
    return f"{text} ({extras})" if extras else text


def configuration_label(configuration: Configuration) -> str:
    """`yarn x4`, or `yarn x4 + self_extend (group_size=4,window=512)` when a rule is sent."""
    scaling, attention = configuration
    return label(scaling) if attention is None else f"{label(scaling)} + {label(attention)}"


def _short(value: object) -> str:
    if not isinstance(value, list):
        return str(value)
    low, high = min(value), max(value)
    return f"{low:g}" if low == high else f"{low:g}..{high:g}"
