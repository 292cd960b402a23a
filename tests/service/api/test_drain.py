"""SIGTERM drains: not ready, new work refused, the running request finishes, then exit 0."""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from tests.live_server import start_server
from tests.service.api.conftest import BASE_OPTIONS, SERVER_ENV
from tests.service.api.helpers import assert_error_shape, metric_value, wait_for

LONG_CONTEXT = 4096
# Long enough to still be running after the signal, short enough to finish within the grace time.
IN_FLIGHT = {"prompt": "a", "max_new_tokens": 1500, "temperature": 0}


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
            assert_error_shape(probe.post("/generate", json={"prompt": "a", "max_new_tokens": 1}), 503)
            assert probe.get("/healthz").status_code == 200
            finished = in_flight.result()
        assert finished.status_code == 200, finished.text
        body = finished.json()
        assert body["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == IN_FLIGHT["max_new_tokens"]
        assert server.wait() == 0
    finally:
        server.stop()
        server.log_path.unlink(missing_ok=True)
