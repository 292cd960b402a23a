"""The rotary embedding every reference method builds on: transformers' Llama RoPE in float64.

All four repositories import `rotate_half` from transformers' Llama model and index cos/sin tables
made like `LlamaRotaryEmbedding` (inv_freq = base^(-2m/d), `emb = cat(freqs, freqs)`) or its
linear-scaling variant (positions divided by a factor). Their tables are float32; these are float64,
so the ports agree with the rules to rounding, not to float32 table error.
"""

from __future__ import annotations

import torch


def inverse_frequencies(head_dim: int, base: float) -> torch.Tensor:
    """1 / base^(2m/d) for m < d/2, float64."""
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))


def cos_sin(positions: torch.Tensor, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [*positions.shape, head_dim] at (possibly fractional) positions."""
    freqs = positions.to(torch.float64)[..., None] * inverse_frequencies(head_dim, base)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def table(
    length: int, head_dim: int, base: float, scaling_factor: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The cached cos/sin rows 0 .. length-1 (`LlamaLinearScalingRotaryEmbedding` when scaled)."""
    return cos_sin(torch.arange(length, dtype=torch.float64) / scaling_factor, head_dim, base)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-second, first), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' `(x * cos) + (rotate_half(x) * sin)`."""
    return x * cos + rotate_half(x) * sin


def causal_mask(query_positions: torch.Tensor, key_length: int) -> torch.Tensor:
    """transformers' additive causal mask [q_len, key_length]: 0 where the key's index is at most the
    query's position, the dtype's minimum elsewhere."""
    keys = torch.arange(key_length)[None, :]
    blocked = keys > query_positions[:, None]
    return torch.zeros(blocked.shape, dtype=torch.float64).masked_fill(
        blocked, torch.finfo(torch.float64).min
    )
