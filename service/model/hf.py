"""Hugging Face Llama-family checkpoints (llama, mistral, qwen2) read and written as our model.

These architectures are ours with RoPE in the neox layout, so loading is a config translation
plus a key rename; no `transformers` import is needed at run time. The checkpoint's own
`rope_scaling` (or v5 `rope_parameters`) becomes the model's default scaling. `export_llama` writes
one of our RoPE models as a Llama directory, so `transformers` can run the very same weights.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pe_runtime import PECache
from service.model.checkpoint import build_model
from service.model.config import ModelConfig
from service.model.transformer import Transformer

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
_CONFIG_FILE = "config.json"
_SHARD_INDEX = "model.safetensors.index.json"
# Our module names for theirs; everything else in a key is shared.
_RENAMES = (
    ("self_attn.", "attn."),
    ("input_layernorm.", "attn_norm."),
    ("post_attention_layernorm.", "mlp_norm."),
)
_ROPE_MODEL_KEYS = ("rope_theta", "partial_rotary_factor")


class UnsupportedCheckpointError(ValueError):
    """The directory is a Hugging Face checkpoint this loader cannot run faithfully."""


def is_hf_checkpoint(directory: Path) -> bool:
    config_path = directory / _CONFIG_FILE
    return config_path.is_file() and "model_type" in json.loads(config_path.read_text())


def hf_config_to_model_config(hf: Mapping[str, Any]) -> ModelConfig:
    """Translate a Llama-family `config.json`; refuses features the model does not implement."""
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedCheckpointError(
            f"model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    if hf.get("hidden_act", "silu") != "silu" or hf.get("mlp_bias", False):
        raise UnsupportedCheckpointError("only SwiGLU MLPs (hidden_act 'silu', no mlp_bias) are supported")
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    n_heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    head_dim = int(hf.get("head_dim") or hidden // n_heads)
    scaling = {key: value for key, value in rope.items() if key not in _ROPE_MODEL_KEYS}
    eos_id, extra_eos_ids = _ids(hf.get("eos_token_id"))
    is_default = scaling.get("rope_type", scaling.get("type", "default")) == "default"
    return ModelConfig(
        vocab_size=int(hf["vocab_size"]),
        d_model=hidden,
        n_layers=int(hf["num_hidden_layers"]),
        n_heads=n_heads,
        n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
        ffn_hidden=int(hf["intermediate_size"]),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        pe="rope",
        native_context=int(hf["max_position_embeddings"]),
        rope_base=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        rope_layout="neox",
        rotary_fraction=float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))),
        rope_scaling=None if is_default else scaling,
        bos_id=_ids(hf.get("bos_token_id"))[0],
        eos_id=eos_id,
        extra_eos_ids=extra_eos_ids,
        head_dim_override=head_dim if head_dim * n_heads != hidden else None,
        qkv_bias=model_type == "qwen2" or bool(hf.get("attention_bias", False)),
        sliding_window=_sliding_window(hf),
    )


def load_hf_checkpoint(
    directory: Path,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    pe_cache: PECache | None = None,
) -> Transformer:
    """Load a single-file or sharded safetensors Llama-family checkpoint as our `Transformer`."""
    config = hf_config_to_model_config(json.loads((directory / _CONFIG_FILE).read_text()))
    state: dict[str, torch.Tensor] = {}
    for shard in _weight_files(directory):
        with safe_open(str(shard), framework="pt") as tensors:
            for key in tensors.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                ours = _our_key(key)
                if ours is not None:
                    state[ours] = tensors.get_tensor(key)
    return build_model(config, state, device=device, dtype=dtype, pe_cache=pe_cache)


def export_llama(model: Transformer, directory: Path) -> None:
    """Write a RoPE (neox) model as a `LlamaForCausalLM` directory with the same weights."""
    config = model.config
    if config.pe != "rope" or config.rope_layout != "neox" or config.qkv_bias:
        raise UnsupportedCheckpointError("only neox-layout RoPE models without qkv bias map onto Llama")
    directory.mkdir(parents=True, exist_ok=True)
    rope_parameters = dict(config.rope_scaling or {})
    rope_parameters["rope_type"] = rope_parameters.pop("rope_type", rope_parameters.pop("type", "default"))
    rope_parameters["rope_theta"] = config.rope_base
    hf_config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "intermediate_size": config.ffn_hidden,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.native_context,
        "rms_norm_eps": config.norm_eps,
        "tie_word_embeddings": config.tie_embeddings,
        "partial_rotary_factor": config.rotary_fraction,
        "rope_parameters": rope_parameters,
        "bos_token_id": config.bos_id,
        "eos_token_id": [config.eos_id, *config.extra_eos_ids] if config.extra_eos_ids else config.eos_id,
    }
    (directory / _CONFIG_FILE).write_text(json.dumps(hf_config, indent=2) + "\n")
    tensors = {
        _their_key(key): value.detach().contiguous().cpu()
        for key, value in model.state_dict().items()
        if not (config.tie_embeddings and key == "lm_head.weight")
    }
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})


def _weight_files(directory: Path) -> list[Path]:
    index = directory / _SHARD_INDEX
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return [directory / name for name in sorted(set(weight_map.values()))]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise UnsupportedCheckpointError(f"no *.safetensors weights in {directory}")
    return files


def _our_key(key: str) -> str | None:
    """Their parameter name -> ours; None for buffers we recompute (rotary inv_freq)."""
    if "rotary_emb" in key:
        return None
    key = key.removeprefix("model.")
    for theirs, ours in _RENAMES:
        key = key.replace(theirs, ours)
    return key


def _their_key(key: str) -> str:
    for theirs, ours in _RENAMES:
        key = key.replace(ours, theirs)
    return key if key.startswith("lm_head.") else f"model.{key}"


def _ids(value: int | list[int] | None) -> tuple[int | None, tuple[int, ...]]:
    """A token id or a list of them (Llama 3 lists several EOS ids): (the first or None, the rest)."""
    listed = value if isinstance(value, list) else [] if value is None else [value]
    ids = [int(token) for token in listed]
    return (ids[0], tuple(ids[1:])) if ids else (None, ())


def _sliding_window(hf: Mapping[str, Any]) -> int | None:
    """Mistral/Qwen2 sliding-window attention, which the engine honours by capping the context."""
    window = hf.get("sliding_window")
    if window is None or (hf.get("model_type") == "qwen2" and not hf.get("use_sliding_window", False)):
        return None
    return int(window)
