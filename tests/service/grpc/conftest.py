"""A gRPC channel to the shared live server of tests/service/conftest.py."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from tests.live_server import LiveServer


@pytest.fixture
def grpc_channel(server: LiveServer) -> Iterator[grpc.Channel]:
    assert server.grpc_target is not None
    with grpc.insecure_channel(server.grpc_target) as channel:
        yield channel
