"""Self-Extend, ported from datamllab/LongLM `self_extend_patch/Llama_4_40.py`, `self_extend_forward`
(the eager forward, at the commit "Fix group query position calculation", 715c1e3, which changed
its group query position from `W − W/G` to `W − W//G`).

What the port keeps of that forward:
- the log-n query scale `scale_base`: `q * (log(position_ids + 1) / log(scale_base)).clip(1)`,
  before RoPE, off when `scale_base <= 0`;
- two rotations of every query and key: "neighbor" at the true positions and "group" at
  `q // G + W' − W' // G`, `k // G`, where W' is 0 while the largest query position is below W
  (their guard against a negative shift) and W otherwise;
- both score matrices get transformers' causal mask, then `torch.where(neighbor_attention_mask,
  neighbor, group)`: in a prefill (q_len == kv_seq_len) the neighbour mask is the lower triangle
  minus the triangle of pairs at least W apart; in decoding (q_len == 1) it is the last W keys;
- key positions are `position_ids` in a prefill and `arange(kv_seq_len)` in decoding, keys cached
  unrotated (transformers' `DynamicCache` holds the projected keys: this forward rotates after the
  cache update).
The softmax and the matmuls are float64 here (theirs upcast the softmax to float32).
"""

from __future__ import annotations

import math

import torch

from tests.references.rotary import causal_mask, cos_sin, rotate


def self_extend_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    base: float,
    group_size: int,
    window: int,
    scale_base: int = -1,
    prefill: int | None = None,
) -> torch.Tensor:
    """Outputs [heads, T, head_dim]: the first `prefill` tokens (all by default) as one forward,
    each later token as a q_len == 1 forward over the cached keys."""
    length = q.shape[1]
    prefill = length if prefill is None else prefill
    outputs = [
        _forward(
            q[:, :prefill],
            k[:, :prefill],
            v[:, :prefill],
            torch.arange(prefill),
            base=base,
            group_size=group_size,
            window=window,
            scale_base=scale_base,
        )
    ]
    for step in range(prefill, length):
        outputs.append(
            _forward(
                q[:, step : step + 1],
                k[:, : step + 1],
                v[:, : step + 1],
                torch.tensor([step]),
                base=base,
                group_size=group_size,
                window=window,
                scale_base=scale_base,
            )
        )
    return torch.cat(outputs, dim=1)


def _forward(
    query_states: torch.Tensor,
    key_states: torch.Tensor,
    value_states: torch.Tensor,
    position_ids: torch.Tensor,
    *,
    base: float,
    group_size: int,
    window: int,
    scale_base: int,
) -> torch.Tensor:
    """One call of their forward; `key_states`/`value_states` are the cache after its update."""
    q_len, kv_seq_len, head_dim = query_states.shape[1], key_states.shape[1], query_states.shape[-1]
    if scale_base > 0:
        scale = ((position_ids + 1)[None, :, None].double().log() / math.log(scale_base)).clip(1)
        scaled_query = query_states * scale
    else:
        scaled_query = query_states

    query_position = position_ids
    key_position = position_ids if q_len != 1 else torch.arange(kv_seq_len)

    neighbor_q_cos, neighbor_q_sin = cos_sin(query_position, head_dim, base)
    neighbor_k_cos, neighbor_k_sin = cos_sin(key_position, head_dim, base)
    shift = 0 if query_position.max() < window else window
    group_query_position = query_position // group_size + shift - shift // group_size
    group_key_position = key_position // group_size
    group_q_cos, group_q_sin = cos_sin(group_query_position, head_dim, base)
    group_k_cos, group_k_sin = cos_sin(group_key_position, head_dim, base)

    neighbor_query = rotate(scaled_query, neighbor_q_cos, neighbor_q_sin)
    neighbor_key = rotate(key_states, neighbor_k_cos, neighbor_k_sin)
    group_query = rotate(scaled_query, group_q_cos, group_q_sin)
    group_key = rotate(key_states, group_k_cos, group_k_sin)

    neighbor_weights = neighbor_query @ neighbor_key.transpose(-1, -2) / math.sqrt(head_dim)
    group_weights = group_query @ group_key.transpose(-1, -2) / math.sqrt(head_dim)
    mask = causal_mask(position_ids, kv_seq_len)
    group_weights = group_weights + mask
    neighbor_weights = neighbor_weights + mask

    if q_len == 1:
        neighbor_attention_mask = torch.zeros((q_len, kv_seq_len))
        neighbor_attention_mask[:, -window:] = 1
    elif q_len == kv_seq_len:
        neighbor_attention_mask = torch.tril(torch.ones((q_len, kv_seq_len)))
        if q_len - window > 0:
            group_attention_mask = torch.tril(torch.ones((q_len - window, kv_seq_len - window)))
            neighbor_attention_mask[window:, :-window] -= group_attention_mask
    else:
        raise ValueError("q_len should be 1 or seq_len.")

    weights = torch.where(neighbor_attention_mask.bool(), neighbor_weights, group_weights)
    return torch.softmax(weights, dim=-1) @ value_states
