"""`RequestHandle` for the engine: the engine side delivers events, one caller reads them.

Readers may be plain threads (`for event in handle`) or asyncio tasks (`async for`). Events arrive
in batches, one per engine step, and `deliver` wakes each asyncio loop once per batch however many
requests and tokens it carries: a loop woken once per token per request spends its time in
wake-ups rather than in serving. The deliverer never blocks on a reader, so a slow client costs
the engine nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import defaultdict, deque
from collections.abc import AsyncIterator, Callable, Iterable, Iterator

from service.engine.errors import EngineError
from service.engine.types import EngineEvent, GenerationResult, ScoreResult

Item = EngineEvent | EngineError


class EngineHandle:
    def __init__(self, request_id: str, on_cancel: Callable[[], None] = lambda: None) -> None:
        self.request_id = request_id
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self._items: deque[Item] = deque()
        self._async_wakeups: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self._cancelled = threading.Event()
        self._on_cancel = on_cancel

    def cancel(self) -> None:
        """Ask the engine to drop the request; its slot is freed at the next step."""
        with self._lock:
            first = not self._cancelled.is_set()
            self._cancelled.set()
        if first:
            self._on_cancel()

    def push(self, item: Item) -> None:
        """One item alone; batches go through `deliver`."""
        deliver([(self, item)])

    def _append(self, items: Iterable[Item]) -> list[tuple[asyncio.AbstractEventLoop, asyncio.Event]]:
        with self._lock:
            self._items.extend(items)
            self._arrived.notify_all()
            return list(self._async_wakeups)

    def __iter__(self) -> Iterator[EngineEvent]:
        while True:
            with self._lock:
                self._arrived.wait_for(lambda: bool(self._items))
                item = self._items.popleft()
            yield _unwrap(item)
            if is_final(item):
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
                if is_final(item):
                    return
        finally:
            with self._lock:
                self._async_wakeups.remove(wakeup)


def deliver(items: Iterable[tuple[EngineHandle, Item]]) -> None:
    """Hand a step's items to their handles; one wake-up per asyncio loop for the whole batch."""
    per_handle: defaultdict[EngineHandle, list[Item]] = defaultdict(list)
    for handle, item in items:
        per_handle[handle].append(item)
    per_loop: defaultdict[asyncio.AbstractEventLoop, list[asyncio.Event]] = defaultdict(list)
    for handle, handle_items in per_handle.items():
        for loop, event in handle._append(handle_items):
            per_loop[loop].append(event)
    for loop, events in per_loop.items():
        # A reader whose loop has closed is gone; the engine must not fail because of it.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(_set_all, events)


def _set_all(events: list[asyncio.Event]) -> None:
    for event in events:
        event.set()


def _unwrap(item: Item) -> EngineEvent:
    if isinstance(item, EngineError):
        raise item
    return item


def is_final(item: Item) -> bool:
    return isinstance(item, EngineError | GenerationResult | ScoreResult)
