"""RoPE: frequencies per scaling type (one module each), the registry that dispatches on the type,
and the cos/sin tables with their application."""

from pe_runtime.rope.registry import SCALING_RULES, rope_inv_freq, rope_seq_len_key
from pe_runtime.rope.tables import ROPE_LAYOUTS, RopeLayout, apply_rope, rope_cos_sin, rope_cos_sin_at

__all__ = [
    "ROPE_LAYOUTS",
    "SCALING_RULES",
    "RopeLayout",
    "apply_rope",
    "rope_cos_sin",
    "rope_cos_sin_at",
    "rope_inv_freq",
    "rope_seq_len_key",
]
