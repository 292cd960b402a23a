"""One real pe-serve process for all SDK tests: two tiny checkpoints, an API key, one batch slot.

A single batch slot and a one-place queue make a full queue (429) reachable with two requests;
every other test runs one request at a time, so the limits do not get in its way.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from pe_client import AsyncPEClient, PEClient

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


@pytest.fixture
def client(server: LiveServer) -> Iterator[PEClient]:
    with PEClient(server.base_url, api_key=API_KEY) as sdk:
        yield sdk


@pytest.fixture
def async_client(server: LiveServer) -> AsyncPEClient:
    """Not entered here: each test runs its own event loop and closes the client in it."""
    return AsyncPEClient(server.base_url, api_key=API_KEY)


@pytest.fixture
def metrics_http(server: LiveServer) -> Iterator[httpx.Client]:
    """Plain HTTP for /metrics, which the SDK does not wrap."""
    with httpx.Client(base_url=server.base_url, timeout=10.0) as http:
        yield http
