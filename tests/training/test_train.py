"""Training end to end on a tiny random corpus: checkpoint files, log, record, reproducibility."""

from __future__ import annotations

import csv
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from service.model.checkpoint import load_checkpoint, read_config
from training.corpus import Corpus
from training.recipe import Hyperparameters, zoo_model_config
from training.train import train

TINY = replace(
    Hyperparameters(), steps=3, batch_size=2, context=32, warmup_steps=1, eval_every=2, eval_windows=4
)


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    generator = torch.Generator().manual_seed(0)
    return Corpus(
        train=torch.randint(0, 256, (4096,), generator=generator),
        held_out=torch.randint(0, 256, (512,), generator=generator),
        train_files=("train.py",),
        held_out_files=("held_out.py",),
    )


def test_training_writes_a_loadable_bfloat16_checkpoint_and_its_record(
    tmp_path: Path, corpus: Corpus
) -> None:
    record = train("alibi", tmp_path, TINY, corpus)

    name, config = read_config(tmp_path)
    assert (name, config) == ("zoo-alibi", zoo_model_config("alibi"))
    weights = load_checkpoint(tmp_path, dtype=torch.bfloat16)
    assert sum(p.numel() for p in weights.parameters()) == record.parameters
    saved = json.loads((tmp_path / "training.json").read_text())
    assert saved["steps"] == 3 and saved["tokens"] == 3 * 2 * 32
    assert saved["final_held_out_bits_per_byte"] == record.final_held_out_bits_per_byte
    assert 0 < record.final_train_bits_per_byte < 10 and record.held_out_windows == 4
    with (tmp_path / "training_log.csv").open() as log_file:
        rows = list(csv.DictReader(log_file))
    assert [row["step"] for row in rows] == ["1", "2", "3"]
    assert [bool(row["held_out_bits_per_byte"]) for row in rows] == [False, True, True]


def test_training_is_deterministic_given_the_seed(tmp_path: Path, corpus: Corpus) -> None:
    first = train("rope", tmp_path / "a", TINY, corpus)
    second = train("rope", tmp_path / "b", TINY, corpus)
    other_seed = train("rope", tmp_path / "c", replace(TINY, seed=TINY.seed + 1), corpus)

    weights = [(tmp_path / run / "model.safetensors").read_bytes() for run in ("a", "b", "c")]
    assert weights[0] == weights[1] != weights[2]
    assert first.final_train_bits_per_byte == second.final_train_bits_per_byte
    assert other_seed.final_train_bits_per_byte != first.final_train_bits_per_byte
