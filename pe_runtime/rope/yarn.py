"""YaRN (Peng et al. 2023): interpolate low frequencies, extrapolate high ones, ramp between, and
temper attention by an mscale factor.

The ramp runs over the rotary channels whose number of rotations within the original context lies
between beta_slow and beta_fast.
"""

from __future__ import annotations

import math

import torch

from pe_runtime.rope.spectrum import base_inv_freq, derived, original_length, required
from pe_runtime.scaling import RopeScaling


def _mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1.0 else 0.1 * mscale * math.log(factor) + 1.0


def attention_factor(scaling: RopeScaling) -> float:
    """The explicit attention_factor, else mscale / mscale_all_dim (DeepSeek), else 0.1 ln(factor) + 1.

    Zero mscale values count as unset, as in transformers.
    """
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    if scaling.mscale and scaling.mscale_all_dim:
        return _mscale(scaling.factor, scaling.mscale) / _mscale(scaling.factor, scaling.mscale_all_dim)
    return _mscale(scaling.factor)


def _channel_for_rotations(rotations: float, rotary_dim: int, base: float, original: int) -> float:
    """The (fractional) channel index whose wavelength fits `rotations` times into `original`."""
    return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))


def _extrapolation_weight(rotary_dim: int, base: float, scaling: RopeScaling) -> torch.Tensor:
    """Per frequency, 1 where the original spectrum is kept and 0 where it is interpolated."""
    original = original_length(scaling)
    beta_fast = required(scaling, "beta_fast", scaling.beta_fast)
    beta_slow = required(scaling, "beta_slow", scaling.beta_slow)
    low = derived(
        "beta_fast",
        "the first channel of the YaRN ramp",
        lambda: _channel_for_rotations(beta_fast, rotary_dim, base, original),
    )
    high = derived(
        "beta_slow",
        "the last channel of the YaRN ramp",
        lambda: _channel_for_rotations(beta_slow, rotary_dim, base, original),
    )
    if required(scaling, "truncate", scaling.truncate):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = (torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)
    return 1 - ramp.clamp(0, 1)


def inv_freq(
    rotary_dim: int, base: float, scaling: RopeScaling, seq_len: int | None
) -> tuple[torch.Tensor, float]:
    extrapolated = base_inv_freq(rotary_dim, base)
    interpolated = extrapolated / scaling.factor
    keep = _extrapolation_weight(rotary_dim, base, scaling)
    return interpolated * (1 - keep) + extrapolated * keep, attention_factor(scaling)
