"""Our checkpoint format round-trips exactly, and a RoPE model exports to a Llama directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from service.model.checkpoint import is_checkpoint, load_checkpoint, read_config, save_checkpoint
from service.model.config import SCHEMES, ModelConfig
from service.model.hf import export_llama, is_hf_checkpoint, load_hf_checkpoint
from service.model.transformer import Transformer
from tests.conftest import TINY_CONFIG

TOKENS = torch.randint(0, 258, (2, 24), generator=torch.Generator().manual_seed(0))


def tiny(**overrides: object) -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig.from_dict(TINY_CONFIG | overrides)).eval()


@pytest.mark.parametrize("scheme", SCHEMES)
@torch.inference_mode()
def test_round_trip_is_exact_for_every_scheme(tmp_path: Path, scheme: str) -> None:
    model = tiny(pe=scheme)
    save_checkpoint(model, tmp_path / "m", name="tiny")
    loaded = load_checkpoint(tmp_path / "m")
    assert torch.equal(model(TOKENS), loaded(TOKENS))
    assert read_config(tmp_path / "m") == ("tiny", model.config)


def test_files_are_readable_by_other_users(tmp_path: Path) -> None:
    save_checkpoint(tiny(), tmp_path)
    for path in tmp_path.iterdir():
        assert path.stat().st_mode & 0o044 == 0o044, path.name


def test_tied_head_is_stored_once_and_tied_again(tmp_path: Path) -> None:
    save_checkpoint(tiny(tie_embeddings=True), tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as tensors:
        assert "lm_head.weight" not in set(tensors.keys())
    loaded = load_checkpoint(tmp_path)
    assert loaded.lm_head.weight is loaded.embed_tokens.weight


def test_bfloat16_files_load_into_the_requested_dtype(tmp_path: Path) -> None:
    save_checkpoint(tiny(), tmp_path, dtype=torch.bfloat16)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as tensors:
        assert tensors.get_tensor("embed_tokens.weight").dtype == torch.bfloat16
    assert load_checkpoint(tmp_path, dtype=torch.float32).embed_tokens.weight.dtype == torch.float32


def test_config_json_is_the_config_plus_name(tmp_path: Path) -> None:
    model = tiny(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16})
    save_checkpoint(model, tmp_path / "zoo-rope")
    config = json.loads((tmp_path / "zoo-rope" / "config.json").read_text())
    assert config == model.config.to_dict() | {"name": "zoo-rope"}
    assert is_checkpoint(tmp_path / "zoo-rope") and not is_hf_checkpoint(tmp_path / "zoo-rope")


@pytest.mark.parametrize("tied", [False, True])
@torch.inference_mode()
def test_llama_export_loads_back_with_identical_logits(tmp_path: Path, tied: bool) -> None:
    model = tiny(tie_embeddings=tied, rope_scaling={"rope_type": "linear", "factor": 2.0})
    export_llama(model, tmp_path)
    assert is_hf_checkpoint(tmp_path) and not is_checkpoint(tmp_path)
    assert torch.equal(model(TOKENS), load_hf_checkpoint(tmp_path)(TOKENS))


def test_llama_export_refuses_models_llama_cannot_express(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="neox"):
        export_llama(tiny(pe="alibi"), tmp_path)
