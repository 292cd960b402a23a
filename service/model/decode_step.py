"""One decode step as a pure function: a new token per row in, next-token logits out.

gpt-fast's `decode_one_token`, for a batch of rows of different lengths and scalings, over the
paged KV cache. Everything the step needs is an argument: the packed weights, the positional
tables (already gathered into one stack per batch, indexed per row by `table_index`), the block
pool, and per-row tokens, positions and blocks. Nothing branches on data, and shapes depend only
on the batch size and the window (a power of two of blocks), so `torch.compile` traces it once
per window bucket and replays it for every step of that shape. The model's weights are arguments
too, not constants, so every model with the same architecture and scheme shares the compiled code.

Attention is written as products and sums over the gathered blocks rather than through
`scaled_dot_product_attention`: for one query per row that is what the compiler fuses best (the
block gather folds into the reductions), and SDPA's CPU kernel is slow for a single query.

The math is the eager model's (`service.model.transformer`) step for step, with the query, key
and value projections fused into one matrix product and the gate and up projections into another.
"""

from __future__ import annotations

from typing import NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import Tensor

from pe_runtime.rope import apply_rope
from service.model.config import RopeLayout, Scheme
from service.model.transformer import Block, Transformer, rms_norm


class StepShape(NamedTuple):
    """The model's fixed sizes: constants to the compiler, one compiled entry per distinct shape."""

    pe: Scheme
    n_heads: int
    n_kv_heads: int
    head_dim: int
    norm_eps: float
    embedding_scale: float
    rope_layout: RopeLayout
    block_size: int


class LayerWeights(NamedTuple):
    attn_norm: Tensor  # [D]
    qkv: Tensor  # [(H + 2 Hkv) * hd, D]
    qkv_bias: Tensor | None
    o_proj: Tensor  # [D, H * hd]
    mlp_norm: Tensor  # [D]
    gate_up: Tensor  # [2 F, D]
    down: Tensor  # [D, F]


class StepWeights(NamedTuple):
    embed: Tensor  # [V, D]
    layers: tuple[LayerWeights, ...]
    final_norm: Tensor  # [D]
    lm_head: Tensor  # [V, D]
    t5_table: Tensor | None  # [num_buckets, H]


class StepInputs(NamedTuple):
    """Per-row inputs of one step; B rows, a window of `window_blocks.shape[1]` blocks."""

    tokens: Tensor  # [B] the token each row feeds in
    positions: Tensor  # [B] its position (the row's cached length)
    window_blocks: Tensor  # [B, nb] the blocks of each row's window, padded with the scratch block
    table_index: Tensor | None  # [B] which table of the stacks below each row reads
    rope_cos: Tensor | None  # [U, W, rotary_dim]
    rope_sin: Tensor | None
    absolute: Tensor | None  # [U, W, D] learned or sinusoidal embeddings
    alibi_slopes: Tensor | None  # [H] float32
    t5_buckets: Tensor | None  # [2 W - 1], the bucket of key k for query q at k - q + W - 1


def step_shape(model: Transformer, block_size: int) -> StepShape:
    config = model.config
    return StepShape(
        pe=config.pe,
        n_heads=config.n_heads,
        n_kv_heads=config.n_kv_heads,
        head_dim=config.head_dim,
        norm_eps=config.norm_eps,
        embedding_scale=config.embedding_scale,
        rope_layout=config.rope_layout,
        block_size=block_size,
    )


@torch.no_grad()
def pack_weights(model: Transformer) -> StepWeights:
    """The model's weights in the step's layout (fused projections are copies, made once)."""
    layers = []
    for block in cast(list[Block], list(model.layers)):
        attention, mlp = block.attn, block.mlp
        biases = [attention.q_proj.bias, attention.k_proj.bias, attention.v_proj.bias]
        layers.append(
            LayerWeights(
                attn_norm=block.attn_norm.weight,
                qkv=torch.cat([attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight]),
                qkv_bias=torch.cat([b for b in biases if b is not None]) if biases[0] is not None else None,
                o_proj=attention.o_proj.weight,
                mlp_norm=block.mlp_norm.weight,
                gate_up=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
                down=mlp.down_proj.weight,
            )
        )
    t5 = model.positions.t5_table
    return StepWeights(
        embed=model.embed_tokens.weight,
        layers=tuple(layers),
        final_norm=model.norm.weight,
        lm_head=model.lm_head.weight,
        t5_table=t5.weight if t5 is not None else None,
    )


def decode_one_token(
    shape: StepShape,
    weights: StepWeights,
    inputs: StepInputs,
    key_pages: list[Tensor],
    value_pages: list[Tensor],
) -> Tensor:
    """Logits float32 [B, V]; writes each row's new key and value into its block at its position."""
    batch = inputs.tokens.shape[0]
    window = inputs.window_blocks.shape[1] * shape.block_size
    heads, kv_heads, head_dim = shape.n_heads, shape.n_kv_heads, shape.head_dim
    positions = inputs.positions
    hidden = weights.embed[inputs.tokens] * shape.embedding_scale  # [B, D]
    if inputs.absolute is not None and inputs.table_index is not None:
        hidden = hidden + inputs.absolute[inputs.table_index, positions].to(hidden.dtype)
    rope = None
    if inputs.rope_cos is not None and inputs.rope_sin is not None and inputs.table_index is not None:
        rope = (
            inputs.rope_cos[inputs.table_index, positions][:, None],  # [B, 1, rotary_dim]
            inputs.rope_sin[inputs.table_index, positions][:, None],
        )
    bias = _attention_bias(shape, weights, inputs, window)  # [B, H | 1, W] float32
    write_blocks = inputs.window_blocks.gather(1, (positions // shape.block_size)[:, None])[:, 0]
    write_offsets = positions % shape.block_size
    for layer, keys_pages, values_pages in zip(weights.layers, key_pages, value_pages, strict=True):
        normed = rms_norm(hidden, layer.attn_norm, shape.norm_eps)
        qkv = F.linear(normed, layer.qkv, layer.qkv_bias)
        queries = qkv[:, : heads * head_dim].view(batch, heads, head_dim)
        keys = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(batch, kv_heads, head_dim)
        values = qkv[:, (heads + kv_heads) * head_dim :].view(batch, kv_heads, head_dim)
        if rope is not None:
            queries = apply_rope(queries, *rope, layout=shape.rope_layout)
            keys = apply_rope(keys, *rope, layout=shape.rope_layout)
        keys_pages[:, write_blocks, write_offsets] = keys.transpose(0, 1)  # [Hkv, B, hd]
        values_pages[:, write_blocks, write_offsets] = values.transpose(0, 1)
        attended = _attend(shape, queries, _window(keys_pages, inputs), _window(values_pages, inputs), bias)
        hidden = hidden + F.linear(attended.to(hidden.dtype), layer.o_proj)
        normed = rms_norm(hidden, layer.mlp_norm, shape.norm_eps)
        gate, up = F.linear(normed, layer.gate_up).chunk(2, dim=-1)
        hidden = hidden + F.linear(F.silu(gate) * up, layer.down)
    logits = F.linear(rms_norm(hidden, weights.final_norm, shape.norm_eps), weights.lm_head)
    return logits.float()


def _window(pages: Tensor, inputs: StepInputs) -> Tensor:
    """[B, Hkv, W, hd]: each row's blocks side by side."""
    batch, count = inputs.window_blocks.shape
    gathered = pages[:, inputs.window_blocks]  # [Hkv, B, nb, block, hd]
    return gathered.view(pages.shape[0], batch, count * pages.shape[2], -1).transpose(0, 1)


def _attend(shape: StepShape, queries: Tensor, keys: Tensor, values: Tensor, bias: Tensor) -> Tensor:
    """One query per row over its window: [B, H, hd] x [B, Hkv, W, hd] -> [B, H * hd] (float32).

    Query heads are grouped over their key/value head (grouped-query attention) by a view.
    """
    batch, kv_heads, window, head_dim = keys.shape
    group = shape.n_heads // kv_heads
    grouped = queries.float().view(batch, kv_heads, group, 1, head_dim)
    scores = (grouped * keys.float()[:, :, None]).sum(-1) * head_dim**-0.5  # [B, Hkv, G, W]
    # bias [B, H | 1, W] -> broadcastable against [B, Hkv, G, W]
    per_head = bias[:, :, None] if bias.shape[1] == 1 else bias.view(batch, kv_heads, group, window)
    scores = scores + per_head
    weights = torch.softmax(scores, dim=-1)
    attended = (weights[..., None] * values.float()[:, :, None]).sum(-2)  # [B, Hkv, G, hd]
    return attended.reshape(batch, -1)


def _attention_bias(shape: StepShape, weights: StepWeights, inputs: StepInputs, window: int) -> Tensor:
    """The causal mask plus the scheme's bias, float32 [B, H, W] (or [B, 1, W] with no bias)."""
    key_positions = torch.arange(window, device=inputs.positions.device)
    distance = key_positions[None, :] - inputs.positions[:, None]  # [B, W], k - q
    blocked = torch.where(distance <= 0, 0.0, float("-inf"))[:, None]  # [B, 1, W]
    if inputs.alibi_slopes is not None:
        return blocked + inputs.alibi_slopes[None, :, None] * distance[:, None].float()
    if inputs.t5_buckets is not None and weights.t5_table is not None:
        buckets = inputs.t5_buckets[distance + window - 1]  # [B, W]
        return blocked + weights.t5_table[buckets].permute(0, 2, 1).float()
    return blocked
