"""What a client pays for gRPC instead of HTTP: one 64-token greedy generation, end to end.

Starts the real server (`python -m service`, HTTP and gRPC on free loopback ports) and times the
same request through the SDK's clients: `PEClient.generate` (JSON), `PEClient.generate_stream`
(SSE) and `GrpcPEClient.generate` (the server-streaming `Generate`). The three take turns within
each repeat (the order rotating) and the overhead is the median over repeats of the per-repeat
difference, so drifting machine load hits every kind alike. All kinds must produce the same
tokens. Short by design (well under a minute on two cores). Run:

    python -m bench.grpc_latency [--repeats N] [--model-dir DIR] [--output PATH] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path

from pe_client import PEClient, StreamToken
from pe_client.grpc import GrpcPEClient

from bench.serving import DEFAULT_MODEL_DIR, ServerOptions, free_port, running_server
from bench.throughput import interleaved_runs

DEFAULT_OUTPUT = Path(__file__).parent / "results" / "grpc_latency.md"
NEW_TOKENS = 64
PROMPT = "def fibonacci(n):\n"
REQUEST = {"prompt": PROMPT, "max_new_tokens": NEW_TOKENS, "temperature": 0.0}
Timed = tuple[float, list[int]]


def timed(run: Callable[[], list[int]]) -> Callable[[], Timed]:
    def measure() -> Timed:
        started = time.perf_counter()
        tokens = run()
        return (time.perf_counter() - started) * 1000.0, tokens

    return measure


def streamed_tokens(client: PEClient) -> list[int]:
    with client.generate_stream(**REQUEST) as stream:  # type: ignore[arg-type]
        return [event.token for event in stream if isinstance(event, StreamToken)]


def measure(base_url: str, grpc_target: str, repeats: int) -> dict[str, list[Timed]]:
    with PEClient(base_url, max_retries=0) as http, GrpcPEClient(grpc_target, max_retries=0) as grpc:
        runs = {
            "HTTP JSON (PEClient.generate)": timed(lambda: http.generate(**REQUEST).tokens),  # type: ignore[arg-type]
            "HTTP SSE (PEClient.generate_stream)": timed(lambda: streamed_tokens(http)),
            "gRPC (GrpcPEClient.generate)": timed(lambda: grpc.generate(**REQUEST).tokens),  # type: ignore[arg-type]
        }
        return interleaved_runs(repeats, runs)


def report(results: dict[str, list[Timed]], *, model_dir: Path, repeats: int, threads: int) -> str:
    kinds = list(results)
    token_lists = {tuple(tokens) for runs in results.values() for _, tokens in runs}
    if len(token_lists) != 1:
        raise AssertionError("the protocols did not generate the same tokens")
    generated = len(next(iter(token_lists)))
    baseline = [ms for ms, _ in results[kinds[0]]]
    lines = [
        "# gRPC vs HTTP latency",
        "",
        f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {platform.machine()}, {os.cpu_count()} cores, "
        f"model `{model_dir.name}`, CPU float32, {threads} engine thread(s), {repeats} repeats.",
        f"One greedy generation of max_new_tokens={NEW_TOKENS} ({generated} generated; prompt {PROMPT!r}),",
        "one request at a time, through the SDK's clients on loopback; the same tokens on every protocol.",
        "Overhead: median over repeats of (kind - HTTP JSON), measured back to back.",
        "",
        "| client | median ms | min ms | overhead vs HTTP JSON, ms | overhead % |",
        "|---|---:|---:|---:|---:|",
    ]
    for kind in kinds:
        times = [ms for ms, _ in results[kind]]
        deltas = [ms - base for ms, base in zip(times, baseline, strict=True)]
        overhead = statistics.median(deltas)
        lines.append(
            f"| {kind} | {statistics.median(times):.2f} | {min(times):.2f} | {overhead:+.2f} | "
            f"{100.0 * overhead / statistics.median(baseline):+.1f} |"
        )
    lines += ["", f"Run: `python -m bench.grpc_latency --repeats {repeats}`", ""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.grpc_latency", description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument("--threads", type=int, default=1, help="engine torch threads (default 1)")
    args = parser.parse_args(argv)
    grpc_port = free_port()
    with tempfile.TemporaryDirectory(prefix="pe-grpc-latency-") as workdir:
        log_path = Path(workdir) / "server.log"
        options = ServerOptions(threads=args.threads, grpc_port=grpc_port)
        with running_server(args.model_dir, log_path, options) as base_url:
            results = measure(base_url, f"127.0.0.1:{grpc_port}", args.repeats)
    text = report(results, model_dir=args.model_dir, repeats=args.repeats, threads=args.threads)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
