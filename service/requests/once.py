"""Each request id runs once: a retry attaches to the run in progress or gets the recent answer.

A client that lost its connection before the answer (a timeout, a proxy that dropped it, a
replica restarting) sends the same request again under the same id. Running it twice would cost
a second generation and, with sampling, could answer differently; so the first submission starts
one shared run, later submissions of the same key wait on that run, and the serialized answer of
a run that succeeded is kept for `keep_s` to answer a late retry. What is kept is bounded in
count and in bytes, oldest evicted first.

An answer is one body (`attached`) or a stream of chunks (`streamed`): a caller that attaches to
a stream mid-way gets every chunk from the first, then follows the run, so a retried stream reads
exactly what the first submission read. A transport may also give each submission a fingerprint
of what it asks: a key reused with another fingerprint is refused (INVALID) rather than answered
with another request's answer; without one, the key alone decides (HTTP puts the body in its key).

The run is not tied to the caller that started it: it is cancelled only once every caller has
left, so a retry that arrives while the first connection is being torn down still gets its answer.
Failures are not kept: a retry of a failed request runs again.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Coroutine, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from service.requests.errors import ErrorKind, RequestError
from service.requests.running import REQUEST_ID_FIELD

DEFAULT_CAPACITY = 1024
DEFAULT_MAX_BYTES = 32 * 2**20
DEFAULT_KEEP_S = 120.0

Start = Callable[[], Coroutine[Any, Any, bytes]]
# Called once, in the run's own task: it may refuse (raise) before returning the chunks' iterator,
# so that what it sets up belongs to the run from the start and is released with it.
StartStream = Callable[[], AsyncIterator[bytes]]


def fingerprint_of(kind: str, body: BaseModel) -> str:
    """What a submission asks, as `attached` and `streamed` compare it: the method and the body."""
    return hashlib.sha256(f"{kind}\0{body.model_dump_json()}".encode()).hexdigest()


def reused_id() -> RequestError:
    return RequestError(
        ErrorKind.INVALID,
        "This request id was used for another request: a retry must repeat it exactly; "
        "a new request needs a new id.",
        param=REQUEST_ID_FIELD,
        error_type="request_id_reused",
    )


@dataclass
class _Run:
    """A run in progress: the chunks it answered so far, pulsed on `grew` as each one comes."""

    fingerprint: Hashable
    chunks: list[bytes] = field(default_factory=list)
    grew: asyncio.Event = field(default_factory=asyncio.Event)
    opened: bool = False  # its start() returned: the request was accepted
    waiters: int = 0
    # The whole answer, the chunks joined (a body is one chunk); set once the run is created.
    task: asyncio.Future[bytes] = field(init=False)

    def pulse(self) -> None:
        self.grew.set()
        self.grew.clear()

    async def pump(self, start: StartStream) -> bytes:
        chunks = start()
        self.opened = True
        self.pulse()
        async for chunk in chunks:
            self.chunks.append(chunk)
            self.pulse()
        return b"".join(self.chunks)

    async def wait_opened(self) -> None:
        """Until start() returned; raises what it raised (or the run's failure before that)."""
        while not self.opened and not self.task.done():
            await self.grew.wait()
        if not self.opened:
            self.task.result()

    async def follow(self) -> AsyncIterator[bytes]:
        """Every chunk from the first, then each as it comes; the run's failure at its end."""
        sent = 0
        while True:
            while sent < len(self.chunks):
                yield self.chunks[sent]
                sent += 1
            if self.task.done():
                self.task.result()
                return
            await self.grew.wait()


@dataclass(frozen=True)
class _Answer:
    chunks: tuple[bytes, ...]
    fingerprint: Hashable
    at: float

    @property
    def size(self) -> int:
        return sum(map(len, self.chunks))


async def _kept(chunks: tuple[bytes, ...]) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield chunk


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
    def attached(
        self, key: Hashable | None, start: Start, fingerprint: Hashable = None
    ) -> Iterator[asyncio.Future[bytes]]:
        """The future of the run under `key`, started with `start()` unless one runs or just ran.

        Await it shielded (`asyncio.shield`) to leave early: leaving the block detaches this
        caller, and the run is cancelled once no caller is attached and it has not finished.
        A `key` of None is a run of this caller's own, neither shared nor kept.
        """

        async def one_chunk() -> AsyncIterator[bytes]:
            yield await start()

        with self._attach(key, fingerprint, one_chunk) as held:
            if isinstance(held, _Run):
                yield held.task
            else:
                kept: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
                kept.set_result(b"".join(held.chunks))
                yield kept

    @contextlib.asynccontextmanager
    async def streamed(
        self, key: Hashable | None, start: StartStream, fingerprint: Hashable = None
    ) -> AsyncIterator[AsyncIterator[bytes]]:
        """The chunks of the run under `key`, started with `start()` unless one runs or just ran.

        Entering waits until the run's `start()` has returned, and raises what it raised, so a
        caller inside the block knows the request was accepted. Leaving detaches this caller, as
        in `attached`; a `key` of None is a run of this caller's own.
        """
        with self._attach(key, fingerprint, start) as held:
            if isinstance(held, _Run):
                await held.wait_opened()
                yield held.follow()
            else:
                yield _kept(held.chunks)

    @contextlib.contextmanager
    def _attach(
        self, key: Hashable | None, fingerprint: Hashable, start: StartStream
    ) -> Iterator[_Run | _Answer]:
        """The kept answer under `key`, else its run (started unless one runs), this caller attached."""
        self._forget_old()
        answer = None if key is None else self._answers.get(key)
        if answer is not None:
            if answer.fingerprint != fingerprint:
                raise reused_id()
            yield answer
            return
        run = None if key is None else self._running.get(key)
        if run is None:
            run = _Run(fingerprint)
            run.task = asyncio.ensure_future(run.pump(start))
            if key is not None:
                self._running[key] = run
                run.task.add_done_callback(lambda task: self._settle(key, task))
            run.task.add_done_callback(lambda _: run.grew.set())
        elif run.fingerprint != fingerprint:
            raise reused_id()
        run.waiters += 1
        try:
            yield run
        finally:
            run.waiters -= 1
            if run.waiters == 0 and not run.task.done():
                run.task.cancel()

    def _settle(self, key: Hashable, task: asyncio.Future[bytes]) -> None:
        run = self._running.get(key)
        if run is None or run.task is not task:
            return
        del self._running[key]
        if task.cancelled() or task.exception() is not None:
            return
        answer = _Answer(tuple(run.chunks), run.fingerprint, self._clock())
        if answer.size > self.max_bytes:
            return
        if key in self._answers:
            self._kept_bytes -= self._answers.pop(key).size
        self._answers[key] = answer
        self._kept_bytes += answer.size
        while len(self._answers) > self.capacity or self._kept_bytes > self.max_bytes:
            self._evict_oldest()

    def _forget_old(self) -> None:
        horizon = self._clock() - self.keep_s
        while self._answers and next(iter(self._answers.values())).at < horizon:
            self._evict_oldest()

    def _evict_oldest(self) -> None:
        _, answer = self._answers.popitem(last=False)
        self._kept_bytes -= answer.size
