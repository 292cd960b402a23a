"""What a model's layers compute, read once from its config, and which backend may run it.

`BlockSpec.of(config)` is the one place that turns `ModelConfig`'s block fields into the features
of the layer math (norm, activation, residual shape, biases, q/k norms, rotary layout, the
scheme's positional input). Backends declare what they run as an **allow-list** (`Support`): for
every feature, the values they implement. A feature a backend does not declare is refused, so a
field added to `BlockSpec` keeps every fast backend off the model until someone says the backend
runs it; a field added to `ModelConfig` must be read here or listed in `NEUTRAL_FIELDS`, which a
test checks. A backend that refuses a model says why, and the model runs on the eager pass.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from service.model.config import Activation, ModelConfig, Norm, Residual, RopeLayout, Scheme

# ModelConfig fields that do not change which operations a layer runs: sizes (they shape the
# tensors every backend reads from the weights), ids, and the inputs `pe_runtime` turns into
# tables or biases before any layer runs (every backend reads those tables, not the fields).
NEUTRAL_FIELDS: Mapping[str, str] = {
    "vocab_size": "a size, read from the weights",
    "d_model": "a size, read from the weights",
    "n_layers": "a size, read from the weights",
    "n_heads": "a size, passed to every kernel",
    "n_kv_heads": "a size, passed to every kernel",
    "ffn_hidden": "a size, read from the weights",
    "head_dim_override": "a size, passed to every kernel as head_dim",
    "norm_eps": "a constant, passed to every kernel",
    "tie_embeddings": "how the weights are stored; the head is a matrix either way",
    "native_context": "the positional tables' length (pe_runtime)",
    "rope_base": "the rotary tables (pe_runtime)",
    "rope_scaling": "the rotary tables (pe_runtime)",
    "rotary_fraction": "a size, passed to every kernel as rotary_dim",
    "t5_num_buckets": "the T5 bias (positional.py)",
    "t5_max_distance": "the T5 bias (positional.py)",
    "bos_id": "tokens, not math",
    "eos_id": "tokens, not math",
    "extra_eos_ids": "tokens, not math",
    "sliding_window": "the engine caps a request's context at it (engine/models.py)",
    "embedding_scale": "the embedding, before the layers (the pass's prelude)",
    "alibi_rule": "the ALiBi slopes (pe_runtime)",
    "alibi_bias_max": "the ALiBi slopes (pe_runtime)",
    "alibi_scale": "the ALiBi slopes (positional.py)",
    "shaw_max_distance": "Shaw's tables, read only by its explicit attention (pe = shaw)",
    "cope_npos_max": "CoPE's tables, read only by its explicit attention (pe = cope)",
}


@dataclass(frozen=True)
class BlockSpec:
    """The features of one model's layer math; every backend runs exactly these or refuses."""

    pe: Scheme  # which positional input the layers read (tables, a score bias, explicit attention)
    rope_layout: RopeLayout
    norm: Norm
    norm_bias: bool  # LayerNorm's bias
    activation: Activation
    gated_mlp: bool
    residual: Residual
    qkv_bias: bool
    attn_out_bias: bool
    mlp_bias: bool
    lm_head_bias: bool
    qk_norm: bool
    embedding_norm: bool

    @classmethod
    def of(cls, config: ModelConfig) -> BlockSpec:
        return cls(
            pe=config.pe,
            rope_layout=config.rope_layout,
            norm=config.norm,
            norm_bias=config.norm == "layer" and config.norm_bias,
            activation=config.activation,
            gated_mlp=config.gated_mlp,
            residual=config.residual,
            qkv_bias=config.qkv_bias,
            attn_out_bias=config.attn_out_bias,
            mlp_bias=config.mlp_bias,
            lm_head_bias=config.lm_head_bias,
            qk_norm=config.qk_norm,
            embedding_norm=config.embedding_norm,
        )

    @staticmethod
    def config_fields() -> frozenset[str]:
        """The `ModelConfig` fields `of` reads, each under its own name (the rest are `NEUTRAL_FIELDS`)."""
        return frozenset(field.name for field in dataclasses.fields(BlockSpec))


ANY = None  # a feature whose every value a backend runs


@dataclass(frozen=True)
class Support:
    """A backend's allow-list: for each `BlockSpec` feature, the values it runs (`ANY`: all)."""

    backend: str
    allowed: Mapping[str, frozenset[Any] | None]

    def refuses(self, spec: BlockSpec) -> str | None:
        """Why this backend cannot run `spec` (None when it can)."""
        reasons = []
        for field in dataclasses.fields(spec):
            value = getattr(spec, field.name)
            if field.name not in self.allowed:
                reasons.append(f"{field.name} (not declared by the {self.backend} backend)")
            elif (values := self.allowed[field.name]) is not None and value not in values:
                reasons.append(f"{field.name}={value!r}")
        return f"the {self.backend} backend does not run {', '.join(reasons)}" if reasons else None


# Schemes whose positions reach the layers as tables or a bias on the scores (the fast passes'
# inputs); Shaw, Transformer-XL and CoPE need their explicit attention (relative_attention.py).
TABLE_OR_BIAS_SCHEMES: frozenset[Scheme] = frozenset(
    {"rope", "rope_alibi", "nope", "alibi", "t5_bias", "learned", "sinusoidal"}
)

# Every feature of the block, for backends that run all of it; each backend narrows what it must.
_EVERY_BLOCK: Mapping[str, frozenset[Any] | None] = {
    "pe": TABLE_OR_BIAS_SCHEMES,
    "rope_layout": ANY,
    "norm": ANY,
    "norm_bias": ANY,
    "activation": ANY,
    "gated_mlp": ANY,
    "residual": ANY,
    "qkv_bias": ANY,
    "attn_out_bias": ANY,
    "mlp_bias": ANY,
    "lm_head_bias": ANY,
    "qk_norm": ANY,
    "embedding_norm": ANY,
}

# The C pass interprets the block (kernels/batch_pass.c): every norm, activation, residual shape,
# bias and q/k norm the config expresses.
C_SUPPORT = Support("c", _EVERY_BLOCK)

# The torch step (compiled, CUDA graphs) runs the model's own layers over the pool's blocks.
TORCH_STEP_SUPPORT = Support("torch step", _EVERY_BLOCK)
