"""Linear scaling (position interpolation, Chen et al. 2023).

Dividing every frequency by `factor` is the same as dividing positions by it, which keeps the
position ids integral and the tables shareable.
"""

from __future__ import annotations

import torch

from pe_runtime.rope.spectrum import base_inv_freq
from pe_runtime.scaling import RopeScaling


def inv_freq(
    rotary_dim: int, base: float, scaling: RopeScaling, seq_len: int | None
) -> tuple[torch.Tensor, float]:
    return base_inv_freq(rotary_dim, base) / scaling.factor, 1.0
