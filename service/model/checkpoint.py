"""Our checkpoint format: `config.json` (`ModelConfig.to_dict()` plus `name`) and `model.safetensors`.

safetensors rather than pickle so that loading a checkpoint can never run code. A tied output
head is not stored twice: the file holds `embed_tokens.weight` only and tying restores the head.

Every model, ours or translated from another format, is built here, and weights that are not the
ones its config describes are refused before loading, with the config keys that set each wrong
shape under the checkpoint's own names (`Naming`), rather than as torch's "size mismatch".
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from pe_runtime import PECache
from service.model.config import ModelConfig
from service.model.hf_families import UnsupportedCheckpointError
from service.model.transformer import Transformer

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
_TIED_HEAD = "lm_head.weight"
# The config fields (`head_dim` included) that set each dimension of a parameter, by the end of
# its name, first match; a bias is its weight's first dimension.
_DIMENSION_FIELDS: tuple[tuple[re.Pattern[str], tuple[tuple[str, ...], ...]], ...] = tuple(
    (re.compile(pattern), dims)
    for pattern, dims in (
        (r"(embed_tokens|lm_head)\.(weight|bias)$", (("vocab_size",), ("d_model",))),
        (r"learned_table\.weight$", (("native_context",), ("d_model",))),
        (r"t5_table\.weight$", (("t5_num_buckets",), ("n_heads",))),
        (r"attn\.q_proj\.(weight|bias)$", (("n_heads", "head_dim"), ("d_model",))),
        (r"attn\.[kv]_proj\.(weight|bias)$", (("n_kv_heads", "head_dim"), ("d_model",))),
        (r"attn\.o_proj\.(weight|bias)$", (("d_model",), ("n_heads", "head_dim"))),
        (r"attn\.[qk]_norm\.weight$", (("head_dim",),)),
        (r"relative\.(key|value)_table$", (("shaw_max_distance",), ("head_dim",))),
        (r"relative\.[uv]$", (("n_heads",), ("head_dim",))),
        (r"relative\.r_proj\.weight$", (("n_heads", "head_dim"), ("d_model",))),
        (r"relative\.position_table$", (("cope_npos_max",), ("head_dim",))),
        (r"mlp\.(gate|up)_proj\.(weight|bias)$", (("ffn_hidden",), ("d_model",))),
        (r"mlp\.down_proj\.(weight|bias)$", (("d_model",), ("ffn_hidden",))),
        (r"norm\.(weight|bias)$", (("d_model",),)),
    )
)
_LAYER = re.compile(r"^layers\.(\d+)\.")
_SHOWN = 4  # problems spelled out in a refusal; the rest are counted


@dataclass(frozen=True)
class Naming:
    """How a checkpoint's own files name our tensors and our config fields (`head_dim` included),
    so that a refusal points at what to fix there: a Hugging Face tensor and config key, not ours."""

    tensor: Callable[[str], str]
    config_keys: Callable[[str], tuple[str, ...]]


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
    naming: Naming | None = None,
) -> Transformer:
    """A model in eval mode with `state` loaded strictly (tied heads excepted), on device and dtype.

    Weights that are not the ones `config` describes are an `UnsupportedCheckpointError` in the
    terms of `naming` (ours, i.e. `config.json`'s `ModelConfig` fields, by default)."""
    with torch.device("meta"):
        model = Transformer(config, pe_cache)
    expected = {key: value.shape for key, value in model.state_dict().items()}
    if config.tie_embeddings:
        state = {key: value for key, value in state.items() if key != _TIED_HEAD}
        del expected[_TIED_HEAD]
    _refuse_mismatches(
        expected, state, naming or Naming(str, functools.partial(_own_config_keys, config)), config.n_layers
    )
    if config.tie_embeddings:
        state[_TIED_HEAD] = state["embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    if config.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.to(device=device, dtype=dtype).eval()


def _refuse_mismatches(
    expected: Mapping[str, torch.Size], state: Mapping[str, torch.Tensor], naming: Naming, n_layers: int
) -> None:
    """Refuse `state` unless it holds exactly the `expected` tensors at their shapes, naming the
    config keys behind each difference (torch's own error names neither the file nor the key)."""
    keys: dict[str, None] = {}  # ordered, without repeats
    problems = []
    for name, want in expected.items():
        got = state[name].shape if name in state else want
        if got != want:
            named = [key for field in _differing_fields(name, want, got) for key in naming.config_keys(field)]
            keys.update(dict.fromkeys(named))
            source = ", ".join(named) or "the config"
            problems.append(f"{naming.tensor(name)!r} is {list(got)}, not the {list(want)} of {source}")
    held = 1 + max((layer for name in state if (layer := _layer(name)) is not None), default=-1)
    if held != n_layers:
        layer_keys = naming.config_keys("n_layers")
        keys.update(dict.fromkeys(layer_keys))
        problems.append(f"the weights hold {held} layers, not the {n_layers} of {', '.join(layer_keys)}")

    def within(name: str) -> bool:
        """Not in a layer that only one side has: those are the layer count's problem."""
        layer = _layer(name)
        return layer is None or layer < min(held, n_layers)

    problems += [f"the weights lack {name!r}" for name in expected if name not in state and within(name)]
    problems += [
        f"{naming.tensor(name)!r} is no tensor of this config"
        for name in state
        if name not in expected and within(name)
    ]
    if problems:
        about = f"config key(s) {', '.join(map(repr, keys))}" if keys else "the config"
        more = f" (and {len(problems) - _SHOWN} more)" if len(problems) > _SHOWN else ""
        raise UnsupportedCheckpointError(
            f"the weights disagree with {about}: {'; '.join(problems[:_SHOWN])}{more}"
        )


def _layer(name: str) -> int | None:
    match = _LAYER.match(name)
    return int(match[1]) if match else None


def _differing_fields(name: str, want: torch.Size, got: torch.Size) -> tuple[str, ...]:
    """The config fields that set the dimensions where `got` differs from `want`."""
    dims = next((dims for pattern, dims in _DIMENSION_FIELDS if pattern.search(name)), ())
    differing = [index for index in range(len(want)) if len(got) != len(want) or got[index] != want[index]]
    return tuple(dict.fromkeys(field for index in differing if index < len(dims) for field in dims[index]))


def _own_config_keys(config: ModelConfig, field: str) -> tuple[str, ...]:
    """Our `config.json` holds `ModelConfig`'s fields; its head_dim is derived unless overridden."""
    if field != "head_dim":
        return (field,)
    return ("head_dim_override",) if config.head_dim_override is not None else ("d_model", "n_heads")
