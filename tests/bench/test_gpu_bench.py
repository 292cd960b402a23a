"""The GPU benchmark's script end to end on a CPU (`--quick`, graphs uncaptured): it is meant to run
unattended on a lent GPU machine, so every part of it must have run before it gets there."""

from __future__ import annotations

import re
from pathlib import Path

from bench.gpu import main
from tests.conftest import TinyCheckpointFactory

NUMBER = r"\d+(?:\.\d+)?"


def test_quick_run_fills_both_tables(make_tiny_checkpoint: TinyCheckpointFactory, tmp_path: Path) -> None:
    model_dir = make_tiny_checkpoint("rope", name="tiny-gpu-bench")
    output = tmp_path / "gpu.md"
    argv = ["--device", "cpu", "--dtype", "float32", "--no-compile", "--quick"]
    assert main([*argv, "--model-dir", str(model_dir), "--output", str(output)]) == 0
    text = output.read_text()
    steps = text.split("## 1.", 1)[1].split("## 2.", 1)[0]
    header = next(line for line in steps.splitlines() if line.startswith("| batch"))
    assert "eager ms" in header and "CUDA graphs ms" in header and "`generate()` ms" in header
    for batch in (1, 2):  # --quick's batches: eager, graphs, generate(), then two ratios
        assert re.search(rf"^\| {batch} \|( {NUMBER} \|){{3}}( {NUMBER}x \|){{2}}$", steps, re.MULTILINE)
    assert re.search(rf"Goal at batch 1, at most 0.15 ms per step \(CUDA graphs\): {NUMBER} ms", steps)
    http = text.split("## 2.", 1)[1]
    assert "2 clients through HTTP" in http and "--device cpu --dtype float32 --no-compile" in http
    assert re.search(rf"^\| {NUMBER} \| {NUMBER} \| {NUMBER}x \|$", http, re.MULTILINE)
