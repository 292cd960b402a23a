"""The positional side of one forward pass: what each scheme adds to embeddings or attention.

All PE math comes from `pe_runtime` (tables, slopes, buckets, interpolation, via `PECache`); this
module only decides which positions each row of a batch holds and shapes the results so that
attention can broadcast them. Rows may differ in how many tokens they already have cached and in
their RoPE scaling, which is what lets one forward pass serve requests with different scalings.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pe_runtime import (
    PECache,
    PEConfigError,
    RopeScaling,
    RopeTables,
    alibi_bias,
    rope_inv_freq,
    rope_seq_len_key,
)
from pe_runtime.absolute import interpolate_learned
from service.model.attention_rules import AttentionRule
from service.model.config import ModelConfig, Scheme
from service.model.relative_attention import RelativeInputs, relative_inputs
from service.model.rule_attention import RuleRow, TurnedKeys, rule_row_inputs

# Scalings each scheme can honour. RoPE takes every type; absolute schemes can only stretch their
# positions linearly (position interpolation); relative biases have no frequencies to rescale.
SUPPORTED_SCALINGS: dict[Scheme, tuple[str, ...]] = {
    "rope": ("none", "linear", "ntk", "dynamic", "yarn", "llama3", "longrope"),
    "learned": ("none", "linear"),
    "sinusoidal": ("none", "linear"),
    "alibi": ("none",),
    "t5_bias": ("none",),
    "nope": ("none",),
    "rope_alibi": ("none", "linear", "ntk", "dynamic", "yarn", "llama3", "longrope"),
    "transformer_xl": ("none", "linear"),
    "shaw": ("none",),
    "cope": ("none",),
}


# Attention rules each scheme can honour (`pe_attention`). Grouping, clamping and chunking move RoPE
# angles; StreamingLLM only chooses which keys are seen (and, for ALiBi, measures distance in cache
# slots), so it also serves ALiBi and NoPE. Log-n (`logn`) scales queries and serves every scheme.
_ROPE_RULES = ("standard", "self_extend", "rerope", "leaky_rerope", "dca", "streaming")
SUPPORTED_ATTENTION: dict[Scheme, tuple[str, ...]] = {
    "rope": _ROPE_RULES,
    "rope_alibi": _ROPE_RULES,
    "alibi": ("standard", "streaming"),
    "nope": ("standard", "streaming"),
    "learned": ("standard",),
    "sinusoidal": ("standard",),
    "t5_bias": ("standard",),
    "transformer_xl": ("standard",),
    "shaw": ("standard",),
    "cope": ("standard",),
}


def check_supported_attention(scheme: Scheme, rule: AttentionRule) -> None:
    """Refuse a rule a scheme cannot apply (field `type`), as `check_supported_scaling` does."""
    supported = SUPPORTED_ATTENTION[scheme]
    if rule.type not in supported:
        raise PEConfigError(
            f"attention {rule.type!r} does not apply to the {scheme!r} scheme "
            f"(supported: {', '.join(supported)})",
            field="type",
        )


def check_supported_scaling(scheme: Scheme, scaling_type: str) -> None:
    """Refuse a scaling a scheme cannot apply rather than silently ignoring it (field `type`)."""
    supported = SUPPORTED_SCALINGS[scheme]
    if scaling_type not in supported:
        raise PEConfigError(
            f"scaling {scaling_type!r} does not apply to the {scheme!r} scheme "
            f"(supported: {', '.join(supported)})",
            field="type",
        )


_Key = TypeVar("_Key", bound=Hashable)


def default_scaling(config: ModelConfig) -> RopeScaling:
    """The scaling a model runs with when a request names none: its config's, as transformers reads it."""
    return RopeScaling.from_hf(config.rope_scaling, max_position_embeddings=config.native_context)


# Stretched learned tables kept per model: a handful of factors covers real traffic, and the bound
# stops a client cycling through factors from growing memory.
STRETCHED_TABLES_KEPT = 8


@dataclass(frozen=True)
class PositionalInputs:
    """Positional data for one forward; the leading dim is the batch size, or 1 when rows agree.

    `attn_mask` is None when no key needs hiding beyond what `causal` says: plain causal attention
    over `Tq == Tk` (training, fresh prefills), or every query seeing every key (one new token per
    row, all rows of one length: a lone stream's decode pass). Both spare building a mask and let
    attention take its fused kernel.
    """

    absolute: Tensor | None  # [B|1, Tq, d_model], added to the token embeddings
    rope: tuple[Tensor, Tensor] | None  # cos, sin [B|1, 1, Tq, rotary_dim] for the new tokens
    attn_mask: Tensor | None  # additive [B|1, n_heads|1, Tq, Tk], -inf where a key is not visible
    causal: bool  # with no mask: causal attention (True) or every key visible (False)
    relative: RelativeInputs | None = None  # Shaw, Transformer-XL, CoPE: read by their explicit attention
    # `pe_attention`: per row, the branches of its rule (None: the pass's own attention); None
    # when no row has one. `query_scale` [B, 1, Tq, 1]: log-n factors, None when no row asks.
    rules: tuple[RuleRow | None, ...] | None = None
    query_scale: Tensor | None = None


class PassTables(NamedTuple):
    """Positional tables for a fixed-shape pass (`PassInputs`).

    The tables every row reads are stacked once, `table_index` saying which one each row uses;
    they stay valid until a row joins, leaves or changes table, so a step only indexes them.
    """

    table_index: Tensor | None  # [B]
    rope_cos: Tensor | None  # [U, W, rotary_dim]
    rope_sin: Tensor | None
    absolute: Tensor | None  # [U, W, d_model]
    alibi_slopes: Tensor | None  # [H]
    t5_buckets: Tensor | None  # [2 W - 1]


class PassInputs(NamedTuple):
    """Per-row inputs of one fixed-shape pass (a decode step, or a prompt chunk's tokens as rows);
    B rows, a window of `window_blocks.shape[1]` blocks."""

    tokens: Tensor  # [B] the token each row feeds in
    positions: Tensor  # [B] its position (the row's cached length)
    window_blocks: Tensor  # [B, nb] the blocks of each row's window, padded with the scratch block
    table_index: Tensor | None  # [B] which table of the stacks below each row reads
    rope_cos: Tensor | None  # [U, W, rotary_dim]
    rope_sin: Tensor | None
    absolute: Tensor | None  # [U, W, D] learned or sinusoidal embeddings
    alibi_slopes: Tensor | None  # [H] float32
    t5_buckets: Tensor | None  # [2 W - 1], the bucket of key k for query q at k - q + W - 1


class StepPositions(NamedTuple):
    """What a fixed-shape pass's rows take from their positions (`step_positions`)."""

    absolute: Tensor | None  # [B, D], added to the embedded tokens
    rope: tuple[Tensor, Tensor] | None  # cos, sin [B, rotary_dim] at each row's position
    bias: Tensor | None  # [B, H, W] float32 on the attention scores over the window


def step_positions(inputs: PassInputs, slot_positions: Tensor, t5_table: Tensor | None) -> StepPositions:
    """Each row's positional inputs, indexed from the stacks `PositionalEncoding.pass_tables`
    built; the bias reads the positions the pool records for the window's keys (`slot_positions`
    [NB, BS], `PagedKVCache.key_positions`). Pure tensor work, so a compiled step traces it."""
    positions, index, blocks = inputs.positions, inputs.table_index, inputs.window_blocks
    absolute = rope = bias = None
    if inputs.absolute is not None and index is not None:
        absolute = inputs.absolute[index, positions]
    if inputs.rope_cos is not None and inputs.rope_sin is not None and index is not None:
        rope = inputs.rope_cos[index, positions], inputs.rope_sin[index, positions]
    t5 = (inputs.t5_buckets, t5_table) if inputs.t5_buckets is not None and t5_table is not None else None
    if inputs.alibi_slopes is not None or t5 is not None:
        key_positions = slot_positions[blocks].flatten(1)  # [B, W]
        window = key_positions.shape[1]
        bias = score_bias(positions[:, None], key_positions, inputs.alibi_slopes, t5, window)
    return StepPositions(absolute, rope, bias[:, :, 0] if bias is not None else None)


def score_bias(
    query_positions: Tensor,
    key_positions: Tensor,
    alibi_slopes: Tensor | None,
    t5: tuple[Tensor, Tensor] | None,
    span: int,
) -> Tensor | None:
    """The scheme's bias on the scores, float32 [R, H, Tq, Tk], for queries at `query_positions`
    [R, Tq] and keys at `key_positions` [R|1, Tk] (the positions the cache records for them):
    ALiBi's slope * (k - q) (`pe_runtime.alibi_bias`), or T5's learned value for the bucket of
    k - q, `t5` being (buckets [2 span - 1] indexed by k - q + span - 1, the learned table
    [num_buckets, H]). None for schemes without one. The only place either bias is written, for
    every pass. A key slot no query sees (padding, a slot not written yet) may hold any
    position: its distance is clamped into the buckets, and the mask hides it."""
    if alibi_slopes is not None:
        return alibi_bias(alibi_slopes, query_positions, key_positions).transpose(0, 1)
    if t5 is not None:
        buckets, table = t5
        offsets = key_positions[:, None, :] - query_positions[:, :, None] + span - 1  # [R, Tq, Tk]
        return table[buckets[offsets.clamp(0, 2 * span - 2)]].permute(0, 3, 1, 2).float()
    return None


@dataclass(frozen=True)
class _Row:
    """What distinguishes one row's positions: tokens already cached and its (sized) table."""

    past: int
    scaling: RopeScaling
    table_key: Hashable
    count: int  # real tokens among the pass's query_length
    table_length: int = dataclasses.field(compare=False)
    rule: AttentionRule | None = None  # `pe_attention`; None: standard
    shift: int = 0  # text index minus cache slot of its new tokens (`text_offsets`)


class PositionalEncoding(nn.Module):
    """Holds the scheme's trainable tables (learned positions, T5 buckets) and builds the inputs."""

    def __init__(self, config: ModelConfig, pe_cache: PECache) -> None:
        super().__init__()
        self.config = config
        self.pe_cache = pe_cache  # the process's table cache (pe_runtime), not a KV store
        self.default_scaling = default_scaling(config)
        self.learned_table = (
            nn.Embedding(config.native_context, config.d_model) if config.pe == "learned" else None
        )
        self.t5_table = (
            nn.Embedding(config.t5_num_buckets, config.n_heads) if config.pe == "t5_bias" else None
        )
        self._stretched: OrderedDict[float, tuple[Hashable, Tensor]] = OrderedDict()

    def check_scaling(self, scaling: RopeScaling) -> None:
        check_supported_scaling(self.config.pe, scaling.type)

    def forward(
        self,
        query_length: int,
        past_lengths: Sequence[int],
        scalings: Sequence[RopeScaling],
        *,
        device: torch.device,
        dtype: torch.dtype,
        table_lengths: Sequence[int] | None = None,
        counts: Sequence[int] | None = None,
        key_positions: Tensor | None = None,
        rules: Sequence[AttentionRule | None] | None = None,
        text_offsets: Sequence[int] | None = None,
        turned_keys: Sequence[TurnedKeys | None] | None = None,
    ) -> PositionalInputs:
        """Inputs for `query_length` new tokens per row after `past_lengths[i]` cached ones.

        `key_positions` [B|1, Tk] are the positions the cache records for the pass's key window
        (`RowCache.key_positions`), which the score bias and the attention rules read; by default
        every key sits at its index. Which keys a query sees goes by index (its row's entries up
        to its own), or by the row's rule (`rules[i]`, `pe_attention`; None: standard).

        `scalings` has one entry per row. `table_lengths[i]` is the sequence length whose table row
        `i` reads when its scaling depends on the length (default: its length after this pass); a
        chunked prefill passes the whole prompt's length so that every chunk uses one table.
        `counts[i]` is how many of row i's tokens are real: padding repeats the last real position,
        so it never reaches past a table (a learned one ends where the model's context does).
        `text_offsets[i]` is how far row i's new tokens sit in its text past their cache slot (a
        streaming row that gave back blocks, `PagedKVCache.slide`): positions are text indices,
        slots only say which keys are the row's. `turned_keys[i]` keeps row i's keys turned for its
        rule across passes (`rule_attention.TurnedKeys`).
        """
        for scaling in set(scalings):
            self.check_scaling(scaling)
        lengths = table_lengths or [past + query_length for past in past_lengths]
        real = counts or [query_length] * len(past_lengths)
        row_rules = list(rules) if rules is not None else [None] * len(past_lengths)
        shifts = list(text_offsets) if text_offsets is not None else [0] * len(past_lengths)
        rows = [
            _Row(past, scaling, self.table_key(scaling, length), count, length, rule, shift)
            for past, scaling, length, count, rule, shift in zip(
                past_lengths, scalings, lengths, real, row_rules, shifts, strict=True
            )
        ]
        if len(set(rows)) == 1 and rules is None:  # a rule row keeps its own turned keys
            rows = rows[:1]
        key_length = max(row.past for row in rows) + query_length
        starts = torch.tensor([row.shift + row.past for row in rows], device=device)
        last = torch.tensor([row.count - 1 for row in rows], device=device)
        offsets = torch.minimum(torch.arange(query_length, device=device)[None, :], last[:, None])
        query_positions = starts[:, None] + offsets  # [R, Tq] text indices
        if key_positions is None:
            key_positions = torch.arange(key_length, device=device)[None]
        bias = self._attention_bias(query_positions, key_positions, key_length, dtype)
        fresh = all(row.past == 0 for row in rows)
        sees_all = query_length == 1 and len({row.past for row in rows}) == 1
        if bias is None and (fresh or sees_all):
            mask = None
        else:
            mask = _causal_mask(query_positions, key_length, dtype)
            mask = mask if bias is None else mask + bias
        return PositionalInputs(
            absolute=self._absolute(rows, query_positions, dtype),
            rope=self._rope(rows, query_positions, key_length + max(row.shift for row in rows), dtype),
            attn_mask=mask,
            causal=mask is None and not sees_all,
            relative=relative_inputs(
                self.config,
                self.pe_cache,
                query_positions,
                [row.past for row in rows],
                [_linear_factor(row.scaling) for row in rows],
                key_length,
            ),
            rules=self._rule_rows(rows, query_positions, key_positions, dtype, turned_keys),
            query_scale=_query_scale(rows, query_positions, dtype),
        )

    def _rule_rows(
        self,
        rows: list[_Row],
        query_positions: Tensor,
        key_positions: Tensor,
        dtype: torch.dtype,
        turned_keys: Sequence[TurnedKeys | None] | None,
    ) -> tuple[RuleRow | None, ...] | None:
        """Each row's rule branches (`rule_attention`); None when every row attends as trained."""
        if not any(row.rule is not None and row.rule.moves_pairs for row in rows):
            return None
        config = self.config
        slopes = self.alibi_slopes(query_positions.device) if config.pe in ("alibi", "rope_alibi") else None
        built: list[RuleRow | None] = []
        key_rows = key_positions if key_positions.shape[0] > 1 else key_positions.expand(len(rows), -1)
        for index, row in enumerate(rows):
            if row.rule is None or not row.rule.moves_pairs:
                built.append(None)
                continue
            inv_freq, seq_len = None, None
            if config.has_rope:
                seq_len = rope_seq_len_key(row.scaling, row.table_length)
                inv_freq = rope_inv_freq(config.rotary_dim, config.rope_base, row.scaling, seq_len)[0]
            built.append(
                rule_row_inputs(
                    row.rule,
                    query_positions[index],
                    key_rows[index, : row.past + query_positions.shape[1]],  # its own slots (`attend_rows`)
                    row.past + row.count,
                    inv_freq=inv_freq,
                    layout=config.rope_layout,
                    alibi_slopes=slopes,
                    dtype=dtype,
                    past=row.past,
                    store=turned_keys[index] if turned_keys is not None else None,
                    owner=(row.rule, row.scaling, seq_len, dtype),
                    query_groups=config.n_heads // config.n_kv_heads,
                )
            )
        return tuple(built)

    def at_positions(
        self, position_ids: Tensor, scalings: Sequence[RopeScaling], *, dtype: torch.dtype
    ) -> PositionalInputs:
        """RoPE inputs for a fresh causal pass whose tokens sit at `position_ids` [B, T], not 0..T-1.

        Training only: PoSE's skipped positions and randomized positions (`training.positions`)
        rotate each token by an id of their choosing. Plain RoPE is the one scheme this is exact
        for: its rotation is its whole positional input, so causal attention over the tokens' order
        stays right whatever ids they carry. Serving never calls this.
        """
        if self.config.pe != "rope":
            raise ValueError(f"explicit position ids need the 'rope' scheme, not {self.config.pe!r}")
        for scaling in set(scalings):
            self.check_scaling(scaling)
        key_length = int(position_ids.max()) + 1
        rows = [
            _Row(0, scaling, self.table_key(scaling, key_length), position_ids.shape[1], key_length)
            for scaling in scalings
        ]
        rope = self._rope(rows, position_ids, key_length, dtype)
        return PositionalInputs(absolute=None, rope=rope, attn_mask=None, causal=True)

    def pass_tables(
        self,
        scalings: Sequence[RopeScaling],
        table_lengths: Sequence[int],
        window: int,
        *,
        device: torch.device,
        dtype: torch.dtype,
    ) -> PassTables:
        """The tables the rows of a decode pass read, each row's for its scaling and table length.

        Tables span the step's window of `window` positions; rows sharing a table share its entry.
        Raises PEConfigError where `forward` would (a scaling the scheme cannot apply, a position
        past a learned table).
        """
        for scaling in set(scalings):
            self.check_scaling(scaling)
        pe = self.config.pe
        index, cos, sin, absolute = None, None, None, None
        if self.config.has_rope:
            index, cos, sin = self._step_rope(scalings, table_lengths, window, device, dtype)
        elif pe in ("learned", "sinusoidal"):
            index, absolute = self._step_absolute(scalings, table_lengths, window, device, dtype)
        slopes = self.alibi_slopes(device) if pe in ("alibi", "rope_alibi") else None
        buckets = self._t5_buckets(window, device) if pe == "t5_bias" else None
        return PassTables(index, cos, sin, absolute, slopes, buckets)

    def _step_rope(
        self,
        scalings: Sequence[RopeScaling],
        table_lengths: Sequence[int],
        window: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Row-to-table index [B] and the stacked cos and sin [U, W, rotary_dim]."""
        first_row: dict[tuple[RopeScaling, Hashable], int] = {}
        keys = [(s, self.table_key(s, length)) for s, length in zip(scalings, table_lengths, strict=True)]
        for row, key in enumerate(keys):
            first_row.setdefault(key, row)
        tables = [
            self.pe_cache.rope(
                self.config.rotary_dim,
                self.config.rope_base,
                key[0],
                window,
                device=device,
                dtype=dtype,
                layout=self.config.rope_layout,
                seq_len=table_lengths[row],
            )
            for key, row in first_row.items()
        ]
        order = list(first_row)
        index = torch.tensor([order.index(key) for key in keys], device=device)
        return (
            index,
            torch.stack([table.cos for table in tables]),
            torch.stack([table.sin for table in tables]),
        )

    def _step_absolute(
        self,
        scalings: Sequence[RopeScaling],
        table_lengths: Sequence[int],
        window: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> tuple[Tensor, Tensor]:
        """Row-to-table index [B] and the stacked learned or sinusoidal tables [U, W, d_model].

        A learned table is checked against the furthest position; a sinusoidal one is built for
        the whole window, so the stack stays the same from step to step.
        """
        factors = [_linear_factor(scaling) for scaling in scalings]
        order = list(dict.fromkeys(factors))
        needed = max(table_lengths) if self.learned_table is not None else window
        stacked = []
        for factor in order:
            table = self._absolute_table(factor, needed, device)[:window]
            stacked.append(F.pad(table, (0, 0, 0, window - table.shape[0])))
        index = torch.tensor([order.index(factor) for factor in factors], device=device)
        return index, torch.stack(stacked).to(dtype)

    def table_key(self, scaling: RopeScaling, total_length: int) -> Hashable:
        """What a row's positional table depends on at `total_length` besides fixed parameters.

        Only RoPE scalings that change with the length (dynamic, LongRoPE) make it vary; cached
        entries computed under another key are stale.
        """
        return rope_seq_len_key(scaling, total_length) if self.config.has_rope else None

    def keeps_cached_keys(self, scaling: RopeScaling) -> bool:
        """Whether cached entries stay as computed when the table changes (dynamic NTK, "hf" mode).

        That is transformers' behaviour; every other scaling recomputes a sequence's entries when
        its table changes, so that incremental decoding equals a fresh pass.
        """
        return scaling.type == "dynamic" and scaling.dynamic_mode == "hf"

    def _rope(
        self, rows: list[_Row], query_positions: Tensor, key_length: int, dtype: torch.dtype
    ) -> tuple[Tensor, Tensor] | None:
        """cos/sin at the new positions, each row from the table for its own current length."""
        if not self.config.has_rope:
            return None
        row_keys = [(row.scaling, row.table_key) for row in rows]
        tables: dict[tuple[RopeScaling, Hashable], RopeTables] = {}
        for key, length in zip(row_keys, (row.table_length for row in rows), strict=True):
            if key not in tables:
                tables[key] = self.pe_cache.rope(
                    self.config.rotary_dim,
                    self.config.rope_base,
                    key[0],
                    key_length,
                    device=query_positions.device,
                    dtype=dtype,
                    layout=self.config.rope_layout,
                    seq_len=length,
                )
        cos = _gather_rows({key: table.cos for key, table in tables.items()}, row_keys, query_positions)
        sin = _gather_rows({key: table.sin for key, table in tables.items()}, row_keys, query_positions)
        return cos[:, None], sin[:, None]  # [R, 1, Tq, rotary_dim]

    def alibi_slopes(self, device: torch.device) -> Tensor:
        """The model's ALiBi slopes [n_heads], float32: its rule and steepest slope, then its scale."""
        config = self.config
        slopes = self.pe_cache.alibi_slopes(
            config.n_heads,
            device=device,
            dtype=torch.float32,
            bias_max=config.alibi_bias_max,
            rule=config.alibi_rule,
        )
        return slopes if config.alibi_scale == 1.0 else slopes * config.alibi_scale

    def _attention_bias(
        self, query_positions: Tensor, key_positions: Tensor, key_length: int, dtype: torch.dtype
    ) -> Tensor | None:
        """ALiBi or T5 additive bias [R, n_heads, Tq, Tk]; None for the other schemes."""
        device = query_positions.device
        slopes = self.alibi_slopes(device) if self.config.pe in ("alibi", "rope_alibi") else None
        t5 = None
        if self.t5_table is not None:
            t5 = (self._t5_buckets(key_length, device), self.t5_table.weight)
        bias = score_bias(query_positions, key_positions, slopes, t5, key_length)
        return bias.to(dtype) if bias is not None else None

    def _t5_buckets(self, span: int, device: torch.device) -> Tensor:
        """T5's bucket of every distance k - q within `span`, [2 span - 1] (`pe_runtime`)."""
        return self.pe_cache.t5_buckets(
            span,
            bidirectional=False,
            num_buckets=self.config.t5_num_buckets,
            max_distance=self.config.t5_max_distance,
            device=device,
        )

    def _absolute(self, rows: list[_Row], query_positions: Tensor, dtype: torch.dtype) -> Tensor | None:
        """Learned or sinusoidal embeddings [R, Tq, d_model] at each row's (possibly stretched) positions."""
        if self.config.pe not in ("learned", "sinusoidal"):
            return None
        needed = int(query_positions.max()) + 1
        factors = [_linear_factor(row.scaling) for row in rows]
        tables = {
            factor: self._absolute_table(factor, needed, query_positions.device)[:needed]
            for factor in set(factors)
        }
        return _gather_rows(tables, factors, query_positions).to(dtype)

    def _absolute_table(self, factor: float, needed: int, device: torch.device) -> Tensor:
        """A table of at least `needed` rows, read at position / factor (linear interpolation)."""
        if self.learned_table is None:
            return self.pe_cache.sinusoidal(
                needed, self.config.d_model, device=device, dtype=torch.float32, factor=factor
            )
        table = self.learned_table.weight
        table = table if factor == 1.0 else self._stretched_learned(table, factor)
        if table.shape[0] < needed:
            raise PEConfigError(
                f"position {needed - 1} is past the learned table ({table.shape[0]} positions); "
                "use linear scaling with a larger factor",
                field="factor",
            )
        return table

    def _stretched_learned(self, weight: Tensor, factor: float) -> Tensor:
        """The learned table `weight` interpolated by `factor`, computed once per weights and factor.

        Decoding would otherwise redo the interpolation every step, which costs more than half a
        one-token forward pass of a zoo model. The cache is skipped while gradients flow into
        the table (training) and is keyed by the weights' storage, dtype and in-place version,
        so an optimiser step, `load_state_dict` or `.to()` recomputes it. Weights created inside
        inference mode have no version counter, so they are never cached.
        """
        if weight.is_inference() or (torch.is_grad_enabled() and weight.requires_grad):
            return interpolate_learned(weight, factor)
        fingerprint = (weight.data_ptr(), weight.dtype, weight.device, weight._version)
        cached = self._stretched.pop(factor, None)
        if cached is None or cached[0] != fingerprint:
            cached = (fingerprint, interpolate_learned(weight.detach(), factor))
        self._stretched[factor] = cached  # re-inserted: the most recently used is last
        if len(self._stretched) > STRETCHED_TABLES_KEPT:
            self._stretched.popitem(last=False)
        return cached[1]


def _gather_rows(tables: Mapping[_Key, Tensor], row_keys: Sequence[_Key], positions: Tensor) -> Tensor:
    """Row r of the result reads `tables[row_keys[r]]` at `positions[r]`: [R, Tq, ...] in one gather.

    Tables [L, ...] of equal length; rows sharing a key share its table, so a batch mixing a few
    scalings costs a few lookups, not one per row.
    """
    slot = {key: index for index, key in enumerate(tables)}
    stacked = torch.stack(list(tables.values()))  # [U, L, ...]
    which = torch.tensor([slot[key] for key in row_keys], device=positions.device)
    return stacked[which[:, None], positions]


def _query_scale(rows: list[_Row], query_positions: Tensor, dtype: torch.dtype) -> Tensor | None:
    """Log-n factors [R, 1, Tq, 1] for rows whose rule sets `logn`; None when none does."""
    if all(row.rule is None or row.rule.logn is None for row in rows):
        return None
    scales = [
        row.rule.query_scale(positions.cpu()) if row.rule is not None else torch.ones(positions.shape[0])
        for row, positions in zip(rows, query_positions, strict=True)
    ]
    return torch.stack(scales).to(device=query_positions.device, dtype=dtype)[:, None, :, None]


def _linear_factor(scaling: RopeScaling) -> float:
    return scaling.factor if scaling.type == "linear" else 1.0


def _causal_mask(query_positions: Tensor, key_length: int, dtype: torch.dtype) -> Tensor:
    """Additive mask [R, 1, Tq, Tk]: each query sees keys up to its own position, never padding."""
    key_positions = torch.arange(key_length, device=query_positions.device)
    visible = key_positions[None, None, :] <= query_positions[:, :, None]
    zeros = torch.zeros((), dtype=dtype, device=query_positions.device)
    blocked = torch.full((), float("-inf"), dtype=dtype, device=query_positions.device)
    return torch.where(visible, zeros, blocked)[:, None]
