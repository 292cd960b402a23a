"""The service's lifecycle: loading -> ready -> draining, or failed, and the engine once it exists.

Both transports ask `ServiceState.engine_for_request()` for the engine, so "not ready yet" and
"draining" are answered alike everywhere (503 over HTTP, UNAVAILABLE over gRPC), and `/readyz`
reads the same phase. Whoever must follow the phase as it changes (the gRPC health service)
subscribes with `on_phase_change`.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from service.engine.types import Engine
from service.requests.errors import unavailable
from service.requests.model_names import NO_ALIASES, ModelAliases

logger = logging.getLogger("service.requests.state")


class Phase(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    FAILED = "failed"


@dataclass
class ServiceState:
    """Mutable process-wide state shared by the lifespan, the routes and the CLI's signal handler."""

    drain_timeout_s: float
    engine: Engine | None = None
    # `--alias` names, resolved by every transport through the request core (`prepare`).
    aliases: ModelAliases = NO_ALIASES
    drained: asyncio.Event = field(default_factory=asyncio.Event)
    _phase: Phase = field(default=Phase.LOADING, init=False)
    _listeners: list[Callable[[Phase], None]] = field(default_factory=list, init=False)

    @property
    def phase(self) -> Phase:
        return self._phase

    @phase.setter
    def phase(self, phase: Phase) -> None:
        changed = phase is not self._phase
        self._phase = phase
        if changed:
            for listener in self._listeners:
                listener(phase)

    def on_phase_change(self, listener: Callable[[Phase], None]) -> None:
        """Call `listener(phase)` now and after every change (on the thread that changes it)."""
        self._listeners.append(listener)
        listener(self._phase)

    def ready(self) -> bool:
        """What `/readyz` and gRPC health both answer: loaded, not draining, and the engine up
        (an engine process being restarted is not ready, although the phase stays READY)."""
        return self.phase is Phase.READY and self.engine is not None and self.engine.healthy()

    def engine_for_request(self) -> Engine:
        """The engine, or UNAVAILABLE while loading, draining, after a failed start or a dead worker."""
        if self.ready():
            assert self.engine is not None
            return self.engine
        if self.phase is Phase.READY:
            raise unavailable("the inference engine stopped")
        reason = {
            Phase.LOADING: "the models are still loading",
            Phase.DRAINING: "the server is shutting down",
            Phase.FAILED: "the models failed to load",
        }.get(self.phase, "the server is not ready")
        raise unavailable(reason)

    def check_engine(self) -> None:
        """Turn FAILED once the engine is lost for good (its process died and could not return)."""
        if self.phase is Phase.READY and self.engine is not None and self.engine.lost():
            logger.error("the inference engine is lost; the server stops")
            self.phase = Phase.FAILED

    def mark_ready(self, engine: Engine) -> None:
        self.engine = engine
        if self.phase is Phase.LOADING:
            self.phase = Phase.READY

    async def drain(self) -> bool:
        """Refuse new work, let running requests finish (up to the grace time); True if all did."""
        self.phase = Phase.DRAINING
        finished = True
        if self.engine is not None:
            logger.info("draining", extra={"timeout_s": self.drain_timeout_s})
            finished = await asyncio.to_thread(self.engine.drain, self.drain_timeout_s)
        logger.info("drained", extra={"all_finished": finished})
        self.drained.set()
        return finished
