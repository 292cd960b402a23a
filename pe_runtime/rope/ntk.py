"""Static NTK-aware scaling: base' = base * factor^(d / (d - 2)), fixed for every length.

transformers has no static variant; this is its dynamic formula frozen at seq_len = factor * original,
which lets a checkpoint be served past its context without the table changing during decode.
"""

from __future__ import annotations

import torch

from pe_runtime.rope.spectrum import base_inv_freq, ntk_scaled_base
from pe_runtime.scaling import RopeScaling


def inv_freq(
    rotary_dim: int, base: float, scaling: RopeScaling, seq_len: int | None
) -> tuple[torch.Tensor, float]:
    return base_inv_freq(rotary_dim, ntk_scaled_base(base, rotary_dim, scaling.factor)), 1.0
