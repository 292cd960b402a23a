"""Reading an engine handle from a request handler, with the client's disconnect in view.

A client that goes away must free its batch slot, so the non-streaming path races the engine's
results against `http.disconnect` and cancels the handles if the client wins. A request may hold
several handles (an OpenAI request with `n` choices, several prompts, or an echoed prompt's score);
they are awaited together, and the first failure cancels the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from starlette.types import Receive

from service.engine.types import EngineEvent, GenerationResult, RequestHandle, ScoreResult

ResultT = TypeVar("ResultT", GenerationResult, ScoreResult)
T = TypeVar("T")


class ClientDisconnectedError(Exception):
    """The client closed the connection before the result was ready; nobody is left to answer."""


async def wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        continue


async def result_of(
    handle: RequestHandle,
    result_type: type[ResultT],
    on_event: Callable[[EngineEvent], None] = lambda _: None,
) -> ResultT:
    """The handle's final result; the handle is cancelled if this is."""
    (result,) = await results_of([handle], on_event)
    if not isinstance(result, result_type):
        raise RuntimeError(f"request {handle.request_id} ended without a {result_type.__name__}")
    return result


async def final_results(
    handles: Sequence[RequestHandle],
    receive: Receive,
    on_event: Callable[[EngineEvent], None] = lambda _: None,
) -> list[GenerationResult | ScoreResult]:
    """Every handle's final result, in order. If the client leaves first, or one handle fails, the
    others are cancelled; then ClientDisconnectedError, or the failure, is raised."""
    return await until_disconnected(asyncio.ensure_future(results_of(handles, on_event)), receive)


async def results_of(
    handles: Sequence[RequestHandle], on_event: Callable[[EngineEvent], None] = lambda _: None
) -> list[GenerationResult | ScoreResult]:
    """Every handle's final result, in order; a failure or a cancellation cancels every handle."""

    async def consume(handle: RequestHandle) -> GenerationResult | ScoreResult:
        async for event in handle:
            on_event(event)
            if isinstance(event, GenerationResult | ScoreResult):
                return event
        raise RuntimeError(f"request {handle.request_id} ended without a result")

    consumers = [asyncio.ensure_future(consume(handle)) for handle in handles]
    finished = False
    try:
        results = list(await asyncio.gather(*consumers))  # raises the first failure
        finished = True
        return results
    finally:
        if not finished:
            for handle in handles:
                handle.cancel()
            await _cancelled(consumers)


async def until_disconnected(work: asyncio.Future[T], receive: Receive) -> T:
    """`work`'s result, unless the client disconnects first: then `work` is cancelled (pass it
    through `asyncio.shield` to keep it running) and ClientDisconnectedError is raised."""
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        waiting: set[asyncio.Future[Any]] = {work, watcher}
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            raise ClientDisconnectedError("the client disconnected")
        return work.result()
    finally:
        await _cancelled([work, watcher])


async def _cancelled(tasks: Sequence[asyncio.Future[Any]]) -> None:
    for task in tasks:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
