"""Llama 3.1 scaling: long wavelengths interpolated by `factor`, short ones kept, a smooth band between.

Wavelengths shorter than original / high_freq_factor rotate many times within the trained context and
are left alone; longer than original / low_freq_factor are divided by `factor`; in between the two
are blended linearly in original / wavelength.
"""

from __future__ import annotations

import math

import torch

from pe_runtime.rope.spectrum import base_inv_freq, original_length, required
from pe_runtime.scaling import RopeScaling


def inv_freq(
    rotary_dim: int, base: float, scaling: RopeScaling, seq_len: int | None
) -> tuple[torch.Tensor, float]:
    original = original_length(scaling)
    low_freq_factor = required(scaling, "low_freq_factor", scaling.low_freq_factor)
    high_freq_factor = required(scaling, "high_freq_factor", scaling.high_freq_factor)
    unscaled = base_inv_freq(rotary_dim, base)
    wavelength = 2 * math.pi / unscaled
    interpolated = unscaled / scaling.factor
    smooth = (original / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * interpolated + smooth * unscaled
    scaled = torch.where(wavelength > original / low_freq_factor, interpolated, blended)
    return torch.where(wavelength < original / high_freq_factor, unscaled, scaled), 1.0
