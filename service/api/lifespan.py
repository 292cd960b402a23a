"""Startup and shutdown: load the models in the background, warm them, start the engine; stop it.

Loading runs after the server is listening, so `/healthz` answers at once while `/readyz` stays
503 until every model has run one tiny prefill (which also builds the PE tables of its default
scaling). A failed load, or an `--alias` the loaded models cannot serve, is logged and leaves the
state FAILED; the CLI then exits non-zero.

Companion servers (the gRPC API) start before loading, so their health reports the loading phase
too, and stop after the HTTP side has drained, before the engine shuts down. One that cannot start
(its port is taken) fails the service the same way a failed load does.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Protocol

from fastapi import FastAPI

from service.engine.errors import ModelLoadError
from service.engine.types import Engine, ScoreResult, ScoringRequest
from service.requests.model_names import ModelNameError
from service.requests.prepare import check_aliases
from service.requests.state import Phase, ServiceState
from service.startup_heap import freeze_startup_objects

logger = logging.getLogger("service.api.lifespan")

EngineFactory = Callable[[], Engine]
Lifespan = Callable[[FastAPI], AbstractAsyncContextManager[None]]


class Companion(Protocol):
    """A server that lives as long as the app and serves the same engine."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


_WARMUP_TEXT = "def warm_up():\n    return 0\n"


async def warm_up(engine: Engine) -> None:
    """One short scoring pass per model: weights paged in, kernels chosen, default PE tables built."""
    for info in engine.models():
        tokens = tuple(engine.tokenize(info.name, _WARMUP_TEXT))
        handle = engine.submit(
            ScoringRequest(request_id=f"warmup-{info.name}", model=info.name, tokens=tokens)
        )
        async for event in handle:
            if isinstance(event, ScoreResult):
                break
        logger.info("warmed", extra={"model": info.name, "scheme": info.scheme})


async def start_engine(state: ServiceState, build: EngineFactory, *, warm: bool) -> None:
    try:
        engine = await asyncio.to_thread(build)
        state.engine = engine
        engine.start()
        check_aliases(engine, state.aliases)
        if warm:
            await warm_up(engine)
        freeze_startup_objects()
    except ModelLoadError as error:
        logger.error("model loading failed: %s", error)
        state.phase = Phase.FAILED
        return
    except ModelNameError as error:  # an `--alias` the loaded models cannot serve
        logger.error("refused: %s", error)
        state.phase = Phase.FAILED
        return
    except Exception:
        logger.exception("model loading failed")
        state.phase = Phase.FAILED
        return
    state.mark_ready(engine)
    logger.info("ready", extra={"models": [info.name for info in engine.models()]})


async def start_companions(state: ServiceState, companions: Sequence[Companion]) -> bool:
    """Start each; False (and the state FAILED) as soon as one cannot."""
    for companion in companions:
        try:
            await companion.start()
        except Exception:
            logger.exception("could not start %s", type(companion).__name__)
            state.phase = Phase.FAILED
            return False
    return True


def engine_lifespan(
    state: ServiceState, build: EngineFactory, *, warm: bool, companions: Sequence[Companion] = ()
) -> Lifespan:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        started = await start_companions(state, companions)
        loading = asyncio.create_task(start_engine(state, build, warm=warm)) if started else None
        try:
            yield
        finally:
            if loading is not None and not loading.done():
                loading.cancel()
            for companion in reversed(companions):
                await companion.stop()
            if state.engine is not None:
                await asyncio.to_thread(state.engine.shutdown)

    return lifespan
