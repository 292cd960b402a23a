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


class ClientDisconnectedError(Exception):
    """The client closed the connection before the result was ready; nobody is left to answer."""


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
    (result,) = await final_results([handle], receive, on_event)
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

    async def consume(handle: RequestHandle) -> GenerationResult | ScoreResult:
        async for event in handle:
            on_event(event)
            if isinstance(event, GenerationResult | ScoreResult):
                return event
        raise RuntimeError(f"request {handle.request_id} ended without a result")

    consumers = [asyncio.ensure_future(consume(handle)) for handle in handles]
    everything = asyncio.gather(*consumers)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    finished = False
    try:
        waiting: set[asyncio.Future[Any]] = {everything, watcher}
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        if not everything.done():
            raise ClientDisconnectedError(", ".join(handle.request_id for handle in handles))
        results = everything.result()  # raises the first failure
        finished = True
        return results
    finally:
        if not finished:
            for handle in handles:
                handle.cancel()
        for task in (*consumers, watcher):
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
