"""The engine process killed with SIGKILL under load: health turns not ready, and every request
caught in the window gets an answer a client can act on (`bench/blind_window.py` measures it)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from bench.blind_window import Call, kill_under_load
from tests.live_server import live_server
from tests.service.api.conftest import BASE_OPTIONS, SERVER_ENV


def acceptable(call: Call) -> bool:
    """200 with a complete answer or a typed error event, or 503 + Retry-After to come back later."""
    if call.status == 200:
        return not call.stream or call.stream_end in ("[DONE]", "error event service_unavailable")
    return call.status == 503 and call.retry_after is not None and call.error_type == "service_unavailable"


def test_requests_caught_by_an_engine_kill_get_a_retryable_answer_and_health_turns(
    tiny_zoo: list[Path],
) -> None:
    with live_server(tiny_zoo[:1], options=BASE_OPTIONS, env=SERVER_ENV) as server:
        record = kill_under_load(server, clients=4)
    assert record.window_s(record.readyz) is not None, "/readyz never answered 503"
    assert record.window_s(record.grpc) is not None, "gRPC health never answered NOT_SERVING"
    caught = record.caught()
    assert caught
    refused = Counter(call.verdict() for call in caught if not acceptable(call))
    assert not refused, refused
