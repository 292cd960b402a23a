"""The extrapolation benchmark on tiny checkpoints (native context 64) through a real engine."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from bench.extrapolation import (
    SETTINGS,
    Cell,
    Setting,
    markdown_table,
    plot,
    refusals,
    run,
    summarise,
)
from service.engine.engine import InferenceEngine

NATIVE = 64


@pytest.fixture(scope="module")
def engine(tiny_checkpoints: dict[str, Path]) -> Iterator[InferenceEngine]:
    engine = InferenceEngine.from_model_dirs(tiny_checkpoints.values(), device="cpu", max_context=4 * NATIVE)
    engine.start()
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def stream() -> torch.Tensor:
    return torch.randint(0, 256, (4 * NATIVE,), generator=torch.Generator().manual_seed(0))


def test_scaled_settings_stretch_by_length_over_native_context() -> None:
    yarn = Setting("rope", "yarn").rope_scaling(4 * NATIVE, NATIVE)
    assert (yarn.type, yarn.factor, yarn.original_max_position_embeddings) == ("yarn", 4.0, NATIVE)
    assert Setting("alibi", "none").rope_scaling(4 * NATIVE, NATIVE).type == "none"


def test_ablation_settings_carry_their_changes_into_the_scaling_and_the_label() -> None:
    yarn = Setting("rope", "yarn", overrides=(("beta_fast", 8.0),))
    ntk = Setting("rope", "ntk", factor_multiplier=4.0)
    assert yarn.rope_scaling(4 * NATIVE, NATIVE).beta_fast == 8.0
    assert ntk.rope_scaling(4 * NATIVE, NATIVE).factor == 16.0
    assert (yarn.label, ntk.label) == ("rope / yarn (beta_fast=8)", "rope / ntk (factor x4)")
    assert {yarn, ntk} <= set(SETTINGS)


def test_every_zoo_scheme_runs_unscaled_and_rope_runs_every_scaling() -> None:
    labels = {setting.label for setting in SETTINGS}
    assert {"rope / none", "alibi / none", "t5_bias / none", "nope / none", "learned / none"} <= labels
    assert {f"rope / {kind}" for kind in ("linear", "ntk", "dynamic", "yarn", "llama3")} <= labels
    assert {"sinusoidal / linear", "learned / linear"} <= labels


def test_tail_equals_all_positions_at_the_native_length(
    engine: InferenceEngine, stream: torch.Tensor
) -> None:
    cell = run(engine, stream, (NATIVE,))[Setting("rope", "none")][NATIVE]
    assert cell.tail_bits == pytest.approx(cell.all_bits)
    assert cell.tail_change == pytest.approx(0.0)
    assert cell.tail_bits is not None and 0 < cell.tail_bits < 16


def test_tails_are_paired_with_the_short_windows_holding_the_same_bytes() -> None:
    shortest = torch.tensor([[1.0] * 3, [2.0] * 3, [3.0] * 3, [4.0] * 3])  # four 4-byte windows
    cell = summarise(torch.full((2, 7), 5.0), shortest)  # two 8-byte windows: tails = short windows 1 and 3
    assert (cell.tail_bits, cell.all_bits, cell.tail_bits_short) == (5.0, 5.0, 3.0)
    assert cell.tail_change == 2.0
    assert summarise(torch.full((2, 7), 5.0), None).tail_change is None


def test_learned_positions_are_refused_past_their_table_and_the_report_says_so(
    engine: InferenceEngine, stream: torch.Tensor, tmp_path: Path
) -> None:
    lengths = (NATIVE, 2 * NATIVE)
    results = run(engine, stream, lengths)
    refused, interpolated = results[Setting("learned", "none")], results[Setting("learned", "linear")]
    assert refused[NATIVE].refusal is None and refused[2 * NATIVE].refusal is not None
    assert interpolated[2 * NATIVE].refusal is None and interpolated[2 * NATIVE].tail_change is not None
    assert "| learned / none | +0.000 | refused |" in markdown_table(
        results, lengths, "tail_change", signed=True
    )
    assert any("learned / none" in note and "128" in note for note in refusals(results))
    plot(results, lengths, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 10_000


def test_tables_format_each_cell_attribute() -> None:
    results = {Setting("alibi", "none"): {1: Cell(3.0, 3.0, 3.0), 2: Cell(3.25, 3.1, 3.0)}}
    assert markdown_table(results, (1, 2), "all_bits")[-1] == "| alibi / none | 3.000 | 3.100 |"
    assert (
        markdown_table(results, (1, 2), "tail_change", signed=True)[-1]
        == "| alibi / none | +0.000 | +0.250 |"
    )
