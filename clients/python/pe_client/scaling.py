"""Typed RoPE scalings, one model per `type`, mirroring the server's `pe_scaling` object.

Each class carries only the fields its scaling reads, so a typo or a field that a scaling ignores is
caught before the request leaves the process. Ranges are left to the server: it is the authority
on what a model can run, and its 422 names the offending field.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter


class _Scaling(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class NoScaling(_Scaling):
    """Run the model as trained (positions past the native context are extrapolated as is)."""

    type: Literal["none"] = "none"


class LinearScaling(_Scaling):
    """Position interpolation: positions are divided by `factor`."""

    type: Literal["linear"] = "linear"
    factor: float


class NTKScaling(_Scaling):
    """Static NTK-aware scaling: the rotary base grows so low frequencies stretch by `factor`."""

    type: Literal["ntk"] = "ntk"
    factor: float


class DynamicScaling(_Scaling):
    """Dynamic NTK: the base grows with the running sequence length once it passes the original."""

    type: Literal["dynamic"] = "dynamic"
    factor: float
    original_max_position_embeddings: int | None = None
    dynamic_mode: Literal["bucketed", "hf"] | None = None  # server default: "bucketed"


class YarnScaling(_Scaling):
    """YaRN: NTK-by-parts interpolation plus an attention temperature (`mscale`)."""

    type: Literal["yarn"] = "yarn"
    factor: float
    original_max_position_embeddings: int | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool | None = None


class Llama3Scaling(_Scaling):
    """Llama 3.1 style: high frequencies kept, low ones divided by `factor`, a smooth band between."""

    type: Literal["llama3"] = "llama3"
    factor: float
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None


class LongRopeScaling(_Scaling):
    """LongRoPE: per-frequency rescale factors, `short_factor` within and `long_factor` past the original."""

    type: Literal["longrope"] = "longrope"
    short_factor: list[float]
    long_factor: list[float]
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    attention_factor: float | None = None


PEScaling = Annotated[
    NoScaling | LinearScaling | NTKScaling | DynamicScaling | YarnScaling | Llama3Scaling | LongRopeScaling,
    Field(discriminator="type"),
]
"""Any scaling; pydantic picks the class from the `type` field of a dict."""

ScalingType = Literal["none", "linear", "ntk", "dynamic", "yarn", "llama3", "longrope"]

_SCALING_ADAPTER: TypeAdapter[PEScaling] = TypeAdapter(PEScaling)


def parse_scaling(value: object) -> PEScaling:
    """Build the typed scaling from a dict such as `{"type": "yarn", "factor": 4}`."""
    return _SCALING_ADAPTER.validate_python(value)
