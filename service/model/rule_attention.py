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

Every rule puts a key at a position that depends on the key alone (⌊j/G⌋, 0, j/k, j mod c), so
a row keeps its keys turned there (`TurnedKeys`) and turns only each pass's new keys: a decode
step then costs one score product per branch, not a turn of every cached key in every layer (which
took 30 times a product's time at 8k keys).

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

Turn = tuple[Tensor, Tensor]  # unit cos, sin [N, rotary_dim]


class BranchInputs(NamedTuple):
    """One branch of one row: the turn of its queries, which turned keys it reads, its pairs, its
    bias."""

    query_turn: Turn | None  # [Tq, rotary_dim]; None: no turn
    key_view: int | None  # index into `RuleRow.key_turns`; None: the keys as cached
    selected: Tensor  # [Tq, Tk] bool
    bias: Tensor | None  # [H, Tq, Tk] float32 (ALiBi at the branch's positions)


class TurnedKeys:
    """One row's cached keys turned to its rule's key positions, per layer and per distinct key
    placement (DCA's three branches share one), kept across the row's passes.

    Each kept window knows how many slots it holds turned; a pass turns from there, or from the
    row's committed length if that is less (a pass that failed left slots its row will write
    again), so a placement that first appears late (DCA's, once the text passes its stride) turns
    every slot. Turned keys depend on the rule and on the row's frequencies (`owner`): a change
    of either (a dynamic table's next bucket) turns everything again. The copy lives beside the
    pool, outside its bound: a row under a rule that moves keys holds its keys twice."""

    def __init__(self) -> None:
        self.owner: object = None
        self._kept: dict[tuple[int, int], tuple[Tensor, int]] = {}  # (layer, placement): keys, turned

    def begin(self, owner: object) -> None:
        """A pass of the row under `owner` starts: what was turned under another is dropped."""
        if owner != self.owner:
            self.owner = owner
            self._kept.clear()

    def window(
        self, layer: int, view: int, keys: Tensor, turn: Turn, past: int, layout: RopeLayout
    ) -> Tensor:
        """Keys [Hkv, Tk, hd] turned by `turn` (cos/sin for every slot), reusing what earlier passes
        turned of the first `past` slots (the row's committed entries)."""
        length = keys.shape[1]
        buffer, turned = self._kept.get((layer, view), (None, 0))
        first = min(turned, past)
        if buffer is None or buffer.shape[1] < length:
            capacity = max(length, 2 * (buffer.shape[1] if buffer is not None else 0))
            grown = keys.new_empty((keys.shape[0], capacity, keys.shape[2]))
            if buffer is not None:
                grown[:, :first] = buffer[:, :first]
            buffer = grown
        cos, sin = turn
        buffer[:, first:length] = apply_rope(keys[:, first:], cos[first:], sin[first:], layout=layout)
        self._kept[(layer, view)] = (buffer, length)
        return buffer[:, :length]


class RuleRow(NamedTuple):
    branches: tuple[BranchInputs, ...]
    key_turns: tuple[Turn, ...]  # per distinct key placement, for every slot of the window
    past: int  # the row's committed entries before the pass
    store: TurnedKeys | None

    def keys(self, layer: int, view: int | None, keys: Tensor, layout: RopeLayout) -> Tensor:
        """The window's keys [Hkv, Tk, hd] as branch `view` reads them."""
        if view is None:
            return keys
        turn = self.key_turns[view]
        if self.store is None:
            return apply_rope(keys, *turn, layout=layout)
        return self.store.window(layer, view, keys, turn, self.past, layout)


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
    past: int = 0,
    store: TurnedKeys | None = None,
    owner: object = None,
) -> RuleRow:
    """A row's branches for its queries at text indices `query_positions` [Tq] against the window's
    keys, whose recorded positions are `key_positions` [Tk]; only the first `written` slots hold
    the row's entries (the others are padding or other rows' blocks, never seen). With a `store`,
    the keys of the first `past` slots were turned by earlier passes of this row under `owner`
    (its rule and frequencies)."""
    queries = query_positions.to(torch.int64)
    keys = key_positions.to(torch.int64)
    slot_written = torch.arange(keys.shape[0], device=keys.device) < written
    branches: list[BranchInputs] = []
    placements: list[Tensor] = []
    if store is not None:
        store.begin(owner)
    for branch in rule.branches(queries.cpu(), keys.cpu()):
        query_at = branch.query_position.to(keys.device)
        key_at = branch.key_position.to(keys.device)
        bias = None
        if alibi_slopes is not None:
            bias = alibi_bias(alibi_slopes, query_at, key_at)  # [H, Tq, Tk]
        view = None
        if inv_freq is not None and bool((key_at != keys).any()):
            view = next((at for at, seen in enumerate(placements) if torch.equal(seen, key_at)), None)
            if view is None:
                view = len(placements)
                placements.append(key_at)
        branches.append(
            BranchInputs(
                query_turn=_turn(query_at - queries.double(), inv_freq, layout, dtype),
                key_view=view,
                selected=branch.selected.to(keys.device) & slot_written[None, :],
                bias=bias,
            )
        )
    key_turns = tuple(
        rope_cos_sin_at(inv_freq, at - keys.double(), layout=layout, dtype=dtype)
        for at in placements
        if inv_freq is not None
    )
    return RuleRow(tuple(branches), key_turns, past, store)


def rule_row_attention(
    row: RuleRow, layer: int, queries: Tensor, keys: Tensor, values: Tensor, layout: RopeLayout
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
        turned_keys = row.keys(layer, branch.key_view, keys, layout)
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
    layer: int,
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    attn_mask: Tensor | None,
    causal: bool,
    layout: RopeLayout,
) -> Tensor:
    """Queries [B, H, Tq, hd] against windows [B, Hkv, Tk, hd]: rows with a rule under it, the
    others through SDPA with the pass's mask -> attended [B, H, Tq, hd]."""
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
            attended[index] = rule_row_attention(
                row, layer, queries[index], keys[index], values[index], layout
            )
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
