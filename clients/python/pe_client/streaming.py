"""Server-sent event streams of `/generate`, as iterators that are also context managers.

How a stream opens, closes and resumes after a cut is `pe_client._lazy_stream`'s; this module
reads the events of one response. A response cut in the middle of an event leaves that event
unread: the resumed stream sends it again.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import httpx

from pe_client._base import RetryPolicy, connection_error
from pe_client._lazy_stream import AsyncLazyStream, LazyStream, OpenTransport
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

    def _start_response(self) -> None:
        """A response begins: nothing of an event the last one left unfinished is kept."""
        self._decoder = SSEDecoder()

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


class Stream(_StreamState, LazyStream[httpx.Response]):
    """Token events then one `StreamEnd`; use as `with client.generate_stream(...) as stream:`."""

    def __init__(
        self,
        open_response: OpenTransport[httpx.Response],
        retry_policy: RetryPolicy,
        sleep: Callable[[float], None],
    ) -> None:
        _StreamState.__init__(self)
        LazyStream.__init__(self, open_response, retry_policy, sleep)

    def _events_from(self, response: httpx.Response) -> Iterator[StreamEvent]:
        self._start_response()
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

    def _release(self, response: httpx.Response) -> None:
        response.close()


class AsyncStream(_StreamState, AsyncLazyStream[httpx.Response]):
    """Async twin of `Stream`; use as `async with client.generate_stream(...) as stream:`."""

    def __init__(
        self,
        open_response: OpenTransport[Awaitable[httpx.Response]],
        retry_policy: RetryPolicy,
        sleep: Callable[[float], Awaitable[None]],
    ) -> None:
        _StreamState.__init__(self)
        AsyncLazyStream.__init__(self, open_response, retry_policy, sleep)

    async def _events_from(self, response: httpx.Response) -> AsyncIterator[StreamEvent]:
        self._start_response()
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

    async def _release(self, response: httpx.Response) -> None:
        await response.aclose()

    async def close(self) -> None:
        """Drop the connection; safe to call more than once."""
        await self._let_go()
