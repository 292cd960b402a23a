"""StreamingLLM, ported from mit-han-lab/streaming-llm: `streaming_llm/kv_cache.py`
(`StartRecentKVCache.__call__`), `streaming_llm/pos_shift/modify_llama.py`
(`llama_pos_shift_attention_forward`) and the loop of `examples/eval_long_ppl.py`.

What the port keeps: the text is fed one token at a time; the query is rotated at transformers'
position id for the call, which is the cache length before it (so positions are cache slots); the
cache holds unrotated keys, and every call rotates all cached keys at `arange(kv_seq_len)`; after
every token the cache is trimmed to the first `start_size` and the last `recent_size` entries once
it holds more than `start_size + recent_size`. A one-token call's transformers mask is all zeros.

The repository has no log-n attention; with `logn` the query is scaled by Qwen's factor at its index
in the text, as the SPEC states it (Qwen's own code would index its table by the cache length).
"""

from __future__ import annotations

import math

import torch

from tests.references.logn import logn_table
from tests.references.rotary import rotate, table


def streaming_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    base: float,
    start_size: int,
    recent_size: int,
    logn: int | None = None,
) -> torch.Tensor:
    """Outputs [heads, T, head_dim] of the token-by-token loop with the start+recent cache."""
    head_dim = q.shape[-1]
    keys = torch.empty(k.shape[0], 0, head_dim, dtype=k.dtype)
    values = torch.empty(v.shape[0], 0, head_dim, dtype=v.dtype)
    outputs = []
    for step in range(q.shape[1]):
        query_states = q[:, step : step + 1]
        if logn is not None:
            query_states = query_states * logn_table(logn)[step]
        position_ids = torch.tensor([keys.shape[1]])
        kv_seq_len = keys.shape[1] + 1
        cos, sin = table(kv_seq_len, head_dim, base)
        query_states = rotate(query_states, cos[position_ids], sin[position_ids])
        keys = torch.cat([keys, k[:, step : step + 1]], dim=1)
        values = torch.cat([values, v[:, step : step + 1]], dim=1)
        key_position_ids = torch.arange(kv_seq_len)
        key_states = rotate(keys, cos[key_position_ids], sin[key_position_ids])
        weights = query_states @ key_states.transpose(-1, -2) / math.sqrt(head_dim)
        outputs.append(torch.softmax(weights, dim=-1) @ values)
        keys, values = (
            _start_recent(keys, start_size, recent_size),
            _start_recent(values, start_size, recent_size),
        )
    return torch.cat(outputs, dim=1)


def _start_recent(cached: torch.Tensor, start_size: int, recent_size: int) -> torch.Tensor:
    """`StartRecentKVCache.__call__` on one tensor: unchanged up to start + recent entries, else the
    first `start_size` and the last `recent_size`."""
    seq_len = cached.shape[1]
    if seq_len <= start_size + recent_size:
        return cached
    return torch.cat([cached[:, :start_size], cached[:, seq_len - recent_size : seq_len]], dim=1)
