"""No scaling: the spectrum the model was trained with."""

from __future__ import annotations

import torch

from pe_runtime.rope.spectrum import base_inv_freq
from pe_runtime.scaling import RopeScaling


def inv_freq(
    rotary_dim: int, base: float, scaling: RopeScaling, seq_len: int | None
) -> tuple[torch.Tensor, float]:
    return base_inv_freq(rotary_dim, base), 1.0
