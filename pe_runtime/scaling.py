"""`RopeScaling`: the one description of how RoPE is stretched past the trained context.

It is part of every cache key and of every request, so it is frozen, hashable and canonical: two
configurations that compute the same tables compare equal (defaults are filled in, numbers are floats,
factor lists are tuples). It is validated on construction, whichever way it was built, and every
error names the field as the user wrote it, because the HTTP layer reports that name verbatim.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from pe_runtime.errors import PEConfigError

SCALING_TYPES: Final = ("none", "linear", "ntk", "dynamic", "yarn", "llama3", "longrope")

# Hugging Face spells "no scaling" as "default" and early LongRoPE checkpoints (Phi-3) as "su".
_TYPE_ALIASES: Final[Mapping[str, str]] = {"default": "none", "su": "longrope"} | {
    name: name for name in SCALING_TYPES
}

# The fields each type reads. Anything else set on a scaling of that type is a mistake worth reporting:
# silently ignoring `beta_fast` on a linear scaling would hide a typo in the type.
_TYPE_FIELDS: Final[Mapping[str, frozenset[str]]] = {
    "none": frozenset(),
    "linear": frozenset({"factor"}),
    "ntk": frozenset({"factor"}),
    "dynamic": frozenset({"factor", "original_max_position_embeddings", "dynamic_mode"}),
    "yarn": frozenset(
        {
            "factor",
            "original_max_position_embeddings",
            "beta_fast",
            "beta_slow",
            "mscale",
            "mscale_all_dim",
            "attention_factor",
            "truncate",
        }
    ),
    "llama3": frozenset(
        {"factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"}
    ),
    "longrope": frozenset(
        {"factor", "original_max_position_embeddings", "attention_factor", "short_factor", "long_factor"}
    ),
}

# How dynamic NTK treats a growing sequence (see `pe_runtime.rope.dynamic`): "bucketed" keeps one
# table per length bucket and recomputes cached keys when a sequence crosses into the next bucket;
# "hf" follows transformers (a table for the exact length, cached keys kept as they were computed).
DYNAMIC_MODES: Final = ("bucketed", "hf")

# Bounds on what a scaling may say, the one definition (the API's schemas declare these same
# numbers): a factor, an original length, any other parameter, and a LongRoPE factor list.
MAX_FACTOR: Final = 1024.0
MAX_POSITIONS: Final = 1 << 22
MAX_PARAMETER: Final = 1e6
MAX_FACTOR_LIST: Final = 4096

# transformers' defaults for yarn; Meta's published values for llama3 (transformers requires them, a
# request body should not have to).
_STATIC_DEFAULTS: Final[Mapping[str, Mapping[str, Any]]] = {
    "dynamic": {"dynamic_mode": "bucketed"},
    "yarn": {"beta_fast": 32.0, "beta_slow": 1.0, "truncate": True},
    "llama3": {"low_freq_factor": 1.0, "high_freq_factor": 4.0},
}

_NEEDS_ORIGINAL_LENGTH: Final = frozenset({"dynamic", "yarn", "llama3", "longrope"})
# transformers lets a config's top-level original length override the dict's for these types only.
_TOP_LEVEL_ORIGINAL_WINS: Final = frozenset({"yarn", "llama3", "longrope"})
# Without an explicit factor, transformers derives it as max_position_embeddings / original length.
_FACTOR_FROM_LENGTHS: Final = frozenset({"yarn", "longrope"})
# rope_parameters dicts carry these next to the scaling; they belong to the model, not the scaling.
_MODEL_KEYS: Final = frozenset({"rope_theta", "partial_rotary_factor"})


@dataclass(frozen=True)
class RopeScaling:
    """A resolved RoPE scaling; `type` is one of `SCALING_TYPES` and unused fields stay None."""

    type: str = "none"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None
    dynamic_mode: str | None = None
    # Every cache lookup hashes the scaling; hashing 13 fields each time would dominate a cache hit.
    _hash: int = dataclasses.field(init=False, repr=False, compare=False)

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple[Callable[..., RopeScaling], tuple[Any, ...]]:
        """Rebuild through __init__ so the cached hash is recomputed (str hashes differ per process)."""
        return RopeScaling, tuple(getattr(self, item.name) for item in dataclasses.fields(self) if item.init)

    def __post_init__(self) -> None:
        if self.type not in SCALING_TYPES:
            raise PEConfigError(
                f"type must be one of {', '.join(SCALING_TYPES)}, got {self.type!r}", field="type"
            )
        allowed = _TYPE_FIELDS[self.type]
        if self.factor != 1.0 and "factor" not in allowed:
            raise PEConfigError(f"factor does not apply to {self.type!r} scaling", field="factor")
        for name in _OPTIONAL_FIELDS:
            if getattr(self, name) is not None and name not in allowed:
                raise PEConfigError(f"{name} does not apply to {self.type!r} scaling", field=name)
        for name, value in _STATIC_DEFAULTS.get(self.type, {}).items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        for name, canonicalise in _CANONICALISERS.items():
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, canonicalise(name, value))
        self._check_relations()
        values = tuple(getattr(self, item.name) for item in dataclasses.fields(self) if item.compare)
        object.__setattr__(self, "_hash", hash(values))

    def _check_relations(self) -> None:
        """Constraints between fields, checked once every field is canonical."""
        if self.factor < 1.0:
            raise PEConfigError(f"factor must be >= 1, got {self.factor}", field="factor")
        if self.type in _NEEDS_ORIGINAL_LENGTH and self.original_max_position_embeddings is None:
            raise PEConfigError(
                f"original_max_position_embeddings is required for {self.type!r} scaling",
                field="original_max_position_embeddings",
            )
        if self.beta_fast is not None and self.beta_slow is not None and self.beta_fast <= self.beta_slow:
            raise PEConfigError(
                f"beta_fast must be greater than beta_slow, got {self.beta_fast} <= {self.beta_slow}",
                field="beta_fast",
            )
        if (
            self.low_freq_factor is not None
            and self.high_freq_factor is not None
            and self.high_freq_factor <= self.low_freq_factor
        ):
            raise PEConfigError(
                "high_freq_factor must be greater than low_freq_factor, "
                f"got {self.high_freq_factor} <= {self.low_freq_factor}",
                field="high_freq_factor",
            )
        if self.type == "longrope":
            if self.short_factor is None or self.long_factor is None:
                missing = "short_factor" if self.short_factor is None else "long_factor"
                raise PEConfigError(f"{missing} is required for 'longrope' scaling", field=missing)
            if len(self.short_factor) != len(self.long_factor):
                raise PEConfigError(
                    f"long_factor has {len(self.long_factor)} entries but short_factor has "
                    f"{len(self.short_factor)}; both need one per rotary frequency",
                    field="long_factor",
                )

    @classmethod
    def from_hf(
        cls,
        rope_scaling: Mapping[str, Any] | None,
        *,
        max_position_embeddings: int,
        original_max_position_embeddings: int | None = None,
    ) -> RopeScaling:
        """Build from a Hugging Face `rope_scaling` / `rope_parameters` dict, with transformers' defaults.

        `max_position_embeddings` stands in for the original (pre-extension) length when the dict
        omits it, as transformers does. `original_max_position_embeddings` is a config's top-level
        value (Phi-3 keeps it outside the dict); like transformers, it wins over the dict's for
        yarn, llama3 and longrope. `rope_theta` and `partial_rotary_factor` are model settings and
        are ignored here. None-valued keys count as absent, as transformers reads them with `.get`.
        """
        max_length = _positive_int("max_position_embeddings", max_position_embeddings, math.inf)
        params = {
            key: value
            for key, value in (rope_scaling or {}).items()
            if key not in _MODEL_KEYS and value is not None
        }
        type_key = "rope_type" if "rope_type" in params else "type"
        raw_type = params.pop("rope_type", params.pop("type", "default"))
        scaling_type = _TYPE_ALIASES.get(raw_type) if isinstance(raw_type, str) else None
        if scaling_type is None:
            known = ", ".join(sorted(_TYPE_ALIASES))
            raise PEConfigError(f"{type_key} must be one of {known}, got {raw_type!r}", field=type_key)
        unknown = sorted(str(key) for key in params if key not in _OPTIONAL_FIELDS and key != "factor")
        if unknown:
            raise PEConfigError(f"unknown scaling field {unknown[0]!r}", field=unknown[0])
        if original_max_position_embeddings is not None and scaling_type in _TOP_LEVEL_ORIGINAL_WINS:
            params["original_max_position_embeddings"] = original_max_position_embeddings
        if scaling_type in _NEEDS_ORIGINAL_LENGTH:
            params.setdefault("original_max_position_embeddings", max_length)
        if "factor" not in params:
            params["factor"] = _default_factor(scaling_type, params, max_length)
        if scaling_type == "dynamic":
            params.setdefault("dynamic_mode", "hf")  # what transformers does with such a config
        return cls(type=scaling_type, **params)

    def to_dict(self) -> dict[str, Any]:
        """The resolved fields of this type (defaults included), JSON-ready, for responses and logs."""
        resolved: dict[str, Any] = {"type": self.type}
        for item in dataclasses.fields(self):
            value = getattr(self, item.name)
            if item.name in _TYPE_FIELDS[self.type] and value is not None:
                resolved[item.name] = list(value) if isinstance(value, tuple) else value
        return resolved


def _default_factor(scaling_type: str, params: Mapping[str, Any], max_length: int) -> float:
    """The factor when the dict has none: derived for yarn/longrope, required for the other types."""
    if scaling_type == "none":
        return 1.0
    if scaling_type not in _FACTOR_FROM_LENGTHS:
        raise PEConfigError(f"factor is required for {scaling_type!r} scaling", field="factor")
    original = _positive_int("original_max_position_embeddings", params["original_max_position_embeddings"])
    if original > max_length:
        raise PEConfigError(
            f"original_max_position_embeddings ({original}) exceeds max_position_embeddings ({max_length}) "
            "and no factor is given",
            field="original_max_position_embeddings",
        )
    return max_length / original


def _finite(name: str, value: object, limit: float = MAX_PARAMETER) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PEConfigError(f"{name} must be a number, got {value!r}", field=name)
    if not math.isfinite(value):
        raise PEConfigError(f"{name} must be finite, got {value!r}", field=name)
    if abs(value) > limit:
        raise PEConfigError(f"{name} must be at most {limit:g}, got {value!r}", field=name)
    return float(value)


def _factor(name: str, value: object) -> float:
    return _finite(name, value, MAX_FACTOR)


def _positive(name: str, value: object) -> float:
    number = _finite(name, value)
    if number <= 0.0:
        raise PEConfigError(f"{name} must be > 0, got {number}", field=name)
    return number


def _non_negative(name: str, value: object) -> float:
    number = _finite(name, value)
    if number < 0.0:
        raise PEConfigError(f"{name} must be >= 0, got {number}", field=name)
    return number


def _positive_int(name: str, value: object, limit: float = MAX_POSITIONS) -> int:
    number = _finite(name, value, limit)
    if not number.is_integer() or number < 1:
        raise PEConfigError(f"{name} must be a positive integer, got {value!r}", field=name)
    return int(number)


def _flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise PEConfigError(f"{name} must be true or false, got {value!r}", field=name)
    return value


def _dynamic_mode(name: str, value: object) -> str:
    if value not in DYNAMIC_MODES:
        raise PEConfigError(f"{name} must be one of {', '.join(DYNAMIC_MODES)}, got {value!r}", field=name)
    return str(value)


def _factor_list(name: str, value: object) -> tuple[float, ...]:
    if isinstance(value, str | bytes) or not isinstance(value, list | tuple) or not value:
        raise PEConfigError(f"{name} must be a non-empty list of numbers, got {value!r}", field=name)
    if len(value) > MAX_FACTOR_LIST:
        raise PEConfigError(f"{name} has {len(value)} entries, more than {MAX_FACTOR_LIST}", field=name)
    return tuple(_positive(name, item) for item in value)


_CANONICALISERS: Final[Mapping[str, Callable[[str, object], object]]] = {
    "factor": _factor,
    "original_max_position_embeddings": _positive_int,
    "beta_fast": _positive,
    "beta_slow": _positive,
    "mscale": _non_negative,
    "mscale_all_dim": _non_negative,
    "attention_factor": _positive,
    "truncate": _flag,
    "low_freq_factor": _positive,
    "high_freq_factor": _positive,
    "short_factor": _factor_list,
    "long_factor": _factor_list,
    "dynamic_mode": _dynamic_mode,
}
_OPTIONAL_FIELDS: Final = frozenset(_CANONICALISERS) - {"factor"}
