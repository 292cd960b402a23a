"""ReRoPE and Leaky ReRoPE, ported from bojone/rerope `rerope_patch.py` (`forward_with_rerope`) and
`leaky_rerope_patch.py` (`forward_with_leaky_rerope`), written against transformers 4.31's Llama.

What the ports keep of those forwards:
- the log-n query scale, always on there: `q *= (log(position_ids + 1) / log(training_length))
  .clip(1)` before RoPE (their module constant `training_length = 4096`; a training length at
  least the sequence length leaves every query as it is);
- the cache holds unrotated keys, values and the position ids; every call re-rotates;
- a prefill (q_len > 1) computes two score matrices, `torch.where(|i − j| < window, scores1,
  scores2)`: ReRoPE's scores2 rotate q at `window` and leave k unrotated; Leaky ReRoPE's rotate q
  at row `i + window·(k − 1)` and k at row j of a linear-scaling table (rows t/k, their
  `LlamaLinearScalingRotaryEmbedding` with `scaling_factor` k), scores1 at the true positions;
- decoding (q_len == 1) leaves q unrotated and rotates each key by −(relative position):
  ReRoPE at `min(i − j, window)`, Leaky ReRoPE at row i − j of `cat(cos[:window],
  cos2[window + offset:])`;
- transformers' additive causal mask, then a softmax (float64 here, float32 there).
Their tables are indexed by integer rows, so Leaky ReRoPE needs `window·(k − 1)` to be whole.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Protocol

import torch

from tests.references.rotary import causal_mask, rotate, table

Cache = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""Their `past_key_value`: unrotated keys [heads, T, d], values, and position ids [T]."""


class _Forward(Protocol):
    def __call__(
        self,
        query_states: torch.Tensor,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        position_ids: torch.Tensor,
        past: Cache | None,
    ) -> tuple[torch.Tensor, Cache]: ...


def rerope_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    base: float,
    window: int,
    training_length: int,
    prefill: int | None = None,
) -> torch.Tensor:
    """`forward_with_rerope` over a text: a prefill of `prefill` tokens (all by default), then decoding."""
    return _run(
        q, k, v, prefill, partial(_rerope_forward, base=base, window=window, training_length=training_length)
    )


def leaky_rerope_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    base: float,
    window: int,
    scaling_factor: float,
    training_length: int,
    prefill: int | None = None,
) -> torch.Tensor:
    """`forward_with_leaky_rerope` over a text: a prefill, then decoding."""
    offset = window * (scaling_factor - 1)
    if offset != int(offset):
        raise ValueError(f"window * (scaling_factor - 1) must index a table row, got {offset}")
    forward = partial(
        _leaky_forward,
        base=base,
        window=window,
        scaling_factor=scaling_factor,
        offset=int(offset),
        training_length=training_length,
    )
    return _run(q, k, v, prefill, forward)


def _run(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefill: int | None, forward: _Forward
) -> torch.Tensor:
    """Their generation loop: one call for the prompt, then one per token, the cache carried along."""
    length = q.shape[1]
    prefill = length if prefill is None else prefill
    outputs = []
    past: Cache | None = None
    for begin, end in [(0, prefill), *((step, step + 1) for step in range(prefill, length))]:
        output, past = forward(
            q[:, begin:end], k[:, begin:end], v[:, begin:end], torch.arange(begin, end), past
        )
        outputs.append(output)
    return torch.cat(outputs, dim=1)


def _scaled_and_cached(
    query_states: torch.Tensor,
    key_states: torch.Tensor,
    value_states: torch.Tensor,
    position_ids: torch.Tensor,
    past: Cache | None,
    training_length: int,
) -> tuple[torch.Tensor, Cache]:
    """The lines both forwards share: the log-n scale, then the cache concatenation."""
    query_states = query_states * (
        (position_ids + 1)[None, :, None].double().log() / math.log(training_length)
    ).clip(1)
    if past is not None:
        key_states = torch.cat([past[0], key_states], dim=1)
        value_states = torch.cat([past[1], value_states], dim=1)
        position_ids = torch.cat([past[2], position_ids], dim=0)
    return query_states, (key_states, value_states, position_ids)


def _rerope_forward(
    query_states: torch.Tensor,
    key_states: torch.Tensor,
    value_states: torch.Tensor,
    position_ids: torch.Tensor,
    past: Cache | None,
    *,
    base: float,
    window: int,
    training_length: int,
) -> tuple[torch.Tensor, Cache]:
    q_len, head_dim = query_states.shape[1], query_states.shape[-1]
    query_states, cache = _scaled_and_cached(
        query_states, key_states, value_states, position_ids, past, training_length
    )
    key_states, value_states, position_ids = cache
    kv_seq_len = key_states.shape[1]
    if q_len == 1:
        cos, sin = table(kv_seq_len, head_dim, base)
        relative = (position_ids[-1:] - position_ids).clip(max=window)
        key_states = rotate(key_states, cos[relative], -sin[relative])
        weights = query_states @ key_states.transpose(-1, -2) / math.sqrt(head_dim)
    else:
        cos, sin = table(max(kv_seq_len, window + 1), head_dim, base)
        query_states1 = rotate(query_states, cos[position_ids][-q_len:], sin[position_ids][-q_len:])
        key_states1 = rotate(key_states, cos[position_ids], sin[position_ids])
        far = position_ids * 0 + window
        query_states2 = rotate(query_states, cos[far][-q_len:], sin[far][-q_len:])
        weights1 = query_states1 @ key_states1.transpose(-1, -2) / math.sqrt(head_dim)
        weights2 = query_states2 @ key_states.transpose(-1, -2) / math.sqrt(head_dim)
        rectified_mask = (position_ids[-q_len:, None] - position_ids[None, :]).abs() < window
        weights = torch.where(rectified_mask, weights1, weights2)
    weights = weights + causal_mask(position_ids[-q_len:], kv_seq_len)
    return torch.softmax(weights, dim=-1) @ value_states, cache


def _leaky_forward(
    query_states: torch.Tensor,
    key_states: torch.Tensor,
    value_states: torch.Tensor,
    position_ids: torch.Tensor,
    past: Cache | None,
    *,
    base: float,
    window: int,
    scaling_factor: float,
    offset: int,
    training_length: int,
) -> tuple[torch.Tensor, Cache]:
    q_len, head_dim = query_states.shape[1], query_states.shape[-1]
    query_states, cache = _scaled_and_cached(
        query_states, key_states, value_states, position_ids, past, training_length
    )
    key_states, value_states, position_ids = cache
    kv_seq_len = key_states.shape[1]
    cos, sin = table(kv_seq_len, head_dim, base)
    cos2, sin2 = table(kv_seq_len + offset, head_dim, base, scaling_factor)
    if q_len == 1:
        relative = position_ids[-1:] - position_ids
        cos = torch.cat([cos[:window], cos2[window + offset :]], dim=0)
        sin = torch.cat([sin[:window], sin2[window + offset :]], dim=0)
        key_states = rotate(key_states, cos[relative], -sin[relative])
        weights = query_states @ key_states.transpose(-1, -2) / math.sqrt(head_dim)
    else:
        query_states1 = rotate(query_states, cos[position_ids][-q_len:], sin[position_ids][-q_len:])
        key_states1 = rotate(key_states, cos[position_ids], sin[position_ids])
        shifted = position_ids + offset
        query_states2 = rotate(query_states, cos2[shifted][-q_len:], sin2[shifted][-q_len:])
        key_states2 = rotate(key_states, cos2[position_ids], sin2[position_ids])
        weights1 = query_states1 @ key_states1.transpose(-1, -2) / math.sqrt(head_dim)
        weights2 = query_states2 @ key_states2.transpose(-1, -2) / math.sqrt(head_dim)
        rectified_mask = (position_ids[-q_len:, None] - position_ids[None, :]).abs() < window
        weights = torch.where(rectified_mask, weights1, weights2)
    weights = weights + causal_mask(position_ids[-q_len:], kv_seq_len)
    return torch.softmax(weights, dim=-1) @ value_states, cache
