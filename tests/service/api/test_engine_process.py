"""The engine process under a real server: killed mid-request, restarted, and given up on.

The engine runs in a child process of `pe-serve`; these tests kill it with SIGKILL, as the kernel's
OOM killer or a crashing kernel would, and check what a client and an orchestrator see.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
from pathlib import Path

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.live_server import live_server
from tests.service.api.conftest import BASE_OPTIONS, SERVER_ENV
from tests.service.api.helpers import assert_error_shape, wait_for

LONG_CONTEXT = 4096
STREAM = {"prompt": "a", "max_new_tokens": 3000, "temperature": 0, "stream": True}


def grpc_health(target: str) -> int:
    with grpc.insecure_channel(target) as channel:
        request = health_pb2.HealthCheckRequest(service="")
        status: int = health_pb2_grpc.HealthStub(channel).Check(request, timeout=10).status
        return status


def first_event_then_the_rest(client: httpx.Client, started: threading.Event) -> list[dict[str, object]]:
    events: list[dict[str, object]] = []
    with client.stream("POST", "/generate", json=STREAM) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line.removeprefix("data: ")))
                started.set()
    return events


def test_a_killed_engine_fails_its_requests_at_once_and_is_restarted(tiny_zoo: list[Path]) -> None:
    options = {**BASE_OPTIONS, "max_context": LONG_CONTEXT}
    with (
        live_server(tiny_zoo[:1], options=options, env=SERVER_ENV) as server,
        httpx.Client(base_url=server.base_url, timeout=60.0) as client,
    ):
        first_engine = server.engine_pid()
        started = threading.Event()
        streamed: list[list[dict[str, object]]] = []
        reader = threading.Thread(target=lambda: streamed.append(first_event_then_the_rest(client, started)))
        reader.start()
        assert started.wait(30), "the stream never started"
        os.kill(first_engine, signal.SIGKILL)
        reader.join(10)
        assert not reader.is_alive(), "the stream hung after the engine died"
        wait_for(lambda: client.get("/readyz").status_code == 503, "readyz to report the dead engine")
        assert_error_shape(client.get("/readyz"), 503)
        assert server.grpc_target is not None
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        wait_for(lambda: grpc_health(server.grpc_target or "") == not_serving, "gRPC health too")
        events = streamed[0]
        assert "token" in events[0]
        error = events[-1]["error"]
        assert isinstance(error, dict) and error["type"] == "service_unavailable"
        assert "engine process stopped" in error["message"]
        wait_for(lambda: client.get("/readyz").status_code == 200, "the restarted engine", timeout=120)
        assert grpc_health(server.grpc_target) == health_pb2.HealthCheckResponse.SERVING
        assert server.engine_pid() != first_engine
        again = client.post("/generate", json={"prompt": "a", "max_new_tokens": 4, "temperature": 0})
        assert again.status_code == 200, again.text
        assert again.json()["usage"]["completion_tokens"] == 4
        metrics = client.get("/metrics").text
        assert "pe_engine_process_resident_memory_bytes" in metrics
        assert "process_resident_memory_bytes" in metrics.replace("pe_engine_process_resident", "")
        assert "pe_cache_hits_total" in metrics
        assert server.process.poll() is None
        records = [json.loads(line) for line in server.logs().splitlines() if line.startswith("{")]
        frozen = [record for record in records if record.get("message") == "froze the start-up objects"]
        pids = {server.process.pid, first_engine, server.engine_pid()}
        assert {record["pid"] for record in frozen} == pids, "the API process and both engines froze theirs"
        assert all(record["objects"] > 10_000 for record in frozen)


def test_an_engine_that_cannot_come_back_makes_the_server_exit_non_zero(
    tiny_zoo: list[Path], tmp_path: Path
) -> None:
    checkpoint = shutil.copytree(tiny_zoo[0], tmp_path / tiny_zoo[0].name)
    with live_server([checkpoint], options=BASE_OPTIONS, env=SERVER_ENV) as server:
        shutil.rmtree(checkpoint)  # the restart cannot load it again
        os.kill(server.engine_pid(), signal.SIGKILL)
        assert server.wait(timeout=120) == 1
        assert "the engine process could not be restarted" in server.logs()


def test_the_thread_mode_serves_the_same_api_without_a_child_process(tiny_zoo: list[Path]) -> None:
    options = {**BASE_OPTIONS, "engine_mode": "thread", "torch_threads": 1}
    with (
        live_server(tiny_zoo[:1], options=options, env=SERVER_ENV) as server,
        httpx.Client(base_url=server.base_url, timeout=60.0) as client,
    ):
        tasks = Path(f"/proc/{server.process.pid}/task")
        children = [pid for task in tasks.iterdir() for pid in (task / "children").read_text().split()]
        assert not [pid for pid in children if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        reply = client.post("/generate", json={"prompt": "a", "max_new_tokens": 3, "temperature": 0})
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 3
        metrics = client.get("/metrics").text
        assert "pe_cache_hits_total" in metrics and "pe_engine_process" not in metrics
