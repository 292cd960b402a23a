"""Typed attention rules, one model per `type`, mirroring the server's `pe_attention` object.

`pe_attention` chooses where queries and keys are placed past the trained context (Self-Extend,
ReRoPE, DCA, StreamingLLM, ...), beside `pe_scaling`, which maps positions to angles. The lab
crosses the two. Unlike the scalings, the ranges the SPEC's table states are checked here, so a lab
grid with an impossible rule fails before its first request rather than with one 422 per cell.
"""

from __future__ import annotations

from typing import Annotated, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, model_validator


class _Attention(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # Qwen's log-n attention, which any type may add: q_i is scaled by max(1, ln(i + 1) / ln logn).
    logn: int | None = Field(default=None, gt=1)


class StandardAttention(_Attention):
    """q at its own position, k at its own (the server's default)."""

    type: Literal["standard"] = "standard"


class SelfExtendAttention(_Attention):
    """Self-Extend (LongLM): exact positions within `window`, grouped by `group_size` beyond it."""

    type: Literal["self_extend"] = "self_extend"
    group_size: int = Field(ge=1)
    window: int = Field(ge=1)


class ReRoPEAttention(_Attention):
    """ReRoPE: exact positions within `window`, every farther key at distance `window`."""

    type: Literal["rerope"] = "rerope"
    window: int = Field(ge=1)


class LeakyReRoPEAttention(_Attention):
    """Leaky ReRoPE: beyond `window`, distances grow `leak` times slower instead of staying put."""

    type: Literal["leaky_rerope"] = "leaky_rerope"
    window: int = Field(ge=1)
    leak: float = Field(ge=1)


class DCAAttention(_Attention):
    """Dual chunk attention (ChunkLlama): positions within chunks of `chunk_size`, the last
    `local_window` kept exact."""

    type: Literal["dca"] = "dca"
    chunk_size: int = Field(ge=1)
    local_window: int = Field(ge=0)

    @model_validator(mode="after")
    def _window_inside_chunk(self) -> Self:
        """The chunk's stride is `chunk_size − local_window`, which must stay positive."""
        if self.local_window >= self.chunk_size:
            raise ValueError(f"local_window {self.local_window} must be below chunk_size {self.chunk_size}")
        return self


class StreamingAttention(_Attention):
    """StreamingLLM: `sink_tokens` first keys plus the last `window`, positions as cache slots."""

    type: Literal["streaming"] = "streaming"
    sink_tokens: int = Field(ge=0)
    window: int = Field(ge=1)


PEAttention = Annotated[
    StandardAttention
    | SelfExtendAttention
    | ReRoPEAttention
    | LeakyReRoPEAttention
    | DCAAttention
    | StreamingAttention,
    Field(discriminator="type"),
]
"""Any attention rule; pydantic picks the class from the `type` field of a dict."""

AttentionType = Literal["standard", "self_extend", "rerope", "leaky_rerope", "dca", "streaming"]

_ATTENTION_ADAPTER: TypeAdapter[PEAttention] = TypeAdapter(PEAttention)


def parse_attention(value: object) -> PEAttention:
    """Build the typed rule from a dict such as `{"type": "self_extend", "group_size": 4, "window": 512}`."""
    return _ATTENTION_ADAPTER.validate_python(value)
