"""Static NTK-aware scaling: base' = base * factor^(d / (d - 2)), fixed for every length.

transformers has no static variant; this equals its dynamic formula with factor 1 at
seq_len = factor * original, frozen, so a checkpoint runs past its context with one table for the
whole request instead of a new spectrum at every decode step.
"""

from __future__ import annotations

import torch

from pe_runtime.rope.spectrum import base_inv_freq, ntk_scaled_base
from pe_runtime.scaling import RopeScaling


def inv_freq(
    rotary_dim: int, base: float, scaling: RopeScaling, seq_len: int | None
) -> tuple[torch.Tensor, float]:
    return base_inv_freq(rotary_dim, ntk_scaled_base(base, rotary_dim, scaling.factor)), 1.0
