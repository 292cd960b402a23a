"""A decoder-only transformer whose positional scheme is a config field.

Pre-norm blocks (norm, attention, norm, MLP) with grouped-query attention through
`scaled_dot_product_attention`. The default shape is Llama's (RMSNorm, SwiGLU, no biases), and so
are the parameter names; the config's block fields cover the other families a Hugging Face
loader maps onto it (LayerNorm, GELU MLPs, biases, parallel residuals, q/k norms, an embedding
norm). Everything positional is delegated to `PositionalEncoding`, which draws its math from
`pe_runtime`.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import TypeVar, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pe_runtime import PECache, RopeScaling
from pe_runtime.rope import apply_rope
from service.model.attention import PagedStep, attend
from service.model.attention_rules import AttentionRule
from service.model.config import ModelConfig
from service.model.kv_cache import KVCache, RowCache
from service.model.positional import PositionalEncoding, PositionalInputs
from service.model.relative_attention import relative_attention_layer

ScalingArg = RopeScaling | Sequence[RopeScaling] | None
# `pe_attention` per row (None in a row: standard), or one rule for every row.
AttentionArg = AttentionRule | Sequence[AttentionRule | None] | None
Result = TypeVar("Result")
# A pass a layer at a time: every `next()` runs one layer; the last one returns the result.
Stages = Generator[None, None, Result]


def run_stages(stages: Stages[Result]) -> Result:
    """The whole pass at once."""
    while (result := run_layers(stages, 1)) is None:
        pass
    return result


def run_layers(stages: Stages[Result], layers: int) -> Result | None:
    """The next `layers` layers of a pass: its result if they completed it, else None."""
    for _ in range(layers):
        try:
            next(stages)
        except StopIteration as done:
            return cast(Result, done.value)
    return None


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Root-mean-square norm computed in float32, as Llama does, then cast back."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


def make_norm(config: ModelConfig, dim: int) -> nn.Module:
    """The config's norm over `dim` channels: RMSNorm, or LayerNorm with or without its bias."""
    if config.norm == "layer":
        return nn.LayerNorm(dim, eps=config.norm_eps, bias=config.norm_bias)
    return RMSNorm(dim, config.norm_eps)


def activate(x: Tensor, activation: str) -> Tensor:
    """The MLP's nonlinearity; `gelu_tanh` is GPT-2's tanh approximation (`gelu_new`)."""
    if activation == "silu":
        return F.silu(x)
    return F.gelu(x, approximate="tanh" if activation == "gelu_tanh" else "none")


class Attention(nn.Module):
    """Multi-head attention with `n_kv_heads` key/value heads shared by groups of query heads."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        head_dim = config.head_dim
        self.q_proj = nn.Linear(config.d_model, config.n_heads * head_dim, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.d_model, config.n_kv_heads * head_dim, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.d_model, config.n_kv_heads * head_dim, bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.n_heads * head_dim, config.d_model, bias=config.attn_out_bias)
        # Qwen3 normalises each head's query and key (one weight shared by the heads) before RoPE.
        self.q_norm = RMSNorm(head_dim, config.norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(head_dim, config.norm_eps) if config.qk_norm else None
        self.relative = relative_attention_layer(config)  # explicit attention for Shaw, XL, CoPE

    def forward(
        self, x: Tensor, positions: PositionalInputs, cache: RowCache | PagedStep | None, layer_index: int
    ) -> Tensor:
        batch, length, _ = x.shape
        queries = self._heads(self.q_proj(x), self.config.n_heads)  # [B, H, Tq, hd]
        keys = self._heads(self.k_proj(x), self.config.n_kv_heads)  # [B, Hkv, Tq, hd]
        values = self._heads(self.v_proj(x), self.config.n_kv_heads)
        if self.q_norm is not None and self.k_norm is not None:
            queries, keys = self.q_norm(queries), self.k_norm(keys)
        if positions.rope is not None:
            queries = apply_rope(queries, *positions.rope, layout=self.config.rope_layout)
            keys = apply_rope(keys, *positions.rope, layout=self.config.rope_layout)
        if positions.query_scale is not None:  # log-n attention (`pe_attention.logn`)
            queries = queries * positions.query_scale
        attended = attend(
            cache, layer_index, queries, keys, values, positions, self.relative, self.config.rope_layout
        )  # [B, H, Tq, hd]
        output: Tensor = self.o_proj(attended.transpose(1, 2).reshape(batch, length, -1))
        return output

    def _heads(self, projected: Tensor, n_heads: int) -> Tensor:
        """[B, T, n_heads * hd] -> [B, n_heads, T, hd]."""
        batch, length, _ = projected.shape
        return projected.view(batch, length, n_heads, self.config.head_dim).transpose(1, 2)


class MLP(nn.Module):
    """Gated (SwiGLU: down(silu(gate(x)) * up(x))) or plain (down(gelu(up(x)))) feed-forward."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.activation = config.activation
        bias = config.mlp_bias
        self.gate_proj = nn.Linear(config.d_model, config.ffn_hidden, bias=bias) if config.gated_mlp else None
        self.up_proj = nn.Linear(config.d_model, config.ffn_hidden, bias=bias)
        self.down_proj = nn.Linear(config.ffn_hidden, config.d_model, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        if self.gate_proj is None:
            hidden = activate(self.up_proj(x), self.activation)
        else:
            hidden = activate(self.gate_proj(x), self.activation) * self.up_proj(x)
        output: Tensor = self.down_proj(hidden)
        return output


class Block(nn.Module):
    """One layer; `config.residual` says how attention and MLP combine (see `Residual`)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.residual = config.residual
        self.attn_norm = make_norm(config, config.d_model)
        self.attn = Attention(config)
        self.mlp_norm = make_norm(config, config.d_model) if config.residual != "parallel" else None
        self.mlp = MLP(config)

    def forward(
        self, x: Tensor, positions: PositionalInputs, cache: RowCache | PagedStep | None, layer_index: int
    ) -> Tensor:
        normed = self.attn_norm(x)
        attended = self.attn(normed, positions, cache, layer_index)
        if self.mlp_norm is None:  # parallel: both branches read the one norm
            output: Tensor = x + attended + self.mlp(normed)
        elif self.residual == "parallel_two_norms":
            output = x + attended + self.mlp(self.mlp_norm(x))
        else:
            x = x + attended
            output = x + self.mlp(self.mlp_norm(x))
        return output


class Transformer(nn.Module):
    """The model. `model(tokens)` is the full-sequence forward used for training and scoring.

    `scaling` overrides the config's default RoPE scaling: one value for every row, or one per
    row (this is how a batch mixes requests with different scalings). With a `cache`, `tokens`
    are appended after each row's cached tokens and the cache advances by `T`.
    """

    def __init__(self, config: ModelConfig, pe_cache: PECache | None = None) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model)
        self.embed_norm = make_norm(config, config.d_model) if config.embedding_norm else None
        self.positions = PositionalEncoding(
            config, pe_cache if pe_cache is not None else PECache(registry=None)
        )
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = make_norm(config, config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=config.lm_head_bias)
        self.apply(_init_weights)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        tokens: Tensor,
        *,
        scaling: ScalingArg = None,
        cache: RowCache | None = None,
        last_n: int | None = None,
        table_lengths: Sequence[int] | None = None,
        counts: Sequence[int] | None = None,
        position_ids: Tensor | None = None,
        attention: AttentionArg = None,
    ) -> Tensor:
        """tokens [B, T] -> logits [B, T, vocab_size], or [B, last_n, vocab_size] for the last positions.

        `last_n` spares the output projection (and its memory) for positions nobody reads, such as
        all but the last of a prompt. `table_lengths` (one per row) sizes length-dependent RoPE
        tables (see `PositionalEncoding.forward`). With a cache, `counts[i]` says how many of row
        i's tokens are real (the rest pad rows of a chunked prefill to one width): the cache
        advances row i by `counts[i]`, and the result is [B, 1, vocab_size] at each row's last
        real token.

        With a cache, `tokens` are attended after each row's cached entries and the cache advances
        by `T`, only once every layer has succeeded: a pass that raises leaves it as it was. Rows
        whose table changed since their entries were cached are the caller's to refresh first
        (`service.model.refresh`); the model computes, the batch decides.

        `position_ids` [B, T] (training only, no cache) gives each token's RoPE position in place
        of 0..T-1: PoSE's skipped and randomized positions train this way (`training.positions`).

        `attention` is each row's `pe_attention` rule (`attention_rules`), which places queries
        and keys by the positions the cache records; None is standard attention.
        """
        stages = self.forward_stages(
            tokens,
            scaling=scaling,
            cache=cache,
            last_n=last_n,
            table_lengths=table_lengths,
            counts=counts,
            position_ids=position_ids,
            attention=attention,
        )
        return run_stages(stages)

    def forward_stages(
        self,
        tokens: Tensor,
        *,
        scaling: ScalingArg = None,
        cache: RowCache | None = None,
        last_n: int | None = None,
        table_lengths: Sequence[int] | None = None,
        counts: Sequence[int] | None = None,
        position_ids: Tensor | None = None,
        attention: AttentionArg = None,
    ) -> Stages[Tensor]:
        """`forward` a layer at a time: each `next()` runs one layer, the last returns the logits.

        An engine spreads one pass over several steps this way when a single layer group is all a
        step may spend (a prompt chunk deep in a long context). The cache advances only when the
        last layer is done, so a pass dropped half-way leaves it as it was.
        """
        scalings = self._row_scalings(scaling, tokens.shape[0])
        rules = _row_rules(attention, tokens.shape[0])
        hidden = yield from self._hidden(
            tokens, scalings, cache, table_lengths, counts, position_ids, rules
        )  # [B, T, D]
        if counts is not None:
            last = torch.tensor(list(counts), device=tokens.device) - 1
            hidden = hidden[torch.arange(tokens.shape[0], device=tokens.device), last][:, None]
        elif last_n is not None:
            hidden = hidden[:, -last_n:]
        logits: Tensor = self.lm_head(self.norm(hidden))
        if cache is not None:
            self._advance(cache, tokens, scalings, table_lengths, counts)
        return logits

    def final_hidden(
        self,
        tokens: Tensor,
        *,
        scaling: ScalingArg = None,
        cache: RowCache | None = None,
        table_lengths: Sequence[int] | None = None,
        attention: AttentionArg = None,
    ) -> Tensor:
        """tokens [B, T] -> normed last hidden states [B, T, d_model], before the output head.

        For callers that project positions in chunks (scoring long inputs against a large vocabulary).
        """
        return run_stages(
            self.final_hidden_stages(
                tokens, scaling=scaling, cache=cache, table_lengths=table_lengths, attention=attention
            )
        )

    def final_hidden_stages(
        self,
        tokens: Tensor,
        *,
        scaling: ScalingArg = None,
        cache: RowCache | None = None,
        table_lengths: Sequence[int] | None = None,
        attention: AttentionArg = None,
    ) -> Stages[Tensor]:
        """`final_hidden` a layer at a time, as `forward_stages` is `forward`."""
        scalings = self._row_scalings(scaling, tokens.shape[0])
        rules = _row_rules(attention, tokens.shape[0])
        hidden: Tensor = self.norm(
            (yield from self._hidden(tokens, scalings, cache, table_lengths, rules=rules))
        )
        if cache is not None:
            self._advance(cache, tokens, scalings, table_lengths)
        return hidden

    def _advance(
        self,
        cache: RowCache,
        tokens: Tensor,
        scalings: Sequence[RopeScaling],
        table_lengths: Sequence[int] | None,
        counts: Sequence[int] | None = None,
    ) -> None:
        lengths = table_lengths or [past + tokens.shape[1] for past in cache.lengths]
        keys = [self.positions.table_key(s, length) for s, length in zip(scalings, lengths, strict=True)]
        cache.advance(tokens, keys, counts)

    def _hidden(
        self,
        tokens: Tensor,
        scalings: Sequence[RopeScaling],
        cache: RowCache | None,
        table_lengths: Sequence[int] | None,
        counts: Sequence[int] | None = None,
        position_ids: Tensor | None = None,
        rules: Sequence[AttentionRule | None] | None = None,
    ) -> Stages[Tensor]:
        """The layers' output before the final norm; writes the new entries into `cache`.

        A generator that pauses between layers (see `forward_stages`)."""
        batch, length = tokens.shape
        hidden = self.embed(tokens)  # [B, T, D]
        past_lengths = cache.lengths if cache is not None else [0] * batch
        if position_ids is not None:
            if cache is not None:
                raise ValueError("position_ids are for fresh training passes, not cached ones")
            positions = self.positions.at_positions(position_ids, scalings, dtype=hidden.dtype)
        else:
            if cache is not None:
                cache.reserve(length)
            reads_positions = self.config.has_score_bias or any(rule is not None for rule in rules or ())
            key_positions = cache.key_positions() if cache is not None and reads_positions else None
            positions = self.positions(
                length,
                past_lengths,
                scalings,
                device=tokens.device,
                dtype=hidden.dtype,
                table_lengths=table_lengths,
                counts=counts,
                key_positions=key_positions,
                rules=rules,
                text_offsets=cache.text_offsets if cache is not None else None,
                turned_keys=cache.turned_keys(rules) if cache is not None and rules is not None else None,
            )
        if positions.absolute is not None:
            hidden = hidden + positions.absolute
        for index, layer in enumerate(self.layers):
            if index:
                yield
            hidden = layer(hidden, positions, cache, index)
        return hidden  # [B, T, D]

    def embed(self, tokens: Tensor) -> Tensor:
        """Token ids [...] -> their embeddings [..., D], scaled and normed, before absolute positions."""
        hidden: Tensor = self.embed_tokens(tokens) * self.config.embedding_scale
        return self.embed_norm(hidden) if self.embed_norm is not None else hidden

    def run_blocks(
        self, hidden: Tensor, positions: PositionalInputs, cache: RowCache | PagedStep | None
    ) -> Tensor:
        """Every layer at once over embedded rows [B, T, D] (absolute positions added): the
        layers' output before the final norm. What the torch decode step runs, compiled."""
        for index, layer in enumerate(self.layers):
            hidden = layer(hidden, positions, cache, index)
        return hidden

    def new_cache(self, batch_size: int, capacity: int) -> KVCache:
        """An empty cache on this model's device and dtype."""
        weight = self.embed_tokens.weight
        return KVCache.empty(self.config, batch_size, capacity, device=weight.device, dtype=weight.dtype)

    def _row_scalings(self, scaling: ScalingArg, batch_size: int) -> list[RopeScaling]:
        """One scaling per row: None is the model's default, a single scaling applies to all rows."""
        if scaling is None or isinstance(scaling, RopeScaling):
            return [scaling or self.positions.default_scaling] * batch_size
        if len(scaling) != batch_size:
            raise ValueError(f"got {len(scaling)} scalings for a batch of {batch_size}")
        return list(scaling)


def _row_rules(attention: AttentionArg, batch_size: int) -> list[AttentionRule | None] | None:
    """One rule (or None) per row; None when no row has one."""
    if attention is None:
        return None
    if isinstance(attention, AttentionRule):
        return [attention] * batch_size
    if len(attention) != batch_size:
        raise ValueError(f"got {len(attention)} attention rules for a batch of {batch_size}")
    return list(attention) if any(rule is not None for rule in attention) else None


def _init_weights(module: nn.Module) -> None:
    """GPT-2 style N(0, 0.02) for projections and tables; norm weights stay at one."""
    if isinstance(module, nn.Linear | nn.Embedding):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
