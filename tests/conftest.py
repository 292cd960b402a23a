"""Shared fixtures: tiny random-weight checkpoints written as real files, for any test package.

`make_tiny_checkpoint(scheme, *, name=None, seed=0, **config_overrides)` writes our checkpoint
format (`config.json` + `model.safetensors`) to a fresh directory under a session temp dir and
returns it; the model is called `name` (default `tiny-<scheme>`, also the directory's basename).
Identical arguments return the same directory, so calling it from many tests costs one write.
`tiny_checkpoints` maps every scheme to such a directory (model name `tiny-<scheme>`). Weights
are seeded, so outputs are reproducible across runs. Sizes are chosen to load and decode in
milliseconds on one CPU core, with a short native context (64) so requests can run past it in a
few tokens. `rope_scalings` gives one RoPE scaling of every type for such a model.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from pe_runtime import RopeScaling
from service.model.checkpoint import save_checkpoint
from service.model.config import SCHEMES, ModelConfig
from service.model.kv_cache import RowCache
from service.model.refresh import recompute_row, stale_rows
from service.model.transformer import Transformer

TINY_CONFIG: dict[str, Any] = {
    "d_model": 32,
    "n_layers": 2,
    "n_heads": 4,
    "n_kv_heads": 2,
    "ffn_hidden": 64,
    "native_context": 64,
}

TinyCheckpointFactory = Callable[..., Path]

# Random init (std 0.02) gives nearly uniform attention, so positions barely move the logits and a
# 1e-4 parity check would pass even with wrong positions. Scaling queries and keys up makes
# attention sharp enough that any positional mistake shows.
ATTENTION_GAIN = 8.0


def sharpen_attention(layers: Any, query_attr: str, key_attr: str) -> None:
    """Multiply every layer's query and key projections by `ATTENTION_GAIN`, in place."""
    with torch.no_grad():
        for layer in layers:
            getattr(layer, query_attr).weight.mul_(ATTENTION_GAIN)
            getattr(layer, key_attr).weight.mul_(ATTENTION_GAIN)


def tiny_transformer(*, seed: int = 0, **overrides: Any) -> Transformer:
    """A seeded random `Transformer` of `TINY_CONFIG` (plus overrides) with sharp attention."""
    torch.manual_seed(seed)
    model = Transformer(ModelConfig.from_dict(TINY_CONFIG | overrides))
    sharpen_attention([layer.attn for layer in model.layers], "q_proj", "k_proj")
    return model.eval()


def rope_scalings(original: int, rotary_dim: int) -> dict[str, RopeScaling]:
    """One scaling of every type, extending a model trained on `original` tokens 4x."""
    extension = {"factor": 4.0, "original_max_position_embeddings": original}
    pairs = rotary_dim // 2
    longrope = extension | {
        "short_factor": [1.0 + 0.5 * i for i in range(pairs)],
        "long_factor": [2.0 + i for i in range(pairs)],
    }
    specs: dict[str, dict[str, Any]] = {
        "none": {"rope_type": "default"},
        "linear": {"rope_type": "linear", "factor": 4.0},
        "ntk": {"rope_type": "ntk", "factor": 4.0},
        "dynamic": {"rope_type": "dynamic", **extension, "dynamic_mode": "bucketed"},
        "yarn": {"rope_type": "yarn", **extension},
        "llama3": {"rope_type": "llama3", **extension},
        "longrope": {"rope_type": "longrope", **longrope},
    }
    return {name: RopeScaling.from_hf(spec, max_position_embeddings=original) for name, spec in specs.items()}


def cached_forward(
    model: Transformer, tokens: torch.Tensor, scaling: RopeScaling | list[RopeScaling] | None, cache: RowCache
) -> torch.Tensor:
    """What the engine's batch does per pass: refresh rows whose table changed, then run the tokens."""
    rows = tokens.shape[0]
    scalings = scaling if isinstance(scaling, list) else [scaling or model.positions.default_scaling] * rows
    lengths = [past + tokens.shape[1] for past in cache.lengths]
    for row in stale_rows(model, cache, scalings, lengths):
        recompute_row(model, cache, row, scalings[row], lengths[row])
    logits: torch.Tensor = model(tokens, scaling=scalings, cache=cache)
    return logits


# Tiny models gain nothing from intra-op threads, and on CI's two shared cores threads only contend.
torch.set_num_threads(1)


def write_tiny_checkpoint(
    directory: Path, scheme: str, *, name: str | None = None, seed: int = 0, **overrides: Any
) -> Path:
    """A random-weight model of `scheme` saved to `directory`; overrides replace `TINY_CONFIG` fields.

    The model's name is `name`, or the directory's name.
    """
    save_checkpoint(tiny_transformer(seed=seed, pe=scheme, **overrides), directory, name=name)
    return directory


@pytest.fixture(scope="session")
def make_tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpointFactory:
    root = tmp_path_factory.mktemp("tiny-checkpoints")
    written: dict[str, Path] = {}

    def make(scheme: str = "rope", *, name: str | None = None, seed: int = 0, **overrides: Any) -> Path:
        key = json.dumps([scheme, name, seed, overrides], sort_keys=True)
        if key not in written:
            directory = root / str(len(written)) / (name or f"tiny-{scheme}")
            written[key] = write_tiny_checkpoint(directory, scheme, name=name, seed=seed, **overrides)
        return written[key]

    return make


@pytest.fixture(scope="session")
def tiny_checkpoints(make_tiny_checkpoint: TinyCheckpointFactory) -> dict[str, Path]:
    """One checkpoint per scheme, named `tiny-<scheme>`, RoPE first (so it loads as the default)."""
    order = ("rope", *(scheme for scheme in SCHEMES if scheme != "rope"))
    return {scheme: make_tiny_checkpoint(scheme, name=f"tiny-{scheme}") for scheme in order}
