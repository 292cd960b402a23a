"""The scaling registry and `rope_inv_freq`, the one entry point that dispatches on `scaling.type`.

The registry is keyed on the explicit type name so a new scaling is one module plus one line here,
and the cache learns from `seq_len_key` which requests may share a table.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

import torch

from pe_runtime.errors import PEConfigError
from pe_runtime.rope import dynamic, linear, llama3, longrope, none, ntk, yarn
from pe_runtime.rope.spectrum import ScalingRule, derived
from pe_runtime.scaling import SCALING_TYPES, RopeScaling

SCALING_RULES: Final[Mapping[str, ScalingRule]] = {
    "none": ScalingRule(none.inv_freq),
    "linear": ScalingRule(linear.inv_freq),
    "ntk": ScalingRule(ntk.inv_freq),
    "dynamic": ScalingRule(dynamic.inv_freq, dynamic.effective_seq_len),
    "yarn": ScalingRule(yarn.inv_freq),
    "llama3": ScalingRule(llama3.inv_freq),
    "longrope": ScalingRule(longrope.inv_freq, longrope.effective_seq_len),
}
assert tuple(SCALING_RULES) == SCALING_TYPES, "every scaling type needs exactly one rule"

_UNSCALED: Final = RopeScaling()


def rope_inv_freq(
    head_dim: int, base: float, scaling: RopeScaling | None, seq_len: int | None = None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (float32 [head_dim // 2], on CPU) and the factor cos/sin are multiplied by.

    `head_dim` is the number of rotated channels (pass the rotary dimension for partial rotary).
    `seq_len` is the sequence's total length; only `dynamic` and `longrope` read it.
    """
    _check_rope_shape(head_dim, base)
    scaling = scaling or _UNSCALED
    inv_freq, factor = SCALING_RULES[scaling.type].build(head_dim, base, scaling, seq_len)
    # In practice only an explicit attention_factor fails this: a subnormal one is zero in float32.
    return inv_freq, derived("attention_factor", "the attention factor", lambda: factor, positive=True)


def rope_seq_len_key(scaling: RopeScaling | None, seq_len: int | None) -> int | None:
    """The part of seq_len the frequencies depend on: None for static scalings (one shared table)."""
    scaling = scaling or _UNSCALED
    return SCALING_RULES[scaling.type].seq_len_key(scaling, seq_len)


def _check_rope_shape(head_dim: int, base: float) -> None:
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2:
        raise PEConfigError(f"head_dim must be a positive even integer, got {head_dim!r}", field="head_dim")
    if not base > 1.0 or base == float("inf"):
        raise PEConfigError(f"rope base must be a finite number > 1, got {base!r}", field="base")
