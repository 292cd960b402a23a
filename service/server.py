"""The service as one process: the HTTP app and, unless disabled, the gRPC API beside it.

Both transports share one `ServiceState` (engine and phase), one `ServiceMetrics` and one ledger
of running requests (`RunningRequests`: owners, per-key limits); neither imports the other, and
this module is the only one that knows both.
"""

from __future__ import annotations

from functools import partial

from fastapi import FastAPI

from service.api.app import create_app
from service.api.lifespan import Companion
from service.api.loading import load_engine
from service.engine.types import Engine, EngineStats
from service.requests.metrics import ServiceMetrics
from service.requests.model_names import ModelAliases
from service.requests.running import KeyLimits, RunningRequests
from service.requests.state import ServiceState
from service.settings import Settings


def create_server(settings: Settings, engine: Engine | None = None) -> FastAPI:
    """A server that loads its models itself (the bundled zoo unless `settings.model_dir` says
    otherwise), or serves `engine`, which it then starts, warms and shuts down as its own."""
    state = ServiceState(
        drain_timeout_s=settings.drain_timeout_s, aliases=ModelAliases.from_flags(settings.alias)
    )

    def engine_stats() -> EngineStats | None:
        return state.engine.stats() if state.engine is not None else None

    def engine_metrics() -> bytes:
        return state.engine.metrics_text() if state.engine is not None else b""

    metrics = ServiceMetrics(engine_stats, engine_metrics)
    running = RunningRequests(
        KeyLimits(
            max_concurrent=settings.max_concurrent_per_key,
            max_queued_tokens=settings.max_queued_tokens_per_key,
        )
    )
    build = (lambda: engine) if engine is not None else partial(load_engine, settings)
    companions = [grpc_server(settings, state, metrics, running)] if settings.grpc_port else []
    return create_app(
        settings, build, state=state, service_metrics=metrics, running=running, companions=companions
    )


def grpc_server(
    settings: Settings, state: ServiceState, metrics: ServiceMetrics, running: RunningRequests
) -> Companion:
    """The gRPC API on `settings.grpc_port`; grpc is imported only when it is enabled."""
    from service.grpc_api.server import GrpcServer, tls_credentials

    credentials = None
    if settings.tls_cert is not None and settings.tls_key is not None:
        credentials = tls_credentials(settings.tls_cert, settings.tls_key, settings.tls_client_ca)
    return GrpcServer(
        state,
        metrics,
        host=settings.host,
        port=settings.grpc_port,
        api_keys=settings.api_keys(),
        running=running,
        max_message_bytes=settings.max_body_bytes,
        credentials=credentials,
    )
