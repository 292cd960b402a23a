"""The life of a stream, whatever carries it: opened lazily, read once, closed on every exit.

HTTP (an `httpx.Response` of server-sent events) and gRPC (a server-streaming call) differ only
in how they turn their transport into `StreamEvent`s and how they let go of it; both streams
subclass these two bases and supply just that.

A stream opens on `with` or on the first iteration, so sync and async code read the same way.
It keeps one generator for its whole life: `next(iter(stream))` must not start (and drop, and so
close) a fresh one each time, or reading one event would end the generation. Leaving the `with`
block early, breaking out of the loop or an error closes the transport, and the server sees the
disconnect and frees the batch slot.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from types import TracebackType
from typing import Generic, Self, TypeVar

from pe_client.types import StreamEvent

Transport = TypeVar("Transport")


class LazyStream(ABC, Generic[Transport]):
    """A blocking stream of events over a transport that `open_transport()` starts."""

    def __init__(self, open_transport: Callable[[], Transport]) -> None:
        self._open_transport = open_transport
        self._transport: Transport | None = None
        self._events: Iterator[StreamEvent] | None = None

    @abstractmethod
    def _events_from(self, transport: Transport) -> Iterator[StreamEvent]:
        """The transport's events in order; transport errors become the SDK's."""

    @abstractmethod
    def _release(self, transport: Transport) -> None:
        """Let go of the transport; called again after it has ended, so it must be idempotent."""

    def _opened(self) -> Transport:
        if self._transport is None:
            self._transport = self._open_transport()
        return self._transport

    def __enter__(self) -> Self:
        self._opened()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __iter__(self) -> Iterator[StreamEvent]:
        return self

    def __next__(self) -> StreamEvent:
        if self._events is None:
            self._events = self._read_events()
        return next(self._events)

    def _read_events(self) -> Iterator[StreamEvent]:
        transport = self._opened()
        try:
            yield from self._events_from(transport)
        finally:
            self.close()

    def close(self) -> None:
        """Let go of the connection or call; safe to call more than once."""
        if self._transport is not None:
            self._release(self._transport)


class AsyncLazyStream(ABC, Generic[Transport]):
    """The asyncio twin of `LazyStream`: `async with` and `async for`."""

    def __init__(self, open_transport: Callable[[], Awaitable[Transport]]) -> None:
        self._open_transport = open_transport
        self._transport: Transport | None = None
        self._events: AsyncIterator[StreamEvent] | None = None

    @abstractmethod
    def _events_from(self, transport: Transport) -> AsyncIterator[StreamEvent]:
        """The transport's events in order; transport errors become the SDK's."""

    @abstractmethod
    async def _release(self, transport: Transport) -> None:
        """Let go of the transport; called again after it has ended, so it must be idempotent."""

    async def _opened(self) -> Transport:
        if self._transport is None:
            self._transport = await self._open_transport()
        return self._transport

    async def __aenter__(self) -> Self:
        await self._opened()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._let_go()

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> StreamEvent:
        if self._events is None:
            self._events = self._read_events()
        return await anext(self._events)

    async def _read_events(self) -> AsyncIterator[StreamEvent]:
        transport = await self._opened()
        try:
            async for event in self._events_from(transport):
                yield event
        finally:
            await self._let_go()

    async def _let_go(self) -> None:
        if self._transport is not None:
            await self._release(self._transport)
