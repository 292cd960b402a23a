"""The engine process: the engine core and the models, with an interpreter lock of its own.

The API process starts it when it constructs an `EngineClient`, with a spawn context and one
duplex pipe. Over the pipe, messages are tuples:

- to the engine: `("add", Job)`, `("cancel", job_key)`, `("metrics", nonce)`, `("shutdown",)`;
- from the engine: `("ready", [ModelSpec, ...])` once the models are loaded, or `("failed", text)`;
  then `("step", StepOutput)`, one per step with every request's events of that step (steps with
  no events only every `_STATS_EVERY_S`, for the counters), and
  `("metrics", nonce, text)` in answer to a metrics request.

While the core has work the loop only peeks at the pipe between steps; when it is idle it blocks
on the pipe, so an idle engine costs no CPU. The process exits when told to shut down or when the
pipe closes (the API process is gone), so it never outlives its server.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import logging.config
import signal
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

import torch
from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    REGISTRY,
    ProcessCollector,
    generate_latest,
)

from service.engine.config import EngineConfig, engine_threads
from service.engine.core import EngineCore
from service.engine.engine import load_models
from service.engine.errors import EngineDrainingError, ModelLoadError
from service.startup_heap import freeze_startup_objects

logger = logging.getLogger("service.engine.process")

# The engine process's own process metrics are exported as pe_engine_process_*, beside the API
# process's process_* families, so one /metrics page can carry both without a name clash.
ENGINE_METRICS_NAMESPACE = "pe_engine"

# How an idle engine gathers a burst of requests: until the pipe has been quiet this long, and
# for this long at most.
_GATHER_GAP_S = 0.002
_GATHER_MAX_S = 0.05
# How often a busy engine hands freed heap back (see `_heap_trimmer`); a trim takes milliseconds.
_TRIM_EVERY_S = 2.0
# An engine that went idle trims once it has had no command for this long: requests that follow
# each other closely would otherwise start on a trimmed heap and fault its pages in again. With a
# trim at every end of a request, one client's back-to-back requests ran at 0.86-0.88x the same
# engine on a thread; trimmed after 0.5 s idle, at 0.99-1.08x (alternating runs).
_TRIM_IDLE_AFTER_S = 0.5
# The longest a busy engine goes without telling the API process its counters (for /metrics).
_STATS_EVERY_S = 0.05


def engine_main(connection: Connection, config: EngineConfig) -> None:
    """Entry point of the engine process."""
    # Stopping is the API process's call, through the pipe: a Ctrl-C or a SIGTERM sent to the whole
    # process group must not kill the engine while the server is draining its requests.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if config.log_config is not None:
        logging.config.dictConfig(config.log_config)
    torch.set_num_threads(config.torch_threads or engine_threads())
    _own_process_metrics()
    try:
        models = load_models(
            config.model_dirs,
            device=config.device,
            dtype=config.dtype,
            max_context=config.max_context,
            weights=config.weights,
            max_stream_tokens=config.max_stream_tokens,
        )
        # Pools are allocated and fast backends warmed up here: their failures are start-up's too.
        core = EngineCore(
            models,
            max_batch_size=config.max_batch_size,
            step_token_budget=config.step_token_budget,
            prefill_slowdown=config.prefill_slowdown,
            decode=config.decode,
        )
    except ModelLoadError as error:
        # The API process logs the one line that names the directory; the trace is for debugging.
        logger.debug("model loading failed in the engine process", exc_info=True)
        connection.send(("failed", str(error)))
        return
    except Exception as error:
        logger.exception("model loading failed in the engine process")
        connection.send(("failed", f"{type(error).__name__}: {error}"))
        return
    freeze_startup_objects()
    connection.send(("ready", core.specs()))
    try:
        _serve(connection, core)
    except (EOFError, OSError):
        logger.info("the API process went away; the engine process stops")


def _serve(connection: Connection, core: EngineCore) -> None:
    release_memory = _heap_trimmer()
    used = True  # whether steps (or loading) freed heap since the last trim
    trimmed_at = sent_at = time.monotonic()
    while True:
        idle = not core.has_work()
        now = time.monotonic()
        if not idle and now - trimmed_at > _TRIM_EVERY_S:
            release_memory()
            trimmed_at = now
        if idle and used and not connection.poll(_TRIM_IDLE_AFTER_S):
            release_memory()
            trimmed_at, used = now, False
        used = used or not idle
        if not _handle_commands(connection, core, block=idle):
            return
        if idle:
            # Requests of a burst reach the engine one by one, a fraction of a millisecond apart
            # (each is parsed and validated first); gathering them for a moment lets them start
            # in one step instead of one wave per step. Only an idle engine waits: nobody's
            # stream is delayed, and a lone request pays one gap at most.
            deadline = time.monotonic() + _GATHER_MAX_S
            while time.monotonic() < deadline and connection.poll(_GATHER_GAP_S):
                if not _handle_commands(connection, core, block=False):
                    return
        if core.has_work():
            output = core.step()
            # A step without events (non-streaming rows between their first token and their end)
            # only refreshes counters, which the next message carries anyway: skip it unless the
            # last one is getting old or the core just went idle.
            now = time.monotonic()
            if output.events or not core.has_work() or now - sent_at >= _STATS_EVERY_S:
                connection.send(("step", output))
                sent_at = now


def _handle_commands(connection: Connection, core: EngineCore, *, block: bool) -> bool:
    """Apply every command waiting on the pipe (waiting for one if `block`); False on shutdown."""
    while connection.poll(None if block else 0):
        message = connection.recv()
        kind = message[0]
        if kind == "add":
            core.add(message[1])
        elif kind == "cancel":
            core.cancel(message[1])
        elif kind == "metrics":
            connection.send(("metrics", message[1], generate_latest(REGISTRY)))
        elif kind == "shutdown":
            error = EngineDrainingError("the engine shut down before this request finished")
            connection.send(("step", core.abort_all(error)))
            return False
        block = False
    return True


def _heap_trimmer() -> Callable[[], None]:
    """What hands freed heap memory back to the OS: when the engine has been idle for
    `_TRIM_IDLE_AFTER_S`, and every `_TRIM_EVERY_S` while it is busy.

    Caches and activations of every size are allocated and freed at each step; glibc keeps the
    freed memory in its heap, fragmented, so under steady load the process grew far past what it
    had in use (a 10-minute soak: 5 GB after one minute, 10 GB after four) and after a burst it
    stayed hundreds of MB above its resting size. `malloc_trim(0)` returns the free pages; off
    glibc this is a no-op.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return lambda: None
    trim.argtypes = [ctypes.c_size_t]

    def release() -> None:
        trim(0)

    return release


def _own_process_metrics() -> None:
    """Swap the default process, platform and GC collectors for namespaced process metrics."""
    for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
        REGISTRY.unregister(collector)
    ProcessCollector(namespace=ENGINE_METRICS_NAMESPACE, registry=REGISTRY)
