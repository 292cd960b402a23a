"""`EngineFrontend`: the `Engine` protocol on the API side of the engine core, wherever that runs.

It validates a request with the model catalog, admits it against the queue bound, keeps its handle,
and passes the job on through `_send`; step outputs come back through `_deliver`, in one batch per
engine step. The two subclasses differ only in where the core runs: `InferenceEngine` on a thread
of this process, `EngineClient` in a process of its own.
"""

from __future__ import annotations

import itertools
import threading
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Sequence

from pe_runtime import RopeScaling
from service.engine.catalog import ModelCatalog
from service.engine.core import Job, StepOutput
from service.engine.errors import EngineDrainingError, EngineError, QueueFullError
from service.engine.handle import EngineHandle, deliver, is_final
from service.engine.types import (
    ENGINE_NAMES,
    EngineStats,
    FieldNames,
    GenerationRequest,
    ModelInfo,
    PEInfo,
    ScoringRequest,
    TokenizerInfo,
)
from service.model.attention_rules import AttentionRule


class EngineFrontend(ABC):
    def __init__(self, catalog: ModelCatalog, *, max_batch_size: int, max_queue: int) -> None:
        self.catalog = catalog
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self._lock = threading.Lock()
        self._handles: dict[int, EngineHandle] = {}  # by job key
        self._generating: dict[int, str] = {}  # job key -> model, for generations in flight
        self._keys = itertools.count()
        self._draining = False
        self._core_stats = StepOutput()

    # -- the Engine protocol --------------------------------------------------------------------

    def models(self) -> list[ModelInfo]:
        return self.catalog.models()

    def resolve_model(self, model: str | None, scheme: str | None) -> ModelInfo:
        return self.catalog.resolve_model(model, scheme)

    def resolve_pe(
        self,
        model: str,
        scaling: RopeScaling | None,
        total_length: int,
        attention: AttentionRule | None = None,
    ) -> PEInfo:
        return self.catalog.resolve_pe(model, scaling, total_length, attention)

    def tokenize(self, model: str, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self.catalog.tokenize(model, text, add_special_tokens=add_special_tokens)

    def tokenizer_info(self, model: str) -> TokenizerInfo:
        return self.catalog.tokenizer_info(model)

    def detokenize(self, model: str, tokens: list[int]) -> str:
        return self.catalog.detokenize(model, tokens)

    def check_input(
        self,
        model: str,
        tokens: Sequence[int],
        *,
        new_tokens: int,
        scaling: RopeScaling | None,
        attention: AttentionRule | None = None,
        names: FieldNames = ENGINE_NAMES,
    ) -> PEInfo:
        return self.catalog.check_input(
            model, tokens, new_tokens=new_tokens, scaling=scaling, attention=attention, names=names
        )

    def submit(
        self, request: GenerationRequest | ScoringRequest, names: FieldNames = ENGINE_NAMES
    ) -> EngineHandle:
        """Validate and queue; errors are raised here, before anything is queued."""
        pe = self.catalog.validate(request, names)
        key = next(self._keys)
        handle = EngineHandle(request.request_id, on_cancel=lambda: self._send_cancel(key))
        with self._lock:
            if self._draining or not self.healthy():
                raise EngineDrainingError("the engine is draining or stopped and accepts no new requests")
            generating = isinstance(request, GenerationRequest)
            if generating and self.max_queue and self._queue_depth() >= self.max_queue:
                raise QueueFullError(
                    f"the queue is full ({self.max_queue} requests waiting)",
                    retry_after_s=self._retry_after(),
                )
            self._handles[key] = handle
            if generating:
                self._generating[key] = request.model
        self._send(Job(key, request, pe, time.perf_counter()))
        return handle

    def stats(self) -> EngineStats:
        with self._lock:
            return EngineStats(
                queue_depth=self._queue_depth(),
                running=self._core_stats.running,
                batch_size=self._core_stats.batch_size,
                generated_tokens_total=self._core_stats.generated_total,
            )

    def drain(self, timeout_s: float) -> bool:
        """Stop accepting work, wait for running requests up to timeout_s; True if all finished."""
        with self._lock:
            self._draining = True
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if not self._handles:
                    return True
            time.sleep(0.01)
        with self._lock:
            return not self._handles

    @abstractmethod
    def healthy(self) -> bool: ...

    @abstractmethod
    def lost(self) -> bool: ...

    @abstractmethod
    def start(self) -> None: ...

    @abstractmethod
    def shutdown(self) -> None: ...

    @abstractmethod
    def metrics_text(self) -> bytes: ...

    # -- the transport ------------------------------------------------------------------------

    @abstractmethod
    def _send(self, job: Job) -> None:
        """Pass a job to the core."""

    @abstractmethod
    def _send_cancel(self, key: int) -> None:
        """Ask the core to drop a job."""

    def _deliver(self, output: StepOutput) -> None:
        """Route one step's events to their handles; forget requests that got their final item."""
        with self._lock:
            self._core_stats = output
            routed = [(self._handles[key], item) for key, item in output.events if key in self._handles]
            for key, item in output.events:
                if is_final(item):
                    self._handles.pop(key, None)
                    self._generating.pop(key, None)
        deliver(routed)

    def _fail_request(self, key: int, error: EngineError) -> None:
        """One job fails before the core saw it (it could not be sent)."""
        with self._lock:
            handle = self._handles.pop(key, None)
            self._generating.pop(key, None)
        if handle is not None:
            handle.push(error)

    def _fail_outstanding(self, error: EngineError) -> None:
        """Every request in flight fails with `error` (the core is gone)."""
        with self._lock:
            handles, self._handles = self._handles, {}
            self._generating.clear()
            self._core_stats = StepOutput()
        deliver([(handle, error) for handle in handles.values()])

    def _queue_depth(self) -> int:
        """Generations waiting to start: the larger of two counts.

        In flight beyond each model's batch size is counted here, so that admission does not wait
        on the engine process to speak. Requests that have a slot but wait for KV-cache blocks only
        the core sees; it reports them with every step, so that count is at most one report old.
        Scoring needs no batch slot and never queues here.
        """
        per_model = Counter(self._generating.values())
        beyond_slots = sum(max(0, count - self.max_batch_size) for count in per_model.values())
        return max(beyond_slots, self._core_stats.waiting)

    def _retry_after(self) -> float:
        """A rough wait: one second per batch-load of queued work, at least one."""
        return max(1.0, self._queue_depth() / max(self.max_batch_size, 1))
