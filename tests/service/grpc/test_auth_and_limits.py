"""A server with an API key, one batch slot, one queue place and a small message limit, over gRPC.

The key is read from `authorization: Bearer` metadata (health and reflection stay open, as
`/healthz` does); a full queue is RESOURCE_EXHAUSTED with `retry-after`; a message over the limit
is RESOURCE_EXHAUSTED from gRPC itself. Requests of both protocols are counted in the same
metric families, told apart by their `protocol` label.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service.grpc_api import pe_serve_pb2 as pb
from tests.live_server import LiveServer, live_server
from tests.service.api.conftest import BASE_OPTIONS, SERVER_ENV
from tests.service.api.helpers import metric_sum, metric_value, wait_for
from tests.service.grpc.helpers import SERVICE, assert_status, generate, raw_call, stream

API_KEY = "grpc-test-key"
MAX_MESSAGE_BYTES = 4096
ENDLESS = {"prompt": "a", "max_new_tokens": 400, "temperature": 0.0}
GOOD_KEY = (("authorization", f"Bearer {API_KEY}"),)


@pytest.fixture(scope="module")
def guarded(tiny_zoo: list[Path]) -> Iterator[LiveServer]:
    options = {
        **BASE_OPTIONS,
        "api_key": API_KEY,
        "max_batch_size": 1,
        "max_queue": 1,
        "max_body_bytes": MAX_MESSAGE_BYTES,
    }
    with live_server(tiny_zoo[:1], options=options, env=SERVER_ENV) as running:
        yield running


@pytest.fixture
def channel(guarded: LiveServer) -> Iterator[grpc.Channel]:
    assert guarded.grpc_target is not None
    with grpc.insecure_channel(guarded.grpc_target) as opened:
        yield opened


@pytest.fixture
def metrics(guarded: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=guarded.base_url, timeout=10.0) as http:
        yield http


def list_models(channel: grpc.Channel, metadata: tuple[tuple[str, str], ...]) -> pb.ListModelsResponse:
    response: pb.ListModelsResponse = raw_call(channel, "ListModels")(b"", metadata=metadata, timeout=10)
    return response


@pytest.mark.parametrize(
    "metadata", [(), (("authorization", "Bearer wrong"),), (("authorization", API_KEY),)]
)
def test_a_missing_or_wrong_key_is_unauthenticated(
    channel: grpc.Channel, metadata: tuple[tuple[str, str], ...]
) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        list_models(channel, metadata)
    assert_status(caught.value, grpc.StatusCode.UNAUTHENTICATED)


def test_the_key_opens_every_method_and_health_stays_open(channel: grpc.Channel) -> None:
    assert [card.name for card in list_models(channel, GOOD_KEY).models] == ["tiny-rope"]
    assert generate(channel, {"prompt": "a", "max_new_tokens": 2}, metadata=GOOD_KEY, timeout=30)
    check = health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=SERVICE), timeout=10
    )
    assert check.status == health_pb2.HealthCheckResponse.SERVING


def test_a_message_over_the_limit_is_resource_exhausted(channel: grpc.Channel) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        generate(channel, {"prompt": "a" * (MAX_MESSAGE_BYTES + 1)}, metadata=GOOD_KEY, timeout=30)
    assert caught.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED


def test_a_full_queue_is_resource_exhausted_with_retry_after(
    channel: grpc.Channel, metrics: httpx.Client
) -> None:
    running = stream(channel, ENDLESS, metadata=GOOD_KEY, timeout=60)
    next(running)
    queued = stream(channel, ENDLESS, metadata=GOOD_KEY, timeout=60)
    wait_for(lambda: metric_value(metrics, "pe_serve_queue_depth") == 1, "the second request to queue")
    try:
        with pytest.raises(grpc.RpcError) as caught:
            generate(channel, {"prompt": "a", "max_new_tokens": 1}, metadata=GOOD_KEY, timeout=30)
        metadata = assert_status(caught.value, grpc.StatusCode.RESOURCE_EXHAUSTED)
        assert float(metadata["retry-after"]) >= 1
    finally:
        for call in (queued, running):
            call.cancel()  # type: ignore[attr-defined]
    wait_for(
        lambda: (
            metric_value(metrics, "pe_serve_batch_size") == 0
            and metric_value(metrics, "pe_serve_queue_depth") == 0
        ),
        "the calls to be cancelled",
    )


def test_both_protocols_are_counted_in_the_same_families(
    channel: grpc.Channel, metrics: httpx.Client
) -> None:
    generate(channel, {"prompt": "a", "max_new_tokens": 1}, metadata=GOOD_KEY, timeout=30)
    endpoint = f'endpoint="/{SERVICE}/Generate"'
    assert metric_sum(metrics, "pe_serve_requests_total", 'protocol="grpc"') > 0
    assert metric_sum(metrics, "pe_serve_requests_total", endpoint) > 0
    assert metric_sum(metrics, "pe_serve_request_duration_seconds_count", 'protocol="grpc"') > 0
    assert metric_sum(metrics, "pe_serve_requests_total", 'protocol="http"') > 0
