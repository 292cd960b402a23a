"""The engine process killed with SIGKILL under load: health turns not ready, and every request
caught in the window gets an answer a client can act on (`bench/blind_window.py` measures it)."""

from __future__ import annotations

import os
import signal
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from pe_client import ServiceUnavailableError
from pe_client.grpc import GrpcPEClient

from bench.blind_window import Call, kill_under_load
from tests.live_server import LiveServer, live_server
from tests.service.api.conftest import BASE_OPTIONS, SERVER_ENV
from tests.service.api.helpers import wait_for


@pytest.fixture(scope="module")
def killable(tiny_zoo: list[Path]) -> Iterator[LiveServer]:
    """One model; each test kills its engine once (the server restarts it up to three times)."""
    with live_server(tiny_zoo[:1], options=BASE_OPTIONS, env=SERVER_ENV) as server:
        yield server


def acceptable(call: Call) -> bool:
    """200 with a complete answer or a typed error event, or 503 + Retry-After to come back later."""
    if call.status == 200:
        return not call.stream or call.stream_end in ("[DONE]", "error event service_unavailable")
    return call.status == 503 and call.retry_after is not None and call.error_type == "service_unavailable"


def test_requests_caught_by_an_engine_kill_get_a_retryable_answer_and_health_turns(
    killable: LiveServer,
) -> None:
    record = kill_under_load(killable, clients=4)
    assert record.window_s(record.readyz) is not None, "/readyz never answered 503"
    assert record.window_s(record.grpc) is not None, "gRPC health never answered NOT_SERVING"
    caught = record.caught()
    assert caught
    refused = Counter(call.verdict() for call in caught if not acceptable(call))
    assert not refused, refused


def test_a_grpc_stream_cut_by_an_engine_kill_ends_with_a_retryable_typed_status(killable: LiveServer) -> None:
    """Through the SDK: the stream raises `ServiceUnavailableError` (UNAVAILABLE with pe-serve's
    error type and `retry-after`), not a connection error and not a short, complete-looking answer."""
    assert killable.grpc_target is not None
    wait_for(lambda: httpx.get(killable.url("/readyz")).status_code == 200, "the engine back")
    with (
        GrpcPEClient(killable.grpc_target, max_retries=0) as client,
        client.generate_stream(prompt="a", max_new_tokens=400, temperature=0) as stream,
    ):
        events = iter(stream)
        next(events)
        os.kill(killable.engine_pid(), signal.SIGKILL)
        with pytest.raises(ServiceUnavailableError) as cut:
            for _ in events:
                pass
    assert cut.value.grpc_code == "UNAVAILABLE"
    assert cut.value.type == "service_unavailable"
    assert cut.value.headers.get("retry-after") == "1"
