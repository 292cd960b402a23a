"""`python -m bench.grpc_latency` end to end on a tiny checkpoint: one row per client, same tokens."""

from __future__ import annotations

import pytest

from bench.grpc_latency import main
from tests.conftest import TinyCheckpointFactory


def test_the_report_has_a_row_per_client(
    make_tiny_checkpoint: TinyCheckpointFactory, tmp_path_factory: pytest.TempPathFactory
) -> None:
    model_dir = make_tiny_checkpoint("rope", name="tiny-latency", eos_id=None)
    output = tmp_path_factory.mktemp("grpc-latency") / "grpc_latency.md"
    assert main(["--repeats", "2", "--model-dir", str(model_dir), "--output", str(output)]) == 0
    rows = [line for line in output.read_text().splitlines() if line.startswith("| ")][1:]
    assert [row.split("|")[1].strip().split()[0] for row in rows] == ["HTTP", "HTTP", "gRPC"]
    assert rows[0].split("|")[4].strip() == "+0.00"
