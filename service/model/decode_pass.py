"""One decode pass as a pure function: a new token per row in, next-token logits out.

gpt-fast's `decode_one_token`, for a batch of rows of different lengths and scalings, over the
paged KV cache. Everything the step needs is an argument: the packed weights, the positional
tables (already gathered into one stack per batch, indexed per row by `table_index`), the block
pool, and per-row tokens, positions and blocks. Nothing branches on data, and shapes depend only
on the batch size and the window (a power of two of blocks), so `torch.compile` traces it once
per window bucket and replays it for every step of that shape. The model's weights are arguments
too, not constants, so every model with the same architecture and scheme shares the compiled code.

Attention is `reference_paged_decode_attention`, which the compiler fuses over the whole window.
On a CPU in float32 a batch skips this function: `service.model.kernels.batch_pass` runs the same
layers in C after the same `pass_prelude`, over weights packed for it (`fast_decode.c_batch_pass`).

The math is the eager model's (`service.model.transformer`) step for step, with the query, key
and value projections fused into one matrix product and the gate and up projections into another.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import Tensor

from pe_runtime.rope import apply_rope
from service.model.config import RopeLayout, Scheme
from service.model.kernels.paged_attention import reference_paged_decode_attention
from service.model.spec import TORCH_STEP_SUPPORT, BlockSpec
from service.model.transformer import Block, Transformer, rms_norm


class PassShape(NamedTuple):
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
    """Matrices are [N, K]."""

    attn_norm: Tensor  # [D]
    qkv: Tensor  # [(H + 2 Hkv) * hd, D]
    qkv_bias: Tensor | None
    o_proj: Tensor  # [D, H * hd]
    mlp_norm: Tensor  # [D]
    gate_up: Tensor  # [2 F, D]
    down: Tensor  # [D, F]


class PreludeWeights(NamedTuple):
    """What `pass_prelude` reads: shared by the torch step and the C step."""

    embed: Tensor  # [V, D]
    t5_table: Tensor | None  # [num_buckets, H]


class PassWeights(NamedTuple):
    prelude: PreludeWeights
    layers: tuple[LayerWeights, ...]
    final_norm: Tensor  # [D]
    lm_head: Tensor  # [V, D]


class PassInputs(NamedTuple):
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


def pass_shape(model: Transformer, block_size: int) -> PassShape:
    config = model.config
    return PassShape(
        pe=config.pe,
        n_heads=config.n_heads,
        n_kv_heads=config.n_kv_heads,
        head_dim=config.head_dim,
        norm_eps=config.norm_eps,
        embedding_scale=config.embedding_scale,
        rope_layout=config.rope_layout,
        block_size=block_size,
    )


def prelude_weights(model: Transformer) -> PreludeWeights:
    t5 = model.positions.t5_table
    return PreludeWeights(embed=model.embed_tokens.weight, t5_table=t5.weight if t5 is not None else None)


@torch.no_grad()
def pack_weights(model: Transformer) -> PassWeights:
    """The model's weights in the step's layout (fused projections are copies, made once)."""
    refused = TORCH_STEP_SUPPORT.refuses(BlockSpec.of(model.config))
    if refused is not None:
        raise ValueError(refused)
    layers = []
    for block in cast(list[Block], list(model.layers)):
        attention, mlp = block.attn, block.mlp
        assert block.mlp_norm is not None and mlp.gate_proj is not None  # Llama's block, checked above
        projections = [attention.q_proj, attention.k_proj, attention.v_proj]
        layers.append(
            LayerWeights(
                attn_norm=norm_weight(block.attn_norm),
                qkv=torch.cat([projection.weight for projection in projections]),
                qkv_bias=fused_bias(projections),
                o_proj=attention.o_proj.weight,
                mlp_norm=norm_weight(block.mlp_norm),
                gate_up=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
                down=mlp.down_proj.weight,
            )
        )
    return PassWeights(
        prelude=prelude_weights(model),
        layers=tuple(layers),
        final_norm=norm_weight(model.norm),
        lm_head=model.lm_head.weight,
    )


def fused_bias(projections: Sequence[torch.nn.Module]) -> Tensor | None:
    """The biases of projections whose outputs are stacked into one product (q, k, v): all or none."""
    biases = [projection.bias for projection in projections]
    if not all(isinstance(bias, Tensor) for bias in biases):
        return None
    return torch.cat(cast(list[Tensor], biases))


def decode_one_token(
    shape: PassShape,
    weights: PassWeights,
    inputs: PassInputs,
    key_pages: list[Tensor],
    value_pages: list[Tensor],
) -> Tensor:
    """Logits float32 [B, V]; writes each row's new key and value into its block at its position."""
    batch = inputs.tokens.shape[0]
    heads, kv_heads, head_dim = shape.n_heads, shape.n_kv_heads, shape.head_dim
    hidden, rope, bias = pass_prelude(shape, weights.prelude, inputs)
    for layer, keys_pages, values_pages in zip(weights.layers, key_pages, value_pages, strict=True):
        normed = rms_norm(hidden, layer.attn_norm, shape.norm_eps)
        qkv = F.linear(normed, layer.qkv, layer.qkv_bias)
        queries = qkv[:, : heads * head_dim].view(batch, heads, head_dim)
        keys = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(batch, kv_heads, head_dim)
        values = qkv[:, (heads + kv_heads) * head_dim :].view(batch, kv_heads, head_dim)
        if rope is not None:
            cos, sin = rope[0][:, None], rope[1][:, None]  # [B, 1, rotary_dim]
            queries = apply_rope(queries, cos, sin, layout=shape.rope_layout)
            keys = apply_rope(keys, cos, sin, layout=shape.rope_layout)
        pages = (keys_pages, values_pages, inputs.window_blocks, inputs.positions)
        attended = reference_paged_decode_attention(queries, keys, values, *pages, bias, head_dim**-0.5)
        hidden = hidden + F.linear(attended.view(batch, -1).to(hidden.dtype), layer.o_proj)  # [B, H * hd] in
        normed = rms_norm(hidden, layer.mlp_norm, shape.norm_eps)
        gate, up = F.linear(normed, layer.gate_up).chunk(2, dim=-1)
        hidden = hidden + F.linear(F.silu(gate) * up, layer.down)
    logits = F.linear(rms_norm(hidden, weights.final_norm, shape.norm_eps), weights.lm_head)
    return logits.float()


class PassPrelude(NamedTuple):
    """What every row brings into the layers, from its token and position."""

    hidden: Tensor  # [B, D] the embedded token, absolute positions added
    rope: tuple[Tensor, Tensor] | None  # cos, sin [B, rotary_dim] at the row's position
    bias: Tensor | None  # [B, H, W] float32, the scheme's bias on the attention scores


def pass_prelude(shape: PassShape, weights: PreludeWeights, inputs: PassInputs) -> PassPrelude:
    """The step's inputs to its layers: shared by the torch step and the C batch step."""
    window = inputs.window_blocks.shape[1] * shape.block_size
    positions = inputs.positions
    hidden = weights.embed[inputs.tokens] * shape.embedding_scale
    if inputs.absolute is not None and inputs.table_index is not None:
        hidden = hidden + inputs.absolute[inputs.table_index, positions].to(hidden.dtype)
    rope = None
    if inputs.rope_cos is not None and inputs.rope_sin is not None and inputs.table_index is not None:
        rope = inputs.rope_cos[inputs.table_index, positions], inputs.rope_sin[inputs.table_index, positions]
    return PassPrelude(hidden, rope, _scheme_bias(weights, inputs, window))


def norm_weight(norm: torch.nn.Module) -> Tensor:
    weight = norm.weight
    assert isinstance(weight, Tensor)
    return weight


def _scheme_bias(weights: PreludeWeights, inputs: PassInputs, window: int) -> Tensor | None:
    """The scheme's bias on the scores, float32 [B, H, W]; None where it has none (RoPE, NoPE)."""
    if inputs.alibi_slopes is None and inputs.t5_buckets is None:
        return None
    positions = inputs.positions
    distance = torch.arange(window, device=positions.device)[None, :] - positions[:, None]  # [B, W], k - q
    if inputs.alibi_slopes is not None:
        return inputs.alibi_slopes[None, :, None] * distance[:, None].float()
    if inputs.t5_buckets is not None and weights.t5_table is not None:
        buckets = inputs.t5_buckets[distance + window - 1]  # [B, W]
        return weights.t5_table[buckets].permute(0, 2, 1).float()
    return None
