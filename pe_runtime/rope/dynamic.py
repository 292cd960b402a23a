"""Dynamic NTK scaling: the NTK base change grows with the sequence once it passes the original length.

Within the original length the model sees its trained spectrum exactly; beyond it the base follows
transformers' ((factor * seq_len / original) - (factor - 1))^(d / (d - 2)).
"""

from __future__ import annotations

import torch

from pe_runtime.rope.spectrum import base_inv_freq, ntk_scaled_base, original_length
from pe_runtime.scaling import RopeScaling


def effective_seq_len(scaling: RopeScaling, seq_len: int | None) -> int | None:
    """seq_len when it changes the base, None when the unscaled spectrum applies."""
    if seq_len is None or seq_len <= original_length(scaling):
        return None
    return seq_len


def inv_freq(
    rotary_dim: int, base: float, scaling: RopeScaling, seq_len: int | None
) -> tuple[torch.Tensor, float]:
    original = original_length(scaling)
    length = effective_seq_len(scaling, seq_len) or original
    ratio = scaling.factor * length / original - (scaling.factor - 1.0)
    return base_inv_freq(rotary_dim, ntk_scaled_base(base, rotary_dim, ratio)), 1.0
