"""The FastAPI application factory: the HTTP transport over the request core.

`create_app` is given the state and metrics it shares with any other transport, how to build the
engine, and the companion servers its lifespan runs; `service.server.create_server` composes it
with the gRPC API.
"""

from __future__ import annotations

from collections.abc import Sequence

from fastapi import FastAPI
from fastapi.routing import APIRoute

from service.api.errors import install_error_handlers
from service.api.lifespan import Companion, EngineFactory, engine_lifespan
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
    requests,
    score,
    tokenizer,
)
from service.requests.metrics import ServiceMetrics
from service.requests.once import RunOnce
from service.requests.running import RunningRequests
from service.requests.state import ServiceState
from service.settings import Settings

# Liveness, readiness, scraping and the API description stay reachable without a key; so do the
# playground page and its assets (`playground.public_paths()`), which ask for the key themselves.
OPEN_PATHS = ("/healthz", "/readyz", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc")

_DESCRIPTION = (
    "Inference with a per-request positional encoding: `pe` picks the resident model trained with "
    "that scheme, `pe_scaling` the RoPE context-extension method applied to this request only."
)


def create_app(
    settings: Settings,
    build: EngineFactory,
    *,
    state: ServiceState,
    service_metrics: ServiceMetrics,
    running: RunningRequests,
    companions: Sequence[Companion] = (),
) -> FastAPI:
    app = FastAPI(
        title="pe-serve",
        version="0.1.0",
        description=_DESCRIPTION,
        lifespan=engine_lifespan(state, build, warm=settings.warmup, companions=companions),
    )
    app.state.service = state
    app.state.metrics = service_metrics
    app.state.running = running
    app.state.run_once = RunOnce()
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
        requests,
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
