"""`EngineCore`: the scheduler, one synchronous `step()` at a time, with no threads and no handles.

A step (1) drops cancelled requests, (2) admits waiting ones in arrival order while their model's
KV pool has blocks for them (a generation also needs a batch slot, a document one of the
`max_batch_size` scoring places), (3) runs one decode pass for every model with decoding rows, and
(4) spends the step's budget (`service.engine.budget.StepBudget`: the token budget, held to a
multiple of the decode pass's time; decode rows do not count against it) on prompt chunks and
scoring chunks, taking the candidates round-robin so that one long document cannot starve another
model's prompts. With no row streaming, nobody watches the gaps, and the budget is wider. Whatever
the step produced for every request comes back as one `StepOutput`: the in-process engine hands it
to its handles, the engine process sends it to the API process in one message.

Requests of one model share the decode pass whatever their `pe_scaling`: every row carries its
own scaling down to the RoPE tables, so mixing scalings costs no extra pass.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from prometheus_client import Counter

from service.engine import pool_metrics
from service.engine.batch import ModelBatch, StepOutcome
from service.engine.budget import DEFAULT_PREFILL_SLOWDOWN, DEFAULT_STEP_TOKEN_BUDGET, StepBudget
from service.engine.errors import EngineError, RequestCancelledError, RequestFailedError
from service.engine.handle import Item
from service.engine.models import ModelSpec, ServedModel
from service.engine.sampler import sample_rows
from service.engine.scoring import SCORE_PATHS, ChunkedScorer, cached_positions
from service.engine.sequence import RunningSequence
from service.engine.types import GenerationRequest, PEInfo, ScoreResult, ScoringRequest, Timing
from service.model.attention_rules import attention_label
from service.model.backend import Backend, BackendChoice, choose_backend
from service.model.fast_decode import DEFAULT_MAX_WINDOW, FastDecoder, window_bucket
from service.model.kernels.logit_rows import logit_rows
from service.model.paged_cache import PagedKVCache, PagedRow, PagedRows, bytes_per_token
from service.model.quantized import weights_of

logger = logging.getLogger("service.engine.core")

# Each model's KV block pool unless `--kv-cache-mb` sets it: 128 MiB (about 21,800 tokens of a zoo
# model, 6 KiB per token), or room for `DEFAULT_POOL_REQUESTS` requests of max_context where that is
# more. A real model stores far more per token (SmolLM2 in float32: 46 KiB, so 128 MiB held 2,900
# tokens): one 3,300-token prompt then took the whole pool and evicted every cached prefix, and 16
# clients repeating their prompts read them again each time. A pool is never smaller than one
# request of max_context. On a CPU the pool's memory is committed as rows first write it.
DEFAULT_KV_CACHE_BYTES = 128 << 20
DEFAULT_POOL_REQUESTS = 4


@dataclass(frozen=True)
class DecodeSettings:
    """How decoding uses memory and the compiler (`--kv-cache-mb`, `--compile`, `--prefix-cache`)."""

    kv_cache_bytes: int | None = None  # None: the default rule (`DEFAULT_KV_CACHE_BYTES`)
    compile: bool = False
    prefix_cache: bool = True
    compile_max_window: int = DEFAULT_MAX_WINDOW  # the compiled backends' longest window; C has none


DEFAULT_DECODE = DecodeSettings()


@dataclass(frozen=True)
class Job:
    """A validated request on its way to the core; `pe` is what the response reports."""

    key: int  # unique per front-end, unlike request ids, which callers choose
    request: GenerationRequest | ScoringRequest
    pe: PEInfo
    submitted_at: float


@dataclass
class StepOutput:
    """Everything one step produced: events per job key, and counters."""

    events: list[tuple[int, Item]] = field(default_factory=list)
    running: int = 0
    waiting: int = 0  # generations admitted by the frontend but not yet in a batch (slots or KV blocks)
    batch_size: int = 0
    generated_total: int = 0


@dataclass
class _ScoreJob:
    """A document being scored, holding its row of the model's pool until it ends, however it ends."""

    job: Job
    request: ScoringRequest
    pool: PagedKVCache
    row: PagedRow
    scorer: ChunkedScorer
    started_at: float


class EngineCore:
    def __init__(
        self,
        models: Sequence[ServedModel],
        *,
        max_batch_size: int = 16,
        step_token_budget: int = DEFAULT_STEP_TOKEN_BUDGET,
        prefill_slowdown: float = DEFAULT_PREFILL_SLOWDOWN,
        decode: DecodeSettings = DEFAULT_DECODE,
    ) -> None:
        self._models = {served.name: served for served in models}
        self.max_batch_size = max_batch_size
        self.budget = StepBudget(step_token_budget, prefill_slowdown)
        self._batches = {
            name: _model_batch(served, decode, max_batch_size) for name, served in self._models.items()
        }
        self.compile_seconds = sum(
            batch.fast.compile_seconds for batch in self._batches.values() if batch.fast is not None
        )
        pool_metrics.track(self)
        for name in self._models:
            for path in SCORE_PATHS:
                _scored_positions().labels(name, path)  # every series from 0, for rate()
            for rule in self._models[name].spec.info.supported_attention:
                _attention_requests().labels(name, rule)
        self._waiting: dict[str, deque[Job]] = {name: deque() for name in self._models}
        self._scoring: list[_ScoreJob] = []  # admitted documents, in arrival order
        self._cancelled: set[int] = set()
        self._turn = 0
        self._generated_total = 0
        self._output = StepOutput()

    def add(self, job: Job) -> None:
        """Queue a generation or a document for its model's pool (`_admit`)."""
        self._waiting[job.request.model].append(job)
        _attention_requests().labels(job.request.model, attention_label(job.request.attention)).inc()

    def cancel(self, key: int) -> None:
        """Drop the job at the next step, wherever it is; unknown keys are ignored."""
        self._cancelled.add(key)

    def has_work(self) -> bool:
        return bool(
            self._cancelled
            or self._scoring
            or any(self._waiting.values())
            or any(map(len, self._batches.values()))
        )

    def step(self) -> StepOutput:
        self._drop_cancelled()
        for name in self._models:
            self._admit(name)
        decoding = [batch for batch in self._batches.values() if batch.decoding]
        # The budget is for chunks besides the decode rows, as documented: charging the rows to it
        # starved prompts exactly when many streams run (64 rows left 128 of 192; the bench's
        # 64-request workload took 12% longer in-process). Sampling syncs with the device, so the
        # clock reads the decode pass's real time.
        started = time.perf_counter()
        for batch in decoding:
            self._accept(batch.decode())
        chunks_started = time.perf_counter()
        allowance = self.budget.allowance(
            chunks_started - started if decoding else None,
            streaming=any(batch.streaming for batch in decoding),
        )
        spent = self._run_chunks(allowance)
        self.budget.observe(spent, time.perf_counter() - chunks_started, allowance)
        for batch in self._batches.values():
            self._release_finished(batch)
        return self._flush()

    def abort_all(self, error: EngineError) -> StepOutput:
        """Fail every request the core holds (shutdown, or a crash of the step loop)."""
        for batch in self._batches.values():
            for sequence in batch.retain(lambda _: False):
                if sequence.finish_reason != "error":
                    self._emit(sequence.key, error)
        for waiting in self._waiting.values():
            while waiting:
                self._emit(waiting.popleft().key, error)
        for score in list(self._scoring):
            self._end_score(score, error)
        self._cancelled.clear()
        return self._flush()

    # -- a step's parts -------------------------------------------------------------------------

    def _drop_cancelled(self) -> None:
        if not self._cancelled:
            return
        cancelled, self._cancelled = self._cancelled, set()
        for name, waiting in self._waiting.items():
            for job in [job for job in waiting if job.key in cancelled]:
                waiting.remove(job)
                self._emit(job.key, RequestCancelledError("the request was cancelled before it started"))
            for sequence in self._batches[name].sequences:
                if sequence.key in cancelled and sequence.finish_reason is None:
                    sequence.finish_reason = "cancelled"
        for score in [score for score in self._scoring if score.job.key in cancelled]:
            self._end_score(score, RequestCancelledError("the request was cancelled"))

    def kv_pools(self) -> dict[str, PagedKVCache]:
        return {name: batch.pool for name, batch in self._batches.items()}

    def backends(self) -> dict[str, Backend]:
        return {name: batch.backend for name, batch in self._batches.items()}

    def specs(self) -> list[ModelSpec]:
        """The models as clients see them, each with the backend its steps actually run on."""
        return [
            dataclasses.replace(
                served.spec,
                info=dataclasses.replace(served.spec.info, backend=str(self._batches[name].backend)),
            )
            for name, served in self._models.items()
        ]

    def _admit(self, name: str) -> None:
        """Start the model's waiting jobs in arrival order while its KV pool has blocks for them.

        A generation reserves blocks for its whole request and needs a batch slot; a document
        blocks for its whole length and one of the `max_batch_size` scoring places. A job without
        a slot or place lets the ones behind it by; a job waiting for blocks holds them back, so
        that neither short generations nor short documents starve a long one of memory.
        """
        waiting, batch, served = self._waiting[name], self._batches[name], self._models[name]
        now = time.perf_counter()
        for job in list(waiting):
            request = job.request
            if isinstance(request, ScoringRequest):
                if len(self._scoring) >= self.max_batch_size:
                    continue
                if not batch.pool.fits(cached_positions(request.tokens)):
                    return
                waiting.remove(job)
                self._start_score(job, request, batch, now)
                continue
            if len(batch) >= self.max_batch_size:
                continue
            if not batch.fits(request, served.effective_scaling(request.scaling)):
                return
            waiting.remove(job)
            sequence = RunningSequence(job.key, request, served, job.pe, job.submitted_at)
            sequence.started_at = now
            if sequence.finish_reason is not None:  # resumed after the token that ended it
                self._emit(job.key, sequence.result())
                continue
            batch.add(sequence)

    def _start_score(self, job: Job, request: ScoringRequest, batch: ModelBatch, now: float) -> None:
        """Give the document its row of the pool; its chunks run where prompt chunks do (`batch.fast`)."""
        row = batch.pool.allocate(cached_positions(request.tokens))
        scorer = ChunkedScorer(
            batch.model,
            request.tokens,
            PagedRows(batch.pool, [row]),
            self._models[request.model].effective_scaling(request.scaling),
            fast=batch.fast,
            top_logprobs=request.top_logprobs,
            attention=request.attention,
        )
        self._scoring.append(_ScoreJob(job, request, batch.pool, row, scorer, now))

    def _run_chunks(self, budget: int) -> int:
        """Prompt and scoring chunks, round-robin over the candidates, until the budget is spent;
        returns the units spent. The step's first candidate runs whatever is left of the budget;
        a later one only if what is left buys it a useful chunk (`useful_chunk_cost`)."""
        candidates: list[ModelBatch | _ScoreJob] = [b for b in self._batches.values() if b.prefilling]
        candidates += self._scoring
        if not candidates:
            return 0
        self._turn = (self._turn + 1) % len(candidates)
        left = budget
        for candidate in candidates[self._turn :] + candidates[: self._turn]:
            if left <= 0:
                break
            worth = (
                candidate.useful_chunk_cost()
                if isinstance(candidate, ModelBatch)
                else candidate.scorer.useful_chunk_cost()
            )
            if left < budget and left < worth:
                continue
            if isinstance(candidate, ModelBatch):
                outcome, spent = candidate.prefill_chunk(left)
                self._accept(outcome)
            else:
                spent = self._score_chunk(candidate, left)
            left -= spent
        return budget - left

    def _score_chunk(self, score: _ScoreJob, budget: int) -> int:
        try:
            spent = score.scorer.advance(budget)
        except Exception as error:
            self._end_score(score, _as_engine_error(error))
            return 0
        if not score.scorer.remaining:
            self._end_score(score, _score_result(score))
        return spent

    def _end_score(self, score: _ScoreJob, item: ScoreResult | EngineError) -> None:
        """Send the document's result or error, its blocks back to the pool, its positions to /metrics."""
        self._scoring.remove(score)
        score.scorer.close()
        score.pool.release(score.row)
        for path, positions in score.scorer.positions_by_path.items():
            _scored_positions().labels(score.request.model, path).inc(positions)
        self._emit(score.job.key, item)

    def _accept(self, outcome: StepOutcome) -> None:
        """Sample every row that ran; a row with non-finite logits or a failed pass fails alone."""
        for sequence, error in outcome.failed:
            self._fail(sequence, error)
        if not outcome.rows:
            return
        # One reading of the logits for the finiteness check and what sampling needs of them.
        logits = outcome.logits
        summary = logit_rows(logits)
        finite = summary.finite
        live = [
            row for row, sequence in enumerate(outcome.rows) if finite[row] and sequence.finish_reason is None
        ]
        for row, sequence in enumerate(outcome.rows):
            if not finite[row]:
                self._fail(
                    sequence, RequestFailedError("the model produced non-finite logits for this request")
                )
        if not live:
            return
        try:
            every = len(live) == len(outcome.rows)
            picks = sample_rows(
                [outcome.rows[row].sampler for row in live],
                logits if every else logits[live],
                summary if every else summary.of(live),
            )
        except Exception as error:  # a bug in sampling must fail these requests, never the engine
            logger.exception("sampling failed", extra={"rows": len(live)})
            for row in live:
                self._fail(outcome.rows[row], RequestFailedError(f"sampling failed: {error}"))
            return
        for row, pick in zip(live, picks, strict=True):
            sequence = outcome.rows[row]
            if pick is None:
                self._fail(sequence, RequestFailedError("the sampling controls leave no token to draw"))
                continue
            event = sequence.accept(pick)
            if sequence.request.stream or len(sequence.tokens) == 1:
                self._emit(sequence.key, event)
        self._generated_total += sum(pick is not None for pick in picks)

    def _fail(self, sequence: RunningSequence, error: Exception) -> None:
        if sequence.finish_reason is None:
            sequence.finish_reason = "error"
            self._emit(sequence.key, _as_engine_error(error))

    def _release_finished(self, batch: ModelBatch) -> None:
        """Drop finished and cancelled rows; send each its final result (errors were sent already)."""
        for sequence in batch.retain(lambda sequence: sequence.finish_reason is None):
            if sequence.finish_reason != "error":
                self._emit(sequence.key, sequence.result())

    def _emit(self, key: int, item: Item) -> None:
        self._output.events.append((key, item))

    def _flush(self) -> StepOutput:
        output, self._output = self._output, StepOutput()
        output.running = sum(map(len, self._batches.values()))
        jobs = [job for waiting in self._waiting.values() for job in waiting]
        output.waiting = sum(isinstance(job.request, GenerationRequest) for job in jobs)
        output.batch_size = max((batch.decoding for batch in self._batches.values()), default=0)
        output.generated_total = self._generated_total
        return output


@functools.cache
def _scored_positions() -> Counter:
    """`pe_scored_positions_total`: made by the first core, in the process that runs the engine,
    so that an API process whose engine runs elsewhere exports no empty copy beside the engine's."""
    return Counter(
        "pe_scored_positions",
        "Positions of /score documents run, by the pass that ran them: c (the C pass) or eager "
        "(the model's own layers).",
        ["model", "path"],
    )


@functools.cache
def _attention_requests() -> Counter:
    """`pe_attention_requests_total`: made as `_scored_positions` is, for the same reason."""
    return Counter(
        "pe_attention_requests",
        "Generations and documents queued, by the attention rule they run under (`pe_attention`: "
        "its type, with '+logn' when it scales queries).",
        ["model", "attention"],
    )


def _model_batch(served: ServedModel, decode: DecodeSettings, max_batch_size: int) -> ModelBatch:
    """The model's pool and batch, on the backend `choose_backend` picks, warmed up (compiled) now.

    A fast backend that fails to warm up (Inductor without a working compiler, a CUDA capture
    that runs out of memory) leaves the model eager, with the error in the log, instead of
    killing the engine during start-up.
    """
    model = served.model
    weight = model.embed_tokens.weight
    longest = served.spec.info.max_context
    budget = decode.kv_cache_bytes
    if budget is None:
        requests = DEFAULT_POOL_REQUESTS * longest * bytes_per_token(model.config, weight.dtype)
        budget = max(DEFAULT_KV_CACHE_BYTES, requests)
    pool = PagedKVCache.within(
        model.config,
        budget,
        min_tokens=longest,
        max_tokens=max_batch_size * longest,
        device=weight.device,
        dtype=weight.dtype,
    )
    choice = choose_backend(
        model.config,
        device=weight.device,
        dtype=weight.dtype,
        threads=torch.get_num_threads(),
        allow_compile=decode.compile,
        weights=weights_of(model),
    )
    fast = None
    if choice.backend is not Backend.EAGER:
        try:
            fast = FastDecoder(
                model,
                pool,
                choice.backend,
                max_window=_max_window(choice.backend, decode, longest),
                max_batch=max_batch_size,
            )
            fast.warm_up()
        except Exception as error:
            logger.exception("model %r: the %s backend failed to start", served.name, choice.backend)
            first_line = next(iter(str(error).strip().splitlines()), "")
            failed = f"the {choice.backend} backend failed: {type(error).__name__}: {first_line}"
            choice, fast = BackendChoice(Backend.EAGER, failed), None
    logger.info(
        "model %r decodes on the %s backend (%s)",
        served.name,
        choice.backend,
        choice.reason,
        extra={"model": served.name, "backend": str(choice.backend)},
    )
    return ModelBatch(model, pool, fast, choice.backend, prefix_cache=decode.prefix_cache)


def _max_window(backend: Backend, decode: DecodeSettings, longest: int) -> int:
    """The longest window the fast backend covers. Compiled backends compile an entry per window
    bucket, so `--compile-max-window` bounds their start-up; the C step compiles nothing per
    window, so it covers every context the model accepts and no row falls back to eager."""
    if backend is Backend.C:
        return window_bucket(longest)
    return decode.compile_max_window


def _score_result(score: _ScoreJob) -> ScoreResult:
    logprobs = score.scorer.result()
    alternatives = score.scorer.alternatives()
    return ScoreResult(
        tokens=score.request.tokens,
        token_logprobs=tuple(logprobs),
        total_logprob=sum(value for value in logprobs if value is not None),
        pe=score.job.pe,
        timing=Timing(
            queue_ms=(score.started_at - score.job.submitted_at) * 1000.0,
            prefill_ms=(time.perf_counter() - score.started_at) * 1000.0,
            decode_ms=0.0,
        ),
        top_logprobs=tuple(alternatives) if alternatives is not None else None,
    )


def _as_engine_error(error: Exception) -> EngineError:
    if isinstance(error, EngineError):
        return error
    logger.error("request failed: %r", error)
    return RequestFailedError(f"the request failed in the engine: {error}")
