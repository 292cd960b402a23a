"""Grids of lengths, scalings and attention rules for the context-extension lab, checked before
anything is sent.

A scaling SPEC is `none` or `TYPE:key=value,key=value` with the `pe_scaling` fields; several
values of one key (`factor=2|4|8`) expand into one scaling each. An attention SPEC is written the
same way with the `pe_attention` fields (`self_extend:group_size=4|8,window=512`). Types and keys
are checked by the SDK's own models; the ranges a lab run could not use are checked here, and the
lengths and scaling types against the model's card, so a bad grid fails with a message naming the
culprit instead of after some of its cells have already run.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from pe_client.attention import PEAttention, parse_attention
from pe_client.errors import PEServeError
from pe_client.scaling import PEScaling, parse_scaling
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
        raise GridError("no scaling given")
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
    scalings: Iterable[ScalingSpec], attentions: Iterable[AttentionSpec] | None
) -> list[Configuration]:
    """Every scaling crossed with every attention rule (scalings outer); no rules given (None or
    empty) means one configuration per scaling that sends no `pe_attention` at all."""
    rules: list[PEAttention | None] = [*parse_attention_specs(attentions or [])] or [None]
    return [(scaling, rule) for scaling in parse_specs(scalings) for rule in rules]


def _expand(spec: str, parse: Callable[[object], _Parsed], kind: str) -> list[_Parsed]:
    """The objects a SPEC names: one per combination of its `|` alternatives, built by `parse`."""
    scaling_type, _, assignments = spec.strip().partition(":")
    keys: list[str] = []
    choices: list[list[object]] = []
    for assignment in filter(None, (part.strip() for part in assignments.split(","))):
        key, equals, values = assignment.partition("=")
        if not equals or not key.strip() or not values.strip():
            raise GridError(f"scaling {spec!r}: expected key=value, got {assignment!r}")
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
    """`true`/`false`, an integer, a number, or the text itself (for `dynamic_mode=hf`)."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
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


def check_supported(scalings: Sequence[PEScaling], card: ModelInfo) -> None:
    for scaling in scalings:
        if scaling.type not in card.supported_scalings:
            raise GridError(
                f"{card.name} ({card.scheme}) does not take {scaling.type} scaling; "
                f"it supports {', '.join(card.supported_scalings)}"
            )


def pick_model(cards: Sequence[ModelInfo], model: str | None) -> ModelInfo:
    """The named model's card, or the server's default (the first one loaded)."""
    if not cards:
        raise GridError("the server has no model")
    if model is None:
        return cards[0]
    for card in cards:
        if card.name == model:
            return card
    raise GridError(f"no model {model!r} on the server (it has {', '.join(card.name for card in cards)})")


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
