"""LongRoPE (Ding et al. 2024, Phi-3): searched per-frequency rescale factors, one set for sequences
within the original context and one beyond it, plus an attention factor sqrt(1 + ln f / ln original).
"""

from __future__ import annotations

import math

import torch

from pe_runtime.errors import PEConfigError
from pe_runtime.rope.spectrum import channel_exponents, derived, original_length
from pe_runtime.scaling import RopeScaling


def effective_seq_len(scaling: RopeScaling, seq_len: int | None) -> int | None:
    """Only the side of the original length matters; every long sequence maps to original + 1."""
    original = original_length(scaling)
    return original + 1 if seq_len is not None and seq_len > original else None


def attention_factor(scaling: RopeScaling) -> float:
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    if scaling.factor <= 1.0:
        return 1.0
    original = original_length(scaling)
    return derived(
        "original_max_position_embeddings",
        "the LongRoPE attention factor",
        lambda: math.sqrt(1 + math.log(scaling.factor) / math.log(original)),
    )


def inv_freq(
    rotary_dim: int, base: float, scaling: RopeScaling, seq_len: int | None
) -> tuple[torch.Tensor, float]:
    """The short or the long frequencies, by length; the other set is checked too, since a sequence
    that starts within the original context moves to the long ones as it grows."""
    use_long = effective_seq_len(scaling, seq_len) is not None
    used, other = ("long_factor", "short_factor") if use_long else ("short_factor", "long_factor")
    frequencies = _rescaled(used, getattr(scaling, used), rotary_dim, base)
    _rescaled(other, getattr(scaling, other), rotary_dim, base)
    return frequencies, attention_factor(scaling)


def _rescaled(field: str, factors: tuple[float, ...] | None, rotary_dim: int, base: float) -> torch.Tensor:
    if factors is None or len(factors) != rotary_dim // 2:
        count = 0 if factors is None else len(factors)
        raise PEConfigError(
            f"{field} needs {rotary_dim // 2} entries (rotary_dim / 2), got {count}", field=field
        )
    rescale = torch.tensor(factors, dtype=torch.float32)
    return derived(
        field, "a LongRoPE frequency", lambda: 1.0 / (rescale * base ** channel_exponents(rotary_dim))
    )
