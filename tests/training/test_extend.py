"""The training-side recipes end to end on a tiny base model: one real step of each method."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from service.model.checkpoint import load_checkpoint, read_config, save_checkpoint
from service.model.config import ModelConfig
from service.model.transformer import Transformer
from training.corpus import Corpus
from training.extend import extend
from training.extension import METHODS, Method, recipe, rope_scaling

# Every stage runs exactly one step at this scale (a step count rounds up to at least one).
ONE_STEP_EACH = 0.001
TINY_ROPE = ModelConfig(d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, ffn_hidden=64, pe="rope")


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    """Random bytes, enough held-out for the fine-tunes' eight 1024-token score windows."""
    generator = torch.Generator().manual_seed(0)
    return Corpus(
        train=torch.randint(0, 256, (16384,), generator=generator),
        held_out=torch.randint(0, 256, (8 * 1024,), generator=generator),
        train_files=("train.py",),
        held_out_files=("held_out.py",),
    )


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory whose `zoo-rope` is a tiny random RoPE model, the fine-tunes' base."""
    directory = tmp_path_factory.mktemp("models")
    torch.manual_seed(0)
    save_checkpoint(Transformer(TINY_ROPE), directory / "zoo-rope", name="zoo-rope")
    return directory


def test_the_recipes_follow_the_spec() -> None:
    pi, yarn, pose, randpos = (recipe(method) for method in METHODS)
    for plan, rope_type in ((pi, "linear"), (yarn, "yarn")):
        assert plan.base == "zoo-rope" and plan.positions == "consecutive"
        assert [stage.context for stage in plan.stages] == [512, 1024]  # after the zoo's 256
        assert [stage.scaling["factor"] for stage in plan.stages if stage.scaling] == [2.0, 4.0]
        assert plan.scaling is not None and plan.scaling["rope_type"] == rope_type
        assert plan.eval_context == 1024 and rope_scaling(plan.scaling).factor == 4.0
    assert (pi.name, yarn.name, pose.name, randpos.name) == (
        "zoo-rope-pi4",
        "zoo-rope-yarn4",
        "zoo-rope-pose",
        "zoo-rope-randpos",
    )
    assert pi.steps == yarn.steps and pi.tokens == yarn.tokens
    assert pose.base == "zoo-rope" and [stage.context for stage in pose.stages] == [256]
    assert (pose.positions, pose.position_range) == ("pose", 1024)
    assert (randpos.base, randpos.scaling, randpos.positions, randpos.position_range) == (
        None,
        None,
        "randomized",
        4096,
    )


@pytest.mark.parametrize("method", METHODS)
def test_each_method_trains_and_saves_a_member_with_its_training_block(
    method: Method, corpus: Corpus, models_dir: Path, tmp_path: Path
) -> None:
    plan = recipe(method, scale=ONE_STEP_EACH)
    out = tmp_path / plan.name

    record = extend(plan, out, corpus, models_dir=models_dir, seed=0, command="test")

    saved = json.loads((out / "config.json").read_text())
    assert saved["training"] == {"method": method, "scaling": plan.scaling, "steps": plan.steps}
    name, config = read_config(out)
    assert name == plan.name and config.rope_scaling == plan.scaling
    # The saved model runs with the recipe's scaling when nobody names one.
    assert load_checkpoint(out).positions.default_scaling == rope_scaling(plan.scaling)
    with (out / "training_log.csv").open() as log_file:
        rows = list(csv.DictReader(log_file))
    trained = [row for row in rows if row["step"] != "0"]
    assert [int(row["step"]) for row in trained] == list(range(1, plan.steps + 1))
    assert [int(row["context"]) for row in trained] == [
        stage.context for stage in plan.stages for _ in range(stage.steps)
    ]
    assert trained[-1]["eval_bits_per_byte"] and record.steps == plan.steps
    assert 0 < record.final_eval_bits_per_byte < 12
    if plan.base is not None:  # a fine-tune starts from its base's score and moves its weights
        assert rows[0]["step"] == "0" and record.initial_eval_bits_per_byte is not None
        before = load_file(str(models_dir / "zoo-rope" / "model.safetensors"))
        after = load_file(str(out / "model.safetensors"))
        assert not torch.equal(before["embed_tokens.weight"].float(), after["embed_tokens.weight"].float())
    else:
        assert record.initial_eval_bits_per_byte is None


def test_explicit_position_ids_are_refused_where_they_would_be_wrong() -> None:
    """Only plain RoPE takes them, and only in a fresh pass (a cached one has its own positions)."""
    tokens = torch.zeros(1, 4, dtype=torch.long)
    positions = torch.tensor([[0, 5, 9, 12]])
    rope = Transformer(TINY_ROPE)
    assert rope(tokens, position_ids=positions).shape == (1, 4, TINY_ROPE.vocab_size)
    with pytest.raises(ValueError, match="fresh"):
        rope(tokens, position_ids=positions, cache=rope.new_cache(1, 16))
    alibi = Transformer(ModelConfig(d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, pe="alibi"))
    with pytest.raises(ValueError, match="'rope' scheme"):
        alibi(tokens, position_ids=positions)
