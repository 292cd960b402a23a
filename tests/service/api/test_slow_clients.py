"""Slow and greedy clients: half-sent headers are closed after the header timeout, oversized
headers get 431, connections past the cap get 503, and a normal request is served meanwhile."""

from __future__ import annotations

import json
import selectors
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.live_server import LiveServer, live_server
from tests.service.api.conftest import BASE_OPTIONS, SERVER_ENV
from tests.service.api.helpers import assert_error_shape

HEADER_TIMEOUT_S = 2.0
MAX_CONNECTIONS = 400
HALF_SENT = 300
# How late past the header timeout a close may come: the event loop's timer slack and CI noise.
CLOSE_SLACK_S = 2.0
HALF_HEADER = b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: appl"
SMALL_REQUEST = {"prompt": "a", "max_new_tokens": 1, "temperature": 0}


@pytest.fixture(scope="module")
def guarded(tiny_zoo: list[Path]) -> Iterator[LiveServer]:
    options = {
        **BASE_OPTIONS,
        "header_timeout_s": HEADER_TIMEOUT_S,
        "max_connections": MAX_CONNECTIONS,
        "max_queue": 0,
    }
    with live_server(tiny_zoo[:1], options=options, env=SERVER_ENV) as server:
        yield server


def _open(server: LiveServer, count: int, payload: bytes) -> list[socket.socket]:
    host, port = server.base_url.removeprefix("http://").split(":")
    sockets = []
    for _ in range(count):
        connection = socket.create_connection((host, int(port)), timeout=10.0)
        connection.sendall(payload)
        sockets.append(connection)
    return sockets


def _read_until_closed(sockets: list[socket.socket], deadline: float) -> dict[socket.socket, bytes]:
    """What each socket received before the server closed it; sockets still open are left out."""
    received = {connection: b"" for connection in sockets}
    closed: dict[socket.socket, bytes] = {}
    with selectors.DefaultSelector() as selector:
        for connection in sockets:
            connection.setblocking(False)
            selector.register(connection, selectors.EVENT_READ, data=connection)
        while received and time.monotonic() < deadline:
            for key, _ in selector.select(timeout=max(0.0, deadline - time.monotonic())):
                connection = key.data
                try:
                    chunk = connection.recv(65536)
                except ConnectionResetError:
                    chunk = b""
                if chunk:
                    received[connection] += chunk
                else:
                    selector.unregister(connection)
                    closed[connection] = received.pop(connection)
    return closed


def test_half_sent_requests_are_closed_after_the_header_timeout(guarded: LiveServer) -> None:
    opened_at = time.monotonic()
    sockets = _open(guarded, HALF_SENT, HALF_HEADER)
    try:
        with httpx.Client(base_url=guarded.base_url, timeout=30.0) as client:
            started = time.perf_counter()
            response = client.post("/generate", json=SMALL_REQUEST)
            elapsed = time.perf_counter() - started
        assert response.status_code == 200, response.text
        assert elapsed < 1.0
        closed = _read_until_closed(sockets, opened_at + HEADER_TIMEOUT_S + CLOSE_SLACK_S)
        assert len(closed) == HALF_SENT
        for answer in closed.values():
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 408 ")
            assert json.loads(body)["error"]["type"] == "request_timeout"
    finally:
        for connection in sockets:
            connection.close()


def test_a_100_kb_header_gets_431(guarded: LiveServer) -> None:
    with httpx.Client(base_url=guarded.base_url, timeout=30.0) as client:
        response = client.post("/generate", json=SMALL_REQUEST, headers={"X-Padding": "a" * 100_000})
        assert_error_shape(response, 431, None)
        assert client.post("/generate", json=SMALL_REQUEST).status_code == 200


def test_a_request_with_a_large_body_is_not_mistaken_for_large_headers(guarded: LiveServer) -> None:
    """Body bytes that arrive in the same read as the end of the headers do not count as headers."""
    with httpx.Client(base_url=guarded.base_url, timeout=30.0) as client:
        response = client.post("/score", json={"prompt": "a" * 200_000})
        assert_error_shape(response, 422, "prompt")  # too long for the context, but read in full


def test_connections_past_the_cap_get_503(guarded: LiveServer) -> None:
    request = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n"  # headers unfinished: the connection stays
    sockets = _open(guarded, MAX_CONNECTIONS + 20, request)
    try:
        answers = _read_until_closed(sockets, time.monotonic() + HEADER_TIMEOUT_S / 2)
        refused = [answer for answer in answers.values() if answer.startswith(b"HTTP/1.1 503 ")]
        assert len(refused) == 20
    finally:
        for connection in sockets:
            connection.close()
    with httpx.Client(base_url=guarded.base_url, timeout=30.0) as client:
        assert client.get("/healthz").status_code == 200
