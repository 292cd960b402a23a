"""The extrapolation benchmark on tiny checkpoints (native context 64) through a real engine."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from bench.extrapolation import SETTINGS, Cell, Setting, markdown_table, measure, plot, refusals, run
from service.engine.engine import InferenceEngine
from training.corpus import consecutive_windows

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


def test_every_zoo_scheme_runs_unscaled_and_rope_runs_every_scaling() -> None:
    labels = {setting.label for setting in SETTINGS}
    assert {"rope / none", "alibi / none", "t5_bias / none", "nope / none", "learned / none"} <= labels
    assert {f"rope / {kind}" for kind in ("linear", "ntk", "dynamic", "yarn", "llama3")} <= labels
    assert {"sinusoidal / linear", "learned / linear"} <= labels


def test_tail_equals_all_positions_at_the_native_length(
    engine: InferenceEngine, stream: torch.Tensor
) -> None:
    cell = measure(engine, Setting("rope", "none"), consecutive_windows(stream, NATIVE))
    assert cell.tail_bits == pytest.approx(cell.all_bits)
    assert cell.tail_bits is not None and 0 < cell.tail_bits < 16


def test_learned_positions_are_refused_past_their_table_unless_interpolated(
    engine: InferenceEngine, stream: torch.Tensor
) -> None:
    windows = consecutive_windows(stream, 2 * NATIVE)
    refused = measure(engine, Setting("learned", "none"), windows)
    interpolated = measure(engine, Setting("learned", "linear"), windows)
    assert refused.refusal is not None and refused.tail_bits is None
    assert interpolated.refusal is None and interpolated.tail_bits is not None


def test_report_marks_refusals_and_the_plot_is_written(
    engine: InferenceEngine, stream: torch.Tensor, tmp_path: Path
) -> None:
    lengths = (NATIVE, 2 * NATIVE)
    results = run(engine, stream, lengths)
    learned = results[Setting("learned", "none")]
    assert learned[NATIVE].refusal is None and learned[2 * NATIVE].refusal is not None
    table = markdown_table(results, lengths, "tail_bits", change=True)
    assert "| learned / none | +0.000 | refused |" in table
    assert any("learned / none" in note and "128" in note for note in refusals(results))
    plot(results, lengths, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 10_000


def test_change_table_is_relative_to_the_first_length() -> None:
    results = {Setting("alibi", "none"): {1: Cell(3.0, 3.0), 2: Cell(3.25, 3.1)}}
    assert (
        markdown_table(results, (1, 2), "tail_bits", change=True)[-1] == "| alibi / none | +0.000 | +0.250 |"
    )
