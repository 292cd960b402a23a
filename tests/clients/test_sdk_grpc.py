"""What only the gRPC client has: request ids chosen up front and `cancel()` (the Abort method), and
retries that the server answers from the one run of their request id.

Everything the two clients share is tested for both in test_sdk_live.py.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import httpx
import pytest
from pe_client import APIStatusError, StreamEnd, StreamToken
from pe_client.grpc import AsyncGrpcPEClient, GrpcPEClient
from pe_client.grpc._base import score_response

from tests.clients.conftest import API_KEY
from tests.clients.test_sdk_live import ENDLESS, running_requests, server_is_idle
from tests.live_server import LiveServer
from tests.service.api.helpers import metric_sum, metric_value, wait_for

SCORED = "def once(x):\n    return x + 1\n"


@pytest.fixture
def grpc_client(server: LiveServer) -> GrpcPEClient:
    return GrpcPEClient(server.grpc_target, api_key=API_KEY)


def test_a_stream_knows_its_request_id_before_it_starts(grpc_client: GrpcPEClient) -> None:
    with grpc_client:
        chosen = grpc_client.generate_stream(prompt="a", max_new_tokens=2, request_id="my-own-id")
        generated = grpc_client.generate_stream(prompt="a", max_new_tokens=2)
        assert chosen.request_id == "my-own-id" and generated.request_id.startswith("gen-")
        for stream in (chosen, generated):
            with stream:
                events = list(stream)
            assert isinstance(events[-1], StreamEnd) and events[-1].id == stream.request_id


def test_cancel_stops_a_running_stream_by_its_id(
    grpc_client: GrpcPEClient, server: LiveServer, metrics_http: httpx.Client
) -> None:
    with grpc_client, grpc_client.generate_stream(**ENDLESS) as stream:
        assert isinstance(next(stream), StreamToken)
        wait_for(lambda: running_requests(metrics_http) == 1, "the stream to run")
        with GrpcPEClient(server.grpc_target, api_key=API_KEY) as other:
            other.cancel(stream.request_id)
        with pytest.raises(APIStatusError) as caught:
            list(stream)
    assert caught.value.grpc_code == "CANCELLED" and caught.value.type == "request_cancelled"
    wait_for(lambda: server_is_idle(metrics_http), "the slot to be freed")


def test_the_async_client_cancels_too(server: LiveServer, metrics_http: httpx.Client) -> None:
    async def run() -> str | None:
        async with AsyncGrpcPEClient(server.grpc_target, api_key=API_KEY) as client:
            async with client.generate_stream(**ENDLESS) as stream:
                assert isinstance(await anext(stream), StreamToken)
                await client.cancel(stream.request_id)
                with pytest.raises(APIStatusError) as caught:
                    async for _ in stream:
                        pass
            return caught.value.grpc_code

    assert asyncio.run(run()) == "CANCELLED"
    wait_for(lambda: server_is_idle(metrics_http), "the slot to be freed")


class LostAnswer(grpc.RpcError):  # type: ignore[misc]  # grpc ships no types
    """What a connection dropped after the server answered looks like: UNAVAILABLE without
    pe-serve's metadata, which the SDK takes for a connection error and retries."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "connection reset after the server answered (simulated)"

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()


class LoseTheFirstAnswer(grpc.UnaryUnaryClientInterceptor):  # type: ignore[misc]  # grpc ships no types
    """Lets the first call reach the server and be answered, then drops its answer."""

    def __init__(self) -> None:
        self.lost: list[Any] = []

    def intercept_unary_unary(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        outcome = continuation(details, request)
        if not self.lost:
            self.lost.append(outcome.result())
            raise LostAnswer()
        return outcome


def rope_score_runs(metrics_http: httpx.Client) -> float:
    """PE-table lookups of the RoPE model: one scoring run adds the same number each time."""
    lookups = ("pe_cache_hits_total", "pe_cache_misses_total")
    return sum(metric_sum(metrics_http, name, 'kind="rope"') for name in lookups)


def test_a_retried_call_whose_answer_was_lost_gets_that_answer_from_the_one_run(
    grpc_client: GrpcPEClient, server: LiveServer, metrics_http: httpx.Client
) -> None:
    before = rope_score_runs(metrics_http)
    with grpc_client:
        grpc_client.score(prompt=SCORED)
    one_run = rope_score_runs(metrics_http) - before

    lose = LoseTheFirstAnswer()
    before = rope_score_runs(metrics_http)
    with grpc.insecure_channel(server.grpc_target) as channel:
        intercepted = grpc.intercept_channel(channel, lose)
        with GrpcPEClient(channel=intercepted, api_key=API_KEY, sleep=lambda _: None) as client:
            answer = client.score(prompt=SCORED)
    assert len(lose.lost) == 1 and answer == score_response(lose.lost[0])
    assert rope_score_runs(metrics_http) - before == one_run, "two attempts, one run"


def test_identical_calls_under_one_request_id_at_once_get_one_answer(
    grpc_client: GrpcPEClient, metrics_http: httpx.Client
) -> None:
    request_id = f"sdk-once-{uuid.uuid4().hex}"
    before = metric_value(metrics_http, "pe_serve_generated_tokens_total")
    with grpc_client, ThreadPoolExecutor(max_workers=2) as pool:
        answers = list(
            pool.map(
                lambda _: grpc_client.generate(
                    prompt="a", max_new_tokens=200, temperature=1.0, request_id=request_id
                ),
                range(2),
            )
        )
    assert answers[0] == answers[1] and answers[0].id == request_id
    generated = metric_value(metrics_http, "pe_serve_generated_tokens_total") - before
    assert generated == answers[0].usage.completion_tokens, "one run"
