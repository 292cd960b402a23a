"""`pe_scaling` as a discriminated union on `type`, one model per scaling with its own fields.

Ranges that can be checked field by field are declared here, with `pe_runtime`'s own bounds, so
that the schema shows them and a bad value is named precisely (`pe_scaling.factor`); checks that
relate fields or depend on the model (beta_fast > beta_slow, factor list lengths, defaults from the
model's native context) are `pe_runtime`'s, reached through `RopeScaling.from_hf`, whose
`PEConfigError` names its field just the same.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pe_runtime.scaling import MAX_FACTOR, MAX_FACTOR_LIST, MAX_PARAMETER, MAX_POSITIONS

Factor = Annotated[float, Field(ge=1.0, le=MAX_FACTOR, allow_inf_nan=False)]
Positions = Annotated[int, Field(ge=1, le=MAX_POSITIONS)]
NonNegative = Annotated[float, Field(ge=0.0, le=MAX_PARAMETER, allow_inf_nan=False)]
Positive = Annotated[float, Field(gt=0.0, le=MAX_PARAMETER, allow_inf_nan=False)]
FactorList = Annotated[list[Positive], Field(min_length=1, max_length=MAX_FACTOR_LIST)]

SCALING_EXAMPLES: dict[str, dict[str, Any]] = {
    "none": {"type": "none"},
    "linear": {"type": "linear", "factor": 4.0},
    "ntk": {"type": "ntk", "factor": 4.0},
    "dynamic": {"type": "dynamic", "factor": 4.0, "original_max_position_embeddings": 256},
    "yarn": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "beta_fast": 32.0},
    "llama3": {
        "type": "llama3",
        "factor": 8.0,
        "original_max_position_embeddings": 256,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
    },
    "longrope": {
        "type": "longrope",
        "original_max_position_embeddings": 256,
        "short_factor": [1.0] * 8,
        "long_factor": [4.0] * 8,
    },
}


class _Scaling(BaseModel):
    """Common behaviour: strict JSON types, no unknown fields, Hugging Face dict export."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    def to_hf(self) -> dict[str, Any]:
        """The fields the client gave, in the dict form `RopeScaling.from_hf` reads."""
        return self.model_dump(exclude_none=True)


def _examples(scaling_type: str) -> ConfigDict:
    return ConfigDict(json_schema_extra={"examples": [SCALING_EXAMPLES[scaling_type]]})


class NoScaling(_Scaling):
    """Positions as trained: no extension."""

    model_config = _examples("none")
    type: Literal["none"]


class LinearScaling(_Scaling):
    """Position interpolation: positions divided by `factor`."""

    model_config = _examples("linear")
    type: Literal["linear"]
    factor: Factor


class NTKScaling(_Scaling):
    """Static NTK-aware scaling: the rotary base grows as factor^(d/(d-2))."""

    model_config = _examples("ntk")
    type: Literal["ntk"]
    factor: Factor


class DynamicScaling(_Scaling):
    """Dynamic NTK: the base follows the current sequence length past the original context.

    `dynamic_mode` "bucketed" (default) follows the length rounded up to a bucket (the original
    length times a power of sqrt 2) and recomputes the cached keys when the sequence enters the
    next bucket, so generation equals a fresh pass over the same tokens; "hf" follows the exact
    length and keeps cached keys as computed, which reproduces transformers' `generate()`.
    """

    model_config = _examples("dynamic")
    type: Literal["dynamic"]
    factor: Factor
    original_max_position_embeddings: Positions | None = None
    dynamic_mode: Literal["bucketed", "hf"] = "bucketed"


class YarnScaling(_Scaling):
    """YaRN: per-frequency interpolation ramp between beta_slow and beta_fast plus an attention factor."""

    model_config = _examples("yarn")
    type: Literal["yarn"]
    factor: Factor
    original_max_position_embeddings: Positions | None = None
    beta_fast: Positive | None = None
    beta_slow: Positive | None = None
    mscale: NonNegative | None = None
    mscale_all_dim: NonNegative | None = None
    attention_factor: Positive | None = None
    truncate: bool | None = None


class Llama3Scaling(_Scaling):
    """Llama 3.1: low frequencies interpolated, high kept, a smooth band between."""

    model_config = _examples("llama3")
    type: Literal["llama3"]
    factor: Factor
    original_max_position_embeddings: Positions | None = None
    low_freq_factor: Positive | None = None
    high_freq_factor: Positive | None = None


class LongRopeScaling(_Scaling):
    """LongRoPE: explicit per-frequency factors, short below the original context and long past it."""

    model_config = _examples("longrope")
    type: Literal["longrope"]
    short_factor: FactorList
    long_factor: FactorList
    original_max_position_embeddings: Positions | None = None
    factor: Factor | None = None
    attention_factor: Positive | None = None


PEScaling = Annotated[
    NoScaling | LinearScaling | NTKScaling | DynamicScaling | YarnScaling | Llama3Scaling | LongRopeScaling,
    Field(discriminator="type"),
]
