"""The SDK resumes a stream whose connection is cut, over HTTP and gRPC, sync and async.

A TCP proxy on loopback stands between the SDK and the session's real server. Each case streams
a generation through it once uncut, counting the bytes the server sent, then again with the proxy
passing on only the first half of those bytes and closing the connection (both sockets) once the
reader has had an event: a real cut, at whatever point of an event or frame the half falls, after
the SDK received at least one token. The
SDK must resume by itself (`resume_from`) and its reader must see the uncut stream: the same
tokens, text and usage, greedy and seeded.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import pytest
from pe_client import AsyncPEClient, PEClient, StreamEnd, StreamToken
from pe_client.grpc import AsyncGrpcPEClient, GrpcPEClient

from tests.clients.conftest import API_KEY, AsyncClient, SyncClient, address
from tests.live_server import LiveServer

SAMPLINGS: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "seeded": {"temperature": 0.9, "top_k": 40, "seed": 3, "logprobs": True},
}
NEW_TOKENS = 48
HOLD_LIMIT_S = 30.0  # a held connection is cut by then whatever happens


class CuttingProxy:
    """Forwards each loopback connection to `target`. After `hold_next(n)`, the next connection
    passes n bytes from the server on to the client, then holds the rest until `cut()` has been
    called (the reader has an event), and closes both its sockets: a connection broken mid-stream
    after the client read some of it (gRPC drops what it received but had not handed over)."""

    def __init__(self, target: str) -> None:
        host, port = target.removeprefix("http://").rsplit(":", 1)
        self._target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self.sent: list[int] = []  # bytes from the server to the client, per connection
        self.cuts = 0
        self._hold_at: int | None = None
        self._cut = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def hold_next(self, after_bytes: int) -> None:
        self._cut.clear()
        self._hold_at = after_bytes

    def cut(self) -> None:
        self._cut.set()

    def close(self) -> None:
        self._cut.set()
        self._listener.close()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                client, _ = self._listener.accept()
                server = socket.create_connection(self._target)
                connection, hold_at, self._hold_at = len(self.sent), self._hold_at, None
                self.sent.append(0)
                threading.Thread(target=self._pump, args=(client, server, None, None), daemon=True).start()
                threading.Thread(
                    target=self._pump, args=(server, client, connection, hold_at), daemon=True
                ).start()

    def _pump(
        self, source: socket.socket, sink: socket.socket, connection: int | None, hold_at: int | None
    ) -> None:
        """Copy `source` to `sink`, counting into `sent[connection]` and holding at `hold_at` bytes."""
        with contextlib.suppress(OSError):
            while data := source.recv(4096):
                if connection is not None:
                    if hold_at is not None and self.sent[connection] + len(data) >= hold_at:
                        sink.sendall(data[: hold_at - self.sent[connection]])
                        self._cut.wait(timeout=HOLD_LIMIT_S)
                        self.cuts += 1
                        break
                    self.sent[connection] += len(data)
                sink.sendall(data)
        for end in (source, sink):
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)
            end.close()


@pytest.fixture
def proxy(protocol: str, server: LiveServer) -> Iterator[CuttingProxy]:
    target = server.grpc_target if protocol == "grpc" else server.base_url
    assert target is not None
    running = CuttingProxy(target)
    yield running
    running.close()


# A channel of its own connections: gRPC shares connections between the channels of a process.
OWN_CONNECTIONS = [("grpc.use_local_subchannel_pool", 1)]


@contextlib.contextmanager
def sync_client(protocol: str, proxy: CuttingProxy) -> Iterator[SyncClient]:
    target = address(protocol, proxy.port)
    if protocol == "http":
        with PEClient(target, api_key=API_KEY) as client:
            yield client
        return
    with grpc.insecure_channel(target, OWN_CONNECTIONS) as channel:
        yield GrpcPEClient(target, api_key=API_KEY, channel=channel)


@contextlib.asynccontextmanager
async def async_client(protocol: str, proxy: CuttingProxy) -> AsyncIterator[AsyncClient]:
    target = address(protocol, proxy.port)
    if protocol == "http":
        async with AsyncPEClient(target, api_key=API_KEY) as client:
            yield client
        return
    async with grpc.aio.insecure_channel(target, OWN_CONNECTIONS) as channel:
        yield AsyncGrpcPEClient(target, api_key=API_KEY, channel=channel)


Read = tuple[list[int], str, StreamEnd, int]  # tokens, text, end, tokens read before the first resume


def read_sync(protocol: str, proxy: CuttingProxy, params: dict[str, Any]) -> Read:
    tokens: list[int] = []
    before_resume = -1
    with sync_client(protocol, proxy) as client, client.generate_stream(**params) as stream:
        for event in stream:
            if stream.resumes and before_resume < 0:
                before_resume = len(tokens)
            if isinstance(event, StreamToken):
                tokens.append(event.token)
            proxy.cut()
    assert isinstance(event, StreamEnd)
    return tokens, stream.text, event, before_resume


def read_async(protocol: str, proxy: CuttingProxy, params: dict[str, Any]) -> Read:
    async def read() -> Read:
        tokens: list[int] = []
        before_resume = -1
        async with async_client(protocol, proxy) as client, client.generate_stream(**params) as stream:
            async for event in stream:
                if stream.resumes and before_resume < 0:
                    before_resume = len(tokens)
                if isinstance(event, StreamToken):
                    tokens.append(event.token)
                proxy.cut()
        assert isinstance(event, StreamEnd)
        return tokens, stream.text, event, before_resume

    return asyncio.run(read())


@pytest.mark.parametrize(("mode", "sampling"), [("sync", "greedy"), ("sync", "seeded"), ("async", "seeded")])
def test_a_stream_cut_halfway_is_resumed_and_reads_as_uncut(
    protocol: str, proxy: CuttingProxy, mode: str, sampling: str
) -> None:
    read = read_sync if mode == "sync" else read_async
    params = {"prompt": "def fib(n):", "max_new_tokens": NEW_TOKENS, **SAMPLINGS[sampling]}
    tokens, text, end, before_resume = read(protocol, proxy, params)
    assert len(tokens) == NEW_TOKENS and before_resume == -1 and proxy.cuts == 0
    proxy.hold_next(proxy.sent[-1] // 2)
    resumed = read(protocol, proxy, params)
    assert proxy.cuts == 1
    assert 0 < resumed[3] < NEW_TOKENS, "the cut fell mid-stream"
    assert resumed[:2] == (tokens, text)
    assert resumed[2].usage.completion_tokens == end.usage.completion_tokens == NEW_TOKENS
    assert (resumed[2].finish_reason, resumed[2].usage.prompt_tokens) == (
        end.finish_reason,
        end.usage.prompt_tokens,
    )
