"""`POST /inspect` bodies: which pe_runtime tables to compute, and the tables themselves.

Every size is bounded twice: each dimension by its own field limit, and the whole answer by
`MAX_CELLS` numbers in its tables (checked in `service.api.inspection`, which knows each table's
shape), so no request can make the server build or serialize a table of unbounded size.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from service.engine.types import Scheme
from service.requests.scaling import PEScaling, Positions

MAX_LENGTH = 4096
MAX_HEAD_DIM = 512
MAX_HEADS = 64
MAX_T5_BUCKETS = 256
# Numbers in one answer's tables: RoPE's cos and sin for 4096 positions x 32 frequencies, about
# 5 MB of JSON, built and serialized in a few tenths of a second.
MAX_CELLS = 1 << 18


def _even(value: int) -> int:
    if value % 2:
        raise ValueError(f"must be even, got {value}")
    return value


class InspectRequest(BaseModel):
    """A scheme, a scaling and the shape parameters the tables depend on; defaults are the zoo's."""

    model_config = ConfigDict(extra="forbid", strict=True)

    pe: Scheme = Field("rope", description="rope, alibi, t5_bias or sinusoidal (learned and nope have none).")
    pe_scaling: PEScaling | None = Field(None, description="As in /generate; absent: no scaling.")
    length: int = Field(256, ge=1, le=MAX_LENGTH, description="Positions 0 .. length-1.")
    native_context: Positions = Field(256, description="Default original_max_position_embeddings.")
    seq_len: int | None = Field(
        None, ge=1, le=MAX_LENGTH, description="Sequence length for dynamic and longrope; default length."
    )
    head_dim: Annotated[int, Field(ge=2, le=MAX_HEAD_DIM), AfterValidator(_even)] = Field(
        32, description="RoPE head dimension, or the sinusoidal table's width."
    )
    rope_base: float = Field(10000.0, gt=1.0, le=1e9, allow_inf_nan=False)
    num_heads: int = Field(6, ge=1, le=MAX_HEADS, description="ALiBi heads.")
    t5_num_buckets: int = Field(32, ge=2, le=MAX_T5_BUCKETS)
    t5_max_distance: int = Field(128, ge=1, le=MAX_LENGTH)
    t5_bidirectional: bool = False


class RopeInspection(BaseModel):
    """Per frequency i (`head_dim // 2` of them) and position p: cos and sin of p * inv_freq[i],
    times the attention factor, exactly as the model reads them."""

    head_dim: int
    base: float
    seq_len: int
    inv_freq: list[float]
    inv_freq_unscaled: list[float]
    cos: list[list[float]]
    sin: list[list[float]]


class AlibiInspection(BaseModel):
    """`bias[h][q][k] = slopes[h] * (k - q)`; entries with k > q are masked by the causal mask."""

    slopes: list[float]
    bias: list[list[list[float]]]


class T5Inspection(BaseModel):
    """`buckets[q][k]`: the bucket of relative position k - q (its bias is a learned weight)."""

    num_buckets: int
    max_distance: int
    bidirectional: bool
    buckets: list[list[int]]


class SinusoidalInspection(BaseModel):
    """`table[p]`: the absolute encoding added at position p (read at p / factor when scaled)."""

    dim: int
    factor: float
    table: list[list[float]]


class InspectResponse(BaseModel):
    pe: Scheme
    length: int
    scaling: dict[str, Any] | None
    attention_factor: float
    rope: RopeInspection | None = None
    alibi: AlibiInspection | None = None
    t5_bias: T5Inspection | None = None
    sinusoidal: SinusoidalInspection | None = None
