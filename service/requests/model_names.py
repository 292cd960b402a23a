"""Model names that carry a configuration: `NAME@SPEC[@SPEC]`, and fixed names from `--alias`.

Wherever a request names a model (`model` in every body, gRPC, `/v1`), it may write the scaling
and the attention rule into the name, as the lab CLI writes them (`TYPE:key=value,...`):
`tiny-rope@yarn:factor=2,original_max_position_embeddings=64@self_extend:group_size=4,window=16`.
The type tells which field a SPEC fills: a scaling type fills `pe_scaling`, an attention type
`pe_attention`. This module turns such a name into the fields it stands for (`NamedModel`); the
request core (`service.requests.prepare.resolve_target`) then resolves them exactly as it resolves
the body's own fields, so everything past it (the engine, the prefix cache, metrics) sees the
resolved scaling and rule and the resident model's name, never the alias.

- A scaling SPEC is `none` or `TYPE:key=value,...` with the `pe_scaling` fields; values are
  `true`/`false`, numbers or words (`dynamic_mode=hf`), and a list (LongRoPE's factors) is its
  numbers separated by `;`. It is validated by the body's own `PEScaling` union
  (`parse_scaling_spec`), so it yields the very value a `pe_scaling` field would.
- An attention SPEC is read by `service.model.attention_rules.parse_attention_spec`, the lab's
  and the rules' one parser.
- `--alias NAME=TARGET` (`ModelAliases`) names a fixed `TARGET` (`MODEL@SPEC...`), listed by
  `GET /v1/models`; a request may add SPECs to an alias (`NAME@SPEC`) as to a model.

A name and an explicit field for the same thing in one body is an error naming both (`model`
and the field), as are two scaling SPECs or two attention SPECs in one name.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, get_args

from pydantic import TypeAdapter, ValidationError

from pe_runtime import PEConfigError
from service.engine.catalog import as_model_error
from service.engine.errors import EngineError
from service.engine.types import ATTENTION_FIELD, MODEL_FIELD, SCALING_FIELD, Engine
from service.model.attention_rules import ATTENTION_TYPES, parse_attention_spec
from service.requests.errors import ErrorKind, RequestError, as_request_error, param_from_location
from service.requests.scaling import PEScaling

ALIAS_FLAG = "--alias"
SEPARATOR = "@"
LIST_SEPARATOR = ";"

_SCALING: TypeAdapter[PEScaling] = TypeAdapter(PEScaling)
# The scaling types, read from the union itself: one class per type, each with its `type` literal.
SCALING_TYPES: tuple[str, ...] = tuple(
    get_args(scaling.model_fields["type"].annotation)[0] for scaling in get_args(get_args(PEScaling)[0])
)
# An alias's own name: what a client may write in `model`, without the SPEC separator.
_ALIAS_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/+-]{0,127}")


class ModelNameError(ValueError):
    """A model name whose SPECs cannot be read; the message says which part and why."""


@dataclass(frozen=True)
class NamedModel:
    """What a model name stands for: the resident model (None: the default, or `pe`'s), and the
    `pe_scaling` and `pe_attention` it sets (None: the name sets none)."""

    model: str | None
    scaling: PEScaling | None = None
    attention: Mapping[str, Any] | None = None

    def extended(self, specs: Iterable[str]) -> NamedModel:
        """This configuration with more SPECs; a second scaling or a second rule is an error."""
        named = self
        for spec in specs:
            kind = spec.partition(":")[0].strip()
            if kind in SCALING_TYPES:
                if named.scaling is not None:
                    raise ModelNameError(f"two scaling SPECs ({named.scaling.type} and {spec!r}); give one")
                named = dataclasses.replace(named, scaling=parse_scaling_spec(spec))
            elif kind in ATTENTION_TYPES:
                if named.attention is not None:
                    first = named.attention["type"]
                    raise ModelNameError(f"two attention SPECs ({first} and {spec!r}); give one")
                named = dataclasses.replace(named, attention=_attention(spec))
            else:
                raise ModelNameError(
                    f"{spec!r} is no SPEC: its type {kind!r} is neither a scaling "
                    f"({', '.join(SCALING_TYPES)}) nor an attention rule ({', '.join(ATTENTION_TYPES)})"
                )
        return named


def parse_scaling_spec(spec: str) -> PEScaling:
    """`none` or `TYPE:key=value,...` as the `pe_scaling` value it writes (the body field's own
    union validates it); raises ModelNameError naming the field (`pe_scaling.factor`)."""
    kind, _, assignments = spec.strip().partition(":")
    fields: dict[str, Any] = {"type": kind.strip()}
    for assignment in filter(None, (part.strip() for part in assignments.split(","))):
        key, equals, text = (part.strip() for part in assignment.partition("="))
        if not equals or not key or not text:
            raise ModelNameError(f"{spec!r}: expected key=value, got {assignment!r}")
        if key in fields:
            raise ModelNameError(f"{spec!r}: {SCALING_FIELD}.{key} is given twice")
        fields[key] = _value(text)
    try:
        return _SCALING.validate_python(fields)
    except ValidationError as error:
        problems = error.errors()
        # An unknown key first: a misspelt one also leaves its field missing, which says less.
        problem = next((each for each in problems if each["type"] == "extra_forbidden"), problems[0])
        param = param_from_location((SCALING_FIELD, *problem["loc"]), problem["type"])
        raise ModelNameError(f"{spec!r}: {param}: {problem['msg']}") from None


def parse_model_name(name: str) -> tuple[str, list[str]]:
    """`NAME@SPEC@SPEC` as NAME and its SPECs (none for a plain name)."""
    base, *specs = name.split(SEPARATOR)
    if not base.strip():
        raise ModelNameError("no model name before the first '@'")
    for spec in specs:
        if not spec.strip():
            raise ModelNameError("an empty SPEC (two '@' in a row, or one at the end)")
    return base.strip(), [spec.strip() for spec in specs]


@dataclass(frozen=True)
class ModelAliases:
    """The fixed names of `--alias NAME=TARGET`, in the order given; empty when none."""

    targets: Mapping[str, str] = dataclasses.field(default_factory=dict)  # NAME -> TARGET as given
    named: Mapping[str, NamedModel] = dataclasses.field(default_factory=dict)  # NAME -> parsed TARGET

    @classmethod
    def from_flags(cls, flags: Sequence[str]) -> ModelAliases:
        """Parse every `NAME=TARGET`; raises ModelNameError naming the flag and the entry."""
        targets: dict[str, str] = {}
        named: dict[str, NamedModel] = {}
        for flag in flags:
            name, equals, target = (part.strip() for part in flag.partition("="))
            try:
                if not equals or not name or not target:
                    raise ModelNameError("expected NAME=TARGET, e.g. long=zoo-rope@yarn:factor=4")
                if not _ALIAS_NAME.fullmatch(name):
                    raise ModelNameError(
                        f"the name {name!r} must be 1-128 letters, digits and '._:/+-' (no '@'), "
                        "starting with a letter or digit"
                    )
                if name in targets:
                    raise ModelNameError(f"{name!r} is given twice")
                model, specs = parse_model_name(target)
                named[name] = NamedModel(model).extended(specs)
            except ModelNameError as error:
                raise ModelNameError(f"{ALIAS_FLAG} {flag!r}: {error}") from None
            targets[name] = target
        return cls(targets=targets, named=named)

    def __bool__(self) -> bool:
        return bool(self.named)

    def resolve(self, name: str | None, resident: Callable[[], Iterable[str]]) -> NamedModel:
        """What `name` stands for: an alias, a resident model's name as is (`resident()` lists
        them), or `NAME@SPEC...` with NAME a model or an alias; raises ModelNameError."""
        if name is None:
            return NamedModel(None)
        if name in self.named:
            return self.named[name]
        if SEPARATOR not in name or name in set(resident()):
            return NamedModel(name)
        base, specs = parse_model_name(name)
        return self.named.get(base, NamedModel(base)).extended(specs)


NO_ALIASES = ModelAliases()


def resolve_name(engine: Engine, name: str | None, aliases: ModelAliases) -> NamedModel:
    """What a request's `model` stands for (`ModelAliases.resolve`); an unreadable name is an
    error on `model`. The resident names are asked for only when the name has a '@'."""
    try:
        return aliases.resolve(name, lambda: (info.name for info in engine.models()))
    except ModelNameError as error:
        raise RequestError(ErrorKind.INVALID, f"{MODEL_FIELD} {name!r}: {error}", param=MODEL_FIELD) from None


def merged_field(name: str | None, named: Any, given: Any, field: str) -> Any:
    """The one value of `field`: from the model name or from the body, never both."""
    if named is not None and given is not None:
        raise RequestError(
            ErrorKind.INVALID,
            f"{MODEL_FIELD} {name!r} sets {field} and the body sets {field} too; give it in one place.",
            param=MODEL_FIELD,
        )
    return named if named is not None else given


@contextmanager
def set_by_name(name: str | None, named: bool) -> Iterator[None]:
    """Within: an error about a field the model name set (`pe_scaling.factor`) is an error on
    `model`, whose message names that field; when `named` is False errors pass as they are."""
    if not named:
        yield
        return
    try:
        yield
    except (RequestError, EngineError, PEConfigError) as raised:
        error = as_request_error(raised, "")
        message = as_model_error(str(name), error.param, error.message)
        raise RequestError(error.kind, message, param=MODEL_FIELD) from None


def _attention(spec: str) -> dict[str, Any]:
    """An attention SPEC as the `pe_attention` dict it writes (the rule's resolved fields)."""
    try:
        return parse_attention_spec(spec).to_dict()
    except PEConfigError as error:
        raise ModelNameError(f"{spec!r}: {ATTENTION_FIELD}.{error.field}: {error.message}") from None


def _value(text: str) -> Any:
    """`true`/`false`, an integer, a number, a `;`-separated list of numbers, or the word itself."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    if LIST_SEPARATOR in text:
        return [_value(part.strip()) for part in text.split(LIST_SEPARATOR) if part.strip()]
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            continue
    return text
