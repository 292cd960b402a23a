"""The server process: a SIGTERM drain that lets running work finish, JSON logs, failed starts."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.live_server import REPO_ROOT, start_server
from tests.service.api.conftest import BASE_OPTIONS, SERVER_ENV
from tests.service.api.helpers import assert_error_shape, metric_value, wait_for

LONG_CONTEXT = 4096
# Long enough to still be running after the signal, short enough to finish within the grace time.
IN_FLIGHT = {"prompt": "a", "max_new_tokens": 1000, "temperature": 0}
PROBE_ID = {"X-Request-ID": "refused-while-draining"}


def test_sigterm_lets_the_running_request_finish_and_exits_zero(tiny_zoo: list[Path]) -> None:
    options = {**BASE_OPTIONS, "max_context": LONG_CONTEXT, "drain_timeout": 120}
    server = start_server(tiny_zoo[:1], options=options, env=SERVER_ENV)
    try:
        with (
            httpx.Client(base_url=server.base_url, timeout=120.0) as waiting,
            httpx.Client(base_url=server.base_url, timeout=10.0) as probe,
            ThreadPoolExecutor(max_workers=1) as pool,
        ):
            in_flight = pool.submit(waiting.post, "/generate", json=IN_FLIGHT)
            wait_for(lambda: metric_value(probe, "pe_serve_batch_size") == 1, "the request to run")
            server.send_signal(signal.SIGTERM)
            wait_for(lambda: probe.get("/readyz").status_code == 503, "readyz to turn 503")
            assert_error_shape(probe.get("/readyz"), 503)
            refused = probe.post("/generate", json={"prompt": "a", "max_new_tokens": 1}, headers=PROBE_ID)
            assert_error_shape(refused, 503)
            assert probe.get("/healthz").status_code == 200
            finished = in_flight.result()
        assert finished.status_code == 200, finished.text
        body = finished.json()
        assert body["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == IN_FLIGHT["max_new_tokens"]
        assert server.wait() == 0
        access_lines = [
            json.loads(line) for line in server.logs().splitlines() if PROBE_ID["X-Request-ID"] in line
        ]
        assert {
            "request_id": PROBE_ID["X-Request-ID"],
            "path": "/generate",
            "status": 503,
        }.items() <= access_lines[0].items()
    finally:
        server.stop()
        server.log_path.unlink(missing_ok=True)


def _missing(directory: Path) -> None:
    """Nothing at the path."""


def _config_not_json(directory: Path) -> None:
    (directory / "config.json").write_text("{not json")


def _truncated_weights(directory: Path) -> None:
    weights = directory / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])


def _hf_without_tokenizer(directory: Path) -> None:
    (directory / "config.json").write_text(json.dumps({"model_type": "llama"}))


BAD_STARTS = {
    "missing": _missing,
    "config not JSON": _config_not_json,
    "truncated weights": _truncated_weights,
    "HF without tokenizer": _hf_without_tokenizer,
}


@pytest.mark.parametrize("spoil", BAD_STARTS.values(), ids=list(BAD_STARTS))
def test_a_bad_model_directory_is_named_in_one_line_and_exits_one(
    tiny_zoo: list[Path], tmp_path: Path, spoil: Callable[[Path], None]
) -> None:
    directory = tmp_path / "bad-model"
    if spoil is not _missing:
        shutil.copytree(tiny_zoo[0], directory)
    spoil(directory)
    command = [
        sys.executable,
        "-m",
        "service",
        "--port",
        "0",
        "--grpc-port",
        "0",
        "--model-dir",
        str(directory),
    ]
    finished = subprocess.run(
        command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, env={**os.environ, **SERVER_ENV}
    )
    assert finished.returncode == 1
    lines = [json.loads(line) for line in finished.stderr.splitlines() if line.startswith("{")]
    errors = [line for line in lines if line["level"] == "error"]
    assert len(errors) == 1, finished.stderr
    assert errors[0]["message"].startswith("model loading failed: ")
    assert str(directory) in errors[0]["message"]
    assert "Traceback" not in finished.stderr
