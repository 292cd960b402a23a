"""Log-n attention, ported from Qwen-7B's `modeling_qwen.py` (`QWenAttention`, `use_logn_attn`),
read from the copy of the Hugging Face repository Qwen/Qwen-7B at github.com/zhangningboo/Qwen-7B.

What the port keeps: the factor table `[log(i, seq_length) if i > seq_length else 1 for i in
range(1, 32768)]` (built in Python doubles, kept float64 here, float32 there), applied only when the
key length exceeds `seq_length`, to the rotated queries of the current call, rows `key_size −
q_len .. key_size` (a query's index in the text while nothing is evicted); causal attention with
RoPE (Qwen's rotary is transformers' rotate-half form), keys cached rotated.
"""

from __future__ import annotations

import functools
import math

import torch

from tests.references.rotary import causal_mask, cos_sin, rotate

# The table's length in Qwen-7B: queries past index 32766 have no factor there.
QWEN_TABLE_LENGTH = 32767


@functools.lru_cache(maxsize=8)
def logn_table(seq_length: int) -> torch.Tensor:
    """Qwen's `logn_list` as a float64 tensor [32767]: row t scales the query at text index t."""
    return torch.tensor(
        [math.log(i, seq_length) if i > seq_length else 1 for i in range(1, QWEN_TABLE_LENGTH + 1)],
        dtype=torch.float64,
    )


def logn_query(query: torch.Tensor, key_size: int, seq_length: int) -> torch.Tensor:
    """Qwen's block: with more than `seq_length` keys, scale query rows [key_size − q_len, key_size)."""
    if key_size <= seq_length:
        return query
    seq_start = key_size - query.shape[1]
    return query * logn_table(seq_length)[seq_start:key_size][None, :, None]


def logn_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    base: float,
    seq_length: int,
    prefill: int | None = None,
) -> torch.Tensor:
    """Qwen's attention with `use_logn_attn` over a text: one call for `prefill` tokens (all by
    default), then one call per token over the cache."""
    length, head_dim = q.shape[1], q.shape[-1]
    prefill = length if prefill is None else prefill
    cached_keys = torch.empty(k.shape[0], 0, head_dim, dtype=k.dtype)
    outputs = []
    for begin, end in [(0, prefill), *((step, step + 1) for step in range(prefill, length))]:
        positions = torch.arange(begin, end)
        cos, sin = cos_sin(positions, head_dim, base)
        query = rotate(q[:, begin:end], cos, sin)
        cached_keys = torch.cat([cached_keys, rotate(k[:, begin:end], cos, sin)], dim=1)
        query = logn_query(query, end, seq_length)
        weights = query @ cached_keys.transpose(-1, -2) / math.sqrt(head_dim) + causal_mask(positions, end)
        outputs.append(torch.softmax(weights, dim=-1) @ v[:, :end])
    return torch.cat(outputs, dim=1)
