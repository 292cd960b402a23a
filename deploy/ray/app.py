"""pe-serve as a Ray Serve application: each replica is one whole pe-serve (engine and every model).

    serve run deploy.ray.app:app                                   # one replica, the bundled zoo
    serve run deploy.ray.app:build_app num_replicas=2 num_gpus=0.5 max_batch_size=8
    serve deploy deploy/ray/serve-config.yaml                      # on a running Ray cluster

The FastAPI app is the service's own (`service.server.create_server`), built inside each replica by
`__serve_build_asgi_app__` so that the engine, torch and the models live in the replica process and
nothing heavy is pickled from the driver. Every replica serves every `pe` and `pe_scaling`, so
Serve's router may send any request anywhere.

Lifecycle, mapped onto Serve:
- start: Serve runs the app's lifespan at replica start. Ours starts loading in the background
  and returns at once (so a standalone server answers `/healthz` while loading); here the lifespan
  is wrapped to wait until the models are loaded and warm, so a replica takes traffic only when
  `/readyz` would be 200, and a failed load fails the replica's start (Serve retries it).
- health: `check_health` raises once the engine is dead or lost; Serve then replaces the replica.
  It is asked every `HEALTH_CHECK_PERIOD_S`.
- a replica that dies under requests: Serve routes requests not yet assigned to the live replicas
  by itself; for those the dead one held, its proxy answers 502 (or ends a stream with a typed
  error event) through `deploy/ray/proxy.py`, and the SDK retries under the same request id.
- stop: Serve stops routing to the replica, waits for its ongoing requests up to
  `graceful_shutdown_timeout_s` (the service's `drain_timeout_s`), then the lifespan's exit drains
  the engine (nothing is left by then unless the timeout ran out) and shuts it down.

The engine runs on a thread of the replica (`engine_mode=thread`) unless told otherwise: the
replica actor is already the process Ray schedules, accounts CPUs, GPUs and memory to, restarts
and kills. An engine subprocess would sit outside that accounting, and when Ray kills the actor
(a failed health check, a scale-down past the grace time, a node drain) it would be left behind
holding its memory and GPU until it noticed. The isolation the subprocess buys a standalone
server (HTTP parsing off the model's cores) matters less here, where Serve's proxy parses HTTP.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field, model_validator
from ray import serve
from ray.serve import Application
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.requests.state import Phase, ServiceState
from service.server import create_server
from service.settings import Settings

# The header naming the replica that answered: routing is visible from outside.
REPLICA_HEADER = "X-PE-Serve-Replica"
_READY_POLL_S = 0.2
HEALTH_CHECK_PERIOD_S = 2.0
HEALTH_CHECK_TIMEOUT_S = 10.0


class ReplicaOptions(BaseModel):
    """How many replicas and what each one reserves; everything else given is a `Settings` field."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_replicas: int = Field(default=1, ge=1, description="Fixed replica count (without max_replicas).")
    min_replicas: int = Field(default=1, ge=0, description="Autoscaling floor (with max_replicas).")
    max_replicas: int | None = Field(
        default=None, ge=1, description="Set to autoscale on ongoing requests instead of a fixed count."
    )
    target_ongoing_requests: float = Field(
        default=8.0, gt=0, description="Ongoing requests per replica the autoscaler aims for."
    )
    num_cpus: float = Field(default=1.0, gt=0, description="CPUs reserved per replica.")
    num_gpus: float = Field(
        default=0.0, ge=0, description="GPU fraction per replica: 0.5 puts two replicas on one GPU."
    )

    @model_validator(mode="after")
    def _floor_below_ceiling(self) -> ReplicaOptions:
        if self.max_replicas is not None and self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas must not exceed max_replicas")
        return self

    def deployment_options(self, settings: Settings) -> dict[str, Any]:
        """The `serve.deployment` options: scaling, resources, and the service's limits and grace."""
        scaling: dict[str, Any] = (
            {"num_replicas": self.num_replicas}
            if self.max_replicas is None
            else {
                "autoscaling_config": {
                    "min_replicas": self.min_replicas,
                    "max_replicas": self.max_replicas,
                    "target_ongoing_requests": self.target_ongoing_requests,
                }
            }
        )
        return {
            **scaling,
            "ray_actor_options": {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus},
            # A replica holds a full batch plus its own queue; beyond that Serve queues at the proxy
            # instead of the replica answering 429.
            "max_ongoing_requests": settings.max_batch_size + max(settings.max_queue, 1),
            "graceful_shutdown_timeout_s": settings.drain_timeout_s,
            # `check_health` is cheap (the engine's own flag): ask often, so that a replica whose
            # engine died leaves the routing table within seconds rather than Serve's default 10-30.
            "health_check_period_s": HEALTH_CHECK_PERIOD_S,
            "health_check_timeout_s": HEALTH_CHECK_TIMEOUT_S,
        }


def replica_settings(overrides: Mapping[str, Any]) -> Settings:
    """`Settings` as a replica sees them: PE_SERVE_* from its environment, then `overrides`.

    Host and port are Serve's proxy's business, not the replica's; the engine runs on a thread
    unless `engine_mode` says otherwise (see the module docstring). The gRPC API is off unless
    `grpc_port` is given: replicas sharing a host would all bind its default port.
    """
    return Settings(**{"engine_mode": "thread", "grpc_port": 0, **overrides})


def _wait_until_ready(original: Any, state: ServiceState) -> Any:
    """The app's lifespan, holding start-up until the models are ready and draining at the end."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        context: AbstractAsyncContextManager[None] = original(app)
        async with context:
            while state.phase is Phase.LOADING:
                await asyncio.sleep(_READY_POLL_S)
            if state.phase is not Phase.READY:
                raise RuntimeError("pe-serve replica: the models failed to load (see the replica log)")
            yield
            await state.drain()

    return lifespan


class _ReplicaHeader:
    """Pure ASGI (streamed responses pass untouched): adds the replica id to every response."""

    def __init__(self, app: ASGIApp, replica_id: str) -> None:
        self.app = app
        self.header = (REPLICA_HEADER.lower().encode(), replica_id.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_with_header(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), self.header]
            await send(message)

        await self.app(scope, receive, send_with_header if scope["type"] == "http" else send)


@serve.ingress()
class PEServeReplica:
    """One replica: the service's FastAPI app with its engine and models, in this actor."""

    def __init__(self, settings: dict[str, Any]) -> None:
        self.settings = replica_settings(settings)
        self.state: ServiceState | None = None

    def __serve_build_asgi_app__(self) -> FastAPI:
        app = create_server(self.settings)
        self.state = app.state.service
        app.router.lifespan_context = _wait_until_ready(app.router.lifespan_context, app.state.service)
        replica_id = serve.get_replica_context().replica_id.unique_id
        app.add_middleware(_ReplicaHeader, replica_id=replica_id)
        return app

    async def check_health(self) -> None:
        """Raise (so Serve replaces this replica) once the engine died or was lost for good."""
        state = self.state
        if state is None or state.engine is None:
            return
        state.check_engine()
        if state.phase is Phase.FAILED or not state.engine.healthy():
            raise RuntimeError("pe-serve replica: the inference engine stopped")


def build_app(args: Mapping[str, Any]) -> Application:
    """The application for `serve run deploy.ray.app:build_app key=value ...` or a config's `args`.

    Keys of `ReplicaOptions` size and place the replicas; any other key is a pe-serve setting
    (`max_batch_size=8`, `model_dir=/models/a:/models/b`, `device=cuda`), checked here, on the
    driver, so a typo fails before any replica starts.
    """
    replica_keys = set(ReplicaOptions.model_fields)
    options = ReplicaOptions(**{key: value for key, value in args.items() if key in replica_keys})
    overrides = {key: value for key, value in args.items() if key not in replica_keys}
    settings = replica_settings(overrides)
    deployment = serve.deployment(name="pe-serve", **options.deployment_options(settings))(PEServeReplica)
    application: Application = deployment.bind(overrides)
    return application


app = build_app({})
