"""Requests while they run: whose they are, what one key may have at once, and how to find them.

Every engine job of either transport is submitted here (`Submission.submit`), filed under its
request id and the caller that made it (`service.requests.auth`: a key's name, or ANONYMOUS when
the server has no keys). That one ledger is what makes these rules hold alike over HTTP, `/v1` and
gRPC:

- A request belongs to its caller: `Abort`, cancellation and lookup name a request by id within
  the caller's own requests, so another key's request answers NOT_FOUND exactly as one that does
  not exist (and two keys may use the same id).
- Per-key limits (`--max-concurrent-per-key`, `--max-queued-tokens-per-key`): a job that would
  take its caller past either is refused before the engine sees it, as a full queue is (429 /
  RESOURCE_EXHAUSTED with a retry delay). A request's tokens are its prompt plus the new tokens
  it asks for, counted until its job ends.
- One request per id: another with the id of one running is refused (CONFLICT), except a resumed
  stream (`resume_from`), which replaces a generation of its id and route still running: the
  stream it continues, whose client is gone though this server may not have noticed yet.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

from service.engine.types import (
    Engine,
    EngineEvent,
    FieldNames,
    GenerationRequest,
    GenerationResult,
    RequestHandle,
    ScoreResult,
    ScoringRequest,
    TokenEvent,
)
from service.requests.errors import ErrorKind, RequestError
from service.requests.metrics import ServiceMetrics
from service.requests.responses import RunningRequestInfo

REQUEST_ID_FIELD = "request_id"
# Seconds a client refused by a per-key limit is told to wait: one of its own requests ends by then
# on any workload this server is sized for, and polling faster only adds load.
KEY_LIMIT_RETRY_AFTER_S = 1


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


@dataclass(frozen=True)
class KeyLimits:
    """What one caller may have unfinished at once; 0 is no limit."""

    max_concurrent: int = 0
    max_queued_tokens: int = 0


@dataclass
class Running:
    """One request of one caller: its engine jobs (several for OpenAI's `n`) while any is unfinished."""

    caller: str
    request_id: str
    endpoint: str
    started_at: float = field(default_factory=time.time)
    models: list[str] = field(default_factory=list)
    jobs: int = 0
    tokens: int = 0
    aborted: bool = False
    handles: list[TrackedHandle] = field(default_factory=list)

    def info(self) -> RunningRequestInfo:
        return RunningRequestInfo(
            request_id=self.request_id,
            endpoint=self.endpoint,
            models=self.models,
            jobs=self.jobs,
            tokens=self.tokens,
            age_s=round(time.time() - self.started_at, 3),
            cancelled=self.aborted,
        )


def job_tokens(job: GenerationRequest | ScoringRequest) -> int:
    """What a job counts against its caller's token limit: prompt plus the new tokens it may make."""
    if isinstance(job, GenerationRequest):
        return len(job.prompt_tokens) + job.sampling.max_new_tokens
    return len(job.tokens)


def not_found(request_id: str) -> RequestError:
    """Another caller's request and no request at all read the same, so ids reveal nothing."""
    detail = f"No running request has id {request_id!r}."
    return RequestError(ErrorKind.NOT_FOUND, detail, param=REQUEST_ID_FIELD, error_type="request_not_found")


def stopped_by_owner() -> RequestError:
    return RequestError(
        ErrorKind.CANCELLED, "The request was stopped by Abort or POST /requests/{id}/cancel."
    )


def key_limit(message: str, error_type: str) -> RequestError:
    """A per-key refusal: what a full queue is to the client (wait, then retry)."""
    return RequestError(
        ErrorKind.QUEUE_FULL, message, error_type=error_type, retry_after_s=KEY_LIMIT_RETRY_AFTER_S
    )


class RunningRequests:
    """The ledger of unfinished requests by (caller, request id), shared by every transport."""

    def __init__(self, limits: KeyLimits | None = None) -> None:
        self.limits = limits or KeyLimits()
        self._running: dict[tuple[str, str], Running] = {}

    def open(self, caller: str, request_id: str, endpoint: str) -> Submission:
        """What one HTTP request or gRPC call submits its jobs through, under `request_id`."""
        return Submission(self, caller, request_id, endpoint)

    def lookup(self, caller: str, request_id: str) -> Running:
        """The caller's request by id; NOT_FOUND for another caller's or none."""
        running = self._running.get((caller, request_id))
        if running is None:
            raise not_found(request_id)
        return running

    def abort(self, caller: str, request_id: str) -> Running:
        """Stop the caller's request: its readers end with CANCELLED; NOT_FOUND for another's or none."""
        running = self.lookup(caller, request_id)
        running.aborted = True
        for handle in list(running.handles):
            handle.cancel()
        return running

    def admit(self, running: Running, job: GenerationRequest | ScoringRequest) -> int:
        """Check `job` against the caller's limits and the id against its running requests."""
        key = (running.caller, running.request_id)
        filed = self._running.get(key)
        if filed is not None and filed is not running:
            resumes = isinstance(job, GenerationRequest) and job.resumed is not None
            if not resumes or filed.endpoint != running.endpoint:
                message = f"A request with id {running.request_id!r} is running."
                raise RequestError(ErrorKind.CONFLICT, message, param=REQUEST_ID_FIELD)
            for handle in list(filed.handles):  # each leaves the ledger as it is cancelled
                handle.cancel()
        mine = [other for (caller, _), other in self._running.items() if caller == running.caller]
        limits = self.limits
        if filed is None and limits.max_concurrent and len(mine) >= limits.max_concurrent:
            message = f"This key has {len(mine)} requests unfinished, its limit; retry when one ends."
            raise key_limit(message, "key_concurrency_limit")
        tokens = job_tokens(job)
        if limits.max_queued_tokens and tokens > limits.max_queued_tokens:
            message = (
                f"The request needs {tokens} tokens (prompt plus new tokens); one key may have at most "
                f"{limits.max_queued_tokens} unfinished."
            )
            raise RequestError(ErrorKind.INVALID, message)
        held = sum(other.tokens for other in mine)
        if limits.max_queued_tokens and held + tokens > limits.max_queued_tokens:
            message = (
                f"This key has {held} tokens unfinished; {tokens} more would pass its limit of "
                f"{limits.max_queued_tokens}. Retry when one of its requests ends."
            )
            raise key_limit(message, "key_token_limit")
        self._running[key] = running
        return tokens

    def release(self, running: Running, handle: TrackedHandle | None = None) -> None:
        """`handle`'s job ended; the request leaves the ledger with its last job (or none submitted)."""
        if handle is not None:
            running.jobs -= 1
            running.tokens -= handle.tokens
            running.handles.remove(handle)
        key = (running.caller, running.request_id)
        if running.jobs == 0 and self._running.get(key) is running:
            del self._running[key]


class Submission:
    """One call's jobs, filed under one request id: the first job opens the request's entry."""

    def __init__(self, ledger: RunningRequests, caller: str, request_id: str, endpoint: str) -> None:
        self._ledger = ledger
        self.running = Running(caller=caller, request_id=request_id, endpoint=endpoint)

    def submit(
        self, engine: Engine, job: GenerationRequest | ScoringRequest, names: FieldNames
    ) -> TrackedHandle:
        """Admit `job` (per-key limits, a free id) and queue it; raises RequestError / EngineError,
        naming fields as the request wrote them (`names`)."""
        running = self.running
        tokens = self._ledger.admit(running, job)
        try:
            inner = engine.submit(job, names)
        except BaseException:
            self._ledger.release(running)
            raise
        handle = TrackedHandle(inner, running, tokens, self._ledger)
        running.jobs += 1
        running.tokens += tokens
        running.handles.append(handle)
        running.models.append(job.model)
        return handle


class TrackedHandle:
    """An engine handle that leaves the ledger when its job ends: final result, failure or cancel.

    Once its request is aborted, reading it raises CANCELLED (`stopped_by_owner`) rather than
    what the engine says of a cancelled job. `cancel()` after the final result does nothing.
    """

    def __init__(self, inner: RequestHandle, running: Running, tokens: int, ledger: RunningRequests) -> None:
        self.request_id = inner.request_id
        self.tokens = tokens
        self._inner = inner
        self._running = running
        self._ledger = ledger
        self._finished = False
        self._released = False

    def cancel(self) -> None:
        if not self._finished:
            self._finished = True
            self._inner.cancel()
        self._release()

    def __aiter__(self) -> AsyncIterator[EngineEvent]:
        return self._iterate_async()

    async def _iterate_async(self) -> AsyncIterator[EngineEvent]:
        try:
            async for event in self._inner:
                yield self._checked(event)
        except Exception as error:
            raise self._failure(error) from None

    def __iter__(self) -> Iterator[EngineEvent]:
        try:
            for event in self._inner:
                yield self._checked(event)
        except Exception as error:
            raise self._failure(error) from None

    def _failure(self, error: Exception) -> Exception:
        """The job failed (or was stopped): it leaves the ledger; an aborted one reads CANCELLED."""
        self._release()
        return stopped_by_owner() if self._running.aborted else error

    def _checked(self, event: EngineEvent) -> EngineEvent:
        if self._running.aborted:
            raise stopped_by_owner()
        if isinstance(event, GenerationResult | ScoreResult):
            self._finished = True
            self._release()
        return event

    def _release(self) -> None:
        if not self._released:
            self._released = True
            self._ledger.release(self._running, self)
