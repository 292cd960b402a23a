"""`InferenceEngine`: continuous batching on a worker thread, one running batch per model.

Each loop iteration (1) takes newly submitted requests from the inbox, (2) admits waiting ones
while their model's batch has room (scoring requests and prompt prefills run then, alone), and
(3) runs one decode step for every non-empty batch. Requests therefore join and leave between
decode steps and nobody waits for the slowest sequence. Requests for the same model share the
decode forward pass whatever their `pe_scaling`: every row carries its own scaling down to the
RoPE tables (gathered per row from `PECache`), so mixing scalings costs no extra pass.

Failure is contained per request: non-finite logits fail the row they appear in, and if a batched
step raises, the rows are rerun one by one so only the row that raises fails.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections import defaultdict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from pe_runtime import PECache, RopeScaling
from service.engine.batch import RunningBatch
from service.engine.errors import (
    EngineDrainingError,
    EngineError,
    InvalidRequestError,
    ModelNotFoundError,
    QueueFullError,
    RequestCancelledError,
    RequestFailedError,
)
from service.engine.handle import EngineHandle
from service.engine.models import ServedModel, load_served_model, resolve_device, resolve_dtype
from service.engine.sampler import sample_rows
from service.engine.scoring import score_tokens
from service.engine.sequence import RunningSequence
from service.engine.types import (
    EngineStats,
    GenerationRequest,
    ModelInfo,
    PEInfo,
    SamplingParams,
    ScoreRequest,
    ScoreResult,
    Timing,
)
from service.model.config import SCHEMES

logger = logging.getLogger("service.engine")

_IDLE_WAIT_S = 0.05


@dataclass
class _Job:
    request: GenerationRequest | ScoreRequest
    handle: EngineHandle
    pe: PEInfo
    submitted_at: float


@functools.cache
def process_pe_cache() -> PECache:
    """The process's PE table cache, registered once on the global Prometheus registry."""
    return PECache()


class InferenceEngine:
    """Implements `service.engine.types.Engine`. Construct, `start()`, then `submit()` from any thread."""

    def __init__(
        self, models: Sequence[ServedModel], *, max_batch_size: int = 16, max_queue: int = 64
    ) -> None:
        if not models:
            raise ValueError("the engine needs at least one model")
        self._models = {served.name: served for served in models}
        if len(self._models) != len(models):
            raise ValueError("model names must be unique")
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self._batches = {name: RunningBatch(served.model) for name, served in self._models.items()}
        self._waiting: dict[str, deque[_Job]] = {name: deque() for name in self._models}
        self._inbox: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._queued = 0  # submitted, not yet admitted to a batch
        self._running = 0
        self._last_batch_size = 0
        self._generated_total = 0
        self._draining = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._crash: BaseException | None = None

    @classmethod
    def from_model_dirs(
        cls,
        dirs: Iterable[Path | str],
        *,
        device: str = "auto",
        dtype: str | torch.dtype | None = None,
        max_context: int = 4096,
        max_batch_size: int = 16,
        max_queue: int = 64,
        pe_cache: PECache | None = None,
    ) -> InferenceEngine:
        """Load every directory (ours or Hugging Face Llama-family) onto one device, in order."""
        target = resolve_device(device)
        cache = pe_cache if pe_cache is not None else process_pe_cache()
        models = [
            load_served_model(
                Path(directory),
                device=target,
                dtype=resolve_dtype(dtype, target),
                max_context=max_context,
                pe_cache=cache,
            )
            for directory in dirs
        ]
        return cls(models, max_batch_size=max_batch_size, max_queue=max_queue)

    # -- the Engine protocol -------------------------------------------------------------------

    def models(self) -> list[ModelInfo]:
        return [served.info for served in self._models.values()]

    def resolve_model(self, model: str | None, scheme: str | None) -> ModelInfo:
        """`model` by name, else the first model (load order) trained with `scheme`, else the first."""
        if model is not None:
            served = self._models.get(model)
            if served is None:
                raise ModelNotFoundError(f"model {model!r} is not loaded", param="model")
            if scheme is not None and served.info.scheme != scheme:
                raise InvalidRequestError(
                    f"model {model!r} uses the {served.info.scheme!r} scheme, not {scheme!r}", param="pe"
                )
            return served.info
        if scheme is None:
            return next(iter(self._models.values())).info
        for served in self._models.values():
            if served.info.scheme == scheme:
                return served.info
        if scheme not in SCHEMES:
            raise InvalidRequestError(f"unknown scheme {scheme!r}; expected one of {SCHEMES}", param="pe")
        raise ModelNotFoundError(f"no loaded model uses the {scheme!r} scheme", param="pe")

    def resolve_pe(self, model: str, scaling: RopeScaling | None, total_length: int) -> PEInfo:
        return self._served(model).resolve_pe(scaling, total_length)

    def encode(self, model: str, text: str) -> list[int]:
        return self._served(model).encode(text)

    def decode(self, model: str, tokens: list[int]) -> str:
        return self._served(model).tokenizer.decode(tokens)

    def submit(self, request: GenerationRequest | ScoreRequest) -> EngineHandle:
        """Validate and queue; errors are raised here, before anything is queued."""
        served = self._served(request.model)
        tokens = request.prompt_tokens if isinstance(request, GenerationRequest) else request.tokens
        self._check_tokens(served, tokens, minimum=1 if isinstance(request, GenerationRequest) else 2)
        if isinstance(request, GenerationRequest):
            _check_sampling(request.sampling)
        new_tokens = request.sampling.max_new_tokens if isinstance(request, GenerationRequest) else 0
        pe = served.resolve_pe(request.scaling, len(tokens) + new_tokens)
        with self._lock:
            if self._draining or self._stop.is_set() or self._crash is not None:
                raise EngineDrainingError("the engine is draining or stopped and accepts no new requests")
            if self.max_queue and self._queued >= self.max_queue:
                raise QueueFullError(
                    f"the queue is full ({self.max_queue} requests waiting)",
                    retry_after_s=self._retry_after(),
                )
            self._queued += 1
        handle = EngineHandle(request.request_id)
        self._inbox.put(_Job(request, handle, pe, time.perf_counter()))
        return handle

    def stats(self) -> EngineStats:
        with self._lock:
            return EngineStats(
                queue_depth=self._queued,
                running=self._running,
                batch_size=self._last_batch_size,
                generated_tokens_total=self._generated_total,
            )

    def healthy(self) -> bool:
        return self._crash is None and (self._thread is None or self._thread.is_alive())

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="pe-serve-engine", daemon=True)
            self._thread.start()

    def drain(self, timeout_s: float) -> bool:
        with self._lock:
            self._draining = True
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if self._queued == 0 and self._running == 0:
                    return True
            time.sleep(0.01)
        with self._lock:
            return self._queued == 0 and self._running == 0

    def shutdown(self) -> None:
        """Stop the worker; requests still queued or running fail with EngineDrainingError."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._abort_everything(EngineDrainingError("the engine shut down before this request finished"))

    # -- the worker ---------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._collect_inbox(block=not any(self._batches.values()))
                for name in self._models:
                    self._admit(name)
                    self._decode_step(name)
        except BaseException as error:
            self._crash = error
            logger.exception("engine worker crashed")
            self._abort_everything(RequestFailedError(f"the engine stopped: {error}"))

    def _collect_inbox(self, *, block: bool) -> None:
        try:
            job = self._inbox.get(timeout=_IDLE_WAIT_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._waiting[job.request.model].append(job)
            try:
                job = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _admit(self, name: str) -> None:
        """Start waiting requests while the model's batch has room (scoring needs no slot)."""
        waiting, batch = self._waiting[name], self._batches[name]
        starting: dict[int, list[RunningSequence]] = defaultdict(list)  # by prompt length
        while waiting and (
            isinstance(waiting[0].request, ScoreRequest)
            or len(batch) + sum(map(len, starting.values())) < self.max_batch_size
        ):
            job = waiting.popleft()
            starts_generating = not job.handle.cancelled and not isinstance(job.request, ScoreRequest)
            with self._lock:  # one step from queued to running: stats never show the job in neither
                self._queued -= 1
                self._running += int(starts_generating)
            if job.handle.cancelled:
                job.handle.push(RequestCancelledError("the request was cancelled before it started"))
            elif isinstance(job.request, ScoreRequest):
                self._score(job, job.request)
            else:
                sequence = RunningSequence(
                    job.request, job.handle, self._models[name], job.pe, job.submitted_at
                )
                starting[len(job.request.prompt_tokens)].append(sequence)
        for sequences in starting.values():
            self._prefill(batch, sequences)

    def _score(self, job: _Job, request: ScoreRequest) -> None:
        served = self._models[request.model]
        started = time.perf_counter()
        try:
            logprobs = score_tokens(served.model, request.tokens, served.effective_scaling(request.scaling))
        except Exception as error:
            job.handle.push(_as_engine_error(error))
            return
        job.handle.push(
            ScoreResult(
                tokens=request.tokens,
                token_logprobs=tuple(logprobs),
                total_logprob=sum(value for value in logprobs if value is not None),
                pe=job.pe,
                timing=Timing(
                    queue_ms=(started - job.submitted_at) * 1000.0,
                    prefill_ms=(time.perf_counter() - started) * 1000.0,
                    decode_ms=0.0,
                ),
            )
        )

    def _prefill(self, batch: RunningBatch, sequences: list[RunningSequence]) -> None:
        """Prefill prompts of one length together; if that raises, each alone, so only the culprit fails."""
        started = time.perf_counter()
        for sequence in sequences:
            sequence.started_at = started
        try:
            self._accept_rows(sequences, batch.prefill(sequences))
        except Exception:
            for sequence in sequences:
                try:
                    self._accept_rows([sequence], batch.prefill([sequence]))
                except Exception as error:
                    self._fail(sequence, error)
        self._release_finished(batch)

    def _decode_step(self, name: str) -> None:
        batch = self._batches[name]
        self._release_finished(batch)
        if not len(batch):
            return
        try:
            self._accept_rows(batch.sequences, batch.decode())
        except Exception:
            logger.exception("batched decode step failed; rerunning rows one by one")
            outcomes = batch.decode_rows_alone()
            for sequence, outcome in zip(batch.sequences, outcomes, strict=True):
                if isinstance(outcome, Exception):
                    self._fail(sequence, outcome)
                else:
                    self._accept_rows([sequence], outcome[None])
        with self._lock:
            self._last_batch_size = len(batch.sequences)
        self._release_finished(batch)

    def _accept_rows(self, sequences: Sequence[RunningSequence], logits: Tensor) -> None:
        """Sample every row of float32 logits [N, V]; a row with non-finite logits fails alone."""
        finite = torch.isfinite(logits).all(dim=-1).tolist()
        live = [
            row for row, sequence in enumerate(sequences) if finite[row] and not sequence.handle.cancelled
        ]
        for row, sequence in enumerate(sequences):
            if not finite[row]:
                self._fail(
                    sequence, RequestFailedError("the model produced non-finite logits for this request")
                )
        if not live:
            return
        picks = sample_rows([sequences[row].sampler for row in live], logits[live])
        for row, (token, logprob) in zip(live, picks, strict=True):
            sequences[row].accept(token, logprob)
        with self._lock:
            self._generated_total += len(live)

    def _fail(self, sequence: RunningSequence, error: Exception) -> None:
        sequence.finish_reason = "error"
        sequence.handle.push(_as_engine_error(error))

    def _release_finished(self, batch: RunningBatch) -> None:
        """Drop finished and cancelled rows; send each its final result (errors were sent already)."""
        for sequence in batch.sequences:
            if sequence.handle.cancelled and sequence.finish_reason is None:
                sequence.finish_reason = "cancelled"
        done = batch.retain(lambda sequence: sequence.finish_reason is None)
        for sequence in done:
            if sequence.finish_reason != "error":
                sequence.handle.push(sequence.result())
        with self._lock:
            self._running -= len(done)

    def _abort_everything(self, error: EngineError) -> None:
        for batch in self._batches.values():
            for sequence in batch.retain(lambda _: False):
                if sequence.finish_reason != "error":
                    sequence.handle.push(error)
        jobs = [job for waiting in self._waiting.values() for job in waiting]
        for waiting in self._waiting.values():
            waiting.clear()
        while True:
            try:
                jobs.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        for job in jobs:
            job.handle.push(error)
        with self._lock:
            self._queued = 0
            self._running = 0

    # -- helpers ------------------------------------------------------------------------------

    def _served(self, name: str) -> ServedModel:
        served = self._models.get(name)
        if served is None:
            raise ModelNotFoundError(f"model {name!r} is not loaded", param="model")
        return served

    @staticmethod
    def _check_tokens(served: ServedModel, tokens: Sequence[int], *, minimum: int) -> None:
        if len(tokens) < minimum:
            raise InvalidRequestError(
                f"at least {minimum} token(s) are needed, got {len(tokens)}", param="tokens"
            )
        vocab = served.info.vocab_size
        for index, token in enumerate(tokens):
            if not 0 <= token < vocab:
                raise InvalidRequestError(
                    f"token {token} is outside the vocabulary of {served.name!r} (0..{vocab - 1})",
                    param=f"tokens.{index}",
                )

    def _retry_after(self) -> float:
        """A rough wait: one second per batch-load of queued work, at least one."""
        return max(1.0, self._queued / max(self.max_batch_size, 1))


def _check_sampling(params: SamplingParams) -> None:
    """Ranges the sampler relies on (the HTTP layer checks them too; other callers may not)."""
    problems = {
        "max_new_tokens": params.max_new_tokens < 1,
        "temperature": not params.temperature >= 0.0,
        "top_k": params.top_k < 0,
        "top_p": not 0.0 < params.top_p <= 1.0,
    }
    for field, bad in problems.items():
        if bad:
            value = getattr(params, field)
            raise InvalidRequestError(f"{field} is out of range: {value!r}", param=field)


def _as_engine_error(error: Exception) -> EngineError:
    if isinstance(error, EngineError):
        return error
    logger.error("request failed: %r", error)
    return RequestFailedError(f"the request failed in the engine: {error}")
