"""Weights whose shapes are not the config's: loaded as transformers loads them, or refused by key.

transformers' MPT builds a 4 x d_model MLP whatever `expansion_ratio` says, so a directory it saved
with another ratio holds 4x weights under a config that claims otherwise: we load what transformers
runs and log the disagreement. Any other shape the config contradicts is refused before loading,
with the config key to fix, at start-up too, never as torch's raw "size mismatch".
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tokenizers import Tokenizer, models  # noqa: E402

from service.engine.engine import load_models  # noqa: E402
from service.engine.errors import ModelLoadError  # noqa: E402
from service.model.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from service.model.config import ModelConfig  # noqa: E402
from service.model.hf import UnsupportedCheckpointError, load_hf_checkpoint  # noqa: E402
from service.model.transformer import Transformer  # noqa: E402

VOCAB = 96
LLAMA = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def save(directory: Path, config: Any, model_class: str) -> Any:
    """A tiny random model written by `save_pretrained`, as a Hub checkpoint's files are."""
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).eval()
    model.save_pretrained(directory)
    return model


def edit_config(directory: Path, **changes: Any) -> None:
    path = directory / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))


def test_mpt_with_expansion_ratio_loads_as_transformers_runs_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = transformers.MptConfig(vocab_size=VOCAB, d_model=36, n_layers=2, n_heads=6, expansion_ratio=2)
    reference = save(tmp_path, config, "MptForCausalLM")
    assert json.loads((tmp_path / "config.json").read_text())["expansion_ratio"] == 2
    with caplog.at_level(logging.WARNING, logger="service.model.hf_families"):
        ours = load_hf_checkpoint(tmp_path)
    assert ours.config.ffn_hidden == 4 * 36
    assert any("expansion_ratio" in record.getMessage() for record in caplog.records)
    tokens = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        assert (ours(tokens) - reference(tokens).logits).abs().max().item() <= 1e-4


def test_mpt_whose_config_agrees_logs_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    config = transformers.MptConfig(vocab_size=VOCAB, d_model=36, n_layers=2, n_heads=6)
    save(tmp_path, config, "MptForCausalLM")
    with caplog.at_level(logging.WARNING, logger="service.model.hf_families"):
        load_hf_checkpoint(tmp_path)
    assert not caplog.records


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("intermediate_size", 48),
        ("hidden_size", 48),
        ("num_attention_heads", 8),
        ("num_key_value_heads", 4),
        ("vocab_size", 100),
        ("num_hidden_layers", 3),
    ],
)
def test_llama_whose_config_contradicts_its_weights_is_refused_by_key(
    tmp_path: Path, key: str, value: int
) -> None:
    save(tmp_path, transformers.LlamaConfig(**LLAMA), "LlamaForCausalLM")
    edit_config(tmp_path, **{key: value})
    with pytest.raises(UnsupportedCheckpointError, match=rf"config key\(s\) [^:]*'{key}'") as refused:
        load_hf_checkpoint(tmp_path)
    assert "size mismatch" not in str(refused.value)


def test_fused_projection_that_does_not_split_is_refused_by_key(tmp_path: Path) -> None:
    """Phi-3's fused qkv is split by the config's head counts before any shape is compared."""
    save(tmp_path, transformers.Phi3Config(**LLAMA, pad_token_id=0), "Phi3ForCausalLM")
    edit_config(tmp_path, num_key_value_heads=4)
    with pytest.raises(
        UnsupportedCheckpointError,
        match=r"'model\.layers\.0\.self_attn\.qkv_proj\.weight'.*'num_key_value_heads'",
    ):
        load_hf_checkpoint(tmp_path)


def test_start_up_refuses_the_checkpoint_with_the_key(tmp_path: Path) -> None:
    save(tmp_path, transformers.LlamaConfig(**LLAMA), "LlamaForCausalLM")
    Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0")).save(
        str(tmp_path / "tokenizer.json")
    )
    edit_config(tmp_path, intermediate_size=48)
    with pytest.raises(ModelLoadError, match=r"UnsupportedCheckpointError: .*'intermediate_size'") as refused:
        load_models([tmp_path], device="cpu", dtype="float32")
    assert isinstance(refused.value.__cause__, UnsupportedCheckpointError)


def test_own_checkpoint_whose_config_contradicts_its_weights_is_refused_by_field(tmp_path: Path) -> None:
    config = ModelConfig(d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_hidden=64)
    save_checkpoint(Transformer(config), tmp_path)
    edit_config(tmp_path, ffn_hidden=48)
    with pytest.raises(UnsupportedCheckpointError, match=r"config key\(s\) 'ffn_hidden':.*'layers\.0\.mlp"):
        load_checkpoint(tmp_path)
