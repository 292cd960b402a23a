"""A shared live server over the tiny random-weight checkpoints of tests/conftest.py.

The server is a real `pe-serve` process on a loopback port (see tests/live_server.py), shared by
every module that uses the default configuration (one start-up for all of them); modules that
need other settings start their own.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from service.model.config import SCHEMES
from tests.conftest import TINY_CONFIG
from tests.live_server import LiveServer, OptionValue, live_server

NATIVE_CONTEXT: int = TINY_CONFIG["native_context"]
ROTARY_FREQUENCIES: int = TINY_CONFIG["d_model"] // TINY_CONFIG["n_heads"] // 2
MAX_CONTEXT = 512
# The load order of `tiny_checkpoints`: RoPE first, so it is the default model.
SCHEME_ORDER = ("rope", *(scheme for scheme in SCHEMES if scheme != "rope"))
SERVER_ENV = {"OMP_NUM_THREADS": "1"}
BASE_OPTIONS: dict[str, OptionValue] = {"device": "cpu", "dtype": "float32", "max_context": MAX_CONTEXT}


def model_name(scheme: str) -> str:
    return f"tiny-{scheme}"


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
