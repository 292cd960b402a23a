"""What a client of the real server sees: HTTP overhead, long contexts, stalls, padding, mixed scalings.

`bench.throughput` measures the engine inside the benchmark's own process. This benchmark starts
the real server (`python -m service`) as a subprocess on a free loopback port and drives it with
concurrent clients over real connections, because what users pay for is the whole path: JSON,
uvicorn, the API process, the pipe to the engine process, SSE framing. Five sections, each a table in
`bench/results/serving.md`:

1. serving-path cost: tok/s through HTTP vs. the in-process engine vs. transformers `generate()`;
2. dynamic NTK vs. YaRN per-token time past the native context, plus one ~4000-token generation;
3. stalls: inter-token gaps of streaming clients while a long `/score` or prefill arrives;
4. a realistic mixed workload vs. `generate()` in static padded batches (what padding costs);
5. mixed `pe_scaling` types in one batch vs. a uniform batch.

Same weights everywhere: `bench.throughput.prepare_models` writes the checkpoint with EOS disabled
(every request runs to `max_new_tokens`, so every side does the same work) and exports it as a
Llama directory for transformers. Greedy decoding, float32, CPU. Kinds measured against each other
take turns within every repeat, and ratios are medians of per-repeat ratios, so drifting machine
load hits both sides of a ratio alike. Run:

    python -m bench.serving [--quick] [--repeats N] [--output PATH] [--model-dir DIR] [--threads N]

`--quick` shrinks every size (and defaults to one repeat) to smoke-test the script in about a minute;
its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import itertools
import json
import math
import os
import platform
import random
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import torch

from bench.throughput import (
    Measurement,
    interleaved_runs,
    median,
    paired_overhead,
    prepare_models,
    prompts,
    run_engine,
    run_generate,
    scaling_specs,
)
from pe_runtime import RopeScaling
from service.engine.core import DecodeSettings
from service.engine.engine import InferenceEngine

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL_DIR = REPO_ROOT / "models" / "zoo-rope"
DEFAULT_OUTPUT = Path(__file__).parent / "results" / "serving.md"
MAX_BATCH_SIZE = 64
MAX_CONTEXT = 4096
# The realistic workload's 64 requests reserve up to 50,000 tokens of KV blocks (6 KiB each): the
# default 128 MiB pool would queue half of them, which generate() never does.
KV_CACHE_MB = 512
READY_TIMEOUT_S = 900.0  # a cold start with --compile compiles the decode pass first
STOP_TIMEOUT_S = 30.0
SCALING_NAMES = ("none", "linear", "ntk", "dynamic", "yarn", "llama3")
STALL_GOAL = 5.0  # max gap with a long request arriving / p99 gap alone
PADDING_GOAL = 5.0  # makespan of generate() in padded static batches / ours
MIXED_GOAL = 0.05  # extra cost of a batch mixing scaling types

Body = dict[str, Any]


@dataclass(frozen=True)
class Sizes:
    """Every length and count in the benchmark, so `--quick` can shrink them all in one place."""

    concurrency: tuple[int, ...]
    short_prompt: int  # sections 1 and 5
    short_new: int
    long_prompt: int  # section 2, dynamic vs. yarn
    long_new: int
    longest_prompt: int  # section 2, one very long dynamic generation
    longest_new: int
    longest_timeout_s: float
    stream_clients: int  # section 3
    stream_prompt: int
    stream_new: int
    interloper_tokens: int
    workload_requests: int  # section 4
    workload_prompt: tuple[int, int]
    workload_new: tuple[int, int]
    reference_batch: int
    mixed_clients: int  # section 5
    repeats: int
    # Sections 1 and 5 time runs of a second or two, where one hiccup of a shared machine moves a
    # ratio by several percent: they take this many times the repeats of the long sections.
    short_run_repeats: int
    request_timeout_s: float


FULL = Sizes(
    concurrency=(1, 16, 64),
    short_prompt=32,
    short_new=64,
    long_prompt=200,
    long_new=560,
    longest_prompt=100,
    longest_new=3900,
    longest_timeout_s=600.0,
    stream_clients=4,
    stream_prompt=32,
    stream_new=400,
    interloper_tokens=4000,
    workload_requests=64,
    workload_prompt=(16, 1024),
    workload_new=(16, 512),
    reference_batch=16,
    mixed_clients=16,
    repeats=3,
    short_run_repeats=3,
    request_timeout_s=900.0,
)
QUICK = Sizes(
    concurrency=(1, 4),
    short_prompt=8,
    short_new=8,
    long_prompt=16,
    long_new=24,
    longest_prompt=100,
    longest_new=300,
    longest_timeout_s=60.0,
    stream_clients=4,
    stream_prompt=8,
    stream_new=24,
    interloper_tokens=1024,
    workload_requests=8,
    workload_prompt=(16, 64),
    workload_new=(4, 16),
    reference_batch=4,
    mixed_clients=4,
    repeats=1,
    short_run_repeats=1,
    request_timeout_s=120.0,
)


# -- the server process ---------------------------------------------------------------------------


def free_port() -> int:
    """A port the OS just handed out on 127.0.0.1 (a tiny race remains until the server binds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@dataclass(frozen=True)
class ServerOptions:
    """How a benchmark starts the server; the defaults are those of the CPU runs in bench/results."""

    threads: int | None = None  # None: the server's own default (every core)
    compile: bool = False
    device: str = "cpu"
    dtype: str = "float32"
    compile_max_window: int = MAX_CONTEXT
    grpc_port: int | str = 0  # 0: no gRPC


def server_command(model_dir: Path | str, port: int | str, options: ServerOptions) -> list[str]:
    """The server exactly as a user would start it, one process serving every section."""
    compile_flags = ("--compile", "--compile-max-window", str(options.compile_max_window))
    return [
        *("-m", "service", "--host", "127.0.0.1", "--port", str(port), "--model-dir", str(model_dir)),
        *("--grpc-port", str(options.grpc_port)),
        *("--device", options.device, "--dtype", options.dtype, "--max-context", str(MAX_CONTEXT)),
        *(
            "--max-batch-size",
            str(MAX_BATCH_SIZE),
            "--max-queue",
            "0",
            *(("--torch-threads", str(options.threads)) if options.threads is not None else ()),
        ),
        *(compile_flags if options.compile else ("--no-compile",)),
        *("--kv-cache-mb", str(KV_CACHE_MB)),
    ]


def wait_until_ready(process: subprocess.Popen[bytes], base_url: str, log_path: Path) -> None:
    """Poll `/readyz` until 200; fail early, with the server's log, if the process dies."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    with httpx.Client(timeout=2.0, trust_env=False) as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"pe-serve exited with {process.returncode}:\n{log_tail(log_path)}")
            with contextlib.suppress(httpx.TransportError):
                if client.get(base_url + "/readyz").status_code == 200:
                    return
            time.sleep(0.1)
    raise TimeoutError(f"pe-serve not ready after {READY_TIMEOUT_S:.0f} s:\n{log_tail(log_path)}")


def log_tail(log_path: Path, lines: int = 40) -> str:
    return "\n".join(log_path.read_text(errors="replace").splitlines()[-lines:])


@contextlib.contextmanager
def running_server(
    model_dir: Path, log_path: Path, options: ServerOptions, root: Path = REPO_ROOT
) -> Iterator[str]:
    """A ready server subprocess for the block, stopped (SIGTERM, then SIGKILL) whatever happens.

    With `options.threads` its intra-op threads are pinned like the benchmark's own, so HTTP and
    in-process runs compute with the same parallelism; without, each side runs as a user starts it.
    `root` is the checkout whose code it runs (`python -m service` imports from its working
    directory first): another worktree runs another revision beside this one.
    """
    port = free_port()
    environment = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if options.threads is not None:
        environment |= {"OMP_NUM_THREADS": str(options.threads), "MKL_NUM_THREADS": str(options.threads)}
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, *server_command(model_dir, port, options)],
            cwd=root,
            env=environment,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        base_url = f"http://127.0.0.1:{port}"
        wait_until_ready(process, base_url, log_path)
        yield base_url
    except BaseException:
        print(f"server log (last lines):\n{log_tail(log_path)}", file=sys.stderr)
        raise
    finally:
        process.terminate()
        try:
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


# -- HTTP clients ---------------------------------------------------------------------------------


def http_client(base_url: str, timeout_s: float) -> httpx.AsyncClient:
    """No connection limit (every client gets its own connection) and no proxies: loopback only."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits, trust_env=False)


async def post(client: httpx.AsyncClient, path: str, body: Body) -> Body:
    response = await client.post(path, json=body)
    if response.status_code != 200:
        raise RuntimeError(f"POST {path} answered {response.status_code}: {response.text[:500]}")
    reply: Body = response.json()
    return reply


@dataclass(frozen=True)
class Reply:
    body: Body
    latency_s: float  # from the moment all requests were sent together


async def post_lean(base_url: str, path: str, body: Body) -> Body:
    """One POST on a fresh connection, read to its end: the least work a client can do.

    The load generator shares this machine's two cores with the server. httpx spends about 2 ms
    of CPU per request, which a 16-request round pays one after another (about 40 ms of excess
    over the server's own time per round, against about 17 ms with this client, measured side by
    side); that is the client's cost, not the serving path's. Section 1 reports both clients.
    """
    host, _, port = base_url.removeprefix("http://").rpartition(":")
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    )
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(head.encode() + payload)
        response = await reader.read()  # to EOF: the server closes after one response
    finally:
        writer.close()
    status_line, _, rest = response.partition(b"\r\n")
    headers, _, content = rest.partition(b"\r\n\r\n")
    status = int(status_line.split(b" ", 2)[1])
    if status != 200 or b"transfer-encoding" in headers.lower():
        raise RuntimeError(f"POST {path} answered {status}: {content[:500]!r}")
    reply: Body = json.loads(content)
    return reply


def send_all(
    base_url: str, bodies: Sequence[Body], timeout_s: float, *, lean: bool = True
) -> tuple[list[Reply], float]:
    """POST every body to /generate at once, one connection each; the replies and the makespan.

    `lean`: the minimal client (`post_lean`); otherwise one `httpx.AsyncClient`.
    """

    async def run() -> tuple[list[Reply], float]:
        async with http_client(base_url, timeout_s) as client:
            start = time.perf_counter()

            async def one(body: Body) -> Reply:
                if lean:
                    reply = await post_lean(base_url, "/generate", body)
                else:
                    reply = await post(client, "/generate", body)
                return Reply(reply, time.perf_counter() - start)

            async with asyncio.timeout(timeout_s):
                replies = await asyncio.gather(*(one(body) for body in bodies))
            return list(replies), time.perf_counter() - start

    return asyncio.run(run())


def generate_body(
    tokens: Sequence[int], new_tokens: int, scaling: Body | None = None, *, stream: bool = False
) -> Body:
    body: Body = {"tokens": list(tokens), "max_new_tokens": new_tokens, "temperature": 0}
    if scaling is not None:
        body["pe_scaling"] = scaling
    if stream:
        body["stream"] = True
    return body


def completion_tokens(replies: Sequence[Reply], bodies: Sequence[Body]) -> list[int]:
    """Generated counts; each must equal max_new_tokens, or the sides would not do the same work."""
    counts = [int(reply.body["usage"]["completion_tokens"]) for reply in replies]
    expected = [int(body["max_new_tokens"]) for body in bodies]
    if counts != expected:
        raise RuntimeError(f"requests stopped early (EOS not disabled?): {counts} != {expected}")
    return counts


def http_throughput(
    base_url: str, bodies: Sequence[Body], timeout_s: float, *, lean: bool = True
) -> Measurement:
    """Generated tokens / wall time of all `bodies` at once, and the median decode time per token.

    Per token is `timing.decode_ms / (completion_tokens - 1)`: the first token comes out of the
    prefill, so decode time covers the others.
    """
    replies, wall_s = send_all(base_url, bodies, timeout_s, lean=lean)
    counts = completion_tokens(replies, bodies)
    per_token = [
        float(reply.body["timing"]["decode_ms"]) / (count - 1)
        for reply, count in zip(replies, counts, strict=True)
        if count > 1
    ]
    return Measurement(sum(counts) / wall_s, statistics.median(per_token) if per_token else math.nan)


def served_native_context(base_url: str) -> int:
    with httpx.Client(base_url=base_url, timeout=10.0, trust_env=False) as client:
        return int(client.get("/models").json()["models"][0]["native_context"])


def paired_ratio(numerators: Sequence[Measurement], denominators: Sequence[Measurement]) -> float:
    """Median over repeats of one tok/s over the other, each pair taken in the same repeat."""
    return statistics.median(
        a.tokens_per_s / b.tokens_per_s for a, b in zip(numerators, denominators, strict=True)
    )


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), no numpy needed."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


# -- 1. serving-path cost -------------------------------------------------------------------------


def measure_serving_path(
    base_url: str, engine: InferenceEngine, reference: Any, clients: int, sizes: Sizes, repeats: int
) -> dict[str, list[Measurement]]:
    """The same `clients` requests through HTTP, through the engine in this process, and generate()."""
    batch = prompts(clients, sizes.short_prompt)
    bodies = [generate_body(prompt, sizes.short_new) for prompt in batch]
    unscaled = [RopeScaling.from_hf(None, max_position_embeddings=engine.models()[0].native_context)]
    runs = {
        "http": lambda: http_throughput(base_url, bodies, sizes.request_timeout_s),
        "http_httpx": lambda: http_throughput(base_url, bodies, sizes.request_timeout_s, lean=False),
        "engine": lambda: run_engine(engine, batch, sizes.short_new, unscaled),
        "generate": lambda: run_generate(reference, batch, sizes.short_new),
    }
    return interleaved_runs(repeats, runs)


# -- 2. dynamic NTK vs. YaRN past the native context ----------------------------------------------


def measure_scaled_decode(
    base_url: str, native: int, sizes: Sizes, repeats: int
) -> dict[str, list[Measurement]]:
    """One client, one long generation per scaling: the cost of dynamic NTK's length-dependent base."""
    prompt = prompts(1, sizes.long_prompt)[0]
    scalings = {scaling["type"]: scaling for scaling in scaling_specs(native)}
    bodies = {kind: generate_body(prompt, sizes.long_new, scalings[kind]) for kind in ("dynamic", "yarn")}
    runs: dict[str, Callable[[], Measurement]] = {
        kind: functools.partial(http_throughput, base_url, [body], sizes.request_timeout_s)
        for kind, body in bodies.items()
    }
    return interleaved_runs(repeats, runs)


@dataclass(frozen=True)
class LongRun:
    total_tokens: int
    wall_s: float
    finish_reason: str | None
    completion_tokens: int
    decode_ms_per_token: float
    error: str | None


def measure_longest_dynamic(base_url: str, native: int, sizes: Sizes) -> LongRun:
    """One dynamic-NTK generation to nearly max_context; a failure is reported, not raised."""
    prompt = prompts(1, sizes.longest_prompt)[0]
    dynamic = next(scaling for scaling in scaling_specs(native) if scaling["type"] == "dynamic")
    body = generate_body(prompt, sizes.longest_new, dynamic)
    total = sizes.longest_prompt + sizes.longest_new
    start = time.perf_counter()
    try:
        (reply,), _ = send_all(base_url, [body], sizes.longest_timeout_s)
    except (httpx.HTTPError, RuntimeError) as error:
        return LongRun(
            total, time.perf_counter() - start, None, 0, math.nan, f"{type(error).__name__}: {error}"
        )
    count = int(reply.body["usage"]["completion_tokens"])
    decode_ms = float(reply.body["timing"]["decode_ms"])
    per_token = decode_ms / (count - 1) if count > 1 else math.nan
    return LongRun(total, reply.latency_s, reply.body["finish_reason"], count, per_token, None)


# -- 3. stalls ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StallRun:
    gaps_ms: list[float]  # between consecutive token events of one stream, all streams pooled
    interloper_ms: float | None
    overlapped: bool  # streams were still producing tokens when the interloper finished

    @property
    def p50(self) -> float:
        return percentile(self.gaps_ms, 50)

    @property
    def p99(self) -> float:
        return percentile(self.gaps_ms, 99)

    @property
    def max(self) -> float:
        return max(self.gaps_ms, default=math.nan)


async def stream_tokens(
    client: httpx.AsyncClient, body: Body, arrivals: list[float], on_token: Callable[[], None]
) -> None:
    """Consume one SSE generation, appending the arrival time of every token event."""
    async with client.stream("POST", "/generate", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            raise RuntimeError(f"stream answered {response.status_code}: {response.text[:500]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                return
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(f"stream failed: {event['error']}")
            if "token" in event:
                arrivals.append(time.perf_counter())
                on_token()
    raise RuntimeError("stream ended without [DONE]")


def stall_run(base_url: str, sizes: Sizes, interloper: tuple[str, Body] | None) -> StallRun:
    """Streaming clients; once each has a quarter of its tokens, the interloper (if any) is sent."""
    bodies = [
        generate_body(prompt, sizes.stream_new, stream=True)
        for prompt in prompts(sizes.stream_clients, sizes.stream_prompt)
    ]
    arrivals: list[list[float]] = [[] for _ in bodies]
    threshold = max(1, sizes.stream_new // 4)

    async def run() -> tuple[float | None, float]:
        midway = asyncio.Event()

        def check() -> None:
            if min(len(times) for times in arrivals) >= threshold:
                midway.set()

        async def stream(client: httpx.AsyncClient, body: Body, times: list[float]) -> None:
            try:
                await stream_tokens(client, body, times, check)
            finally:
                midway.set()  # a stream that ends or fails must not leave the interloper waiting

        async def interfere(client: httpx.AsyncClient) -> tuple[float | None, float]:
            if interloper is None:
                return None, math.nan
            await midway.wait()
            start = time.perf_counter()
            await post(client, *interloper)
            end = time.perf_counter()
            return (end - start) * 1000.0, end

        async with http_client(base_url, sizes.request_timeout_s) as client:
            streams = asyncio.gather(
                *(stream(client, body, times) for body, times in zip(bodies, arrivals, strict=True))
            )
            try:
                result = await interfere(client)
            except BaseException:
                streams.cancel()
                raise
            await streams
        return result

    interloper_ms, interloper_end = asyncio.run(run())
    gaps = [(later - earlier) * 1000.0 for times in arrivals for earlier, later in itertools.pairwise(times)]
    overlapped = interloper_end < max(times[-1] for times in arrivals if times)
    return StallRun(gaps, interloper_ms, overlapped)


def measure_stalls(base_url: str, native: int, sizes: Sizes, repeats: int) -> dict[str, list[StallRun]]:
    """Gaps alone, then with a long /score, then with a long prefill, arriving mid-stream."""
    long_prompt = list(prompts(1, sizes.interloper_tokens)[0])
    dynamic = next(scaling for scaling in scaling_specs(native) if scaling["type"] == "dynamic")
    score: tuple[str, Body] = ("/score", {"tokens": long_prompt, "pe_scaling": dynamic})
    prefill: tuple[str, Body] = ("/generate", generate_body(long_prompt, 1, dynamic))
    runs = {
        "alone": lambda: stall_run(base_url, sizes, None),
        "score": lambda: stall_run(base_url, sizes, score),
        "prefill": lambda: stall_run(base_url, sizes, prefill),
    }
    return interleaved_runs(repeats, runs)


# -- 4. realistic workload vs. padded static batches ----------------------------------------------


@dataclass(frozen=True)
class WorkItem:
    prompt: tuple[int, ...]
    max_new_tokens: int
    scaling: Body


@dataclass(frozen=True)
class WorkloadRun:
    makespan_s: float
    latencies_s: list[float]


def workload(native: int, sizes: Sizes) -> list[WorkItem]:
    """Seeded random lengths in arrival order, scalings cycling through every type."""
    rng = random.Random(0)
    scalings = scaling_specs(native)
    items = []
    for index in range(sizes.workload_requests):
        length = rng.randint(*sizes.workload_prompt)
        new_tokens = rng.randint(*sizes.workload_new)
        prompt = tuple(rng.randrange(256) for _ in range(length))
        items.append(WorkItem(prompt, new_tokens, scalings[index % len(scalings)]))
    assert all(len(item.prompt) + item.max_new_tokens <= MAX_CONTEXT for item in items)
    return items


def serve_workload(base_url: str, items: Sequence[WorkItem], sizes: Sizes) -> WorkloadRun:
    """Every request at once through HTTP; latency is from the common send to each reply."""
    bodies = [generate_body(item.prompt, item.max_new_tokens, item.scaling) for item in items]
    replies, makespan = send_all(base_url, bodies, sizes.request_timeout_s)
    completion_tokens(replies, bodies)
    return WorkloadRun(makespan, [reply.latency_s for reply in replies])


def reference_batches(items: Sequence[WorkItem], batch_size: int) -> list[Sequence[WorkItem]]:
    return [items[start : start + batch_size] for start in range(0, len(items), batch_size)]


def generate_workload(model: Any, items: Sequence[WorkItem], batch_size: int) -> WorkloadRun:
    """Static batches in arrival order, left-padded to the longest prompt, run to the largest budget.

    A request's latency is the end of its batch: generate() returns the whole batch at once.
    """
    start = time.perf_counter()
    latencies: list[float] = []
    for batch in reference_batches(items, batch_size):
        longest = max(len(item.prompt) for item in batch)
        new_tokens = max(item.max_new_tokens for item in batch)
        inputs = torch.zeros((len(batch), longest), dtype=torch.long)
        mask = torch.zeros_like(inputs)
        for row, item in enumerate(batch):
            inputs[row, longest - len(item.prompt) :] = torch.tensor(item.prompt)
            mask[row, longest - len(item.prompt) :] = 1
        with torch.inference_mode():
            output = model.generate(
                inputs,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        assert output.shape[1] == longest + new_tokens
        latencies += [time.perf_counter() - start] * len(batch)
    return WorkloadRun(time.perf_counter() - start, latencies)


@dataclass(frozen=True)
class WorkloadWork:
    """What each side must compute for the workload, and so how far apart they can be at best.

    Projections cost per token position, decode attention per cached key read, a prefill's
    attention about half the prompt's length squared; generate() pays all three for its padding
    too. A step-latency-bound device (a GPU with a small model) pays per sequential step instead:
    generate() runs its batches one after another, while continuous batching needs at least as
    many steps as the longest `max_new_tokens`.
    """

    useful_positions: int
    padded_positions: int
    useful_key_reads: float
    padded_key_reads: float
    reference_steps: int
    fewest_steps: int


def _key_reads(prompt: int, new_tokens: int) -> float:
    """Keys one sequence's attention reads: its prompt's causal prefill, then one window per new token."""
    return prompt * prompt / 2 + sum(prompt + step for step in range(new_tokens))


def workload_work(items: Sequence[WorkItem], batch_size: int) -> WorkloadWork:
    batches = reference_batches(items, batch_size)
    shapes = [
        (len(batch), max(len(i.prompt) for i in batch), max(i.max_new_tokens for i in batch))
        for batch in batches
    ]
    return WorkloadWork(
        useful_positions=sum(len(item.prompt) + item.max_new_tokens for item in items),
        padded_positions=sum(rows * (prompt + new) for rows, prompt, new in shapes),
        useful_key_reads=sum(_key_reads(len(item.prompt), item.max_new_tokens) for item in items),
        padded_key_reads=sum(rows * _key_reads(prompt, new) for rows, prompt, new in shapes),
        reference_steps=sum(new for _, _, new in shapes),
        fewest_steps=max(item.max_new_tokens for item in items),
    )


def measure_workload(
    base_url: str, reference: Any, items: Sequence[WorkItem], sizes: Sizes, repeats: int
) -> dict[str, list[WorkloadRun]]:
    """No warm-up: by now the server and the reference have run every kernel and table size."""
    runs = {
        "ours": lambda: serve_workload(base_url, items, sizes),
        "generate": lambda: generate_workload(reference, items, sizes.reference_batch),
    }
    return interleaved_runs(repeats, runs, warm_up=False)


# -- 5. mixed scalings in one batch ---------------------------------------------------------------


def measure_mixed(base_url: str, native: int, sizes: Sizes, repeats: int) -> dict[str, list[Measurement]]:
    """The same prompts, all `linear` x4, or cycling through every scaling type."""
    batch = prompts(sizes.mixed_clients, sizes.short_prompt)
    mix = scaling_specs(native)
    uniform = [generate_body(prompt, sizes.short_new, mix[1]) for prompt in batch]
    mixed = [generate_body(prompt, sizes.short_new, mix[i % len(mix)]) for i, prompt in enumerate(batch)]
    runs = {
        "uniform": lambda: http_throughput(base_url, uniform, sizes.request_timeout_s),
        "mixed": lambda: http_throughput(base_url, mixed, sizes.request_timeout_s),
    }
    return interleaved_runs(repeats, runs)


# -- driver and report ----------------------------------------------------------------------------


@dataclass
class Results:
    serving_path: dict[int, dict[str, list[Measurement]]]
    scaled: dict[str, list[Measurement]]
    longest: LongRun
    stalls: dict[str, list[StallRun]]
    workload: dict[str, list[WorkloadRun]]
    work: WorkloadWork
    mixed: dict[str, list[Measurement]]


def run_all(
    ours_dir: Path,
    llama_dir: Path,
    workdir: Path,
    sizes: Sizes,
    repeats: int,
    threads: int | None,
    compile: bool,
) -> Results:
    """Every section against one server process; the in-process engine only lives for section 1."""
    from transformers import LlamaForCausalLM

    reference = LlamaForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    reference.train(False)
    options = ServerOptions(threads=threads, compile=compile)
    with running_server(ours_dir, workdir / "server.log", options) as base_url:
        native = served_native_context(base_url)
        short_repeats = repeats * sizes.short_run_repeats
        progress("1/5 serving path")
        engine = InferenceEngine.from_model_dirs(
            [ours_dir],
            device="cpu",
            dtype="float32",
            max_batch_size=MAX_BATCH_SIZE,
            max_queue=0,
            decode=DecodeSettings(
                kv_cache_bytes=KV_CACHE_MB << 20, compile=compile, compile_max_window=MAX_CONTEXT
            ),
        )
        engine.start()
        try:
            path = {
                clients: measure_serving_path(base_url, engine, reference, clients, sizes, short_repeats)
                for clients in sizes.concurrency
            }
        finally:
            engine.shutdown()
        progress("2/5 dynamic vs. yarn")
        scaled = measure_scaled_decode(base_url, native, sizes, repeats)
        longest = measure_longest_dynamic(base_url, native, sizes)
        progress("3/5 stalls")
        stalls = measure_stalls(base_url, native, sizes, repeats)
        progress("4/5 workload")
        items = workload(native, sizes)
        workload_runs = measure_workload(base_url, reference, items, sizes, repeats)
        progress("5/5 mixed scalings")
        mixed = measure_mixed(base_url, native, sizes, short_repeats)
    return Results(
        path, scaled, longest, stalls, workload_runs, workload_work(items, sizes.reference_batch), mixed
    )


def progress(message: str) -> None:
    print(f"[bench.serving] {message}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one repeat: a smoke test only")
    parser.add_argument("--repeats", type=int, default=None, help="default 3 (1 with --quick)")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="pin intra-op threads, here and in the server (default: each side's own, every core)",
    )
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="the compiled decode pass in the server and the in-process engine (default off, as the server)",
    )
    arguments = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(arguments)
    sizes = QUICK if args.quick else FULL
    repeats = args.repeats if args.repeats is not None else sizes.repeats
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    started = datetime.now(UTC)
    with tempfile.TemporaryDirectory(prefix="bench-serving-") as workdir:
        ours_dir, llama_dir, source = prepare_models(args.model_dir, Path(workdir))
        results = run_all(ours_dir, llama_dir, Path(workdir), sizes, repeats, args.threads, args.compile)
    machine = (
        f"{platform.platform()}, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs "
        f"(load average {load_before:.1f} at start, {os.getloadavg()[0]:.1f} at end)"
    )
    header = Header(
        command=shlex.join(["python", "-m", "bench.serving", *arguments]),
        machine=machine,
        date=f"{started:%Y-%m-%d %H:%M} UTC, {(datetime.now(UTC) - started).total_seconds():.0f} s",
        source=source,
        threads=args.threads,
        compile=args.compile,
        repeats=repeats,
        quick=args.quick,
        revision=code_revision(),
    )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(report(header, sizes, results))
    print(args.output.read_text())
    return 0


@dataclass(frozen=True)
class Header:
    command: str
    machine: str
    date: str
    source: str
    threads: int | None
    compile: bool
    repeats: int
    quick: bool
    revision: str


def code_revision(root: Path = REPO_ROOT) -> str:
    """`git describe --dirty` of the checkout at `root`: the server may be edited between runs, so
    say which code ran."""
    try:
        described = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return described.stdout.strip()


def threads_line(threads: int | None) -> str:
    if threads is None:
        return f"each side on its default intra-op threads ({torch.get_num_threads()} in this process)"
    return f"{threads} intra-op thread(s) in the server and in this process"


def verdict(met: bool) -> str:
    return "met" if met else "**not met**"


def report(header: Header, sizes: Sizes, results: Results) -> str:
    import transformers

    server = shlex.join(
        ["python", *server_command("MODEL_COPY", "PORT", ServerOptions(header.threads, header.compile))]
    )
    lines = [
        "# Serving: the real server over HTTP vs. in-process and transformers `generate()`",
        "",
        f"Command: `{header.command}`",
        "",
        f"- Machine: {header.machine}",
        f"- torch {torch.__version__}, transformers {transformers.__version__}, "
        f"Python {platform.python_version()}",
        f"- Date: {header.date}; code: git {header.revision}",
        f"- Model: {header.source}, EOS disabled (every request runs to `max_new_tokens`), greedy "
        f"(temperature 0), float32, {threads_line(header.threads)}",
        f"- Server (one process for every section, loopback only; MODEL_COPY is the EOS-disabled copy): "
        f"`{server}`",
        f"- Medians of {header.repeats} repeat(s), {header.repeats * sizes.short_run_repeats} for the "
        "short runs of sections 1 and 5; kinds compared take turns within each repeat (after one "
        "warm-up each unless noted) and ratios are medians of per-repeat ratios.",
    ]
    if header.quick:
        lines += ["", "**`--quick` run: sizes shrunk to a smoke test; these numbers mean nothing.**"]
    lines += section_serving_path(sizes, results.serving_path)
    lines += section_scaled(sizes, results.scaled, results.longest)
    lines += section_stalls(sizes, results.stalls)
    lines += section_workload(sizes, results.workload, results.work)
    lines += section_mixed(sizes, results.mixed)
    return "\n".join(lines) + "\n"


def section_serving_path(sizes: Sizes, results: dict[int, dict[str, list[Measurement]]]) -> list[str]:
    lines = [
        "",
        "## 1. Serving-path cost",
        "",
        f"{sizes.short_prompt}-token prompts + {sizes.short_new} new tokens, N clients at once, no scaling. "
        "HTTP: N concurrent `POST /generate` to the server, each on its own connection, sent by a "
        "minimal asyncio client (`post_lean`); the httpx columns send the same requests with one "
        "`httpx.AsyncClient`, whose own CPU time on the shared cores counts against the server. "
        "In-process: N `GenerationRequest`s submitted "
        "to an `InferenceEngine` in this process (same flags). generate(): one static batch of N on the "
        "Llama export. tok/s = generated tokens of all requests / wall time. ms/token: median over "
        "requests of decode time / (tokens - 1) (generate(): wall time / new tokens).",
        "",
        "| clients | HTTP tok/s | in-process tok/s | generate() tok/s | HTTP / in-process "
        "| HTTP / generate() | httpx tok/s | httpx / in-process | HTTP ms/token | in-process ms/token |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for clients, kinds in results.items():
        http, httpx_, engine, generate = (
            median(kinds[kind]) for kind in ("http", "http_httpx", "engine", "generate")
        )
        lines.append(
            f"| {clients} | {http.tokens_per_s:.1f} | {engine.tokens_per_s:.1f} "
            f"| {generate.tokens_per_s:.1f} | {paired_ratio(kinds['http'], kinds['engine']):.2f} "
            f"| {paired_ratio(kinds['http'], kinds['generate']):.2f} | {httpx_.tokens_per_s:.1f} "
            f"| {paired_ratio(kinds['http_httpx'], kinds['engine']):.2f} | {http.token_latency_ms:.2f} "
            f"| {engine.token_latency_ms:.2f} |"
        )
    return lines


def section_scaled(sizes: Sizes, results: dict[str, list[Measurement]], longest: LongRun) -> list[str]:
    lines = [
        "",
        "## 2. Dynamic NTK vs. YaRN per generated token (HTTP, one client)",
        "",
        f"A {sizes.long_prompt}-token prompt + {sizes.long_new} new tokens "
        f"({sizes.long_prompt + sizes.long_new} in all), factor 4 over the native context. Decode "
        "ms/token: the response's `timing.decode_ms` / (completion tokens - 1); wall ms/token: the "
        "request's wall time / completion tokens (prefill and HTTP included).",
        "",
        "| scaling | decode ms/token | wall ms/token |",
        "|---|---:|---:|",
    ]
    for kind, samples in results.items():
        summary = median(samples)
        lines.append(f"| {kind} | {summary.token_latency_ms:.2f} | {1000.0 / summary.tokens_per_s:.2f} |")
    decode_ratio = statistics.median(
        d.token_latency_ms / y.token_latency_ms
        for d, y in zip(results["dynamic"], results["yarn"], strict=True)
    )
    wall_ratio = 1.0 / paired_ratio(results["dynamic"], results["yarn"])
    lines += [
        "",
        f"dynamic / yarn: {decode_ratio:.2f}x per decoded token, {wall_ratio:.2f}x in wall time.",
        "",
        f"One long dynamic generation: {sizes.longest_prompt}-token prompt + {sizes.longest_new} new "
        f"tokens ({longest.total_tokens} in all, server `--max-context {MAX_CONTEXT}`, client timeout "
        f"{sizes.longest_timeout_s:.0f} s): ",
    ]
    if longest.error is None:
        lines[-1] += (
            f"finished (`finish_reason` {longest.finish_reason}, {longest.completion_tokens} tokens) in "
            f"{longest.wall_s:.1f} s wall, {longest.decode_ms_per_token:.2f} decode ms/token."
        )
    else:
        lines[-1] += f"**did not finish** after {longest.wall_s:.1f} s: {longest.error}"
    return lines


def section_stalls(sizes: Sizes, results: dict[str, list[StallRun]]) -> list[str]:
    labels = {
        "alone": "streams alone",
        "score": f"+ {sizes.interloper_tokens}-token `/score`",
        "prefill": f"+ {sizes.interloper_tokens}-token prompt `/generate` (max_new_tokens 1)",
    }
    alone = results["alone"]
    lines = [
        "",
        "## 3. Stalls: inter-token gaps of streaming clients",
        "",
        f'{sizes.stream_clients} clients stream (`"stream": true`) {sizes.stream_new} tokens each from '
        f"{sizes.stream_prompt}-token prompts; every token event's arrival time is recorded at the client "
        "and gaps between consecutive events of one stream are pooled. Once every stream has a quarter "
        "of its tokens, one long request (dynamic x4) is sent. Ratio: max gap / p99 gap of the streams "
        f"alone in the same repeat (goal <= {STALL_GOAL:.0f}x).",
        "",
        "| scenario | gaps | p50 ms | p99 ms | max ms | max / p99 alone | long request ms "
        "| streams still running at its end |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    worst = 0.0
    for kind, runs in results.items():
        ratio = statistics.median(run.max / base.p99 for run, base in zip(runs, alone, strict=True))
        if kind != "alone":
            worst = max(worst, ratio)
        interloper = [run.interloper_ms for run in runs if run.interloper_ms is not None]
        overlapped = sum(run.overlapped for run in runs)
        lines.append(
            f"| {labels[kind]} | {len(runs[0].gaps_ms)} | {statistics.median(r.p50 for r in runs):.1f} "
            f"| {statistics.median(r.p99 for r in runs):.1f} | {statistics.median(r.max for r in runs):.1f} "
            f"| {ratio:.1f}x | {f'{statistics.median(interloper):.0f}' if interloper else '-'} "
            f"| {'-' if kind == 'alone' else f'{overlapped}/{len(runs)}'} |"
        )
    lines += ["", f"Worst max / p99-alone: {worst:.1f}x, goal {verdict(worst <= STALL_GOAL)}."]
    return lines


def section_workload(sizes: Sizes, results: dict[str, list[WorkloadRun]], work: WorkloadWork) -> list[str]:
    low, high = sizes.workload_prompt
    new_low, new_high = sizes.workload_new
    ratio = statistics.median(
        g.makespan_s / o.makespan_s for g, o in zip(results["generate"], results["ours"], strict=True)
    )
    bound = max(
        work.padded_positions / work.useful_positions,
        work.padded_key_reads / work.useful_key_reads,
        work.reference_steps / work.fewest_steps,
    )
    if ratio > bound:
        reach = (
            f"The measured {ratio:.2f}x is above all three: besides doing less work, ours does each "
            "unit of it faster (its decode pass)."
        )
    elif bound < PADDING_GOAL:
        reach = (
            f"The goal ({PADDING_GOAL:.0f}x) is above all three ({bound:.2f}x at most): out of reach for "
            "this workload by batching and removing padding alone; only a cheaper step reaches it."
        )
    else:
        reach = f"The goal ({PADDING_GOAL:.0f}x) is within the largest bound ({bound:.2f}x)."
    labels = {
        "ours": f"pe-serve over HTTP (`--max-batch-size {MAX_BATCH_SIZE}`), all at once",
        "generate": f"generate(), static batches of {sizes.reference_batch}",
    }
    lines = [
        "",
        "## 4. Realistic workload vs. padded static batches",
        "",
        f"{sizes.workload_requests} requests (`random.Random(0)`): prompt lengths uniform in {low}..{high}, "
        f"max_new_tokens in {new_low}..{new_high}, scalings cycling through {', '.join(SCALING_NAMES)} "
        "(factor 4 over the native context). Ours: all sent at once; latency from the send to each reply. "
        f"generate(): batches of {sizes.reference_batch} in arrival order, left-padded to the batch's "
        "longest prompt and run to its largest max_new_tokens; a request's latency is the end of its batch. "
        "No warm-up (both sides are warm from the sections above).",
        "",
        "| server | makespan s | p50 latency s | p99 latency s |",
        "|---|---:|---:|---:|",
    ]
    for kind, runs in results.items():
        lines.append(
            f"| {labels[kind]} | {statistics.median(r.makespan_s for r in runs):.2f} "
            f"| {statistics.median(percentile(r.latencies_s, 50) for r in runs):.2f} "
            f"| {statistics.median(percentile(r.latencies_s, 99) for r in runs):.2f} |"
        )
    lines += [
        "",
        f"makespan generate() / ours: {ratio:.2f}x "
        f"(goal >= {PADDING_GOAL:.0f}x: {verdict(ratio >= PADDING_GOAL)}).",
        "",
        "What each side must compute (see `WorkloadWork`), generate() / the requests' own:",
        "",
        "| work | requests | generate() | ratio |",
        "|---|---:|---:|---:|",
        f"| token positions (projections, MLP) | {work.useful_positions} | {work.padded_positions} "
        f"| {work.padded_positions / work.useful_positions:.2f}x |",
        f"| attention key reads | {work.useful_key_reads:.3g} | {work.padded_key_reads:.3g} "
        f"| {work.padded_key_reads / work.useful_key_reads:.2f}x |",
        f"| sequential decode passes (at least) | {work.fewest_steps} | {work.reference_steps} "
        f"| {work.reference_steps / work.fewest_steps:.2f}x |",
        "",
        "At equal cost per unit of work, the makespan ratio cannot exceed these: between the first two "
        "where compute or memory bandwidth bounds the run (this CPU), the third where step latency does "
        f"(a GPU). {reach}",
        "",
        "Note: generate() can apply only one RoPE scaling per model, so the reference runs the unscaled "
        "export for every request. It is a cost reference (same weights, same number of tokens per "
        "request), not a quality one: past the native context its output is not what the scaled request "
        "would produce.",
    ]
    return lines


def section_mixed(sizes: Sizes, results: dict[str, list[Measurement]]) -> list[str]:
    uniform, mixed = median(results["uniform"]), median(results["mixed"])
    overhead = paired_overhead(results["uniform"], results["mixed"])
    return [
        "",
        "## 5. Mixed scalings in one batch vs. uniform (HTTP)",
        "",
        f"{sizes.mixed_clients} clients at once, {sizes.short_prompt}-token prompts + {sizes.short_new} "
        f"new tokens. Uniform: every request `linear` x4. Mixed: cycling through {', '.join(SCALING_NAMES)}. "
        "Overhead: median over repeats of uniform tok/s / mixed tok/s - 1.",
        "",
        "| batch | tok/s | ms/token |",
        "|---|---:|---:|",
        f"| uniform | {uniform.tokens_per_s:.1f} | {uniform.token_latency_ms:.2f} |",
        f"| mixed | {mixed.tokens_per_s:.1f} | {mixed.token_latency_ms:.2f} |",
        "",
        f"Mixed costs {overhead * 100:+.1f}% "
        f"(goal <= {MIXED_GOAL * 100:.0f}%: {verdict(overhead <= MIXED_GOAL)}).",
    ]


if __name__ == "__main__":
    raise SystemExit(main())
