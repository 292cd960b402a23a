"""A cancelled stream, an expired deadline and `Abort` each free the batch slot; other requests go on.

Each case runs a long gRPC generation beside a short HTTP one: the short one gives the same answer
as alone, the long one is stopped, and `pe_serve_batch_size` returns to 0.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import httpx
import pytest

from service.grpc_api import pe_serve_pb2 as pb
from tests.live_server import LiveServer
from tests.service.api.conftest import MAX_CONTEXT, model_name
from tests.service.api.helpers import metric_sum, metric_value, wait_for
from tests.service.grpc.helpers import assert_status, raw_call, stream

# On a model the C step cannot run (its attention is its own), so that the long request takes
# seconds, not the fraction of one the tiny models' C steps need for 500 tokens.
LONG = {"model": model_name("shaw"), "prompt": "a", "max_new_tokens": MAX_CONTEXT - 8, "temperature": 0.0}
SHORT = {"prompt": "def f():", "max_new_tokens": 16, "temperature": 0.0}
DEADLINE_S = 0.5  # far shorter than LONG takes


def batch_size(client: httpx.Client) -> float:
    return metric_value(client, "pe_serve_batch_size")


def cancel_the_call(channel: grpc.Channel, call: Any, request_id: str) -> None:
    call.cancel()


def abort_by_id(channel: grpc.Channel, call: Any, request_id: str) -> None:
    raw_call(channel, "Abort")(pb.AbortRequest(request_id=request_id).SerializeToString(), timeout=10)


STOPS: dict[str, tuple[Callable[[grpc.Channel, Any, str], None], grpc.StatusCode]] = {
    "client cancel": (cancel_the_call, grpc.StatusCode.CANCELLED),
    "abort": (abort_by_id, grpc.StatusCode.CANCELLED),
}


@pytest.mark.parametrize("how", list(STOPS))
def test_a_stopped_stream_frees_its_slot(grpc_channel: grpc.Channel, client: httpx.Client, how: str) -> None:
    alone = client.post("/generate", json=SHORT).json()
    stop, code = STOPS[how]
    request_id = f"stop-{how.replace(' ', '-')}"
    call = stream(grpc_channel, {**LONG, "request_id": request_id}, timeout=60)
    first = next(call)
    assert first.HasField("token")
    wait_for(lambda: batch_size(client) == 1, "the long generation to run")
    beside = client.post("/generate", json=SHORT).json()
    stop(grpc_channel, call, request_id)
    with pytest.raises(grpc.RpcError) as caught:
        for _ in call:
            pass
    assert caught.value.code() is code
    wait_for(lambda: batch_size(client) == 0, "the slot to be freed")
    assert beside["tokens"] == alone["tokens"]
    assert client.post("/generate", json=SHORT).json()["tokens"] == alone["tokens"]


def test_abort_ends_the_stream_with_cancelled_and_names_abort(
    grpc_channel: grpc.Channel, client: httpx.Client
) -> None:
    call = stream(grpc_channel, {**LONG, "request_id": "abort-named"}, timeout=60)
    next(call)
    abort_by_id(grpc_channel, call, "abort-named")
    with pytest.raises(grpc.RpcError) as caught:
        list(call)
    metadata = assert_status(caught.value, grpc.StatusCode.CANCELLED)
    assert "Abort" in (caught.value.details() or "") and metadata["x-request-id"] == "abort-named"
    wait_for(lambda: batch_size(client) == 0, "the slot to be freed")


def test_aborting_an_unknown_id_is_not_found(grpc_channel: grpc.Channel) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        abort_by_id(grpc_channel, None, "no-such-request")
    assert_status(caught.value, grpc.StatusCode.NOT_FOUND, "request_id")


def test_an_expired_deadline_frees_the_slot(grpc_channel: grpc.Channel, client: httpx.Client) -> None:
    """The call is running (its first token came) when its deadline passes."""
    alone = client.post("/generate", json=SHORT).json()
    expired_before = metric_sum(client, "pe_serve_requests_total", 'status="DEADLINE_EXCEEDED"')
    call = stream(grpc_channel, LONG, timeout=DEADLINE_S)
    assert next(call).HasField("token")
    beside = client.post("/generate", json=SHORT).json()
    with pytest.raises(grpc.RpcError) as caught:
        list(call)
    assert caught.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    assert beside["tokens"] == alone["tokens"]
    wait_for(lambda: batch_size(client) == 0, "the slot to be freed")
    wait_for(
        lambda: (
            metric_sum(client, "pe_serve_requests_total", 'status="DEADLINE_EXCEEDED"') == expired_before + 1
        ),
        "the server to count the expired call",
    )


def test_a_running_request_id_with_another_body_is_refused(
    grpc_channel: grpc.Channel, client: httpx.Client
) -> None:
    running: Iterator[pb.GenerateResponse] = stream(grpc_channel, {**LONG, "request_id": "twice"}, timeout=60)
    next(running)
    with pytest.raises(grpc.RpcError) as caught:
        list(stream(grpc_channel, {**SHORT, "request_id": "twice"}, timeout=30))
    assert_status(caught.value, grpc.StatusCode.INVALID_ARGUMENT, "request_id")
    running.cancel()  # type: ignore[attr-defined]
    wait_for(lambda: batch_size(client) == 0, "the slot to be freed")


# The client's receive window for the next test: about 30 token messages, which the tiny model fills
# in well under a second once the client stops reading.
SMALL_WINDOW = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]


def test_a_stream_cancelled_while_the_server_waits_to_send_counts_as_cancelled(
    server: LiveServer, client: httpx.Client
) -> None:
    """With the client's window full, the server's stream waits in its `yield` when the cancel comes;
    grpc then closes the generator (GeneratorExit) instead of cancelling a wait (CancelledError),
    and that must be counted as a cancelled call too, not as one that succeeded."""
    assert server.grpc_target is not None
    cancelled_before = metric_sum(client, "pe_serve_requests_total", 'status="CANCELLED"')
    with grpc.insecure_channel(server.grpc_target, options=SMALL_WINDOW) as channel:
        call = stream(channel, LONG, timeout=60)
        assert next(call).HasField("token")
        time.sleep(1.0)  # the server fills the window and blocks in its send (it cannot fail the test)
        call.cancel()  # type: ignore[attr-defined]
    wait_for(lambda: batch_size(client) == 0, "the slot to be freed")
    wait_for(
        lambda: metric_sum(client, "pe_serve_requests_total", 'status="CANCELLED"') == cancelled_before + 1,
        "the server to count the cancelled call",
    )
