"""The server process: a SIGTERM drain that lets running work finish, JSON logs, failed starts."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

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


def test_a_server_that_cannot_load_its_models_exits_non_zero(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-checkpoint"
    command = [
        sys.executable,
        "-m",
        "service",
        "--port",
        "0",
        "--grpc-port",
        "0",
        "--model-dir",
        str(missing),
    ]
    finished = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert finished.returncode == 1
    failure = next(
        json.loads(line) for line in finished.stderr.splitlines() if "model loading failed" in line
    )
    assert failure["level"] == "error" and str(missing) in failure["exc_info"]
