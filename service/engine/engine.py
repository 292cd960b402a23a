"""`InferenceEngine`: the engine core on a worker thread of this process.

This is the embedded mode (tests, benchmarks, a Python program serving itself). The server runs the
same core in a process of its own (`service.engine.client.EngineClient`), so that the model's
compute and the HTTP event loop do not share one interpreter lock; both present the same `Engine`
interface through `EngineFrontend`.

The worker takes submitted jobs and cancellations from its inbox, runs `EngineCore.step()` while
there is work, and delivers each step's output to the handles in one batch. If a step raises,
which only a bug in the core can make it do (model failures stay with their rows), every request
fails at once and the engine reports itself lost.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from pe_runtime import PECache
from service.engine.budget import DEFAULT_PREFILL_SLOWDOWN, DEFAULT_STEP_TOKEN_BUDGET
from service.engine.catalog import ModelCatalog
from service.engine.config import EngineConfig
from service.engine.core import DEFAULT_DECODE, DecodeSettings, EngineCore, Job
from service.engine.errors import EngineDrainingError, ModelLoadError, RequestFailedError
from service.engine.frontend import EngineFrontend
from service.engine.models import ServedModel, load_served_model, resolve_device, resolve_dtype
from service.model.kernels.openmp import release_thread_pool

logger = logging.getLogger("service.engine")

_IDLE_WAIT_S = 0.05

_Command = Job | int  # a job to add, or the key of a job to cancel


@functools.cache
def process_pe_cache() -> PECache:
    """The process's PE table cache, registered once on the global Prometheus registry."""
    return PECache()


def load_models(
    dirs: Iterable[Path | str],
    *,
    device: str = "auto",
    dtype: str | torch.dtype | None = None,
    max_context: int = 4096,
    weights: str = "float",
    pe_cache: PECache | None = None,
    max_stream_tokens: int = 65536,
) -> list[ServedModel]:
    """Load every directory (ours, Hugging Face or GGUF) onto one device, in order, its linear
    weights kept as `weights` says."""
    target = resolve_device(device)
    cache = pe_cache if pe_cache is not None else process_pe_cache()
    models = []
    for directory in map(Path, dirs):
        try:
            served = load_served_model(
                directory,
                device=target,
                dtype=resolve_dtype(dtype, target),
                max_context=max_context,
                weights=weights,
                pe_cache=cache,
                max_stream_tokens=max_stream_tokens,
            )
        except Exception as error:
            # A truncated safetensors file or a config.json that is not JSON says nothing of where.
            raise ModelLoadError(f"cannot load {directory}: {type(error).__name__}: {error}") from error
        models.append(served)
    return models


class InferenceEngine(EngineFrontend):
    """Implements `service.engine.types.Engine`. Construct, `start()`, then `submit()` from any thread."""

    def __init__(
        self,
        models: Sequence[ServedModel],
        *,
        max_batch_size: int = 16,
        max_queue: int = 64,
        step_token_budget: int = DEFAULT_STEP_TOKEN_BUDGET,
        prefill_slowdown: float = DEFAULT_PREFILL_SLOWDOWN,
        decode: DecodeSettings = DEFAULT_DECODE,
    ) -> None:
        self._core = EngineCore(
            models,
            max_batch_size=max_batch_size,
            step_token_budget=step_token_budget,
            prefill_slowdown=prefill_slowdown,
            decode=decode,
        )
        super().__init__(ModelCatalog(self._core.specs()), max_batch_size=max_batch_size, max_queue=max_queue)
        self._inbox: queue.SimpleQueue[_Command] = queue.SimpleQueue()
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
        weights: str = "float",
        max_batch_size: int = 16,
        max_queue: int = 64,
        step_token_budget: int = DEFAULT_STEP_TOKEN_BUDGET,
        prefill_slowdown: float = DEFAULT_PREFILL_SLOWDOWN,
        decode: DecodeSettings = DEFAULT_DECODE,
        pe_cache: PECache | None = None,
        max_stream_tokens: int = 65536,
    ) -> InferenceEngine:
        models = load_models(
            dirs,
            device=device,
            dtype=dtype,
            max_context=max_context,
            weights=weights,
            pe_cache=pe_cache,
            max_stream_tokens=max_stream_tokens,
        )
        return cls(
            models,
            max_batch_size=max_batch_size,
            max_queue=max_queue,
            step_token_budget=step_token_budget,
            prefill_slowdown=prefill_slowdown,
            decode=decode,
        )

    @classmethod
    def from_config(cls, config: EngineConfig, *, max_queue: int = 64) -> InferenceEngine:
        """The engine an `EngineConfig` describes, on a thread of this process."""
        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        return cls.from_model_dirs(
            config.model_dirs,
            device=config.device,
            dtype=config.dtype,
            max_context=config.max_context,
            max_stream_tokens=config.max_stream_tokens,
            weights=config.weights,
            max_batch_size=config.max_batch_size,
            max_queue=max_queue,
            step_token_budget=config.step_token_budget,
            prefill_slowdown=config.prefill_slowdown,
            decode=config.decode,
        )

    def healthy(self) -> bool:
        return (
            self._crash is None
            and not self._stop.is_set()
            and (self._thread is None or self._thread.is_alive())
        )

    def lost(self) -> bool:
        return self._crash is not None

    def metrics_text(self) -> bytes:
        """Nothing of its own: the core's PE cache counters are on this process's registry."""
        return b""

    def start(self) -> None:
        """Run the engine's thread. The calling thread, which built the engine (loaded and warmed up
        its models), lets its idle OpenMP workers go: the model's work is the engine thread's from
        now on, and a second pool alive in the process slows every step (`release_thread_pool`)."""
        if self._thread is None:
            release_thread_pool()
            self._thread = threading.Thread(target=self._run, name="pe-serve-engine", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        """Stop the worker; requests still queued or running fail with EngineDrainingError."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._fail_outstanding(EngineDrainingError("the engine shut down before this request finished"))

    def _send(self, job: Job) -> None:
        self._inbox.put(job)

    def _send_cancel(self, key: int) -> None:
        self._inbox.put(key)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._collect_inbox(block=not self._core.has_work())
                if self._core.has_work():
                    self._deliver(self._core.step())
        except BaseException as error:
            self._crash = error
            logger.exception("engine worker crashed")
            self._fail_outstanding(RequestFailedError(f"the engine stopped: {error}"))

    def _collect_inbox(self, *, block: bool) -> None:
        try:
            command = self._inbox.get(timeout=_IDLE_WAIT_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if isinstance(command, Job):
                self._core.add(command)
            else:
                self._core.cancel(command)
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
