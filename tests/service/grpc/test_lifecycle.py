"""Health through a server's life as a `Watch` client sees it, draining on SIGTERM, and reflection.

The lifecycle test serves the bundled zoo's RoPE model, whose loading and warm-up take long enough
for a client to connect while the server still loads.
"""

from __future__ import annotations

import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from service.api.loading import ZOO_DIR
from tests.live_server import LiveServer, launch_server
from tests.service.api.conftest import SERVER_ENV
from tests.service.api.helpers import metric_value, wait_for
from tests.service.grpc.helpers import SERVICE, assert_status, generate, stream

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
IN_FLIGHT = {"prompt": "a", "max_new_tokens": 400, "temperature": 0.0}
CONNECT_TIMEOUT_S = 60.0


def watch(channel: grpc.Channel, seen: list[int], serving: threading.Event) -> None:
    """Record every status the Watch stream sends until the server goes away."""
    updates = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=SERVICE))
    try:
        for update in updates:
            seen.append(update.status)
            if update.status == SERVING:
                serving.set()
    except grpc.RpcError:
        pass  # the server stopped


def test_health_watch_sees_loading_serving_draining_and_streams_drain() -> None:
    server: LiveServer = launch_server(
        [ZOO_DIR / "zoo-rope"], options={"device": "cpu", "drain_timeout": 120}, env=SERVER_ENV
    )
    seen: list[int] = []
    serving = threading.Event()
    try:
        assert server.grpc_target is not None
        with (
            grpc.insecure_channel(server.grpc_target) as channel,
            httpx.Client(base_url=server.base_url, timeout=10.0) as probe,
            ThreadPoolExecutor(max_workers=2) as pool,
        ):
            grpc.channel_ready_future(channel).result(timeout=CONNECT_TIMEOUT_S)
            watcher = pool.submit(watch, channel, seen, serving)
            wait_for(lambda: bool(seen), "the first health update")
            assert seen[0] == NOT_SERVING, "connected after loading; the zoo model loaded too fast"
            with pytest.raises(grpc.RpcError) as loading:
                generate(channel, {"prompt": "a", "max_new_tokens": 1}, timeout=10)
            if not serving.is_set():
                assert_status(loading.value, grpc.StatusCode.UNAVAILABLE)
            assert serving.wait(timeout=120)
            in_flight = stream(channel, IN_FLIGHT, timeout=120)
            next(in_flight)
            wait_for(lambda: metric_value(probe, "pe_serve_batch_size") == 1, "the stream to run")
            server.send_signal(signal.SIGTERM)
            wait_for(lambda: seen[-1] == NOT_SERVING, "health to turn NOT_SERVING")
            with pytest.raises(grpc.RpcError) as refused:
                generate(channel, {"prompt": "a", "max_new_tokens": 1}, timeout=10)
            assert_status(refused.value, grpc.StatusCode.UNAVAILABLE)
            rest = list(in_flight)
            assert rest[-1].end.finish_reason == "length"
            assert rest[-1].end.usage.completion_tokens == IN_FLIGHT["max_new_tokens"]
            watcher.result(timeout=60)
        assert server.wait() == 0
        transitions = [status for index, status in enumerate(seen) if index == 0 or seen[index - 1] != status]
        assert transitions == [NOT_SERVING, SERVING, NOT_SERVING]
    finally:
        server.stop()
        server.log_path.unlink(missing_ok=True)


def test_reflection_lists_the_service_and_its_methods(grpc_channel: grpc.Channel) -> None:
    database = ProtoReflectionDescriptorDatabase(grpc_channel)
    services = set(database.get_services())
    assert {SERVICE, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= services
    described = database.FindFileContainingSymbol(SERVICE)
    methods = {method.name for service in described.service for method in service.method}
    assert methods == {"Generate", "Score", "ListModels", "Abort"}


def test_health_answers_for_the_server_and_the_service(grpc_channel: grpc.Channel) -> None:
    stub = health_pb2_grpc.HealthStub(grpc_channel)
    for service in ("", SERVICE):
        assert stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status == SERVING
