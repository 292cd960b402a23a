"""Dynamic NTK scaling: the NTK base change grows with the sequence once it passes the original length.

Within the original length the model sees its trained spectrum exactly; beyond it the base follows
transformers' ((factor * seq_len / original) - (factor - 1))^(d / (d - 2)).

Which length the base follows depends on `scaling.dynamic_mode`:

- `"hf"`: the exact sequence length, as transformers computes it. A server that honoured this for
  every cached key would rebuild the whole sequence at every token, so transformers (and the `hf`
  mode of the engine) keeps cached keys as they were rotated: incremental decoding then depends on
  how the sequence was fed in, which is what reproducing `generate()` needs.
- `"bucketed"` (the service's default): the length rounded up to the next bucket, the original
  length times a power of sqrt(2) (for 256: 363, 512, 725, 1024, 1449, 2048, ...). A sequence then
  changes tables a few times in its life (8 times from 256 to 4096 tokens), the engine recomputes
  its cached keys only at those crossings, and incremental decoding equals a fresh pass over the
  same tokens. The base is at most sqrt(2) times the length too long, i.e. slightly more stretched.
"""

from __future__ import annotations

import math

import torch

from pe_runtime.rope.spectrum import base_inv_freq, ntk_scaled_base, original_length
from pe_runtime.scaling import RopeScaling

BUCKET_RATIO = math.sqrt(2.0)


def bucket_length(original: int, seq_len: int) -> int:
    """The smallest bucket, original * sqrt(2)^k rounded up (k >= 1), that holds `seq_len`."""
    steps = 1
    while _bucket(original, steps) < seq_len:
        steps += 1
    return _bucket(original, steps)


def _bucket(original: int, steps: int) -> int:
    """original * sqrt(2)^steps, exact for even steps (powers of two need no rounding)."""
    whole = original << (steps // 2)
    return math.ceil(whole * BUCKET_RATIO) if steps % 2 else whole


def effective_seq_len(scaling: RopeScaling, seq_len: int | None) -> int | None:
    """The length the base is computed for, None when the unscaled spectrum applies."""
    original = original_length(scaling)
    if seq_len is None or seq_len <= original:
        return None
    return seq_len if scaling.dynamic_mode == "hf" else bucket_length(original, seq_len)


def inv_freq(
    rotary_dim: int, base: float, scaling: RopeScaling, seq_len: int | None
) -> tuple[torch.Tensor, float]:
    original = original_length(scaling)
    length = effective_seq_len(scaling, seq_len) or original
    ratio = scaling.factor * length / original - (scaling.factor - 1.0)
    return base_inv_freq(rotary_dim, ntk_scaled_base(base, rotary_dim, ratio)), 1.0
