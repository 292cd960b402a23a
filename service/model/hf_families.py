"""Hugging Face model families as our `ModelConfig` and parameter names, one table entry each.

Each family says two things: how its `config.json` reads as our block fields (norm, MLP, biases,
residual, positional scheme), and how its parameter names map onto ours, fused projections split
as they go. Anything a family's config asks for that the model does not implement is refused here
with the config key that asked for it, so a checkpoint is never served approximately.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

logger = logging.getLogger(__name__)


class UnsupportedCheckpointError(ValueError):
    """The checkpoint (Hugging Face, GGUF or ours) is one this loader cannot run faithfully."""


Config = Mapping[str, Any]
# (their key, their tensor) -> our (key, tensor) pairs; nothing for buffers we recompute.
KeyMap = Callable[[str, Tensor], Iterator[tuple[str, Tensor]]]
# A family's config and tensors (their names) -> our ModelConfig fields that the weights decide.
WeightFields = Callable[[Config, Mapping[str, Tensor]], dict[str, Any]]


def _config_alone(hf: Config, tensors: Mapping[str, Tensor]) -> dict[str, Any]:
    """Most families' configs describe their weights: nothing is read from the tensors."""
    return {}


@dataclass(frozen=True)
class Family:
    block: Callable[[Config], dict[str, Any]]  # our ModelConfig fields beyond the common shapes
    keys: Callable[[Config], KeyMap]
    from_weights: WeightFields = _config_alone


def refuse(key: str, value: Any, why: str) -> UnsupportedCheckpointError:
    return UnsupportedCheckpointError(f"config key {key!r} = {value!r}: {why}")


def require(hf: Config, key: str, expected: Any, why: str = "not implemented") -> None:
    """Refuse a checkpoint whose `key` is set to anything but `expected` (absent counts as it)."""
    value = hf.get(key, expected)
    if value != expected and value is not None:
        raise refuse(key, value, why)


def rope_params(hf: Config) -> dict[str, Any]:
    """`rope_parameters` (transformers v5) or `rope_scaling` (v4), whichever the config has."""
    return dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})


def rope_base(hf: Config, *legacy: str, default: float = 10000.0) -> float:
    for key in ("rope_theta", *legacy):
        if key in rope_params(hf):
            return float(rope_params(hf)[key])
        if hf.get(key) is not None:
            return float(hf[key])
    return default


def rotary_fraction(hf: Config, *legacy: str, default: float = 1.0) -> float:
    for key in ("partial_rotary_factor", *legacy):
        if key in rope_params(hf):
            return float(rope_params(hf)[key])
        if hf.get(key) is not None:
            return float(hf[key])
    return default


def activation(hf: Config, key: str, default: str) -> str:
    value = hf.get(key, default)
    names = {"silu": "silu", "gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
    names |= {"gelu_fast": "gelu_tanh"}
    if value not in names:
        raise refuse(key, value, f"unsupported activation (supported: {', '.join(names)})")
    return names[value]


def _split(tensor: Tensor, sizes: list[int], dim: int = 0) -> list[Tensor]:
    return [part.contiguous() for part in torch.split(tensor, sizes, dim=dim)]


def _per_head_qkv(tensor: Tensor, n_heads: int) -> list[Tensor]:
    """[n_heads * 3 * hd, ...] laid out head by head (q, k, v of head 0, then head 1) -> q, k, v."""
    grouped = tensor.reshape(n_heads, 3, -1, *tensor.shape[1:])
    return [grouped[:, part].reshape(-1, *tensor.shape[1:]).contiguous() for part in range(3)]


def _renamer(renames: tuple[tuple[str, str], ...], *, prefix: str, drop: tuple[str, ...] = ()) -> KeyMap:
    """A map by renaming alone, after dropping `prefix`; keys containing a `drop` part are skipped."""

    def keys(key: str, tensor: Tensor) -> Iterator[tuple[str, Tensor]]:
        if any(part in key for part in drop):
            return
        key = key.removeprefix(prefix)
        for theirs, ours in renames:
            key = re.sub(theirs, ours, key)
        yield key, tensor

    return keys


def _with_fused(base: KeyMap, fused: Mapping[str, Callable[[Tensor], list[tuple[str, Tensor]]]]) -> KeyMap:
    """`base`, except that keys ending in one of `fused`'s suffixes are split into several."""

    def keys(key: str, tensor: Tensor) -> Iterator[tuple[str, Tensor]]:
        for ours, value in base(key, tensor):
            for suffix, split in fused.items():
                if ours.endswith(suffix):
                    stem = ours[: -len(suffix)]
                    yield from ((stem + name, part) for name, part in split(value))
                    break
            else:
                yield ours, value

    return keys


# --- Llama and its close relatives (model.layers.N.self_attn / mlp) ---------------------------------

_LLAMA_RENAMES = (
    (r"self_attn\.", "attn."),
    (r"input_layernorm\.", "attn_norm."),
    (r"post_attention_layernorm\.", "mlp_norm."),
)


def _llama_keys(hf: Config) -> KeyMap:
    return _renamer(_LLAMA_RENAMES, prefix="model.", drop=("rotary_emb",))


def _llama_block(hf: Config) -> dict[str, Any]:
    if hf.get("hidden_act", "silu") != "silu":
        raise refuse("hidden_act", hf.get("hidden_act"), "only SwiGLU MLPs (silu) are supported")
    bias = bool(hf.get("attention_bias", False))
    return {
        "mlp_bias": bool(hf.get("mlp_bias", False)),
        "qkv_bias": bias or hf.get("model_type") == "qwen2",
        "attn_out_bias": bias,
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
    }


def _qwen3_block(hf: Config) -> dict[str, Any]:
    return _llama_block(hf) | {"qk_norm": True}


def _phi3_block(hf: Config) -> dict[str, Any]:
    return _llama_block(hf) | {"qkv_bias": False, "attn_out_bias": False}


def _phi3_keys(hf: Config) -> KeyMap:
    heads, kv_heads = (
        int(hf["num_attention_heads"]),
        int(hf.get("num_key_value_heads") or hf["num_attention_heads"]),
    )
    head_dim = int(hf.get("head_dim") or int(hf["hidden_size"]) // heads)
    qkv = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]

    def split_qkv(tensor: Tensor) -> list[tuple[str, Tensor]]:
        return list(
            zip(("q_proj.weight", "k_proj.weight", "v_proj.weight"), _split(tensor, qkv), strict=True)
        )

    def split_gate_up(tensor: Tensor) -> list[tuple[str, Tensor]]:
        half = tensor.shape[0] // 2
        return list(zip(("gate_proj.weight", "up_proj.weight"), _split(tensor, [half, half]), strict=True))

    return _with_fused(_llama_keys(hf), {"qkv_proj.weight": split_qkv, "gate_up_proj.weight": split_gate_up})


def _stablelm_block(hf: Config) -> dict[str, Any]:
    require(hf, "qk_layernorm", False, "per-head q/k LayerNorms are not implemented")
    if hf.get("hidden_act", "silu") != "silu":
        raise refuse("hidden_act", hf.get("hidden_act"), "only SwiGLU MLPs (silu) are supported")
    return {
        "norm": "layer",
        "norm_eps": float(hf.get("layer_norm_eps", 1e-5)),
        "qkv_bias": bool(hf.get("use_qkv_bias", False)),
        "residual": "parallel" if hf.get("use_parallel_residual", False) else "sequential",
        "rotary_fraction": rotary_fraction(hf, default=0.25),
    }


# --- GPT-2, GPT-J, GPT-NeoX, BLOOM, MPT, Falcon ------------------------------------------------------


def _classic_block(
    hf: Config, activation_name: str, *, eps_key: str = "layer_norm_epsilon"
) -> dict[str, Any]:
    """What the GPT-2 lineage shares: LayerNorm and a plain (ungated) GELU MLP."""
    return {
        "norm": "layer",
        "norm_eps": float(hf.get(eps_key, 1e-5)),
        "gated_mlp": False,
        "activation": activation_name,
    }


def _gpt2_block(hf: Config) -> dict[str, Any]:
    require(hf, "scale_attn_weights", True, "unscaled attention is not implemented")
    require(hf, "scale_attn_by_inverse_layer_idx", False)
    require(hf, "add_cross_attention", False)
    return _classic_block(hf, activation(hf, "activation_function", "gelu_new")) | {
        "pe": "learned",
        "mlp_bias": True,
        "qkv_bias": True,
        "attn_out_bias": True,
        "tie_embeddings": True,
    }


def _gpt2_keys(hf: Config) -> KeyMap:
    width = int(hf["n_embd"])
    renames = (
        (r"^wte\.", "embed_tokens."),
        (r"^wpe\.", "positions.learned_table."),
        (r"^h\.", "layers."),
        (r"\.ln_1\.", ".attn_norm."),
        (r"\.ln_2\.", ".mlp_norm."),
        (r"\.attn\.c_proj\.", ".attn.o_proj."),
        (r"\.mlp\.c_fc\.", ".mlp.up_proj."),
        (r"\.mlp\.c_proj\.", ".mlp.down_proj."),
        (r"^ln_f\.", "norm."),
    )
    base = _renamer(renames, prefix="transformer.", drop=(".attn.bias", ".attn.masked_bias"))

    def keys(key: str, tensor: Tensor) -> Iterator[tuple[str, Tensor]]:
        for ours, value in base(key, tensor):
            # Conv1D stores [in, out]; ours is nn.Linear's [out, in].
            conv = value.dim() == 2 and any(
                name in ours for name in ("c_attn", "o_proj", "up_proj", "down_proj")
            )
            value = value.t().contiguous() if conv else value
            if ".c_attn." in ours:
                stem, kind = ours.split(".c_attn.")
                parts = _split(value, [width, width, width])
                yield from ((f"{stem}.{n}_proj.{kind}", p) for n, p in zip("qkv", parts, strict=True))
            else:
                yield ours, value

    return keys


def _gptj_block(hf: Config) -> dict[str, Any]:
    head_dim = int(hf["n_embd"]) // int(hf["n_head"])
    rotary = int(hf.get("rotary_dim") or head_dim)
    return _classic_block(hf, activation(hf, "activation_function", "gelu_new")) | {
        "mlp_bias": True,
        "lm_head_bias": True,
        "residual": "parallel",
        "rope_layout": "gptj",
        "rotary_fraction": rotary / head_dim,
        "rope_base": rope_base(hf),
    }


def _gptj_keys(hf: Config) -> KeyMap:
    renames = (
        (r"^wte\.", "embed_tokens."),
        (r"^h\.", "layers."),
        (r"\.ln_1\.", ".attn_norm."),
        (r"\.attn\.out_proj\.", ".attn.o_proj."),
        (r"\.mlp\.fc_in\.", ".mlp.up_proj."),
        (r"\.mlp\.fc_out\.", ".mlp.down_proj."),
        (r"^ln_f\.", "norm."),
    )
    return _renamer(
        renames, prefix="transformer.", drop=(".attn.bias", ".attn.masked_bias", "embed_positions")
    )


def _neox_block(hf: Config) -> dict[str, Any]:
    bias = bool(hf.get("attention_bias", True))
    return _classic_block(hf, activation(hf, "hidden_act", "gelu"), eps_key="layer_norm_eps") | {
        "mlp_bias": True,
        "qkv_bias": bias,
        "attn_out_bias": bias,
        "residual": "parallel_two_norms" if hf.get("use_parallel_residual", True) else "sequential",
        "rotary_fraction": rotary_fraction(hf, "rotary_pct", default=0.25),
        "rope_base": rope_base(hf, "rotary_emb_base"),
    }


def _fused_per_head(hf: Config, heads_key: str) -> Callable[[Tensor], list[tuple[str, Tensor]]]:
    heads = int(hf[heads_key])

    def split(tensor: Tensor) -> list[tuple[str, Tensor]]:
        kind = "bias" if tensor.dim() == 1 else "weight"
        return [(f"{n}_proj.{kind}", p) for n, p in zip("qkv", _per_head_qkv(tensor, heads), strict=True)]

    return split


def _neox_keys(hf: Config) -> KeyMap:
    renames = (
        (r"^embed_in\.", "embed_tokens."),
        (r"^embed_out\.", "lm_head."),
        (r"\.input_layernorm\.", ".attn_norm."),
        (r"\.post_attention_layernorm\.", ".mlp_norm."),
        (r"\.attention\.query_key_value\.(weight|bias)", r".attn.qkv.\1"),
        (r"\.attention\.dense\.", ".attn.o_proj."),
        (r"\.mlp\.dense_h_to_4h\.", ".mlp.up_proj."),
        (r"\.mlp\.dense_4h_to_h\.", ".mlp.down_proj."),
        (r"^final_layer_norm\.", "norm."),
    )
    base = _renamer(
        renames, prefix="gpt_neox.", drop=("rotary_emb", ".attention.bias", ".attention.masked_bias")
    )
    split = _fused_per_head(hf, "num_attention_heads")
    return _with_fused(base, {"qkv.weight": split, "qkv.bias": split})


def _bloom_block(hf: Config) -> dict[str, Any]:
    require(hf, "apply_residual_connection_post_layernorm", False)
    return _classic_block(hf, "gelu_tanh") | {
        "pe": "alibi",
        "mlp_bias": True,
        "qkv_bias": True,
        "attn_out_bias": True,
        "embedding_norm": True,
        "tie_embeddings": True,
    }


def _bloom_keys(hf: Config) -> KeyMap:
    renames = (
        (r"^word_embeddings_layernorm\.", "embed_norm."),
        (r"^word_embeddings\.", "embed_tokens."),
        (r"^h\.", "layers."),
        (r"\.input_layernorm\.", ".attn_norm."),
        (r"\.post_attention_layernorm\.", ".mlp_norm."),
        (r"\.self_attention\.query_key_value\.(weight|bias)", r".attn.qkv.\1"),
        (r"\.self_attention\.dense\.", ".attn.o_proj."),
        (r"\.mlp\.dense_h_to_4h\.", ".mlp.up_proj."),
        (r"\.mlp\.dense_4h_to_h\.", ".mlp.down_proj."),
        (r"^ln_f\.", "norm."),
    )
    split = _fused_per_head(hf, "n_head")
    return _with_fused(_renamer(renames, prefix="transformer."), {"qkv.weight": split, "qkv.bias": split})


def _mpt_block(hf: Config) -> dict[str, Any]:
    attn = dict(hf.get("attn_config") or {})
    if not attn.get("alibi", True):
        raise refuse("attn_config.alibi", attn.get("alibi"), "MPT without ALiBi is not implemented")
    for key in ("softmax_scale", "clip_qkv"):
        if attn.get(key) is not None:
            raise refuse(f"attn_config.{key}", attn[key], "not implemented")
    if attn.get("qk_ln", False):
        raise refuse("attn_config.qk_ln", attn["qk_ln"], "not implemented")
    require(hf, "no_bias", True, "MPT with biases is not implemented")
    return _classic_block(hf, "gelu") | {
        "pe": "alibi",
        "norm_bias": False,
        "alibi_rule": "mpt",
        "alibi_bias_max": float(attn.get("alibi_bias_max", 8)),
        "tie_embeddings": True,
    }


def _mpt_keys(hf: Config) -> KeyMap:
    width = int(hf["d_model"])
    renames = (
        (r"^wte\.", "embed_tokens."),
        (r"^blocks\.", "layers."),
        (r"\.norm_1\.", ".attn_norm."),
        (r"\.norm_2\.", ".mlp_norm."),
        (r"\.attn\.Wqkv\.", ".attn.qkv."),
        (r"\.attn\.out_proj\.", ".attn.o_proj."),
        (r"\.ffn\.up_proj\.", ".mlp.up_proj."),
        (r"\.ffn\.down_proj\.", ".mlp.down_proj."),
        (r"^norm_f\.", "norm."),
    )

    def split(tensor: Tensor) -> list[tuple[str, Tensor]]:
        return [(f"{n}_proj.weight", p) for n, p in zip("qkv", _split(tensor, [width] * 3), strict=True)]

    return _with_fused(_renamer(renames, prefix="transformer."), {"qkv.weight": split})


def _mpt_from_weights(hf: Config, tensors: Mapping[str, Tensor]) -> dict[str, Any]:
    """The MLP width of the weights: transformers' MPT builds 4 x d_model whatever
    `expansion_ratio` says (MosaicML's own code honours it), so a directory transformers saved can
    hold a wider MLP than its config claims. We run what transformers runs; the disagreement is
    logged, since the config is then wrong for any loader that does read it."""
    up = next((tensor for key, tensor in tensors.items() if key.endswith(".ffn.up_proj.weight")), None)
    if up is None:
        return {}
    width, claimed = int(up.shape[0]), shape(hf)["ffn_hidden"]
    if width != claimed:
        logger.warning(
            "MPT config key 'expansion_ratio' = %r makes an MLP of %d, the weights hold %d "
            "(transformers ignores the key); using the weights' width",
            hf.get("expansion_ratio"),
            claimed,
            width,
        )
    return {"ffn_hidden": width}


def _falcon_shape(hf: Config) -> tuple[int, int, bool]:
    """(query heads, key/value heads, grouped layout) as Falcon's attention reads its fused qkv."""
    heads = int(hf["num_attention_heads"])
    if hf.get("new_decoder_architecture", False):
        return heads, int(hf.get("num_kv_heads") or heads), True
    if hf.get("multi_query", True):
        return heads, 1, False
    kv = hf.get("num_kv_heads")
    if kv is not None and int(kv) != heads:
        raise refuse("num_kv_heads", kv, "only new_decoder_architecture groups key/value heads")
    return heads, heads, False


def _falcon_block(hf: Config) -> dict[str, Any]:
    _, kv_heads, grouped = _falcon_shape(hf)
    two_norms = grouped and int(hf.get("num_ln_in_parallel_attn") or 2) == 2
    parallel = grouped or bool(hf.get("parallel_attn", True))
    bias = bool(hf.get("bias", False))
    return {
        "n_kv_heads": kv_heads,
        "norm": "layer",
        "norm_eps": float(hf.get("layer_norm_epsilon", 1e-5)),
        "gated_mlp": False,
        "activation": activation(hf, "activation", "gelu"),
        "mlp_bias": bias,
        "qkv_bias": bias,
        "attn_out_bias": bias,
        "residual": "parallel_two_norms" if two_norms else "parallel" if parallel else "sequential",
        "ffn_hidden": int(hf.get("ffn_hidden_size") or 4 * int(hf["hidden_size"])),
        "rope_base": rope_base(hf),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", True)),
    } | (_falcon_alibi(hf) if hf.get("alibi", False) else {})


def _falcon_alibi(hf: Config) -> dict[str, Any]:
    """Falcon-RW's ALiBi: BLOOM's slopes, added to the scores before they are divided by
    sqrt(head_dim), so the slopes are scaled by it. (Its reference computes the bias in bfloat16,
    exact for power-of-two head counts at positions below 256; ours stays in float32.)"""
    head_dim = int(hf["hidden_size"]) // int(hf["num_attention_heads"])
    return {"pe": "alibi", "alibi_scale": head_dim**-0.5}


def _falcon_keys(hf: Config) -> KeyMap:
    heads, kv_heads, grouped = _falcon_shape(hf)
    renames = (
        (r"^word_embeddings\.", "embed_tokens."),
        (r"^h\.", "layers."),
        (r"\.(input_layernorm|ln_attn)\.", ".attn_norm."),
        (r"\.(post_attention_layernorm|ln_mlp)\.", ".mlp_norm."),
        (r"\.self_attention\.query_key_value\.(weight|bias)", r".attn.qkv.\1"),
        (r"\.self_attention\.dense\.", ".attn.o_proj."),
        (r"\.mlp\.dense_h_to_4h\.", ".mlp.up_proj."),
        (r"\.mlp\.dense_4h_to_h\.", ".mlp.down_proj."),
        (r"^ln_f\.", "norm."),
    )

    def split(tensor: Tensor) -> list[tuple[str, Tensor]]:
        kind = "bias" if tensor.dim() == 1 else "weight"
        rest = tensor.shape[1:]
        if grouped:  # [kv groups, queries of the group + k + v, hd]
            per_group = tensor.reshape(kv_heads, heads // kv_heads + 2, -1, *rest)
            parts = [per_group[:, :-2], per_group[:, -2], per_group[:, -1]]
            parts = [part.reshape(-1, *rest).contiguous() for part in parts]
        elif kv_heads == 1:  # all queries, then the one key and value
            head_dim = tensor.shape[0] // (heads + 2)
            parts = _split(tensor, [heads * head_dim, head_dim, head_dim])
        else:
            parts = _per_head_qkv(tensor, heads)
        return [(f"{n}_proj.{kind}", p) for n, p in zip("qkv", parts, strict=True)]

    base = _renamer(renames, prefix="transformer.", drop=("rotary_emb",))
    return _with_fused(base, {"qkv.weight": split, "qkv.bias": split})


def first(hf: Config, *keys: str, default: Any = None) -> Any:
    """The first of `keys` the config sets: families name the same shape differently."""
    for key in keys:
        if hf.get(key) is not None:
            return hf[key]
    if default is None:
        raise refuse(keys[0], None, "missing")
    return default


# Our shape fields (and `head_dim`) and the config keys that set them, in the order they are tried.
SHAPE_KEYS: dict[str, tuple[str, ...]] = {
    "vocab_size": ("vocab_size",),
    "d_model": ("hidden_size", "n_embd", "d_model", "n_embed"),
    "n_layers": ("num_hidden_layers", "n_layer", "n_layers"),
    "n_heads": ("num_attention_heads", "n_head", "n_heads"),
    "n_kv_heads": ("num_key_value_heads",),
    "head_dim": ("head_dim",),
    "ffn_hidden": ("intermediate_size", "n_inner", "ffn_hidden_size"),
    "native_context": ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"),
}
# Keys that one family's own block reads into a shape field (Falcon's kv heads, MPT's MLP ratio).
_FAMILY_SHAPE_KEYS = {
    "n_kv_heads": ("num_kv_heads", "multi_query", "new_decoder_architecture"),
    "ffn_hidden": ("expansion_ratio",),
}
# What a shape field follows when the config sets none of its keys.
_DEFAULTS_FROM = {"n_kv_heads": ("n_heads",), "head_dim": ("d_model", "n_heads"), "ffn_hidden": ("d_model",)}


def shape(hf: Config) -> dict[str, Any]:
    """The common shape fields, under whichever names the family uses."""
    width = int(first(hf, *SHAPE_KEYS["d_model"]))
    heads = int(first(hf, *SHAPE_KEYS["n_heads"]))
    ffn = first(hf, *SHAPE_KEYS["ffn_hidden"], default=0) or int(float(hf.get("expansion_ratio", 4)) * width)
    return {
        "vocab_size": int(first(hf, *SHAPE_KEYS["vocab_size"])),
        "d_model": width,
        "n_layers": int(first(hf, *SHAPE_KEYS["n_layers"])),
        "n_heads": heads,
        "n_kv_heads": int(first(hf, *SHAPE_KEYS["n_kv_heads"], default=heads)),
        "ffn_hidden": int(ffn),
        "native_context": int(first(hf, *SHAPE_KEYS["native_context"], default=2048)),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
    }


def config_keys(hf: Config, field: str) -> tuple[str, ...]:
    """The keys of this config that set our shape `field` (a `ModelConfig` field or `head_dim`),
    so that a refusal names what to fix in the checkpoint's own `config.json`; for a field the
    config leaves unset, the keys of the fields it defaults from (head_dim: width and heads)."""
    candidates = SHAPE_KEYS.get(field, (field,)) + _FAMILY_SHAPE_KEYS.get(field, ())
    named = tuple(key for key in candidates if hf.get(key) is not None)
    if named or field not in _DEFAULTS_FROM:
        return named or candidates[:1]
    return tuple(key for source in _DEFAULTS_FROM[field] for key in config_keys(hf, source))


FAMILIES: dict[str, Family] = {
    "llama": Family(_llama_block, _llama_keys),
    "mistral": Family(_llama_block, _llama_keys),
    "qwen2": Family(_llama_block, _llama_keys),
    "qwen3": Family(_qwen3_block, _llama_keys),
    "phi3": Family(_phi3_block, _phi3_keys),
    "stablelm": Family(_stablelm_block, _llama_keys),
    "gpt2": Family(_gpt2_block, _gpt2_keys),
    "gptj": Family(_gptj_block, _gptj_keys),
    "gpt_neox": Family(_neox_block, _neox_keys),
    "bloom": Family(_bloom_block, _bloom_keys),
    "mpt": Family(_mpt_block, _mpt_keys, _mpt_from_weights),
    "falcon": Family(_falcon_block, _falcon_keys),
}


def family(hf: Config) -> Family:
    model_type = hf.get("model_type")
    if model_type not in FAMILIES:
        raise refuse("model_type", model_type, f"not supported (supported: {', '.join(FAMILIES)})")
    return FAMILIES[str(model_type)]
