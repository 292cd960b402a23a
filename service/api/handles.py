"""Reading an engine handle from a request handler, with the client's disconnect in view.

A client that goes away must free its batch slot, so the non-streaming path races the engine's
result against `http.disconnect` and cancels the handle if the client wins.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import TypeVar

from starlette.types import Receive

from service.api.metrics import ServiceMetrics
from service.engine.types import EngineEvent, GenerationResult, RequestHandle, ScoreResult, TokenEvent

ResultT = TypeVar("ResultT", GenerationResult, ScoreResult)


class ClientDisconnectedError(Exception):
    """The client closed the connection before the result was ready; nobody is left to answer."""


class FirstTokenTimer:
    """Observes time-to-first-token once per request, whichever path delivers the first token."""

    def __init__(self, metrics: ServiceMetrics, started_at: float) -> None:
        self._metrics = metrics
        self._started_at = started_at
        self._seen = False

    def __call__(self, event: EngineEvent) -> None:
        if not self._seen and isinstance(event, TokenEvent):
            self._seen = True
            self._metrics.time_to_first_token.observe(time.perf_counter() - self._started_at)


async def wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        continue


async def final_result(
    handle: RequestHandle,
    result_type: type[ResultT],
    receive: Receive,
    on_event: Callable[[EngineEvent], None] = lambda _: None,
) -> ResultT:
    """The handle's final result; ClientDisconnectedError (request cancelled) if the client leaves first."""

    async def consume() -> ResultT:
        async for event in handle:
            on_event(event)
            if isinstance(event, result_type):
                return event
        raise RuntimeError(f"request {handle.request_id} ended without a {result_type.__name__}")

    consumer = asyncio.ensure_future(consume())
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if consumer.done():
            return consumer.result()
        handle.cancel()
        raise ClientDisconnectedError(handle.request_id)
    finally:
        for task in (consumer, watcher):
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
