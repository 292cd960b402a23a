"""Server-sent event streams of `/generate`, as iterators that are also context managers.

A stream opens its connection lazily (on `with` or on the first iteration), so sync and async
code read the same way, and closes it when iteration ends, fails, or the `with` block is left
early: the server sees the disconnect and cancels the generation.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from types import TracebackType
from typing import Self

import httpx

from pe_client._base import connection_error
from pe_client.errors import APIConnectionError, APIStreamError
from pe_client.types import ErrorBody, StreamEnd, StreamEvent, StreamToken

DONE = "[DONE]"


class SSEDecoder:
    """Turns the lines of an event stream into event payloads (`data:` lines joined)."""

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        """The completed event's data when `line` ends an event (a blank line), else None."""
        if not line:
            payload = "\n".join(self._data) if self._data else None
            self._data.clear()
            return payload
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value.removeprefix(" "))
        return None


class _StreamState:
    """What both stream kinds accumulate: the text so far and the final event."""

    def __init__(self) -> None:
        self.text = ""
        self.final: StreamEnd | None = None
        self._decoder = SSEDecoder()
        self._done = False

    def _accept(self, line: str, request: httpx.Request) -> StreamEvent | None:
        """The event a line completes, if any; raises `APIStreamError` for a server error event."""
        payload = self._decoder.feed(line)
        if payload is None:
            return None
        if payload == DONE:
            self._done = True
            return None
        data = json.loads(payload)
        if "error" in data:
            error = ErrorBody.model_validate(data).error
            raise APIStreamError(error.message, request=request, error_type=error.type, param=error.param)
        if "finish_reason" in data:
            self.final = StreamEnd.model_validate(data)
            return self.final
        token = StreamToken.model_validate(data)
        self.text += token.text
        return token

    def _check_complete(self, request: httpx.Request) -> None:
        if not self._done:
            raise APIConnectionError(request=request, message="The stream ended before [DONE].")


class Stream(_StreamState):
    """Token events then one `StreamEnd`; use as `with client.generate_stream(...) as stream:`."""

    def __init__(self, open_response: Callable[[], httpx.Response]) -> None:
        super().__init__()
        self._open_response = open_response
        self._response: httpx.Response | None = None
        self._events: Iterator[StreamEvent] | None = None

    def _response_opened(self) -> httpx.Response:
        if self._response is None:
            self._response = self._open_response()
        return self._response

    def __enter__(self) -> Self:
        self._response_opened()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __iter__(self) -> Iterator[StreamEvent]:
        return self

    def __next__(self) -> StreamEvent:
        # One generator for the stream's life: `next(iter(stream))` must not drop (and so close)
        # a fresh generator each time, or reading one event would end the generation.
        if self._events is None:
            self._events = self._read_events()
        return next(self._events)

    def _read_events(self) -> Iterator[StreamEvent]:
        response = self._response_opened()
        try:
            for line in response.iter_lines():
                event = self._accept(line, response.request)
                if event is not None:
                    yield event
                if self._done:
                    return
            self._check_complete(response.request)
        except httpx.TransportError as exc:
            raise connection_error(exc, response.request) from exc
        finally:
            self.close()

    def close(self) -> None:
        """Drop the connection; safe to call more than once."""
        if self._response is not None:
            self._response.close()


class AsyncStream(_StreamState):
    """Async twin of `Stream`; use as `async with client.generate_stream(...) as stream:`."""

    def __init__(self, open_response: Callable[[], Awaitable[httpx.Response]]) -> None:
        super().__init__()
        self._open_response = open_response
        self._response: httpx.Response | None = None
        self._events: AsyncIterator[StreamEvent] | None = None

    async def _response_opened(self) -> httpx.Response:
        if self._response is None:
            self._response = await self._open_response()
        return self._response

    async def __aenter__(self) -> Self:
        await self._response_opened()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> StreamEvent:
        if self._events is None:
            self._events = self._read_events()
        return await anext(self._events)

    async def _read_events(self) -> AsyncIterator[StreamEvent]:
        response = await self._response_opened()
        try:
            async for line in response.aiter_lines():
                event = self._accept(line, response.request)
                if event is not None:
                    yield event
                if self._done:
                    return
            self._check_complete(response.request)
        except httpx.TransportError as exc:
            raise connection_error(exc, response.request) from exc
        finally:
            await self.close()

    async def close(self) -> None:
        """Drop the connection; safe to call more than once."""
        if self._response is not None:
            await self._response.aclose()
