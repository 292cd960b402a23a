"""What every scaling type shares: the unscaled RoPE spectrum and the builder signature.

Each scaling module only rewrites frequencies (the vLLM habit), so the power-law spectrum and the
NTK base change live here once. All arithmetic is float32, as in transformers, so the frequencies
agree with the reference to the last bits instead of to a tolerance.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from pe_runtime.errors import PEConfigError
from pe_runtime.scaling import RopeScaling

T = TypeVar("T")
D = TypeVar("D", float, torch.Tensor)

# The largest and the smallest positive float32: every table is float32, whatever was computed in float64.
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)
_FLOAT32_SMALLEST = 2.0**-149

FrequencyBuilder = Callable[[int, float, RopeScaling, int | None], tuple[torch.Tensor, float]]
"""(rotary_dim, base, scaling, seq_len) -> (inv_freq float32 [rotary_dim // 2], attention_factor)."""

SeqLenKey = Callable[[RopeScaling, int | None], int | None]
"""Collapses seq_len to the value the frequencies actually depend on (None: independent of it)."""


def ignores_seq_len(scaling: RopeScaling, seq_len: int | None) -> int | None:
    """The key for static scalings: every sequence length shares one table."""
    return None


@dataclass(frozen=True)
class ScalingRule:
    """One registry entry: how a scaling type builds frequencies and how it keys on seq_len."""

    build: FrequencyBuilder
    seq_len_key: SeqLenKey = ignores_seq_len


def channel_exponents(rotary_dim: int) -> torch.Tensor:
    """2i / d for each rotated pair i, float32 [rotary_dim // 2]: the exponent of base per frequency."""
    return torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim


def base_inv_freq(rotary_dim: int, base: float) -> torch.Tensor:
    """Unscaled RoPE inverse frequencies base^(-2i/d), float32 [rotary_dim // 2]."""
    return 1.0 / (base ** channel_exponents(rotary_dim))


def derived(field: str, what: str, compute: Callable[[], D], *, positive: bool = False) -> D:
    """A quantity a scaling computes from its fields, checked: the one rule for derived values.

    Fields that are each in range can still combine into a quantity that is infinite or undefined:
    a subnormal beta_slow puts YaRN's correction range at infinity, a subnormal LongRoPE factor
    makes an infinite frequency, and LongRoPE's attention factor divides by ln(original length).
    Every builder computes such quantities through this function, so they fail as a
    `PEConfigError` naming `field` (a 422 for a request), never as an OverflowError, a
    ZeroDivisionError or a table of infinities. A value must be finite in float32, the tables'
    precision, and with `positive` also above zero there.
    """
    try:
        value = compute()
    except ArithmeticError as error:  # OverflowError, ZeroDivisionError
        raise PEConfigError(f"{field} makes {what} undefined ({error})", field=field) from error
    if isinstance(value, torch.Tensor):
        magnitude = value.abs().max().item() if value.numel() else 0.0
        smallest = value.min().item() if value.numel() else 1.0
    else:
        magnitude = smallest = value
    finite = math.isfinite(magnitude) and abs(magnitude) <= _FLOAT32_MAX
    if not finite or (positive and smallest < _FLOAT32_SMALLEST):
        bound = "finite and positive" if positive else "finite"
        raise PEConfigError(
            f"{field} makes {what} {magnitude if not finite else smallest:g}; it must be {bound} in float32",
            field=field,
        )
    return value


def ntk_scaled_base(base: float, rotary_dim: int, ratio: float) -> float:
    """NTK-aware base change: stretching the lowest frequency by `ratio` while keeping the highest."""
    if rotary_dim <= 2:
        raise PEConfigError(
            f"NTK scaling needs a rotary dimension above 2, got {rotary_dim}", field="head_dim"
        )
    return derived(
        "factor",
        "the NTK-scaled rotary base",
        lambda: base * float(ratio ** (rotary_dim / (rotary_dim - 2))),
        positive=True,
    )


def required(scaling: RopeScaling, field: str, value: T | None) -> T:
    """A field the scaling type reads; RopeScaling fills or demands it, so None means misuse."""
    if value is None:
        raise PEConfigError(f"{field} is required for {scaling.type!r} scaling", field=field)
    return value


def original_length(scaling: RopeScaling) -> int:
    """The pre-extension context length."""
    return required(scaling, "original_max_position_embeddings", scaling.original_max_position_embeddings)
