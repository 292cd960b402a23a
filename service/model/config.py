"""`ModelConfig`: everything needed to rebuild a model, and nothing about how it is served.

The same dataclass describes our zoo checkpoints and Hugging Face Llama-family models once their
config has been translated, so the model code has a single source of truth for shapes and PE.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal, cast, get_args

Scheme = Literal[
    "learned",
    "sinusoidal",
    "rope",
    "alibi",
    "t5_bias",
    "nope",
    "shaw",
    "transformer_xl",
    "cope",
    "rope_alibi",
]
RopeLayout = Literal["neox", "gptj"]
Norm = Literal["rms", "layer"]
Activation = Literal["silu", "gelu", "gelu_tanh"]
# How a block combines its two branches: `sequential` is Llama's x + attn(n1(x)), then + mlp(n2(x));
# `parallel` feeds one norm's output to both (GPT-J, Falcon-7B, StableLM's option);
# `parallel_two_norms` gives each branch its own norm of the same input (GPT-NeoX, Falcon-40B).
Residual = Literal["sequential", "parallel", "parallel_two_norms"]
# ALiBi's slope rule for a head count that is not a power of two: Press et al.'s (BLOOM's) or MPT's.
AlibiRule = Literal["press", "mpt"]
SCHEMES: tuple[Scheme, ...] = get_args(Scheme)
# Schemes that rotate queries and keys, and so take RoPE's tables, layout and scalings.
ROPE_SCHEMES: frozenset[Scheme] = frozenset({"rope", "rope_alibi"})


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters of a decoder-only transformer with a pluggable PE.

    `rope_scaling` is kept in Hugging Face's dict form (with `rope_type`) so a checkpoint's config
    stays readable by people who know that format; it is the model's default scaling, which a
    request's own scaling replaces.

    `embedding_scale` multiplies token embeddings before an absolute position table is added:
    a sinusoidal table has unit-scale entries, so small-initialised embeddings would otherwise be
    swamped by position (Vaswani et al. scale by sqrt(d_model) for the same reason).
    """

    vocab_size: int = 258
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4
    ffn_hidden: int = 704
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    pe: Scheme = "rope"
    native_context: int = 256
    rope_base: float = 10000.0
    rope_layout: RopeLayout = "neox"
    rotary_fraction: float = 1.0
    rope_scaling: Mapping[str, Any] | None = None
    t5_num_buckets: int = 32
    t5_max_distance: int = 128
    bos_id: int | None = 256
    eos_id: int | None = 257
    extra_eos_ids: tuple[int, ...] = ()
    head_dim_override: int | None = None
    qkv_bias: bool = False
    sliding_window: int | None = None
    embedding_scale: float = 1.0
    norm: Norm = "rms"
    norm_bias: bool = True  # LayerNorm's bias (MPT has none); RMSNorm never has one
    gated_mlp: bool = True  # SwiGLU-style down(act(gate(x)) * up(x)); else down(act(up(x)))
    activation: Activation = "silu"
    mlp_bias: bool = False
    attn_out_bias: bool = False
    lm_head_bias: bool = False
    residual: Residual = "sequential"
    embedding_norm: bool = False  # BLOOM's norm right after the token embedding
    qk_norm: bool = False  # Qwen3's RMSNorm over each head's query and key, before RoPE
    alibi_rule: AlibiRule = "press"
    alibi_bias_max: float = 8.0  # the steepest slope is 2^-alibi_bias_max (MPT's config key)
    alibi_scale: float = 1.0  # multiplies the slopes (Falcon adds ALiBi before dividing by sqrt(hd))
    shaw_max_distance: int = 16  # Shaw et al.'s clipping distance k
    cope_npos_max: int = 64  # CoPE's largest contextual position

    def __post_init__(self) -> None:
        # JSON gives lists; a tuple keeps the config immutable like the rest of it.
        object.__setattr__(self, "extra_eos_ids", tuple(int(token) for token in self.extra_eos_ids))
        if self.pe not in SCHEMES:
            raise ValueError(f"unknown positional scheme {self.pe!r}; expected one of {SCHEMES}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError("n_heads must be a multiple of n_kv_heads (grouped-query attention)")
        if self.head_dim_override is None and self.d_model % self.n_heads:
            raise ValueError("d_model must be divisible by n_heads unless head_dim_override is set")
        if self.rope_layout not in ("neox", "gptj"):
            raise ValueError(f"unknown rope_layout {self.rope_layout!r}")
        if self.shaw_max_distance < 1 or self.cope_npos_max < 1:
            raise ValueError("shaw_max_distance and cope_npos_max must be positive")
        if self.norm not in ("rms", "layer") or self.activation not in ("silu", "gelu", "gelu_tanh"):
            raise ValueError(f"unknown norm {self.norm!r} or activation {self.activation!r}")
        if self.residual not in ("sequential", "parallel", "parallel_two_norms"):
            raise ValueError(f"unknown residual {self.residual!r}")
        if self.alibi_rule not in ("press", "mpt"):
            raise ValueError(f"unknown alibi_rule {self.alibi_rule!r}")
        if self.has_rope and (self.rotary_dim == 0 or self.rotary_dim % 2):
            raise ValueError("rotary_fraction * head_dim must be a positive even number")

    @property
    def has_rope(self) -> bool:
        return self.pe in ROPE_SCHEMES

    @property
    def has_score_bias(self) -> bool:
        """Whether the scheme adds a bias to the attention scores (ALiBi, T5)."""
        return self.pe in ("alibi", "rope_alibi", "t5_bias")

    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.d_model // self.n_heads

    @property
    def eos_ids(self) -> frozenset[int]:
        """Every token that ends a generation: `eos_id` and the extra ones (Llama 3 lists several)."""
        main = () if self.eos_id is None else (self.eos_id,)
        return frozenset((*main, *self.extra_eos_ids))

    @property
    def rotary_dim(self) -> int:
        """Leading channels of each head that RoPE rotates (partial rotary keeps the rest as is)."""
        return int(self.head_dim * self.rotary_fraction)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["rope_scaling"] = dict(self.rope_scaling) if self.rope_scaling is not None else None
        data["extra_eos_ids"] = list(self.extra_eos_ids)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelConfig:
        """Build from `to_dict()` output; keys that are not fields (e.g. `name`) are ignored."""
        known = {f.name for f in fields(cls)}
        return cls(**cast(dict[str, Any], {key: value for key, value in data.items() if key in known}))
