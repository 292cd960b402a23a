"""Hugging Face checkpoints of the supported families (`hf_families.FAMILIES`) read as our model.

Loading is a config translation plus a key map per family (`hf_families`); no `transformers`
import is needed at run time. The checkpoint's own
`rope_scaling` (or v5 `rope_parameters`) becomes the model's default scaling. `export_llama` writes
one of our RoPE models as a Llama directory, so `transformers` can run the very same weights.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pe_runtime import PECache
from service.model.checkpoint import Naming, build_model
from service.model.config import ModelConfig
from service.model.hf_families import (
    FAMILIES,
    KeyMap,
    config_keys,
    family,
    rope_base,
    rope_params,
    rotary_fraction,
    shape,
)
from service.model.hf_families import UnsupportedCheckpointError as UnsupportedCheckpointError
from service.model.quantized import PackedBlocks
from service.model.transformer import Transformer

SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
_CONFIG_FILE = "config.json"
_SHARD_INDEX = "model.safetensors.index.json"
_ROPE_MODEL_KEYS = ("rope_theta", "partial_rotary_factor")
# Ours -> Llama's, for `export_llama`.
_LLAMA_NAMES = (
    ("attn.", "self_attn."),
    ("attn_norm.", "input_layernorm."),
    ("mlp_norm.", "post_attention_layernorm."),
)


def is_hf_checkpoint(directory: Path) -> bool:
    config_path = directory / _CONFIG_FILE
    return config_path.is_file() and "model_type" in json.loads(config_path.read_text())


def hf_config_to_model_config(hf: Mapping[str, Any]) -> ModelConfig:
    """Translate a supported family's `config.json`; refuses features the model does not implement."""
    fields = shape(hf) | {"head_dim_override": None, "bos_id": None, "eos_id": None}
    rope = rope_params(hf)
    scaling = {key: value for key, value in rope.items() if key not in _ROPE_MODEL_KEYS}
    is_default = scaling.get("rope_type", scaling.get("type", "default")) == "default"
    fields |= {
        "pe": "rope",
        "rope_base": rope_base(hf),
        "rope_layout": "neox",
        "rotary_fraction": rotary_fraction(hf),
        "rope_scaling": None if is_default else scaling,
    }
    fields |= family(hf).block(hf)
    if "head_dim" in hf and hf["head_dim"] is not None:
        head_dim = int(hf["head_dim"])
        fields["head_dim_override"] = head_dim if head_dim * fields["n_heads"] != fields["d_model"] else None
    if fields["pe"] != "rope":
        fields["rope_scaling"] = None
    eos_id, extra_eos_ids = _ids(hf.get("eos_token_id"))
    fields |= {"bos_id": _ids(hf.get("bos_token_id"))[0], "eos_id": eos_id, "extra_eos_ids": extra_eos_ids}
    fields["sliding_window"] = _sliding_window(hf)
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if hf.get(key) is not None:
            raise UnsupportedCheckpointError(
                f"config key {key!r} = {hf[key]!r}: logit soft-capping is not implemented"
            )
    return ModelConfig(**fields)


def build_hf_model(
    hf: Mapping[str, Any],
    tensors: Mapping[str, torch.Tensor],
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    pe_cache: PECache | None = None,
) -> Transformer:
    """Our model from a family's config and its tensors under their Hugging Face names.

    The head is tied exactly when the checkpoint has no separate head weight (some configs say
    tied but ship both, identical; some say nothing). Weights of other shapes than the config's
    are refused with their own names and the config keys that disagree."""
    checkpoint = family(hf)
    key_map = checkpoint.keys(hf)
    state: dict[str, torch.Tensor] = {}
    theirs: dict[str, str] = {}  # our name -> the checkpoint's, which a refusal names
    for key, tensor in tensors.items():
        for ours, value in _mapped(hf, key_map, key, tensor):
            state[ours], theirs[ours] = value, key
    config = replace(
        hf_config_to_model_config(hf),
        tie_embeddings="lm_head.weight" not in state,
        **checkpoint.from_weights(hf, tensors),
    )
    naming = Naming(theirs.__getitem__, functools.partial(config_keys, hf))
    return build_model(config, state, device=device, dtype=dtype, pe_cache=pe_cache, naming=naming)


def packed_blocks_by_layer(
    hf: Mapping[str, Any], blocks: Mapping[str, PackedBlocks], *, tied: bool
) -> dict[str, PackedBlocks]:
    """A checkpoint's packed matrices (Hugging Face names) under our layer names
    (`layers.0.attn.q_proj`), renamed and split as their floats are; a tied head reads the
    embedding's blocks."""
    key_map = family(hf).keys(hf)
    ours: dict[str, PackedBlocks] = {}
    for key, packed in blocks.items():
        parts = [packed.codes, packed.scales] + ([packed.minimums] if packed.minimums is not None else [])
        mapped = [list(key_map(key, part)) for part in parts]
        for index, (name, codes) in enumerate(mapped[0]):
            scales = mapped[1][index][1]
            minimums = mapped[2][index][1] if len(mapped) > 2 else None
            ours[name.removesuffix(".weight")] = PackedBlocks(packed.weights, codes, scales, minimums)
    if tied and "embed_tokens" in ours:
        ours.setdefault("lm_head", ours["embed_tokens"])
    return ours


def load_hf_checkpoint(
    directory: Path,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    pe_cache: PECache | None = None,
) -> Transformer:
    """Load a single-file or sharded safetensors checkpoint of a supported family as our `Transformer`."""
    hf = json.loads((directory / _CONFIG_FILE).read_text())
    tensors: dict[str, torch.Tensor] = {}
    for shard in _weight_files(directory):
        with safe_open(str(shard), framework="pt") as opened:
            for key in opened.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                tensors[key] = opened.get_tensor(key)
    return build_hf_model(hf, tensors, device=device, dtype=dtype, pe_cache=pe_cache)


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


def _mapped(
    hf: Mapping[str, Any], key_map: KeyMap, key: str, tensor: torch.Tensor
) -> list[tuple[str, torch.Tensor]]:
    """`key_map`'s tensors for one of the checkpoint's, or a refusal naming the attention shape
    keys when a fused projection does not split as they say (torch's error names neither)."""
    try:
        return list(key_map(key, tensor))
    except RuntimeError as error:
        fields = ("d_model", "n_heads", "n_kv_heads", "head_dim")
        keys = dict.fromkeys(name for field in fields for name in config_keys(hf, field))
        raise UnsupportedCheckpointError(
            f"tensor {key!r} of shape {list(tensor.shape)} does not split as config key(s) "
            f"{', '.join(map(repr, keys))} say: {error}"
        ) from error


def _their_key(key: str) -> str:
    for ours, theirs in _LLAMA_NAMES:
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
