"""`RequestHandle` for the engine: the worker thread pushes events, one caller reads them.

Readers may be plain threads (`for event in handle`) or asyncio tasks (`async for`); the worker
never blocks on either and wakes an asyncio reader through its own loop, so a slow client costs
the engine nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from collections.abc import AsyncIterator, Iterator

from service.engine.errors import EngineError
from service.engine.types import EngineEvent, GenerationResult, ScoreResult

_Item = EngineEvent | EngineError


class EngineHandle:
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self._items: deque[_Item] = deque()
        self._async_wakeups: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self._cancelled = threading.Event()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self) -> None:
        """Ask the engine to drop the request; its slot is freed at the next step."""
        self._cancelled.set()

    def push(self, item: _Item) -> None:
        """Called by the engine thread: a token, the final result, or the error that ends the request."""
        with self._lock:
            self._items.append(item)
            self._arrived.notify_all()
            wakeups = list(self._async_wakeups)
        for loop, event in wakeups:
            # A reader whose loop has closed is gone; the engine must not fail because of it.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(event.set)

    def __iter__(self) -> Iterator[EngineEvent]:
        while True:
            with self._lock:
                self._arrived.wait_for(lambda: bool(self._items))
                item = self._items.popleft()
            yield _unwrap(item)
            if _is_final(item):
                return

    def __aiter__(self) -> AsyncIterator[EngineEvent]:
        return self._iterate_async()

    async def _iterate_async(self) -> AsyncIterator[EngineEvent]:
        wakeup = (asyncio.get_running_loop(), asyncio.Event())
        with self._lock:
            self._async_wakeups.append(wakeup)
        try:
            while True:
                with self._lock:
                    item = self._items.popleft() if self._items else None
                    if item is None:
                        wakeup[1].clear()
                if item is None:
                    await wakeup[1].wait()
                    continue
                yield _unwrap(item)
                if _is_final(item):
                    return
        finally:
            with self._lock:
                self._async_wakeups.remove(wakeup)


def _unwrap(item: _Item) -> EngineEvent:
    if isinstance(item, EngineError):
        raise item
    return item


def _is_final(item: _Item) -> bool:
    return isinstance(item, EngineError | GenerationResult | ScoreResult)
