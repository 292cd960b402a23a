"""Server-sent events for `stream: true`: one event per token, a final event, then `[DONE]`.

An error after the first byte cannot change the status line any more, so it is sent as an
`{"error": ...}` event. A response that ends before its last event (the client went away)
cancels the engine request, which is what frees the batch slot of a client that disconnected.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from service.api.errors import error_payload
from service.engine.types import EngineEvent, GenerationResult, RequestHandle, TokenEvent
from service.requests.convert import (
    TokenText,
    finish_reason,
    pe_block,
    timing_block,
    top_logprob_entries,
    usage,
)
from service.requests.errors import as_request_error
from service.requests.responses import StreamEnd, StreamToken

DONE = b"data: [DONE]\n\n"


def sse_event(payload: BaseModel | dict[str, Any]) -> bytes:
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n".encode()


def token_event(event: TokenEvent, text: TokenText) -> bytes:
    """`{"token", "text"}`, plus `logprob` and `top_logprobs` only when the request asked for them."""
    alternatives = top_logprob_entries(event.top_logprobs, text) if event.top_logprobs is not None else None
    token = StreamToken(token=event.token, text=event.text, logprob=event.logprob, top_logprobs=alternatives)
    return f"data: {token.model_dump_json(exclude_none=True)}\n\n".encode()


async def generation_events(
    handle: RequestHandle,
    *,
    response_id: str,
    model: str,
    request_id: str,
    on_event: Callable[[EngineEvent], None],
    text: TokenText,
) -> AsyncIterator[bytes]:
    """The SSE body of one generation."""
    try:
        async for event in handle:
            on_event(event)
            if isinstance(event, TokenEvent):
                yield token_event(event, text)
            elif isinstance(event, GenerationResult):
                end = StreamEnd(
                    id=response_id,
                    model=model,
                    finish_reason=finish_reason(event),
                    usage=usage(event),
                    pe=pe_block(event.pe),
                    timing=timing_block(event.timing),
                )
                yield sse_event(end)
        yield DONE
    except Exception as error:
        yield failure_event(error, request_id)


def failure_event(error: Exception, request_id: str, *, openai: bool = False) -> bytes:
    """The error event for a stream that failed; only unexpected exceptions are logged (as_request_error)."""
    return sse_event(error_payload(as_request_error(error, request_id), openai=openai))


class EventStreamResponse(StreamingResponse):
    """A `text/event-stream` response that calls `on_abort` unless its body was sent to the end.

    Starlette cancels the sending task when the client disconnects; the body generator may then be
    suspended at a `yield` and never resumed, so its own `finally` cannot be relied on to cancel
    the engine request. This wrapper can.
    """

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes], *, on_abort: Callable[[], None]) -> None:
        super().__init__(
            self._tracked(content), headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        self._on_abort = on_abort
        self._completed = False

    async def _tracked(self, content: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        async for chunk in content:
            yield chunk
        self._completed = True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self._completed:
                self._on_abort()


async def merged_events(handles: Sequence[RequestHandle]) -> AsyncIterator[tuple[int, EngineEvent]]:
    """The events of several handles as they come, each with its handle's index.

    The first failure of any handle is raised; leaving the iteration stops reading all of them
    (cancelling the requests is the caller's, as for one handle).
    """
    queue: asyncio.Queue[tuple[int, EngineEvent | Exception | None]] = asyncio.Queue()

    async def pump(index: int, handle: RequestHandle) -> None:
        try:
            async for event in handle:
                queue.put_nowait((index, event))
            queue.put_nowait((index, None))
        except Exception as error:
            queue.put_nowait((index, error))

    pumps = [asyncio.ensure_future(pump(index, handle)) for index, handle in enumerate(handles)]
    try:
        running = len(pumps)
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in pumps:
            task.cancel()
