"""Our checkpoint format: `config.json` (`ModelConfig.to_dict()` plus `name`) and `model.safetensors`.

safetensors rather than pickle so that loading a checkpoint can never run code. A tied output
head is not stored twice: the file holds `embed_tokens.weight` only and tying restores the head.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from pe_runtime import PECache
from service.model.config import ModelConfig
from service.model.transformer import Transformer

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
_TIED_HEAD = "lm_head.weight"


def save_checkpoint(
    model: Transformer,
    directory: Path,
    *,
    name: str | None = None,
    dtype: torch.dtype | None = None,
    training: Mapping[str, Any] | None = None,
) -> None:
    """Write `model` to `directory` (created if needed), casting weights to `dtype` if given.

    `training` is the recipe block of a training-side zoo member (`training.extension`); it is
    stored beside the config as `"training"` and reported on the model's card as its method.
    """
    directory.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict() | {"name": name or directory.name}
    if training is not None:
        config["training"] = dict(training)
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    tensors = {
        key: (value if dtype is None else value.to(dtype)).detach().contiguous().cpu()
        for key, value in model.state_dict().items()
        if not (model.config.tie_embeddings and key == _TIED_HEAD)
    }
    weights = directory / WEIGHTS_FILE
    save_file(tensors, str(weights), metadata={"format": "pt"})
    # safetensors creates the file owner-only (0600); a server running as another user (the
    # container's non-root user reading a mounted models volume) must be able to read it.
    weights.chmod(0o644)


def is_checkpoint(directory: Path) -> bool:
    """True for a directory in our format (a Hugging Face config has `model_type` instead of `pe`)."""
    config_path = directory / CONFIG_FILE
    return config_path.is_file() and "pe" in json.loads(config_path.read_text())


def read_config(directory: Path) -> tuple[str, ModelConfig]:
    """The checkpoint's name and config."""
    data = json.loads((directory / CONFIG_FILE).read_text())
    return str(data.get("name") or directory.name), ModelConfig.from_dict(data)


def training_method(directory: Path) -> str | None:
    """The `"training"` block's method of a training-side zoo member; None for any other model."""
    training = json.loads((directory / CONFIG_FILE).read_text()).get("training")
    return str(training["method"]) if isinstance(training, dict) and "method" in training else None


def load_checkpoint(
    directory: Path,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    pe_cache: PECache | None = None,
) -> Transformer:
    """Rebuild the model from `directory`; every parameter must be present in the file."""
    _, config = read_config(directory)
    state = load_file(str(directory / WEIGHTS_FILE))
    return build_model(config, state, device=device, dtype=dtype, pe_cache=pe_cache)


def build_model(
    config: ModelConfig,
    state: dict[str, torch.Tensor],
    *,
    device: torch.device | str,
    dtype: torch.dtype,
    pe_cache: PECache | None,
) -> Transformer:
    """A model in eval mode with `state` loaded strictly (tied heads excepted), on device and dtype."""
    with torch.device("meta"):
        model = Transformer(config, pe_cache)
    if config.tie_embeddings:
        state = {key: value for key, value in state.items() if key != _TIED_HEAD}
        state[_TIED_HEAD] = state["embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    if config.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.to(device=device, dtype=dtype).eval()
