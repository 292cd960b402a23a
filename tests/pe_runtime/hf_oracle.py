"""transformers as the oracle: its RoPE init functions, BLOOM's ALiBi and T5's buckets, called the
way a Llama/BLOOM/T5 model calls them. Test-only; pe_runtime never imports transformers."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch
from transformers import LlamaConfig, Phi3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.bloom.modeling_bloom import build_alibi_tensor
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.t5.modeling_t5 import T5Attention
from transformers.utils import logging

# transformers warns (correctly) about unusual but valid combinations we test on purpose.
logging.set_verbosity_error()  # type: ignore[no-untyped-call]


@functools.cache
def _llama_config(head_dim: int) -> LlamaConfig:
    return LlamaConfig(hidden_size=head_dim * 2, num_attention_heads=2, head_dim=head_dim)


def llama_config(
    head_dim: int, base: float, rope_parameters: Mapping[str, Any], max_position_embeddings: int
) -> LlamaConfig:
    """A Llama config carrying these RoPE parameters.

    Building a config costs milliseconds, so one per head_dim is reused with its RoPE fields
    replaced: the init functions standardise `rope_parameters` themselves, as on a fresh config.
    """
    config = _llama_config(head_dim)
    config.max_position_embeddings = max_position_embeddings
    config.rope_parameters = {**rope_parameters, "rope_theta": base}
    config.standardize_rope_params()
    return config


def hf_inv_freq(
    head_dim: int,
    base: float,
    rope_parameters: Mapping[str, Any],
    max_position_embeddings: int,
    seq_len: int | None = None,
) -> tuple[torch.Tensor, float]:
    """(inv_freq, attention_factor) exactly as a Llama model with this config would initialise them."""
    config = llama_config(head_dim, base, rope_parameters, max_position_embeddings)
    rope_type = str(rope_parameters.get("rope_type", rope_parameters.get("type", "default")))
    if rope_type == "default":
        return LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    return ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len=seq_len)


def phi3_longrope_inv_freq(
    head_dim: int, rope_scaling: Mapping[str, Any], max_length: int, original_length: int, seq_len: int
) -> tuple[torch.Tensor, float]:
    """LongRoPE as a Phi-3 config initialises it: the original length sits outside rope_scaling."""
    config = Phi3Config(
        hidden_size=head_dim * 2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=max_length,
        original_max_position_embeddings=original_length,
        rope_parameters=dict(rope_scaling),
    )
    return ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=seq_len)


def hf_cos_sin(
    head_dim: int, base: float, rope_parameters: Mapping[str, Any], max_position_embeddings: int, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama's rotary embedding forward for positions 0 .. length-1, float32 [length, head_dim]."""
    config = llama_config(head_dim, base, rope_parameters, max_position_embeddings)
    rotary = LlamaRotaryEmbedding(config)
    positions = torch.arange(length)[None]
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
    return cos[0], sin[0]


def bloom_alibi_slopes(num_heads: int) -> torch.Tensor:
    """The slopes inside BLOOM's alibi tensor: its value at position 1 of a two-token sequence."""
    alibi = build_alibi_tensor(torch.ones(1, 2), num_heads, torch.float32)  # [heads, 1, 2]
    return alibi[:, 0, 1]


def t5_buckets(
    relative_position: torch.Tensor, bidirectional: bool, num_buckets: int, max_distance: int
) -> torch.Tensor:
    buckets: torch.Tensor = T5Attention._relative_position_bucket(  # type: ignore[no-untyped-call]
        relative_position, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance
    )
    return buckets
