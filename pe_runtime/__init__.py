"""Positional-encoding math as pure functions, plus `PECache` for the tables a server reuses.

No HTTP and no weights here: the service and the benchmarks build on these names, and
transformers is only the test oracle, never imported at run time.
"""

from pe_runtime.absolute import interpolate_learned, sinusoidal_table
from pe_runtime.alibi import alibi_bias, alibi_slopes
from pe_runtime.cache import DEFAULT_BUDGET_BYTES_PER_DEVICE, CacheStats, PECache, RopeTables
from pe_runtime.cope import cope_logits, cope_positions
from pe_runtime.errors import PEConfigError
from pe_runtime.rope import (
    ROPE_LAYOUTS,
    RopeLayout,
    apply_rope,
    rope_cos_sin,
    rope_cos_sin_at,
    rope_inv_freq,
    rope_seq_len_key,
)
from pe_runtime.scaling import SCALING_TYPES, RopeScaling
from pe_runtime.shaw import shaw_key_logits, shaw_relative_index, shaw_value_term
from pe_runtime.t5 import t5_relative_position_bucket
from pe_runtime.transformer_xl import relative_shift, relative_sinusoid

__all__ = [
    "DEFAULT_BUDGET_BYTES_PER_DEVICE",
    "ROPE_LAYOUTS",
    "SCALING_TYPES",
    "CacheStats",
    "PECache",
    "PEConfigError",
    "RopeLayout",
    "RopeScaling",
    "RopeTables",
    "alibi_bias",
    "alibi_slopes",
    "apply_rope",
    "cope_logits",
    "cope_positions",
    "interpolate_learned",
    "relative_shift",
    "relative_sinusoid",
    "rope_cos_sin",
    "rope_cos_sin_at",
    "rope_inv_freq",
    "rope_seq_len_key",
    "shaw_key_logits",
    "shaw_relative_index",
    "shaw_value_term",
    "sinusoidal_table",
    "t5_relative_position_bucket",
]
