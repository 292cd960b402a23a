"""What only the gRPC client has: request ids chosen up front and `cancel()` (the Abort method).

Everything the two clients share is tested for both in test_sdk_live.py.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from pe_client import APIStatusError, StreamEnd, StreamToken
from pe_client.grpc import AsyncGrpcPEClient, GrpcPEClient

from tests.clients.conftest import API_KEY
from tests.clients.test_sdk_live import ENDLESS, running_requests, server_is_idle
from tests.live_server import LiveServer
from tests.service.api.helpers import wait_for


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
