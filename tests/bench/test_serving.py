"""The serving benchmark end to end: `--quick` against a real server on a tiny checkpoint.

One run (a server subprocess, about 20 s on two cores) feeds every assertion about the report; the
numbers are not checked for speed, only that each section measured what it says it measured.
"""

from __future__ import annotations

import re
import shlex

import pytest
import torch

from bench.serving import QUICK, SCALING_NAMES, WorkItem, main, percentile, workload, workload_work
from tests.conftest import TinyCheckpointFactory

NATIVE = 64  # the tiny checkpoints' native context
NUMBER = r"-?\d+(?:\.\d+)?"


@pytest.fixture(scope="module")
def quick_report(
    make_tiny_checkpoint: TinyCheckpointFactory, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, list[str]]:
    model_dir = make_tiny_checkpoint("rope", name="tiny-serving")
    output = tmp_path_factory.mktemp("serving") / "serving.md"
    argv = ["--quick", "--no-compile", "--model-dir", str(model_dir), "--output", str(output)]
    assert main(argv) == 0
    return output.read_text(), argv


def table_rows(text: str, heading: str) -> list[list[str]]:
    """Cells of the data rows of the first table after `heading`."""
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    first_table = section.split("\n|", 1)[1].split("\n\n", 1)[0]
    rows = ["|" + line if index == 0 else line for index, line in enumerate(first_table.splitlines())]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows[2:]]


def test_percentile_interpolates_between_ranks() -> None:
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0], 100) == 2.0
    assert percentile([5.0], 99) == 5.0


def test_workload_is_seeded_in_range_and_cycles_every_scaling() -> None:
    items = workload(NATIVE, QUICK)
    assert items == workload(NATIVE, QUICK)
    assert len(items) == QUICK.workload_requests
    assert all(QUICK.workload_prompt[0] <= len(item.prompt) <= QUICK.workload_prompt[1] for item in items)
    assert all(QUICK.workload_new[0] <= item.max_new_tokens <= QUICK.workload_new[1] for item in items)
    assert [item.scaling["type"] for item in items[:6]] == list(SCALING_NAMES)
    work = workload_work(items, QUICK.reference_batch)
    assert work.useful_positions == sum(len(item.prompt) + item.max_new_tokens for item in items)
    assert work.useful_positions <= work.padded_positions
    assert work.useful_key_reads <= work.padded_key_reads
    assert work.fewest_steps == max(item.max_new_tokens for item in items) <= work.reference_steps


def test_work_of_one_padded_batch_counts_prefill_and_decode_reads() -> None:
    items = [WorkItem((1,) * 4, 2, {"type": "none"}), WorkItem((1,) * 2, 3, {"type": "none"})]
    work = workload_work(items, batch_size=2)
    assert (work.useful_positions, work.padded_positions) == (6 + 5, 2 * (4 + 3))
    assert work.useful_key_reads == (8 + 4 + 5) + (2 + 2 + 3 + 4)  # prompt^2 / 2, then one window per token
    assert work.padded_key_reads == 2 * (8 + 4 + 5 + 6)
    assert (work.fewest_steps, work.reference_steps) == (3, 3)


@pytest.mark.slow
def test_quick_report_names_the_run_and_has_every_section(quick_report: tuple[str, list[str]]) -> None:
    text, argv = quick_report
    assert f"Command: `{shlex.join(['python', '-m', 'bench.serving', *argv])}`" in text
    assert f"torch {torch.__version__}" in text and "CPUs" in text and "Date: " in text
    assert "--max-batch-size 64 --max-queue 0" in text and "`--quick` run" in text
    headings = re.findall(r"^## (\d)\. ", text, flags=re.MULTILINE)
    assert headings == ["1", "2", "3", "4", "5"]


@pytest.mark.slow
def test_serving_path_has_a_row_per_concurrency_with_four_throughputs_and_ratios(
    quick_report: tuple[str, list[str]],
) -> None:
    rows = table_rows(quick_report[0], "## 1. Serving-path cost")
    assert [int(row[0]) for row in rows] == list(QUICK.concurrency)
    for row in rows:
        http, engine, generate, to_engine, to_generate, httpx, httpx_to_engine = map(float, row[1:8])
        assert min(http, engine, generate, httpx) > 0
        # The ratios are medians of per-repeat ratios; with one repeat they are the plain ratio.
        assert to_engine == pytest.approx(http / engine, abs=0.02)
        assert to_generate == pytest.approx(http / generate, abs=0.02)
        assert httpx_to_engine == pytest.approx(httpx / engine, abs=0.02)


@pytest.mark.slow
def test_long_dynamic_generation_finished_past_the_native_context(
    quick_report: tuple[str, list[str]],
) -> None:
    text = quick_report[0]
    total = QUICK.longest_prompt + QUICK.longest_new
    assert total > NATIVE
    assert f"({total} in all, server `--max-context 4096`" in text
    assert f"finished (`finish_reason` length, {QUICK.longest_new} tokens)" in text
    assert re.search(rf"dynamic / yarn: {NUMBER}x per decoded token", text)
    assert [row[0] for row in table_rows(text, "## 2.")] == ["dynamic", "yarn"]


@pytest.mark.slow
def test_stalls_count_every_gap_and_the_long_requests_overlapped_the_streams(
    quick_report: tuple[str, list[str]],
) -> None:
    rows = table_rows(quick_report[0], "## 3. Stalls")
    assert len(rows) == 3 and "alone" in rows[0][0] and "/score" in rows[1][0] and "/generate" in rows[2][0]
    gaps = QUICK.stream_clients * (QUICK.stream_new - 1)
    for row in rows:
        assert int(row[1]) == gaps
        p50, p99, worst = (float(cell) for cell in row[2:5])
        assert 0 <= p50 <= p99 <= worst and worst > 0
    assert rows[0][6] == "-" and float(rows[1][6]) > 0 and float(rows[2][6]) > 0
    assert re.search(rf"Worst max / p99-alone: {NUMBER}x, goal ", quick_report[0])


@pytest.mark.slow
def test_workload_reports_both_servers_and_the_padding_it_costs(quick_report: tuple[str, list[str]]) -> None:
    text = quick_report[0]
    rows = table_rows(text, "## 4. Realistic workload")
    assert len(rows) == 2 and "--max-batch-size 64" in rows[0][0] and "batches of 4" in rows[1][0]
    for row in rows:
        makespan, p50, p99 = (float(cell) for cell in row[1:4])
        assert 0 < p50 <= p99 <= makespan + 0.01
    work = workload_work(workload(NATIVE, QUICK), QUICK.reference_batch)
    assert (
        f"| token positions (projections, MLP) | {work.useful_positions} | {work.padded_positions} |" in text
    )
    assert re.search(
        rf"\| sequential decode passes \(at least\) \| {work.fewest_steps} \| {work.reference_steps} \|", text
    )
    assert re.search(rf"makespan generate\(\) / ours: {NUMBER}x", text)
    assert "unscaled export" in text


@pytest.mark.slow
def test_mixed_scalings_compare_uniform_and_mixed(quick_report: tuple[str, list[str]]) -> None:
    text = quick_report[0]
    rows = table_rows(text, "## 5. Mixed scalings")
    assert [row[0] for row in rows] == ["uniform", "mixed"]
    assert all(float(row[1]) > 0 for row in rows)
    assert re.search(rf"Mixed costs [+-]{NUMBER}% \(goal <= 5%: ", text)
