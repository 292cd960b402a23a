"""The blind window after an engine process's death: how long health still says "ready", and what
each request caught in it gets.

A server on the bundled zoo (or `--model-dir`) runs under load: `--clients` threads, half of them
streaming, send generations back to back with no retries (after a refusal, each waits its
`Retry-After`), while two probes ask `/readyz` and gRPC
health `Check` as fast as they answer. The engine process is then killed with SIGKILL, and the run
waits until `/readyz` is 200 again. Per kill it records:

- the window: from the kill to the end of the first probe answering 503 / NOT_SERVING (an upper
  bound; the probes' own round trips are its resolution);
- every request in flight at the kill or sent before the server was ready again: its status, its
  `Retry-After`, its error type, and whether a stream ended with a typed error event.

The engine is restarted at most `MAX_RESTARTS` times in `RESTART_WINDOW_S` before the server gives
up, so every `MAX_RESTARTS` kills run on a fresh server.

    python -m bench.blind_window [--kills 5] [--clients 8]

writes `bench/results/blind_window.md` with the command.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shlex
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service.engine.client import MAX_RESTARTS
from tests.live_server import LiveServer, OptionValue, live_server

RESULTS = Path(__file__).resolve().parent / "results" / "blind_window.md"
OPTIONS: dict[str, OptionValue] = {"device": "cpu", "dtype": "float32", "max_context": 512}
BODY = {"prompt": "def blind(window):", "max_new_tokens": 48, "temperature": 0.8, "seed": 3}
CALL_TIMEOUT_S = 60.0
READY_AGAIN_TIMEOUT_S = 600.0
_PROBE_PAUSE_S = 0.002


@dataclass(frozen=True)
class Probe:
    started: float
    ended: float
    ready: bool


@dataclass(frozen=True)
class Call:
    """One request: `status` None when the connection failed; `stream_end` how a stream ended."""

    started: float
    ended: float
    stream: bool
    status: int | None
    retry_after: str | None = None
    error_type: str | None = None
    stream_end: str | None = None

    def verdict(self) -> str:
        """What the client got, in a few words: the table's row label."""
        if self.status is None:
            return f"connection failed ({self.error_type})"
        if self.status != 200:
            retry = f", Retry-After {self.retry_after}" if self.retry_after else ", no Retry-After"
            return f"{self.status} {self.error_type}{retry}"
        if self.stream:
            return f"200 stream, {self.stream_end}"
        return "200"


@dataclass
class KillRecord:
    killed_at: float
    readyz: list[Probe] = field(default_factory=list)
    grpc: list[Probe] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)

    def window_s(self, probes: Sequence[Probe]) -> float | None:
        """Kill to the end of the first probe sent after it that answered not ready."""
        after = [probe for probe in probes if probe.started >= self.killed_at and not probe.ready]
        return min(probe.ended for probe in after) - self.killed_at if after else None

    def ready_again_at(self) -> float | None:
        after = [probe for probe in self.readyz if probe.started >= self.killed_at]
        seen_down = False
        for probe in sorted(after, key=lambda probe: probe.started):
            seen_down = seen_down or not probe.ready
            if seen_down and probe.ready:
                return probe.ended
        return None

    def caught(self) -> list[Call]:
        """Calls in flight at the kill or started before the server was ready again."""
        back = self.ready_again_at() or float("inf")
        return [call for call in self.calls if call.ended >= self.killed_at and call.started <= back]


def _probe_readyz(base_url: str, stop: threading.Event, out: list[Probe]) -> None:
    with httpx.Client(base_url=base_url, timeout=10.0) as client:
        while not stop.is_set():
            started = time.monotonic()
            try:
                ready = client.get("/readyz").status_code == 200
            except httpx.TransportError:
                ready = False
            out.append(Probe(started, time.monotonic(), ready))
            time.sleep(_PROBE_PAUSE_S)


def _probe_grpc(target: str, stop: threading.Event, out: list[Probe]) -> None:
    serving = health_pb2.HealthCheckResponse.SERVING
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while not stop.is_set():
            started = time.monotonic()
            try:
                ready = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10.0).status == serving
            except grpc.RpcError:
                ready = False
            out.append(Probe(started, time.monotonic(), ready))
            time.sleep(_PROBE_PAUSE_S)


def _one_call(client: httpx.Client, stream: bool) -> Call:
    started = time.monotonic()
    try:
        if not stream:
            response = client.post("/generate", json=BODY)
            return _finished(started, response, stream=False)
        with client.stream("POST", "/generate", json={**BODY, "stream": True}) as response:
            if response.status_code != 200:
                response.read()
                return _finished(started, response, stream=True)
            end = "no [DONE] (truncated)"
            for line in response.iter_lines():
                payload = line.removeprefix("data: ")
                if payload == "[DONE]":
                    end = "[DONE]"
                elif line.startswith("data: ") and '"error"' in payload:
                    end = f"error event {json.loads(payload)['error']['type']}"
            return Call(started, time.monotonic(), True, 200, stream_end=end)
    except httpx.TransportError as error:
        return Call(started, time.monotonic(), stream, None, error_type=type(error).__name__)


def _finished(started: float, response: httpx.Response, *, stream: bool) -> Call:
    error_type = None
    if response.status_code != 200:
        try:
            error_type = response.json()["error"]["type"]
        except (ValueError, KeyError, TypeError):
            error_type = "unreadable body"
    return Call(
        started,
        time.monotonic(),
        stream,
        response.status_code,
        response.headers.get("retry-after"),
        error_type,
    )


def _load(base_url: str, stream: bool, stop: threading.Event, out: list[Call]) -> None:
    """Requests back to back; after a refusal, the wait its `Retry-After` asks for (as the SDK
    does), so that the restarting server is not flooded. Nothing is retried: each call counts."""
    with httpx.Client(base_url=base_url, timeout=CALL_TIMEOUT_S) as client:
        while not stop.is_set():
            call = _one_call(client, stream)
            out.append(call)
            if call.retry_after is not None:
                stop.wait(float(call.retry_after))


def kill_under_load(server: LiveServer, *, clients: int, settle_s: float = 1.0) -> KillRecord:
    """SIGKILL the server's engine process under load; return once `/readyz` is 200 again."""
    assert server.grpc_target is not None, "the server needs its gRPC port"
    stop = threading.Event()
    record = KillRecord(killed_at=float("inf"))
    workers: list[Callable[[], None]] = [
        lambda: _probe_readyz(server.base_url, stop, record.readyz),
        lambda: _probe_grpc(server.grpc_target or "", stop, record.grpc),
        *(
            (lambda stream=index % 2 == 1: _load(server.base_url, stream, stop, record.calls))
            for index in range(clients)
        ),
    ]
    threads = [threading.Thread(target=work, daemon=True) for work in workers]
    for thread in threads:
        thread.start()
    try:
        time.sleep(settle_s)
        engine = server.engine_pid()
        record.killed_at = time.monotonic()
        os.kill(engine, signal.SIGKILL)
        deadline = record.killed_at + READY_AGAIN_TIMEOUT_S
        while record.ready_again_at() is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"not ready again {READY_AGAIN_TIMEOUT_S:.0f} s after the kill")
            time.sleep(0.1)
        time.sleep(settle_s)
    finally:
        stop.set()
        for thread in threads:
            thread.join(CALL_TIMEOUT_S + 10.0)
    hung = [thread for thread in threads if thread.is_alive()]
    if hung:
        raise TimeoutError(f"{len(hung)} client threads still waiting {CALL_TIMEOUT_S:.0f} s after the stop")
    return record


def _ms(seconds: float | None) -> str:
    return "never" if seconds is None else f"{seconds * 1000:.0f} ms"


def _probe_gap_ms(probes: Sequence[Probe]) -> float:
    """Median time between probe starts: the resolution of the window figures."""
    starts = sorted(probe.started for probe in probes)
    gaps = sorted(later - earlier for earlier, later in itertools.pairwise(starts))
    return gaps[len(gaps) // 2] * 1000 if gaps else float("nan")


def report(records: Sequence[KillRecord], command: str, clients: int) -> str:
    lines = [
        "# Blind window after an engine process's death",
        "",
        f"`{command}`: {len(records)} SIGKILLs of the engine process, each under {clients} clients "
        f"(half streaming, no retries, waiting out `Retry-After`), on CPU; `/readyz` and gRPC health "
        "`Check` probed back to back. Window: from the kill to the end of the first probe answering "
        "not ready (an upper bound; the probe interval is its resolution). Caught: requests in flight "
        "at the kill or sent before `/readyz` was 200 again.",
        "",
        "| kill | `/readyz` 503 after | gRPC NOT_SERVING after | probe interval (readyz / gRPC) "
        "| ready again after | caught | what the caught requests got |",
        "|---|---|---|---|---|---|---|",
    ]
    for number, record in enumerate(records, 1):
        caught = record.caught()
        got = Counter(call.verdict() for call in caught)
        back = record.ready_again_at()
        lines.append(
            f"| {number} | {_ms(record.window_s(record.readyz))} | {_ms(record.window_s(record.grpc))} "
            f"| {_probe_gap_ms(record.readyz):.1f} / {_probe_gap_ms(record.grpc):.1f} ms "
            f"| {_ms(None if back is None else back - record.killed_at)} | {len(caught)} "
            f"| {'; '.join(f'{count} x {verdict}' for verdict, count in got.most_common())} |"
        )
    windows = [
        window
        for record in records
        for window in (record.window_s(record.readyz), record.window_s(record.grpc))
        if window is not None
    ]
    lines += ["", f"Longest window: {max(windows) * 1000:.0f} ms." if windows else "No window measured.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--model-dir", nargs="*", default=[], help="default: the bundled zoo")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    command = shlex.join(
        ["python", "-m", "bench.blind_window", *(argv if argv is not None else sys.argv[1:])]
    )
    records: list[KillRecord] = []
    while len(records) < args.kills:
        with live_server(args.model_dir, options=OPTIONS, env={"OMP_NUM_THREADS": "1"}) as server:
            for _ in range(min(MAX_RESTARTS, args.kills - len(records))):
                records.append(kill_under_load(server, clients=args.clients))
                print(report(records[-1:], command, args.clients).splitlines()[-3], flush=True)
    text = report(records, command, args.clients)
    args.output.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
