"""Explicit attention for the schemes that reach inside it: Shaw, Transformer-XL and CoPE.

`scaled_dot_product_attention` takes an additive bias, which is enough for ALiBi and T5, but
Shaw adds a term to the values (it needs the probabilities), Transformer-XL adds per-head biases
to the queries, and CoPE's bias depends on the logits themselves (its gates). These schemes
therefore attend here, with the logits written out: one per-layer module per scheme holds its
parameters and says what it adds, and `RelativeAttention.forward` is the one attention loop.

Queries are taken in blocks, each against only the keys its furthest query can see, so scoring a
long document holds a [block, keys] slice of logits at a time rather than [T, T]. The math is in
float32 whatever the model's dtype (CoPE's positions are cumulative sums of gates).

Rows of a batch may have different numbers of cached tokens: each row's keys are left-aligned at
positions 0 .. length-1 and `query_positions` says where its queries sit (see `positional.py`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from pe_runtime import (
    PECache,
    cope_logits,
    cope_positions,
    relative_shift,
    shaw_key_logits,
    shaw_value_term,
)
from service.model.config import ModelConfig, Scheme

RELATIVE_SCHEMES: frozenset[Scheme] = frozenset({"shaw", "transformer_xl", "cope"})
# Logit elements (batch x heads x queries x keys) per block: 64 MiB of float32.
BLOCK_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class RelativeInputs:
    """What every layer's relative attention reads in one forward; leading dim R is B or 1.

    `lags[r]` is how many positions row r's queries sit behind the row with the most cached
    tokens; Transformer-XL's shift is computed for that row and realigned for the others.
    """

    query_positions: Tensor  # long [R, Tq]
    key_length: int
    shaw_index: Tensor | None  # long [2 * key_length - 1], the row of (q, k) at k - q + key_length - 1
    xl_sinusoids: Tensor | None  # float32 [U, key_length, d_model], distances key_length - 1 .. 0
    xl_table_of_row: Tensor | None  # long [R], which of the U sinusoid tables (linear factors) a row reads
    lags: Tensor  # long [R]
    aligned: bool  # every lag is zero (no realignment needed)


@dataclass(frozen=True)
class Block:
    """Queries `start .. stop - 1` against keys `0 .. key_stop - 1`."""

    start: int
    stop: int
    key_stop: int
    visible: Tensor  # bool [R, 1, stop - start, key_stop]
    shaw_index: Tensor | None  # long, the same shape: each pair's row of Shaw's tables


def relative_inputs(
    config: ModelConfig,
    cache: PECache,
    query_positions: Tensor,
    pasts: Sequence[int],
    linear_factors: Sequence[float],
    key_length: int,
) -> RelativeInputs | None:
    """The per-forward inputs of a relative scheme (None for the others), tables from `cache`."""
    if config.pe not in RELATIVE_SCHEMES:
        return None
    device = query_positions.device
    lag_values = [max(pasts) - past for past in pasts]
    lags = torch.tensor(lag_values, device=device)
    shaw_index = xl_sinusoids = xl_table_of_row = None
    if config.pe == "shaw":
        shaw_index = cache.shaw_index(key_length, max_distance=config.shaw_max_distance, device=device)
    if config.pe == "transformer_xl":
        factors = list(dict.fromkeys(linear_factors))
        xl_sinusoids = torch.stack(
            [
                cache.xl_relative(
                    key_length, config.d_model, device=device, dtype=torch.float32, factor=factor
                )
                for factor in factors
            ]
        )
        xl_table_of_row = torch.tensor([factors.index(factor) for factor in linear_factors], device=device)
    return RelativeInputs(
        query_positions, key_length, shaw_index, xl_sinusoids, xl_table_of_row, lags, not any(lag_values)
    )


class RelativeAttention(nn.Module):
    """One layer's explicit attention; subclasses add their scheme's terms."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.scale = 1.0 / math.sqrt(config.head_dim)

    def forward(self, queries: Tensor, keys: Tensor, values: Tensor, inputs: RelativeInputs | None) -> Tensor:
        """queries [B, H, Tq, hd], keys and values [B, Hkv, Tk, hd] -> [B, H, Tq, hd]."""
        if inputs is None:
            raise ValueError(f"the {self.config.pe!r} scheme needs relative positional inputs")
        dtype = queries.dtype
        groups = self.config.n_heads // self.config.n_kv_heads
        # Scaled once here rather than each [Tq, Tk] term after: every term is linear in q.
        queries = queries.float() * self.scale
        keys, values = keys.float(), values.float()
        if groups > 1:
            keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
        batch, heads, length, _ = queries.shape
        prepared = self.prepare(inputs)
        size = max(1, BLOCK_ELEMENTS // (batch * heads * inputs.key_length))
        outputs = []
        for start in range(0, length, size):
            block = _block(inputs, start, min(length, start + size), length)
            block_queries = queries[:, :, block.start : block.stop]
            block_keys = keys[:, :, : block.key_stop]
            scores = self.scores(block_queries, block_keys, block, inputs, prepared)
            # In place: no producer of the scores keeps them for its backward.
            probabilities = torch.softmax(scores.masked_fill_(~block.visible, float("-inf")), dim=-1)
            attended = probabilities @ values[:, :, : block.key_stop]
            outputs.append(attended + self.value_term(probabilities, block, inputs))
        return torch.cat(outputs, dim=2).to(dtype)

    def prepare(self, inputs: RelativeInputs) -> Tensor | None:
        """Per-layer work shared by all blocks of one forward (nothing by default)."""
        return None

    def scores(
        self, queries: Tensor, keys: Tensor, block: Block, inputs: RelativeInputs, prepared: Tensor | None
    ) -> Tensor:
        """Logits [B, H, Tq', Tk'] before the mask from queries already scaled by 1/sqrt(d)."""
        scores: Tensor = queries @ keys.transpose(-1, -2)
        return scores

    def value_term(self, probabilities: Tensor, block: Block, inputs: RelativeInputs) -> Tensor | float:
        """What the scheme adds to the attended values (nothing by default)."""
        return 0.0


class ShawAttention(RelativeAttention):
    """`e_ij = q_i . (k_j + a^K_ij) / sqrt(d)`, `z_i = sum_j alpha_ij (v_j + a^V_ij)`; tables per layer."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        rows = config.shaw_max_distance + 1
        self.key_table = nn.Parameter(torch.randn(rows, config.head_dim) * 0.02)
        self.value_table = nn.Parameter(torch.randn(rows, config.head_dim) * 0.02)

    def scores(
        self, queries: Tensor, keys: Tensor, block: Block, inputs: RelativeInputs, prepared: Tensor | None
    ) -> Tensor:
        assert block.shaw_index is not None
        return super().scores(queries, keys, block, inputs, prepared) + shaw_key_logits(
            queries, self.key_table, block.shaw_index
        )

    def value_term(self, probabilities: Tensor, block: Block, inputs: RelativeInputs) -> Tensor:
        assert block.shaw_index is not None
        return shaw_value_term(probabilities, self.value_table, block.shaw_index)


class TransformerXLAttention(RelativeAttention):
    """`(q_i + u) . k_j + (q_i + v) . W_R R_{i-j}`, scaled; `W_R` per layer, `u` and `v` per head."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.r_proj = nn.Linear(config.d_model, config.n_heads * config.head_dim, bias=False)
        self.u = nn.Parameter(torch.zeros(config.n_heads, config.head_dim))
        self.v = nn.Parameter(torch.zeros(config.n_heads, config.head_dim))

    def prepare(self, inputs: RelativeInputs) -> Tensor:
        """W_R R for every distance of every table: [U, H, Tk, hd], once per layer and forward."""
        assert inputs.xl_sinusoids is not None
        tables, length, _ = inputs.xl_sinusoids.shape
        projected: Tensor = self.r_proj(inputs.xl_sinusoids.to(self.r_proj.weight.dtype)).float()
        return projected.view(tables, length, self.config.n_heads, -1).transpose(1, 2)

    def scores(
        self, queries: Tensor, keys: Tensor, block: Block, inputs: RelativeInputs, prepared: Tensor | None
    ) -> Tensor:
        assert prepared is not None and inputs.xl_table_of_row is not None
        content = (queries + self.u.float()[:, None] * self.scale) @ keys.transpose(-1, -2)
        # Distances key_stop - 1 .. 0: the tail of the descending tables.
        distances = prepared[:, :, inputs.key_length - block.key_stop :]  # [U, H, Tk', hd]
        if distances.shape[0] > 1 or not inputs.aligned:
            # Row r's queries sit lags[r] behind the furthest row's: its table starts lags[r] later.
            columns = torch.arange(block.key_stop, device=distances.device)
            index = (columns[None, :] + inputs.lags[:, None]).clamp(max=block.key_stop - 1)  # [R, Tk']
            distances = distances[inputs.xl_table_of_row[:, None], :, index].permute(0, 2, 1, 3)
        position = relative_shift(
            (queries + self.v.float()[:, None] * self.scale) @ distances.transpose(-1, -2)
        )
        scores: Tensor = content + position
        return scores


class CoPEAttention(RelativeAttention):
    """Gates `sigmoid(q_i . k_j)`, positions `p_ij` clipped to npos_max, `q_i . e[p_ij]` added."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.position_table = nn.Parameter(torch.randn(config.cope_npos_max + 1, config.head_dim) * 0.02)

    def scores(
        self, queries: Tensor, keys: Tensor, block: Block, inputs: RelativeInputs, prepared: Tensor | None
    ) -> Tensor:
        logits = super().scores(queries, keys, block, inputs, prepared)
        gates = torch.sigmoid(logits) * block.visible
        positions = cope_positions(gates, npos_max=self.config.cope_npos_max)
        # q . e is added unscaled: the queries' 1/sqrt(d) is undone on the table's side.
        scores: Tensor = logits + cope_logits(queries, self.position_table.float() / self.scale, positions)
        return scores


_LAYERS: dict[Scheme, type[RelativeAttention]] = {
    "shaw": ShawAttention,
    "transformer_xl": TransformerXLAttention,
    "cope": CoPEAttention,
}


def relative_attention_layer(config: ModelConfig) -> RelativeAttention | None:
    """The layer's explicit attention for a relative scheme; None where SDPA serves."""
    layer = _LAYERS.get(config.pe)
    return None if layer is None else layer(config)


def _block(inputs: RelativeInputs, start: int, stop: int, length: int) -> Block:
    """The block's bounds, which keys each query sees, and Shaw's rows from relative positions k - q."""
    key_stop = inputs.key_length - length + stop
    query_positions = inputs.query_positions[:, start:stop]
    keys = torch.arange(key_stop, device=query_positions.device)
    relative = (keys[None, None, :] - query_positions[:, :, None])[:, None]  # [R, 1, Tq', Tk']
    shaw_index = None if inputs.shaw_index is None else inputs.shaw_index[relative + inputs.key_length - 1]
    return Block(start, stop, key_stop, relative <= 0, shaw_index)
