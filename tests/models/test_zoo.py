"""The bundled zoo: each checkpoint loads, has the recipe's config, and scores what it scored
when it was trained (a broken loader or a corrupted weight file shows up as a different score)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from service.model.checkpoint import WEIGHTS_FILE, load_checkpoint, read_config
from service.model.config import Scheme
from training.corpus import consecutive_windows, load_corpus
from training.evaluate import windows_bits_per_byte
from training.recipe import ZOO_SCHEMES, Hyperparameters, zoo_model_config
from training.train import windows_fingerprint

ZOO_DIR = Path(__file__).resolve().parents[2] / "models"
TOLERANCE_BITS = 0.05


@pytest.fixture(scope="module")
def held_out() -> torch.Tensor:
    return load_corpus().held_out


def training_record(scheme: str) -> dict[str, Any]:
    record: dict[str, Any] = json.loads((ZOO_DIR / f"zoo-{scheme}" / "training.json").read_text())
    return record


@pytest.mark.parametrize("scheme", ZOO_SCHEMES)
def test_checkpoint_has_the_recipe_config_and_bfloat16_weights(scheme: Scheme) -> None:
    directory = ZOO_DIR / f"zoo-{scheme}"
    name, config = read_config(directory)
    assert (name, config) == (f"zoo-{scheme}", zoo_model_config(scheme))
    with safe_open(str(directory / WEIGHTS_FILE), framework="pt") as weights:
        dtypes = {weights.get_slice(key).get_dtype() for key in weights.keys()}  # noqa: SIM118
    assert dtypes == {"BF16"}
    record = training_record(scheme)
    assert record["scheme"] == scheme
    assert (
        record["tokens"] == record["steps"] * record["hyperparameters"]["batch_size"] * config.native_context
    )


@pytest.mark.parametrize("scheme", ZOO_SCHEMES)
def test_held_out_bits_per_byte_match_the_training_record(scheme: str, held_out: torch.Tensor) -> None:
    record = training_record(scheme)
    hp = Hyperparameters(**record["hyperparameters"])
    windows = consecutive_windows(held_out, hp.context, hp.eval_windows)
    if windows_fingerprint(windows) != record["held_out_sha256"]:
        pytest.skip(
            f"this stdlib differs from the one zoo-{scheme} was scored on (Python {record['python_version']})"
        )
    bits = windows_bits_per_byte(load_checkpoint(ZOO_DIR / f"zoo-{scheme}"), windows)
    assert bits == pytest.approx(record["final_held_out_bits_per_byte"], abs=TOLERANCE_BITS)
