"""A kept-alive connection outlives the clients' own pool expiry (httpx's is 5 s), so that the
client, not the server, gives up on it first; uvicorn's 5 s default raced them."""

from __future__ import annotations

import socket
import time
from urllib.parse import urlsplit

from service.api.connections import KEEP_ALIVE_TIMEOUT_S
from tests.live_server import LiveServer

IDLE_S = 6.0  # past uvicorn's default and httpx's pool expiry, well within ours


def get(connection: socket.socket, host: str) -> bytes:
    connection.sendall(f"GET /healthz HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    received = b""
    while b"\r\n\r\n" not in received or not received.endswith(b"}"):
        chunk = connection.recv(4096)
        if not chunk:
            break
        received += chunk
    return received


def test_a_connection_idle_past_the_clients_expiry_still_answers(server: LiveServer) -> None:
    assert IDLE_S < KEEP_ALIVE_TIMEOUT_S
    address = urlsplit(server.base_url)
    with socket.create_connection((address.hostname, address.port), timeout=30) as connection:
        assert get(connection, address.netloc).startswith(b"HTTP/1.1 200")
        time.sleep(IDLE_S)
        assert get(connection, address.netloc).startswith(b"HTTP/1.1 200")
