"""The bundled training-side members: each carries its recipe's `"training"` block and default
scaling, holds bfloat16 weights, and scores what it scored when it was trained."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from safetensors import safe_open

from service.model.checkpoint import WEIGHTS_FILE, load_checkpoint, read_config
from training.corpus import consecutive_windows, load_corpus
from training.evaluate import windows_bits_per_byte
from training.extension import METHODS, Method, recipe, rope_scaling
from training.recipe import zoo_model_config
from training.train import windows_fingerprint

ZOO_DIR = Path(__file__).resolve().parents[2] / "models"
TOLERANCE_BITS = 0.05


def record_of(directory: Path) -> dict[str, Any]:
    record: dict[str, Any] = json.loads((directory / "training.json").read_text())
    return record


@pytest.mark.parametrize("method", METHODS)
def test_member_has_its_recipe_block_scaling_and_bfloat16_weights(method: Method) -> None:
    plan = recipe(method)
    directory = ZOO_DIR / plan.name
    name, config = read_config(directory)
    assert name == plan.name
    assert config == replace(zoo_model_config("rope"), rope_scaling=plan.scaling)
    assert json.loads((directory / "config.json").read_text())["training"] == plan.training_block()
    with safe_open(str(directory / WEIGHTS_FILE), framework="pt") as weights:
        assert {weights.get_slice(key).get_dtype() for key in weights.keys()} == {"BF16"}  # noqa: SIM118
    record = record_of(directory)
    assert (record["method"], record["steps"], record["tokens"]) == (method, plan.steps, plan.tokens)


@pytest.mark.parametrize("method", METHODS)
def test_member_scores_what_its_training_record_says(method: Method) -> None:
    plan = recipe(method)
    record = record_of(ZOO_DIR / plan.name)
    windows = consecutive_windows(load_corpus().held_out, record["eval_context"], record["eval_windows"])
    if windows_fingerprint(windows) != record["eval_sha256"]:
        pytest.skip(f"this stdlib differs from the one {plan.name} was scored on")
    model = load_checkpoint(ZOO_DIR / plan.name)
    assert model.positions.default_scaling == rope_scaling(plan.scaling)
    bits = windows_bits_per_byte(model, windows)  # no scaling given: the member's own default
    assert bits == pytest.approx(record["final_eval_bits_per_byte"], abs=TOLERANCE_BITS)
