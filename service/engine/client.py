"""`EngineClient`: the `Engine` interface in the API process, over a pipe to the engine process.

Requests are validated here against the catalog the engine sent at start (the same `ModelSpec`
rules), so a bad request never crosses the boundary and errors keep their fields. One reader
thread receives the engine's step messages and hands each to the handles in one batch: the event
loop wakes once per engine step, not once per token per request.

If the engine process dies, every request in flight fails at once with a 503-class error, the
engine reports itself unhealthy (so `/readyz` turns 503), and the client starts a new engine
process. "At once" is as soon as the process begins to exit (`ExitWatch`, within tens of
milliseconds), not when its pipe closes, which waits for the kernel to free its memory.
`/readyz` is 200 again once the new one has loaded. More than `MAX_RESTARTS` deaths within
`RESTART_WINDOW_S`, or a failed reload, and the engine is lost: the server then exits non-zero
and leaves the restart to its supervisor (Kubernetes, compose, systemd).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import multiprocessing
import threading
import time
from collections import deque
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from service.engine.catalog import ModelCatalog
from service.engine.config import EngineConfig
from service.engine.core import Job
from service.engine.errors import EngineUnavailableError, ModelLoadError
from service.engine.exit_watch import ExitWatch
from service.engine.frontend import EngineFrontend
from service.engine.models import ModelSpec
from service.engine.process import engine_main

logger = logging.getLogger("service.engine.client")

MAX_RESTARTS = 3
RESTART_WINDOW_S = 600.0
_METRICS_TIMEOUT_S = 2.0
_STOP_TIMEOUT_S = 10.0


class EngineStartError(ModelLoadError):
    """The engine process could not load its models."""


class EngineClient(EngineFrontend):
    def __init__(self, config: EngineConfig, *, max_queue: int) -> None:
        self.config = config
        process, connection, specs = _spawn(config)
        super().__init__(ModelCatalog(specs), max_batch_size=config.max_batch_size, max_queue=max_queue)
        self._process = process
        self._connection = connection
        self._send_lock = threading.Lock()
        self._available = threading.Event()
        self._available.set()
        self._stopping = False
        self._lost = False
        self._deaths: deque[float] = deque()
        self._metrics_replies: dict[int, tuple[threading.Event, list[bytes]]] = {}
        self._nonces = itertools.count()
        self._reader = threading.Thread(target=self._read, name="pe-serve-engine-reader", daemon=True)
        self._reader.start()
        self._watch = self._watched(process)

    def healthy(self) -> bool:
        return self._available.is_set() and not self._lost and not self._stopping

    def lost(self) -> bool:
        return self._lost

    def start(self) -> None:
        """The engine process runs from the moment it has loaded; nothing to start."""

    def shutdown(self) -> None:
        self._stopping = True
        self._watch.stop()
        with contextlib.suppress(OSError, EOFError):
            self._post(("shutdown",))
        self._process.join(_STOP_TIMEOUT_S)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._reader.join(_STOP_TIMEOUT_S)
        self._fail_outstanding(EngineUnavailableError("the engine shut down before this request finished"))

    def metrics_text(self) -> bytes:
        """The engine process's registry (PE cache counters, its process metrics); empty if it does
        not answer in time, so a busy or restarting engine never blocks a scrape for long."""
        nonce = next(self._nonces)
        waiter: tuple[threading.Event, list[bytes]] = (threading.Event(), [])
        self._metrics_replies[nonce] = waiter
        try:
            self._post(("metrics", nonce))
            waiter[0].wait(_METRICS_TIMEOUT_S)
        except (OSError, EOFError):
            return b""
        finally:
            self._metrics_replies.pop(nonce, None)
        return waiter[1][0] if waiter[1] else b""

    def _send(self, job: Job) -> None:
        try:
            self._post(("add", job))
        except (OSError, EOFError):
            error = EngineUnavailableError("the engine process is not reachable; retry the request")
            self._fail_request(job.key, error)

    def _send_cancel(self, key: int) -> None:
        with contextlib.suppress(OSError, EOFError):
            self._post(("cancel", key))

    def _post(self, message: tuple[object, ...]) -> None:
        with self._send_lock:
            self._connection.send(message)

    def _read(self) -> None:
        while True:
            try:
                message = self._connection.recv()
            except (EOFError, OSError):
                if self._stopping or not self._restart():
                    return
                continue
            if message[0] == "step":
                self._deliver(message[1])
            elif message[0] == "metrics":
                waiter = self._metrics_replies.get(message[1])
                if waiter is not None:
                    waiter[1].append(message[2])
                    waiter[0].set()

    def _watched(self, process: BaseProcess) -> ExitWatch:
        return ExitWatch(process.pid or 0, lambda: self._dying(process))

    def _dying(self, process: BaseProcess) -> None:
        """The engine process began to exit (`ExitWatch`): refuse new work and fail what was in
        flight now, without waiting for the kernel to free its memory and close its pipe."""
        if self._stopping or process is not self._process:
            return
        self._available.clear()
        logger.error("the engine process is exiting", extra={"pid": process.pid})
        self._fail_outstanding(_died())

    def _restart(self) -> bool:
        """The engine process died: fail what was in flight, then start a new one if allowed."""
        self._available.clear()
        self._watch.stop()
        self._process.join(1.0)
        code = self._process.exitcode
        logger.error("the engine process died", extra={"exit_code": code})
        self._fail_outstanding(_died(code))
        now = time.monotonic()
        self._deaths.append(now)
        while self._deaths and now - self._deaths[0] > RESTART_WINDOW_S:
            self._deaths.popleft()
        if len(self._deaths) > MAX_RESTARTS:
            logger.error("the engine process keeps dying; giving up", extra={"deaths": len(self._deaths)})
            self._lost = True
            return False
        try:
            process, connection, _ = _spawn(self.config)
        except Exception:
            logger.exception("the engine process could not be restarted")
            self._lost = True
            return False
        with self._send_lock:
            self._process, self._connection = process, connection
        self._watch = self._watched(process)
        self._available.set()
        logger.info("the engine process was restarted", extra={"pid": process.pid})
        return True


def _died(exit_code: int | None = None) -> EngineUnavailableError:
    code = "" if exit_code is None else f" (exit code {exit_code})"
    return EngineUnavailableError(f"the engine process stopped unexpectedly{code}; retry the request")


def _spawn(config: EngineConfig) -> tuple[BaseProcess, Connection, list[ModelSpec]]:
    """Start an engine process and wait until it has loaded its models (or failed to)."""
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe(duplex=True)
    process = context.Process(target=engine_main, args=(theirs, config), name="pe-serve-engine", daemon=True)
    process.start()
    theirs.close()
    try:
        while not ours.poll(0.5):
            if not process.is_alive():
                raise EngineStartError(
                    f"the engine process exited while loading (exit code {process.exitcode})"
                )
        message = ours.recv()
    except (EOFError, OSError) as error:
        process.join(_STOP_TIMEOUT_S)
        raise EngineStartError(
            f"the engine process exited while loading (exit code {process.exitcode})"
        ) from error
    if message[0] != "ready":
        process.join(_STOP_TIMEOUT_S)
        raise EngineStartError(message[1])
    return process, ours, message[1]
