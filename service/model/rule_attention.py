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

On a CPU in float32, a branch runs as one fused attention call (the flash kernel SDPA uses, which
also returns each query's log-sum-exp) over only the key slots it may select, and the branches'
outputs are merged by their log-sum-exps: no [H, Tq, Tk] score matrix is made, and ReRoPE's near
and far halves each read only their keys. A 3,072-token `/score` of SmolLM2 under ReRoPE took 19.9 s
with the score matrix and 7.7 s fused (standard, on the C pass: 6.4 s). Elsewhere the branches'
products fill one score matrix, one softmax.

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
# A pass's key or value windows: [B, Hkv, Tk, hd], or one [Hkv, Tk_i, hd] per row (`attend_rows`).
Windows = Tensor | Sequence[Tensor]


class BranchInputs(NamedTuple):
    """One branch of one row: the turn of its queries, which turned keys it reads, its pairs, its
    bias; for the fused kernel, the key slots it may select and its additive mask over them."""

    query_turn: Turn | None  # [Tq, rotary_dim]; None: no turn
    key_view: int | None  # index into `RuleRow.key_turns`; None: the keys as cached
    selected: Tensor  # [Tq, Tk] bool
    bias: Tensor | None  # [H, Tq, Tk] float32 (ALiBi at the branch's positions)
    span: tuple[int, int]  # the first key slot any query selects, and one past the last
    fused_mask: Tensor | None  # [1|Hkv, G·Tq, span] 0 / -inf (+ bias); None: the generic path
    sees: Tensor  # [G·Tq] bool: which (stacked) queries select a key in this branch


class TurnedKeys:
    """One row's cached keys turned to its rule's key positions, per layer and per distinct key
    placement (DCA's three branches share one), kept across the row's passes.

    Each kept window knows how many slots it holds turned; a pass turns from there, or from the
    row's committed length if that is less (a pass that failed left slots its row will write
    again), so a placement that first appears late (DCA's, once the text passes its stride) turns
    every slot. Turned keys depend on the rule and on the row's frequencies (`owner`): a change
    of either (a dynamic table's next bucket) turns everything again. The copy lives beside the
    pool, outside its bound: a row under a rule that moves keys holds its keys twice. A window grows
    by doubling, up to `limit` slots (the row's reservation), so that the copy never holds more
    slots than the row can fill."""

    def __init__(self, limit: int) -> None:
        self.owner: object = None
        self.limit = limit
        self._kept: dict[tuple[int, int], tuple[Tensor, int]] = {}  # (layer, placement): keys, turned

    @property
    def nbytes(self) -> int:
        return sum(keys.numel() * keys.element_size() for keys, _ in list(self._kept.values()))

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
            capacity = grown_capacity(length, buffer.shape[1] if buffer is not None else 0, self.limit)
            grown = keys.new_empty((keys.shape[0], capacity, keys.shape[2]))
            if buffer is not None:
                grown[:, :first] = buffer[:, :first]
            buffer = grown
        cos, sin = turn
        buffer[:, first:length] = apply_rope(keys[:, first:], cos[first:], sin[first:], layout=layout)
        self._kept[(layer, view)] = (buffer, length)
        return buffer[:, :length]


def grown_capacity(needed: int, held: int, limit: int) -> int:
    """The slots a kept copy grows to when it must hold `needed` and holds `held`: twice as many, so
    that a row growing a chunk at a time copies its window a logarithmic number of times, but never
    more than `limit` (what the row can fill) unless `needed` is more."""
    return max(needed, min(2 * held, limit))


class RuleRow(NamedTuple):
    branches: tuple[BranchInputs, ...]
    key_turns: tuple[Turn, ...]  # per distinct key placement, for every slot of the window
    past: int  # the row's committed entries before the pass
    store: TurnedKeys | None
    slots: int  # its window's width Tk: its entries before the pass and the pass's tokens

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
    query_groups: int = 1,
) -> RuleRow:
    """A row's branches for its queries at text indices `query_positions` [Tq] against the window's
    keys, whose recorded positions are `key_positions` [Tk]; only the first `written` slots hold
    the row's entries (the others are padding or other rows' blocks, never seen). With a `store`,
    the keys of the first `past` slots were turned by earlier passes of this row under `owner`
    (its rule and frequencies). `query_groups` is how many query heads share a key head."""
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
        selected = branch.selected.to(keys.device) & slot_written[None, :]
        span = _span(selected)
        branches.append(
            BranchInputs(
                query_turn=_turn(query_at - queries.double(), inv_freq, layout, dtype),
                key_view=view,
                selected=selected,
                bias=bias,
                span=span,
                fused_mask=_fused_mask(selected, bias, span, query_groups, dtype),
                sees=selected.any(dim=1).repeat(query_groups),
            )
        )
    key_turns = tuple(
        rope_cos_sin_at(inv_freq, at - keys.double(), layout=layout, dtype=dtype)
        for at in placements
        if inv_freq is not None
    )
    return RuleRow(tuple(branches), key_turns, past, store, keys.shape[0])


def rule_row_attention(
    row: RuleRow, layer: int, queries: Tensor, keys: Tensor, values: Tensor, layout: RopeLayout
) -> Tensor:
    """One row: queries [H, Tq, hd] (rotated at their text indices, log-n applied) against the
    window's keys and values [Hkv, Tk, hd] -> attended [H, Tq, hd].

    Query heads sharing a key head are stacked along the query axis ([Hkv, G·Tq, hd]), so keys and
    values are read once per key head rather than copied for every query head."""
    if all(branch.fused_mask is not None or branch.span[0] == branch.span[1] for branch in row.branches):
        return _fused_row_attention(row, layer, queries, keys, values, layout)
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
    keys: Windows,
    values: Windows,
    attn_mask: Tensor | None,
    causal: bool,
    layout: RopeLayout,
) -> Tensor:
    """Queries [B, H, Tq, hd] against the pass's windows: rows with a rule under it, each over its
    own slots, the others through SDPA with the pass's mask -> attended [B, H, Tq, hd].

    The windows are either the pass's, [B, Hkv, Tk, hd] each (a rule row reads its first
    `RuleRow.slots`), or, when every row has a rule, one [Hkv, slots, hd] per row
    (`PagedRows.write`: no row pays for gathering the others' or the longest row's width)."""
    attended = torch.empty_like(queries)
    plain = [index for index, row in enumerate(rows) if row is None]
    if plain:
        assert isinstance(keys, Tensor) and isinstance(values, Tensor), "plain rows read the pass's windows"
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
            own_keys, own_values = keys[index][:, : row.slots], values[index][:, : row.slots]
            attended[index] = rule_row_attention(row, layer, queries[index], own_keys, own_values, layout)
    return attended


def _fused_row_attention(
    row: RuleRow, layer: int, queries: Tensor, keys: Tensor, values: Tensor, layout: RopeLayout
) -> Tensor:
    """`rule_row_attention` by the fused kernel: each branch attends over its span of key slots
    under its mask, returning its output and each query's log-sum-exp; the outputs are weighted by
    their branch's share of the total (a query selects no key in a branch: none of its weight)."""
    heads, length, head_dim = queries.shape
    kv_heads = keys.shape[0]
    outputs: list[Tensor] = []
    sums: list[Tensor] = []
    for branch in row.branches:
        start, stop = branch.span
        if branch.fused_mask is None or start == stop:
            continue
        grouped = _turned(queries, branch.query_turn, layout).reshape(1, kv_heads, -1, head_dim)
        turned_keys = row.keys(layer, branch.key_view, keys, layout)[None, :, start:stop]
        output, log_sum = _flash_for_cpu(
            grouped,
            turned_keys,
            values[None, :, start:stop],
            0.0,
            False,
            attn_mask=branch.fused_mask[None],
            scale=1.0 / math.sqrt(head_dim),
        )  # [1, Hkv, G·Tq, hd], [1, Hkv, G·Tq]
        outputs.append(output[0])
        sums.append(log_sum[0].masked_fill(~branch.sees, -math.inf))
    if len(outputs) == 1:
        return outputs[0].view(heads, length, head_dim)
    stacked = torch.stack(sums)  # [branches, Hkv, G·Tq]
    shares = torch.softmax(stacked, dim=0)[..., None]  # each branch's part of a query's weight
    merged = (shares * torch.stack(outputs)).sum(dim=0)  # [Hkv, G·Tq, hd]
    return merged.to(queries.dtype).view(heads, length, head_dim)


# The CPU flash-attention kernel behind `F.scaled_dot_product_attention`, called directly because it
# also returns each query's log-sum-exp, which merging branches needs (torch 2.13's aten op).
_flash_for_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _span(selected: Tensor) -> tuple[int, int]:
    """The first key slot any query selects and one past the last; (0, 0) when none does."""
    slots = selected.any(dim=0).nonzero()
    if slots.numel() == 0:
        return (0, 0)
    return (int(slots[0]), int(slots[-1]) + 1)


def _fused_mask(
    selected: Tensor, bias: Tensor | None, span: tuple[int, int], query_groups: int, dtype: torch.dtype
) -> Tensor | None:
    """The fused kernel's additive mask over a branch's span, its queries stacked as the kernel
    reads them ([1|Hkv, G·Tq, span]: 0 where selected, -inf elsewhere, plus the branch's bias);
    None where the kernel does not run (off a CPU, below float32: a bias in bfloat16 would lose
    the differences between keys) or the branch selects nothing."""
    start, stop = span
    if selected.device.type != "cpu" or dtype != torch.float32 or start == stop:
        return None
    blocked = torch.zeros(selected[:, start:stop].shape, dtype=dtype, device=selected.device)
    blocked.masked_fill_(~selected[:, start:stop], -math.inf)  # [Tq, S]
    if bias is None:
        return blocked.repeat(query_groups, 1)[None]  # [1, G·Tq, S]
    heads = bias.shape[0]
    biased = bias[:, :, start:stop].to(dtype) + blocked  # [H, Tq, S]
    return biased.reshape(heads // query_groups, -1, stop - start)  # [Hkv, G·Tq, S]


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
