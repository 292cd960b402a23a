"""The gRPC server beside uvicorn: same process, same asyncio loop, same `ServiceState` and engine.

The app's lifespan starts it before the models load and stops it after the HTTP side has drained,
so SIGTERM drains both protocols at once: the phase turns DRAINING (new requests on either get
503 / UNAVAILABLE, both health answers turn NOT_SERVING) and the engine lets every running request
finish, whichever protocol it came by.

Besides `pe_serve.v1.PEServe` the server runs `grpc.health.v1.Health` (for "" and for the
service: `Check` answers what `/readyz` does at that moment, `Watch` follows the phase) and server
reflection. The method table is built from the proto's
descriptor, so the one proto file is the only list of methods. With server credentials
(`tls_credentials`) the port speaks TLS only, and with a client CA it requires client certificates.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from service.grpc_api import pe_serve_pb2 as pb
from service.grpc_api.servicer import SERVICE_NAME, PEServeServicer
from service.requests.metrics import ServiceMetrics
from service.requests.running import RunningRequests
from service.requests.state import Phase, ServiceState

logger = logging.getLogger("service.grpc")

# Seconds running RPCs get to finish once the HTTP side has drained (they are done by then).
STOP_GRACE_S = 5.0
_HEALTH_SERVICES = ("", SERVICE_NAME)
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def tls_credentials(cert: Path, key: Path, client_ca: Path | None) -> grpc.ServerCredentials:
    """The port's TLS: our certificate chain and key; with `client_ca`, client certificates it signed."""
    return grpc.ssl_server_credentials(
        [(key.read_bytes(), cert.read_bytes())],
        root_certificates=client_ca.read_bytes() if client_ca is not None else None,
        require_client_auth=client_ca is not None,
    )


def method_handlers(servicer: PEServeServicer) -> dict[str, grpc.RpcMethodHandler]:
    """One handler per method of the proto's service; requests arrive and answers leave as bytes (the
    servicer parses, and answers what it may have kept serialized)."""
    behaviours: dict[str, Callable[..., Any]] = {
        "Generate": servicer.generate,
        "Score": servicer.score,
        "ListModels": servicer.list_models,
        "Abort": servicer.abort,
    }
    handlers: dict[str, grpc.RpcMethodHandler] = {}
    for method in pb.DESCRIPTOR.services_by_name["PEServe"].methods:
        make = (
            grpc.unary_stream_rpc_method_handler
            if method.server_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        handlers[method.name] = make(behaviours[method.name])
    return handlers


def bind_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class ReadinessHealth(health.aio.HealthServicer):  # type: ignore[misc]  # grpc_health ships no types
    """Health whose `Check` asks the same question as `/readyz` when it is called.

    The stored statuses follow the phase (and drive `Watch`), but an engine process that died and
    is being restarted leaves the phase READY; `/readyz` is 503 meanwhile, and so is this.
    """

    def __init__(self, state: ServiceState) -> None:
        super().__init__()
        self._state = state

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> health_pb2.HealthCheckResponse:
        response: health_pb2.HealthCheckResponse = await super().Check(request, context)
        if response.status == _SERVING and not self._state.ready():
            return health_pb2.HealthCheckResponse(status=_NOT_SERVING)
        return response


class GrpcServer:
    """Start and stop the gRPC side; its health follows `state.phase`."""

    def __init__(
        self,
        state: ServiceState,
        metrics: ServiceMetrics,
        *,
        host: str,
        port: int,
        api_keys: Collection[bytes],
        running: RunningRequests,
        max_message_bytes: int,
        credentials: grpc.ServerCredentials | None = None,
    ) -> None:
        self.state = state
        self.address = bind_address(host, port)
        self.servicer = PEServeServicer(state, metrics, api_keys, running)
        self._credentials = credentials
        self.health = ReadinessHealth(state)
        self._max_message_bytes = max_message_bytes
        self._server: grpc.aio.Server | None = None
        self._health_updates: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        """Bind and serve; raises OSError when the port cannot be bound."""
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", self._max_message_bytes),
                ("grpc.so_reuseport", 0),
            ]
        )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE_NAME, method_handlers(self.servicer)),)
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
        try:
            if self._credentials is None:
                server.add_insecure_port(self.address)
            else:
                server.add_secure_port(self.address, self._credentials)
        except RuntimeError as error:
            raise OSError(f"gRPC: cannot bind {self.address} (address already in use?): {error}") from None
        await server.start()
        self._server = server
        self.state.on_phase_change(self._follow_phase)
        logger.info("grpc serving", extra={"address": self.address})

    async def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        if self._server is None:
            return
        await self.health.enter_graceful_shutdown()
        await self._server.stop(grace_s)
        self._server = None

    def _follow_phase(self, phase: Phase) -> None:
        status = _SERVING if phase is Phase.READY else _NOT_SERVING
        task = asyncio.get_running_loop().create_task(self._set_health(status))
        self._health_updates.add(task)
        task.add_done_callback(self._health_updates.discard)

    async def _set_health(self, status: int) -> None:
        for service in _HEALTH_SERVICES:
            await self.health.set(service, status)
