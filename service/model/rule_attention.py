"""Attention under a request's `pe_attention` rule, over the keys a pass attends to.

A rule (`attention_rules`) places a query and a key per pair; `AttentionRule.branches` states it
as a few score products, in each of which a query's position depends on the query alone and a
key's on the key alone. The pass rotates every query at its text index and the cache holds every
key rotated at the position the pool records for it (`RowCache.key_positions`), so a branch only
turns each side by the difference between where the branch puts it and where it already is:
positions are data, read from the pool, and nothing cached is rewritten. RoPE composes, so the
row's scaling (its inverse frequencies and attention factor) carries over unchanged.

Per row of a pass:
- `rule_row_inputs` builds, once per pass, each branch's turns (cos/sin of the position
  differences, float64 angles), its selection of pairs (the rule's, within the row's written
  slots) and, for ALiBi, the branch's bias;
- `rule_row_attention` runs one row's queries against its window: a score product per branch,
  each pair taking the score of the branch that selects it, one softmax.

Rows without a rule run the pass's own attention (SDPA, one call for all of them).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from pe_runtime import RopeLayout, alibi_bias, apply_rope, rope_cos_sin_at
from service.model.attention_rules import AttentionRule


class BranchInputs(NamedTuple):
    """One branch of one row: the turns of its queries and keys, its pairs, its bias."""

    query_turn: tuple[Tensor, Tensor] | None  # cos, sin [Tq, rotary_dim]; None: no turn
    key_turn: tuple[Tensor, Tensor] | None  # cos, sin [Tk, rotary_dim]
    selected: Tensor  # [Tq, Tk] bool
    bias: Tensor | None  # [H, Tq, Tk] float32 (ALiBi at the branch's positions)


class RuleRow(NamedTuple):
    branches: tuple[BranchInputs, ...]


def rule_row_inputs(
    rule: AttentionRule,
    query_positions: Tensor,
    key_positions: Tensor,
    written: int,
    *,
    inv_freq: Tensor | None,
    layout: RopeLayout,
    alibi_slopes: Tensor | None,
    dtype: torch.dtype,
) -> RuleRow:
    """A row's branches for its queries at text indices `query_positions` [Tq] against the window's
    keys, whose recorded positions are `key_positions` [Tk]; only the first `written` slots hold
    the row's entries (the others are padding or other rows' blocks, never seen)."""
    queries = query_positions.to(torch.int64)
    keys = key_positions.to(torch.int64)
    slot_written = torch.arange(keys.shape[0], device=keys.device) < written
    branches = []
    for branch in rule.branches(queries.cpu(), keys.cpu()):
        query_at = branch.query_position.to(keys.device)
        key_at = branch.key_position.to(keys.device)
        bias = None
        if alibi_slopes is not None:
            bias = alibi_bias(alibi_slopes, query_at, key_at)  # [H, Tq, Tk]
        branches.append(
            BranchInputs(
                query_turn=_turn(query_at - queries.double(), inv_freq, layout, dtype),
                key_turn=_turn(key_at - keys.double(), inv_freq, layout, dtype),
                selected=branch.selected.to(keys.device) & slot_written[None, :],
                bias=bias,
            )
        )
    return RuleRow(tuple(branches))


def rule_row_attention(
    row: RuleRow, queries: Tensor, keys: Tensor, values: Tensor, layout: RopeLayout
) -> Tensor:
    """One row: queries [H, Tq, hd] (rotated at their text indices, log-n applied) against the
    window's keys and values [Hkv, Tk, hd] -> attended [H, Tq, hd].

    Query heads sharing a key head are stacked along the query axis ([Hkv, G·Tq, hd]), so keys and
    values are read once per key head rather than copied for every query head."""
    heads, length, head_dim = queries.shape
    kv_heads = keys.shape[0]
    scale = 1.0 / math.sqrt(head_dim)
    scores = torch.full((heads, length, keys.shape[1]), -math.inf, device=queries.device)  # [H, Tq, Tk]
    for branch in row.branches:
        turned_queries = _turned(queries, branch.query_turn, layout)
        turned_keys = _turned(keys, branch.key_turn, layout)
        grouped = turned_queries.reshape(kv_heads, -1, head_dim)  # [Hkv, G·Tq, hd]
        products = (grouped @ turned_keys.transpose(-1, -2)).view(heads, length, -1).float() * scale
        if branch.bias is not None:
            products = products + branch.bias
        scores = torch.where(branch.selected, products, scores)
    weights = torch.softmax(scores, dim=-1).to(values.dtype)  # [H, Tq, Tk]
    attended: Tensor = (weights.view(kv_heads, -1, keys.shape[1]) @ values).view(heads, length, head_dim)
    return attended


def attend_rows(
    rows: Sequence[RuleRow | None],
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    attn_mask: Tensor | None,
    causal: bool,
    layout: RopeLayout,
) -> Tensor:
    """Queries [B, H, Tq, hd] against windows [B, Hkv, Tk, hd]: rows with a rule under it, the
    others through SDPA with the pass's mask -> attended [B, H, Tq, hd]."""
    if len(rows) == 1 < queries.shape[0]:  # identical rows, folded into one by the pass
        rows = list(rows) * queries.shape[0]
    attended = torch.empty_like(queries)
    plain = [index for index, row in enumerate(rows) if row is None]
    if plain:
        take = torch.tensor(plain, device=queries.device)
        mask = attn_mask
        if mask is not None and mask.shape[0] > 1:
            mask = mask[take]
        attended[take] = F.scaled_dot_product_attention(
            queries[take],
            keys[take],
            values[take],
            attn_mask=mask,
            is_causal=causal and mask is None,
            enable_gqa=keys.shape[1] != queries.shape[1],
        )
    for index, row in enumerate(rows):
        if row is not None:
            attended[index] = rule_row_attention(row, queries[index], keys[index], values[index], layout)
    return attended


def _turned(x: Tensor, turn: tuple[Tensor, Tensor] | None, layout: RopeLayout) -> Tensor:
    return x if turn is None else apply_rope(x, *turn, layout=layout)


def _turn(
    shift: Tensor, inv_freq: Tensor | None, layout: RopeLayout, dtype: torch.dtype
) -> tuple[Tensor, Tensor] | None:
    """Unit cos/sin [N, rotary_dim] turning each token by `shift` [N] positions (float64 angles);
    None when nothing turns (no RoPE, or the branch leaves this side where it is)."""
    if inv_freq is None or not bool(shift.any()):
        return None
    return rope_cos_sin_at(inv_freq, shift, layout=layout, dtype=dtype)
