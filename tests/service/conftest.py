"""A shared live server over the tiny random-weight checkpoints of tests/conftest.py.

The server is a real `pe-serve` process on loopback ports (HTTP and gRPC, see
tests/live_server.py), shared by every module of tests/service that uses the default
configuration (one start-up for all of them); modules that need other settings start their own.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.live_server import LiveServer, live_server
from tests.service.api.conftest import BASE_OPTIONS, SCHEME_ORDER, SERVER_ENV


@pytest.fixture(scope="session")
def tiny_zoo(tiny_checkpoints: dict[str, Path]) -> list[Path]:
    assert tuple(tiny_checkpoints) == SCHEME_ORDER
    return list(tiny_checkpoints.values())


@pytest.fixture(scope="session")
def server(tiny_zoo: list[Path]) -> Iterator[LiveServer]:
    with live_server(tiny_zoo, options=BASE_OPTIONS, env=SERVER_ENV) as running:
        yield running


@pytest.fixture
def client(server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60.0) as http:
        yield http
