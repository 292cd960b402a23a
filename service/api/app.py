"""The FastAPI application factory.

`create_app(settings)` builds a server that loads its models itself (the bundled zoo unless
`settings.model_dir` says otherwise); `create_app(settings, engine)` serves a given engine, which
the app then starts, warms and shuts down as its own. Unless `settings.grpc_port` is 0, the app's
lifespan also runs the gRPC API on that port, over the same engine and state.
"""

from __future__ import annotations

import importlib
from functools import partial

from fastapi import FastAPI
from fastapi.routing import APIRoute

from service.api.errors import install_error_handlers
from service.api.lifespan import Companion, engine_lifespan
from service.api.loading import load_engine
from service.api.metrics import ServiceMetrics
from service.api.middleware import ApiKeyMiddleware, BodyLimitMiddleware, RequestContextMiddleware
from service.api.openapi import register_stream_models
from service.api.routes import (
    generate,
    health,
    inspect,
    metrics,
    models,
    openai_chat,
    openai_completions,
    openai_models,
    playground,
    score,
    tokenizer,
)
from service.api.state import ServiceState
from service.engine.types import Engine, EngineStats
from service.settings import Settings

# Liveness, readiness, scraping and the API description stay reachable without a key; so do the
# playground page and its assets (`playground.public_paths()`), which ask for the key themselves.
OPEN_PATHS = ("/healthz", "/readyz", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc")

_DESCRIPTION = (
    "Inference with a per-request positional encoding: `pe` picks the resident model trained with "
    "that scheme, `pe_scaling` the RoPE context-extension method applied to this request only."
)


def grpc_server(settings: Settings, state: ServiceState, metrics: ServiceMetrics) -> Companion:
    """The gRPC API on `settings.grpc_port`, imported only when it is enabled."""
    server_module = importlib.import_module("service.grpc_api.server")
    server: Companion = server_module.GrpcServer(
        state,
        metrics,
        host=settings.host,
        port=settings.grpc_port,
        api_keys=settings.api_keys(),
        max_message_bytes=settings.max_body_bytes,
    )
    return server


def create_app(settings: Settings, engine: Engine | None = None) -> FastAPI:
    state = ServiceState(drain_timeout_s=settings.drain_timeout_s)

    def engine_stats() -> EngineStats | None:
        return state.engine.stats() if state.engine is not None else None

    def engine_metrics() -> bytes:
        return state.engine.metrics_text() if state.engine is not None else b""

    service_metrics = ServiceMetrics(engine_stats, engine_metrics)
    build = (lambda: engine) if engine is not None else partial(load_engine, settings)
    companions = [grpc_server(settings, state, service_metrics)] if settings.grpc_port else []
    app = FastAPI(
        title="pe-serve",
        version="0.1.0",
        description=_DESCRIPTION,
        lifespan=engine_lifespan(state, build, warm=settings.warmup, companions=companions),
    )
    app.state.service = state
    app.state.metrics = service_metrics
    install_error_handlers(app)
    modules = (
        generate,
        score,
        inspect,
        models,
        openai_models,
        openai_completions,
        openai_chat,
        tokenizer,
        health,
        metrics,
        playground,
    )
    routers = [module.router for module in modules]
    for router in routers:
        app.include_router(router)
    playground.mount_static(app)
    register_stream_models(app)
    # Added innermost first: the request context wraps everything, then auth, then the body limit.
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=settings.max_body_bytes)
    keys = settings.api_keys()
    if keys:
        app.add_middleware(ApiKeyMiddleware, keys=keys, open_paths=(*OPEN_PATHS, *playground.public_paths()))
    endpoints = [route.path for router in routers for route in router.routes if isinstance(route, APIRoute)]
    app.add_middleware(RequestContextMiddleware, metrics=service_metrics, endpoints=endpoints)
    return app
