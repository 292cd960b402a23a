"""Requests while they run: time to first token, and the registry `Abort` finds them in."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from service.engine.types import (
    Engine,
    EngineEvent,
    GenerationRequest,
    RequestHandle,
    ScoringRequest,
    TokenEvent,
)
from service.requests.errors import ErrorKind, RequestError
from service.requests.metrics import ServiceMetrics

REQUEST_ID_FIELD = "request_id"


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


@dataclass
class Running:
    handle: RequestHandle
    finished: bool = False
    aborted: bool = False


class RunningRequests:
    """Requests by their id while they run, so that another call can stop one by naming it."""

    def __init__(self) -> None:
        self._running: dict[str, Running] = {}

    @contextmanager
    def submitted(self, engine: Engine, job: GenerationRequest | ScoringRequest) -> Iterator[Running]:
        """Submit `job` under its id; cancel it unless it finished, however the block ends."""
        if job.request_id in self._running:
            message = f"A request with id {job.request_id!r} is running."
            raise RequestError(ErrorKind.CONFLICT, message, param=REQUEST_ID_FIELD)
        running = Running(handle=engine.submit(job))
        self._running[job.request_id] = running
        try:
            yield running
        except Exception:
            if running.aborted:
                raise RequestError(ErrorKind.CANCELLED, "The request was stopped by Abort.") from None
            raise
        finally:
            del self._running[job.request_id]
            if not running.finished:
                running.handle.cancel()

    def abort(self, request_id: str) -> None:
        """Stop a running request; NOT_FOUND when none runs under that id."""
        running = self._running.get(request_id)
        if running is None:
            detail = f"No running request has id {request_id!r}."
            raise RequestError(
                ErrorKind.NOT_FOUND, detail, param=REQUEST_ID_FIELD, error_type="request_not_found"
            )
        running.aborted = True
        running.handle.cancel()
