"""Each request id runs once: a retry attaches to the run in progress or gets the recent answer.

A client that lost its connection before the answer (a timeout, a proxy that dropped it, a
replica restarting) sends the same request again under the same id. Running it twice would cost
a second generation and, with sampling, could answer differently; so the first submission starts
one shared run, later submissions of the same key wait on that run, and the serialized answer of
a run that succeeded is kept for `keep_s` to answer a late retry. What is kept is bounded in
count and in bytes, oldest evicted first.

The run is not tied to the caller that started it: it is cancelled only once every caller has
left, so a retry that arrives while the first connection is being torn down still gets its answer.
Failures are not kept: a retry of a failed request runs again.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Hashable, Iterator
from dataclasses import dataclass
from typing import Any

DEFAULT_CAPACITY = 1024
DEFAULT_MAX_BYTES = 32 * 2**20
DEFAULT_KEEP_S = 120.0

Start = Callable[[], Coroutine[Any, Any, bytes]]


@dataclass
class _Run:
    task: asyncio.Future[bytes]
    waiters: int = 0


@dataclass(frozen=True)
class _Answer:
    body: bytes
    at: float


class RunOnce:
    """Shared runs by key, and the answers of recent ones; used from one event loop."""

    def __init__(
        self,
        *,
        capacity: int = DEFAULT_CAPACITY,
        max_bytes: int = DEFAULT_MAX_BYTES,
        keep_s: float = DEFAULT_KEEP_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.keep_s = keep_s
        self._clock = clock
        self._running: dict[Hashable, _Run] = {}
        self._answers: OrderedDict[Hashable, _Answer] = OrderedDict()
        self._kept_bytes = 0

    def held(self) -> tuple[int, int]:
        """(runs in progress plus answers kept, bytes of the answers kept): what this holds."""
        return len(self._running) + len(self._answers), self._kept_bytes

    @contextlib.contextmanager
    def attached(self, key: Hashable, start: Start) -> Iterator[asyncio.Future[bytes]]:
        """The future of the run under `key`, started with `start()` unless one runs or just ran.

        Await it shielded (`asyncio.shield`) to leave early: leaving the block detaches this
        caller, and the run is cancelled once no caller is attached and it has not finished.
        """
        self._forget_old()
        answer = self._answers.get(key)
        if answer is not None:
            kept: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
            kept.set_result(answer.body)
            yield kept
            return
        run = self._running.get(key)
        if run is None:
            run = _Run(asyncio.ensure_future(start()))
            self._running[key] = run
            run.task.add_done_callback(lambda task: self._settle(key, task))
        run.waiters += 1
        try:
            yield run.task
        finally:
            run.waiters -= 1
            if run.waiters == 0 and not run.task.done():
                run.task.cancel()

    def _settle(self, key: Hashable, task: asyncio.Future[bytes]) -> None:
        if key in self._running and self._running[key].task is task:
            del self._running[key]
        if task.cancelled() or task.exception() is not None:
            return
        body = task.result()
        if len(body) > self.max_bytes:
            return
        if key in self._answers:
            self._kept_bytes -= len(self._answers.pop(key).body)
        self._answers[key] = _Answer(body, self._clock())
        self._kept_bytes += len(body)
        while len(self._answers) > self.capacity or self._kept_bytes > self.max_bytes:
            self._evict_oldest()

    def _forget_old(self) -> None:
        horizon = self._clock() - self.keep_s
        while self._answers and next(iter(self._answers.values())).at < horizon:
            self._evict_oldest()

    def _evict_oldest(self) -> None:
        _, answer = self._answers.popitem(last=False)
        self._kept_bytes -= len(answer.body)
