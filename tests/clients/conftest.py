"""One real pe-serve process for all SDK tests: two tiny checkpoints, an API key, one batch slot.

A single batch slot and a one-place queue make a full queue (429) reachable with two requests;
every other test runs one request at a time, so the limits do not get in its way.

The client fixtures are parametrized by protocol: each behavioural test runs with the HTTP
clients and again with the gRPC clients (`pe_client.grpc`), which promise the same methods,
results and errors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
from pe_client import AsyncPEClient, PEClient
from pe_client.grpc import AsyncGrpcPEClient, GrpcPEClient

from tests.live_server import LiveServer, OptionValue, live_server

API_KEY = "sdk-test-key"
NATIVE_CONTEXT = 64
SERVER_ENV = {"OMP_NUM_THREADS": "1"}
SERVER_OPTIONS: dict[str, OptionValue] = {
    "device": "cpu",
    "dtype": "float32",
    "max_context": 4096,
    "max_batch_size": 1,
    "max_queue": 1,
    "api_key": API_KEY,
}


@pytest.fixture(scope="session")
def sdk_models(tiny_checkpoints: dict[str, Path]) -> list[Path]:
    """RoPE first (the default model), ALiBi for a scheme that takes no RoPE scaling."""
    return [tiny_checkpoints["rope"], tiny_checkpoints["alibi"]]


@pytest.fixture(scope="session")
def server(sdk_models: list[Path]) -> Iterator[LiveServer]:
    with live_server(sdk_models, options=SERVER_OPTIONS, env=SERVER_ENV) as running:
        yield running


SyncClient = PEClient | GrpcPEClient
AsyncClient = AsyncPEClient | AsyncGrpcPEClient
ClientFactory = Callable[..., SyncClient]
PROTOCOLS = ("http", "grpc")


def sdk_client(protocol: str, server: LiveServer, **options: Any) -> SyncClient:
    """The protocol's sync client for a server: its URL for HTTP, its gRPC target for gRPC."""
    if protocol == "grpc":
        return GrpcPEClient(server.grpc_target, **options)
    return PEClient(server.base_url, **options)


def address(protocol: str, port: int) -> str:
    """Where a client of the protocol would look for a server on a loopback port."""
    return f"127.0.0.1:{port}" if protocol == "grpc" else f"http://127.0.0.1:{port}"


@pytest.fixture(params=PROTOCOLS)
def protocol(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@pytest.fixture
def make_client(protocol: str) -> ClientFactory:
    """`make_client(server, **options)`: a sync client of this test's protocol."""
    return partial(sdk_client, protocol)


@pytest.fixture
def client(make_client: ClientFactory, server: LiveServer) -> Iterator[SyncClient]:
    with make_client(server, api_key=API_KEY) as sdk:
        yield sdk


@pytest.fixture
def async_client(protocol: str, server: LiveServer) -> AsyncClient:
    """Not entered here: each test runs its own event loop and closes the client in it."""
    if protocol == "grpc":
        return AsyncGrpcPEClient(server.grpc_target, api_key=API_KEY)
    return AsyncPEClient(server.base_url, api_key=API_KEY)


@pytest.fixture
def metrics_http(server: LiveServer) -> Iterator[httpx.Client]:
    """Plain HTTP for /metrics, which the SDK does not wrap."""
    with httpx.Client(base_url=server.base_url, timeout=10.0) as http:
        yield http
