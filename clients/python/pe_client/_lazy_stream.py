"""The life of a stream, whatever carries it: opened lazily, read once, closed on every exit.

HTTP (an `httpx.Response` of server-sent events) and gRPC (a server-streaming call) differ only
in how they turn their transport into `StreamEvent`s and how they let go of it; both streams
subclass these two bases and supply just that.

A stream opens on `with` or on the first iteration, so sync and async code read the same way.
It keeps one generator for its whole life: `next(iter(stream))` must not start (and drop, and so
close) a fresh one each time, or reading one event would end the generation. Leaving the `with`
block early, breaking out of the loop or an error closes the transport, and the server sees the
disconnect and frees the batch slot.

A stream that is cut (the connection breaks, or the server says it went away: `replica_lost`)
is resumed: the transport is opened again with the tokens received so far (`resume_from`), after
the retry policy's wait, and the reader goes on reading events as if nothing happened. The server
continues the generation from those tokens, the same tokens an uncut stream would have brought
when it is greedy or seeded. The policy's `max_retries` bounds the cuts in a row with no token
between them (`RetryPolicy.resume_delay_or_raise`); `resumes` counts them all.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from types import TracebackType
from typing import Generic, Self, TypeVar

from pe_client._base import RetryPolicy
from pe_client.errors import APIError
from pe_client.types import StreamEnd, StreamEvent, StreamToken

Transport = TypeVar("Transport")
# Starts the transport of a stream that holds these tokens already: none, or those before a cut.
OpenTransport = Callable[[Sequence[int]], Transport]


class _Progress:
    """What both stream kinds know of their events: the tokens received, whether the end came, and
    how often the stream was resumed; `_cut()` says how long to wait before resuming, or raises."""

    def __init__(self, retry_policy: RetryPolicy) -> None:
        self.tokens: list[int] = []
        self.resumes = 0
        self._retry_policy = retry_policy
        self._cuts = 0  # in a row, with no token between them
        self._ended = False

    def _note(self, event: StreamEvent) -> None:
        if isinstance(event, StreamToken):
            self.tokens.append(event.token)
            self._cuts = 0
        self._ended = isinstance(event, StreamEnd)

    def _cut(self, error: APIError) -> float | None:
        """Seconds before resuming after `error`; None when the end had come (nothing is missing)."""
        if self._ended:
            return None
        delay = self._retry_policy.resume_delay_or_raise(self._cuts, error)
        self._cuts += 1
        self.resumes += 1
        return delay


class LazyStream(_Progress, ABC, Generic[Transport]):
    """A blocking stream of events over a transport that `open_transport(tokens held)` starts."""

    def __init__(
        self,
        open_transport: OpenTransport[Transport],
        retry_policy: RetryPolicy,
        sleep: Callable[[float], None],
    ) -> None:
        _Progress.__init__(self, retry_policy)
        self._open_transport = open_transport
        self._sleep = sleep
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
            self._transport = self._open_transport(self.tokens)
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
        try:
            while True:
                transport = self._opened()  # a failure to open is final: opening has its own retries
                try:
                    for event in self._events_from(transport):
                        self._note(event)
                        yield event
                    return
                except APIError as error:
                    delay = self._cut(error)
                if delay is None:
                    return
                self.close()
                self._transport = None
                self._sleep(delay)
        finally:
            self.close()

    def close(self) -> None:
        """Let go of the connection or call; safe to call more than once."""
        if self._transport is not None:
            self._release(self._transport)


class AsyncLazyStream(_Progress, ABC, Generic[Transport]):
    """The asyncio twin of `LazyStream`: `async with` and `async for`."""

    def __init__(
        self,
        open_transport: OpenTransport[Awaitable[Transport]],
        retry_policy: RetryPolicy,
        sleep: Callable[[float], Awaitable[None]],
    ) -> None:
        _Progress.__init__(self, retry_policy)
        self._open_transport = open_transport
        self._sleep = sleep
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
            self._transport = await self._open_transport(self.tokens)
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
        try:
            while True:
                transport = await self._opened()  # a failure to open is final, as in `LazyStream`
                try:
                    async for event in self._events_from(transport):
                        self._note(event)
                        yield event
                    return
                except APIError as error:
                    delay = self._cut(error)
                if delay is None:
                    return
                await self._let_go()
                self._transport = None
                await self._sleep(delay)
        finally:
            await self._let_go()

    async def _let_go(self) -> None:
        if self._transport is not None:
            await self._release(self._transport)
