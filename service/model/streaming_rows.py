"""Rows under StreamingLLM attention in the C decode pass, with no layer math of their own.

A streaming row holds its first S entries (the sinks) and its last W or so (`PagedKVCache.slide`
gives back the blocks between), each at the position the pool records for it. Under
`StreamingAttention` its query at text index i reads (`StreamingAttention.branches`):
- a recent key j, i − j ≤ W, where both sit: the plain pass's score (query rotated at i, key as
  cached), since a recent key's slot distance is its text distance;
- a sink j < S out of that window with the query at min(i, S + W): RoPE scores depend on the
  difference alone, so that is the query turned back by Δ = max(0, i − S − W) against the sink as
  cached;
- nothing else: the entries the row still holds between its sinks and its window (the rest of the
  sinks' block, the oldest entries of the window's first block) are masked.

So a decode pass runs a streaming row as a plain one, given its masked slots and, where Δ > 0, its
sinks' turn (`BatchPass`'s `masked` and `sinks`): a step then costs what a plain row's step over
S + W keys costs, however long the text has grown. On SmolLM2 with W = 8187 after an 8,128-token
prompt: 53.3 ms a token against 54.5 for a plain row, and 54.8 ms 512 tokens later; on the
model's own layers (the eager path every other rule takes) it was 70 ms. The eager path stays the
reference it is tested against, and still runs the prompt past S + W + 1 tokens (a chunk's
queries would each need their own Δ) and log-n (a scale per query).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from pe_runtime import RopeScaling, rope_cos_sin_at, rope_inv_freq, rope_seq_len_key
from service.model.attention_rules import AttentionRule, StreamingAttention
from service.model.config import ModelConfig
from service.model.paged_cache import PagedRows

# Schemes whose decode pass has no bias on its scores: the sinks' turn is the only positional change.
_SCHEMES = ("rope", "nope")


class StreamingSlots(NamedTuple):
    """What a decode pass needs to run its streaming rows as plain ones (zeros for the others)."""

    masked: Tensor  # int64 [B, 2]: each row's slots [first, last) out of its rule's sight
    sinks: tuple[Tensor, Tensor] | None  # int64 [B] sinks read turned, float32 [B, 2, R] the turn


def decodes_in_c(rule: AttentionRule | None, config: ModelConfig) -> bool:
    """Whether a row under `rule` runs in the C decode pass: no rule, or streaming without log-n on a
    model whose scores carry no positional bias."""
    if rule is None:
        return True
    return isinstance(rule, StreamingAttention) and rule.logn is None and config.pe in _SCHEMES


def streaming_slots(
    rows: PagedRows,
    rules: Sequence[AttentionRule | None],
    scalings: Sequence[RopeScaling],
    table_lengths: Sequence[int],
    config: ModelConfig,
) -> StreamingSlots | None:
    """Each row's masked slots and sink turn for its next token (before the pass writes it); None
    when no row is streaming."""
    if not any(isinstance(rule, StreamingAttention) for rule in rules):
        return None
    batch = len(rules)
    masked = torch.zeros((batch, 2), dtype=torch.int64)
    counts = torch.zeros(batch, dtype=torch.int64)
    turn = torch.zeros((batch, 2, config.rotary_dim), dtype=torch.float32)
    turned = False
    for index, rule in enumerate(rules):
        if not isinstance(rule, StreamingAttention):
            continue
        query = rows.lengths[index] + rows.text_offsets[index]  # the new token's text index
        recorded = rows.recorded_positions(index)  # ascending: slots keep their text order
        hidden = torch.tensor([rule.sink_tokens, query - rule.window], dtype=recorded.dtype)
        first, last = torch.searchsorted(recorded, hidden).tolist()
        if first < last:
            masked[index] = torch.tensor([first, last])
        back = query - rule.sink_tokens - rule.window
        if back > 0 and rule.sink_tokens and config.has_rope:
            seq_len = rope_seq_len_key(scalings[index], table_lengths[index])
            inv_freq = rope_inv_freq(config.rotary_dim, config.rope_base, scalings[index], seq_len)[0]
            cos, sin = rope_cos_sin_at(
                inv_freq, torch.tensor([-float(back)], dtype=torch.float64), layout=config.rope_layout
            )
            turn[index, 0], turn[index, 1] = cos[0], sin[0]
            counts[index] = rule.sink_tokens
            turned = True
    return StreamingSlots(masked, (counts, turn) if turned else None)
