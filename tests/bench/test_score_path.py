"""The `/score` path benchmark end to end: `--quick` with two real servers on a tiny checkpoint.

Both servers run this checkout here (the benchmark's baseline is another worktree in real runs), so
the report must show the same revision twice, every document's positions counted by /metrics,
and each table filled; the numbers are not checked for speed.
"""

from __future__ import annotations

import re

import pytest

from bench.score_path import main
from bench.serving import REPO_ROOT
from tests.conftest import TinyCheckpointFactory

NUMBER = r"\d+(?:\.\d+)?"


def test_the_quick_run_reports_both_servers_and_which_pass_scored(
    make_tiny_checkpoint: TinyCheckpointFactory, tmp_path_factory: pytest.TempPathFactory
) -> None:
    model_dir = make_tiny_checkpoint("rope", name="tiny-score-path")
    output = tmp_path_factory.mktemp("score-path") / "score_path.md"
    argv = [
        "--quick",
        "--baseline-root",
        str(REPO_ROOT),
        "--model-dir",
        str(model_dir),
        "--output",
        str(output),
    ]
    assert main(argv) == 0
    text = output.read_text()
    assert "--quick` run" in text
    # One warm-up and one repeat of /score alone and of the stall run with it: 4 documents of
    # 1,024 tokens per server, each position but the last run once.
    positions = 4 * 1023
    rows = re.findall(rf"\| (baseline|this) \| {NUMBER} \| {NUMBER} \| ({NUMBER}) / ({NUMBER}) \|", text)
    assert [side for side, _, _ in rows] == ["baseline", "this"]
    for _, on_c, on_eager in rows:
        assert float(on_c) + float(on_eager) == positions
    gaps = rf"\| (baseline|this) \| {NUMBER} \| {NUMBER} \| {NUMBER} \| {NUMBER} \| {NUMBER}x "
    assert len(re.findall(gaps, text)) == 2
    assert re.search(rf"scores {NUMBER}x the baseline's tok/s", text)
