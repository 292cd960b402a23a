"""Endless streams in bounded memory: many `streaming` generations of several times max_context at
once, plain requests beside them, the KV pool and the processes' memory watched throughout.

StreamingLLM's promise is generation without end in constant memory: a row under `pe_attention`
`streaming` keeps its sinks and its window and gives back every block that leaves the window
(docs/attention.md). This run holds the server to it under load. It starts a server on one model
(zoo-rope by default) with a small `max_context` and a small KV pool, then at once:

- `--streams` streamed generations under `{"type": "streaming", "sink_tokens": S, "window": W}`,
  each of `--tokens` new tokens (EOS ignored, so each runs to its length), several times
  `max_context`;
- `--plain-clients` clients sending plain requests one after another (a short `/generate`, a
  `/score`) until the last stream ends, which share the batch and the pool with the streams.

Every `--sample-s` it reads `/metrics`: the model's `pe_kv_cache_usage_perc` (blocks reserved by
running rows), `pe_kv_cache_resident_bytes` (the pool's pages in memory), and the resident memory
of the API process and of the engine process (`process_resident_memory_bytes`,
`pe_engine_process_resident_memory_bytes`: the server and its child, as `bench/soak.py` reads them).

It writes `bench/results/streaming_load.md` with the command and exits 1 unless: every stream
ended with `finish_reason` "length" after exactly `--tokens` tokens, every plain request got 200,
nothing was lost, the pool's usage never went over `--max-usage` (0.60), and the total resident
memory at the end (the last sample while the streams ran) is at most `--max-rss-growth` (1.10)
times its value a quarter of the way in (the first sample once the streams, on average, had made a
quarter of their tokens).

    python -m bench.streaming_load [--streams 6] [--tokens 5000] [--sinks 4] [--window 120]
        [--max-context 1024] [--kv-cache-mb 16] [--plain-clients 2] [--model-dir models/zoo-rope]
        [--torch-threads 1] [--output PATH] [--base-url URL]

`make streaming-load` runs the issue's case (the defaults); `tests/service/api/test_streaming_load.py`
runs a short one (a few hundred tokens on a tiny model) with `run_load`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import re
import shlex
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from bench.soak import rss_bytes
from tests.live_server import REPO_ROOT, OptionValue, live_server

RESULTS = Path(__file__).resolve().parent / "results" / "streaming_load.md"
DEFAULT_MODEL_DIR = REPO_ROOT / "models" / "zoo-rope"
REQUEST_TIMEOUT_S = 3600.0
MAX_USAGE = 0.60
MAX_RSS_GROWTH = 1.10
MIB = 2**20
_WORDS = ("def ", "return ", "x", " = ", "(", ")", ":\n    ", "for i in range(n)", "+ 1", "\n")


@dataclass(frozen=True)
class LoadConfig:
    """What to run: the streams' rule and length, and the plain load beside them."""

    model: str
    streams: int = 6
    tokens: int = 5000
    sinks: int = 4
    window: int = 120
    plain_clients: int = 2
    prompt_chars: int = 64  # the streams' prompts
    plain_chars: int = 160  # the longest plain prompt (a score's; a generation's at most 64)
    sample_s: float = 0.5

    @property
    def rule(self) -> dict[str, Any]:
        return {"type": "streaming", "sink_tokens": self.sinks, "window": self.window}


@dataclass(frozen=True)
class Sample:
    seconds: float  # since the streams were sent
    progress: float  # tokens received so far over all the streams' tokens, 0 to 1
    usage: float  # the model's pe_kv_cache_usage_perc
    kv_resident: int  # the model's pe_kv_cache_resident_bytes
    api_rss: int
    engine_rss: int

    @property
    def rss(self) -> int:
        return self.api_rss + self.engine_rss


@dataclass
class StreamResult:
    status: int | None  # None: lost (no answer, or a stream that ended without its end event)
    tokens: int = 0
    finish_reason: str | None = None
    completion_tokens: int | None = None
    seconds: float = 0.0
    detail: str = ""


@dataclass
class LoadResult:
    config: LoadConfig
    capacity_tokens: int = 0
    kv_bytes: int = 0
    streams: list[StreamResult] = field(default_factory=list)
    plain: Counter[str] = field(default_factory=Counter)  # "generate 200", "score lost", ...
    plain_seconds: list[float] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    idle: Sample | None = None  # a few seconds after the load ended
    skipped_samples: int = 0  # scrapes the busy engine process left without its figures
    seconds: float = 0.0

    @property
    def streams_ok(self) -> bool:
        want = self.config.tokens
        return len(self.streams) == self.config.streams and all(
            s.status == 200
            and s.tokens == want
            and s.completion_tokens == want
            and s.finish_reason == "length"
            for s in self.streams
        )

    @property
    def plain_ok(self) -> bool:
        return all(label.endswith(" 200") for label in self.plain)

    @property
    def running_samples(self) -> list[Sample]:
        """The samples taken while the streams ran (after the first token, before the last)."""
        return [s for s in self.samples if 0.0 < s.progress < 1.0]

    @property
    def peak_usage(self) -> float:
        return max((s.usage for s in self.samples), default=0.0)

    @property
    def quarter(self) -> Sample | None:
        return next((s for s in self.running_samples if s.progress >= 0.25), None)

    @property
    def end(self) -> Sample | None:
        running = self.running_samples
        return running[-1] if running else None

    @property
    def rss_growth(self) -> float:
        """Total resident memory at the end over its value a quarter of the way in."""
        if self.quarter is None or self.end is None:
            return float("inf")
        return self.end.rss / self.quarter.rss

    def passed(self, max_usage: float, max_rss_growth: float) -> bool:
        return (
            self.streams_ok
            and self.plain_ok
            and bool(self.samples)
            and self.peak_usage <= max_usage
            and self.rss_growth <= max_rss_growth
        )


def _text(rng: random.Random, length: int) -> str:
    pieces: list[str] = []
    while sum(map(len, pieces)) < length:
        pieces.append(rng.choice(_WORDS))
    return "".join(pieces)[:length]


def pool_figures(metrics_text: str, model: str) -> dict[str, float]:
    """The model's KV pool gauges (`pe_kv_cache_*`) from a /metrics page, by metric name."""
    pattern = re.compile(rf'^(pe_kv_cache_\w+)\{{model="{re.escape(model)}"\}} (\S+)$', re.M)
    return {name: float(value) for name, value in pattern.findall(metrics_text)}


async def _read_sample(
    client: httpx.AsyncClient, config: LoadConfig, started: float, received: list[int]
) -> Sample | None:
    """The figures now; None when the busy engine process did not answer the scrape in time (the
    page then lacks its figures, the pool's among them)."""
    text = (await client.get("/metrics")).text
    pool = pool_figures(text, config.model)
    api, engine = rss_bytes(text)
    if not engine or "pe_kv_cache_usage_perc" not in pool:
        return None
    return Sample(
        seconds=time.monotonic() - started,
        progress=sum(received) / (config.streams * config.tokens),
        usage=pool.get("pe_kv_cache_usage_perc", 0.0),
        kv_resident=int(pool.get("pe_kv_cache_resident_bytes", 0.0)),
        api_rss=api,
        engine_rss=engine,
    )


async def _stream(
    client: httpx.AsyncClient, config: LoadConfig, index: int, received: list[int]
) -> StreamResult:
    rng = random.Random(index)
    body = {
        "model": config.model,
        "prompt": _text(rng, config.prompt_chars),
        "max_new_tokens": config.tokens,
        "ignore_eos": True,
        "temperature": 0.8,
        "seed": index,
        "stream": True,
        "pe_attention": config.rule,
    }
    started = time.perf_counter()
    result = StreamResult(status=None)
    try:
        async with client.stream("POST", "/generate", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return StreamResult(response.status_code, detail=response.text[:300])
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line.removeprefix("data: ")
                if payload == "[DONE]":
                    result.status = 200 if result.finish_reason is not None else None
                    break
                event = json.loads(payload)
                if "error" in event:
                    result.detail = f"error event: {payload[:300]}"
                    break
                if "finish_reason" in event:
                    result.finish_reason = event["finish_reason"]
                    result.completion_tokens = event["usage"]["completion_tokens"]
                else:
                    result.tokens += 1
                    received[index] = result.tokens
    except httpx.HTTPError as error:
        result.detail = repr(error)
    result.seconds = time.perf_counter() - started
    if result.status is None and not result.detail:
        result.detail = f"ended after {result.tokens} tokens without its end event"
    return result


async def _plain_client(
    client: httpx.AsyncClient, config: LoadConfig, seed: int, done: asyncio.Event, result: LoadResult
) -> None:
    """Plain requests one after another until the streams are done: a short generation, a score."""
    rng = random.Random(1000 + seed)
    while not done.is_set():
        if rng.random() < 0.5:
            kind, path = "generate", "/generate"
            body: dict[str, Any] = {
                "model": config.model,
                "prompt": _text(rng, rng.randint(16, min(64, config.plain_chars))),
                "max_new_tokens": rng.randint(8, 32),
                "temperature": rng.choice((0.0, 0.8)),
                "seed": seed,
            }
        else:
            kind, path = "score", "/score"
            body = {"model": config.model, "prompt": _text(rng, rng.randint(32, config.plain_chars))}
        started = time.perf_counter()
        try:
            response = await client.post(path, json=body)
            result.plain[f"{kind} {response.status_code}"] += 1
            if response.status_code == 200:
                result.plain_seconds.append(time.perf_counter() - started)
        except httpx.HTTPError:
            result.plain[f"{kind} lost"] += 1


async def _sampler(
    client: httpx.AsyncClient,
    config: LoadConfig,
    started: float,
    received: list[int],
    done: asyncio.Event,
    result: LoadResult,
) -> None:
    while not done.is_set():
        sample = await _read_sample(client, config, started, received)
        if sample is None:
            result.skipped_samples += 1
        else:
            result.samples.append(sample)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), timeout=config.sample_s)


async def run_load(base_url: str, config: LoadConfig, *, idle_wait_s: float = 5.0) -> LoadResult:
    """The streams and the plain clients against a running server, sampled throughout."""
    result = LoadResult(config)
    received = [0] * config.streams
    done = asyncio.Event()
    limits = httpx.Limits(max_connections=config.streams + config.plain_clients + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        pool = pool_figures((await client.get("/metrics")).text, config.model)
        result.capacity_tokens = int(pool.get("pe_kv_cache_capacity_tokens", 0))
        result.kv_bytes = int(pool.get("pe_kv_cache_bytes", 0))
        started = time.monotonic()

        async def streams() -> None:
            try:
                result.streams = list(
                    await asyncio.gather(
                        *(_stream(client, config, i, received) for i in range(config.streams))
                    )
                )
            finally:
                done.set()

        await asyncio.gather(
            streams(),
            _sampler(client, config, started, received, done, result),
            *(_plain_client(client, config, i, done, result) for i in range(config.plain_clients)),
        )
        result.seconds = time.monotonic() - started
        for _ in range(20):  # once more after the streams, and idle: until the engine answers
            last = await _read_sample(client, config, started, received)
            if last is not None:
                result.samples.append(last)
                break
        await asyncio.sleep(idle_wait_s)
        for _ in range(20):
            result.idle = await _read_sample(client, config, started, received)
            if result.idle is not None:
                break
    return result


def _percentile(values: list[float], fraction: float) -> float:
    if len(values) < 2:
        return values[0] if values else 0.0
    return statistics.quantiles(values, n=100, method="inclusive")[round(fraction * 100) - 1]


def _sample_row(label: str, sample: Sample) -> str:
    return (
        f"| {label} | {sample.seconds:.0f} | {sample.progress * 100:.0f}% | {sample.usage * 100:.1f}% "
        f"| {sample.kv_resident / MIB:.1f} | {sample.api_rss / MIB:.0f} | {sample.engine_rss / MIB:.0f} "
        f"| {sample.rss / MIB:.0f} |"
    )


def _progress_rows(result: LoadResult) -> list[str]:
    """A sample at each tenth of the streams' progress, the quarter and end marks, and idle."""
    rows: list[str] = []
    marks = {id(result.quarter): "quarter (reference)", id(result.end): "end (last while running)"}
    next_tenth = 0.0
    for sample in result.samples:
        label = marks.get(id(sample))
        if label is None and sample.progress >= next_tenth:
            label = "start" if sample.progress == 0.0 else ("done" if sample.progress >= 1.0 else "")
        if label is not None:
            rows.append(_sample_row(label, sample))
            while next_tenth <= sample.progress:
                next_tenth += 0.1
    if result.idle is not None:
        rows.append(_sample_row("idle, 5 s after", result.idle))
    return rows


def markdown(
    result: LoadResult, *, invocation: str, server: str, max_usage: float, max_rss_growth: float
) -> str:
    config = result.config
    verdict = "PASS" if result.passed(max_usage, max_rss_growth) else "FAIL"
    stream_rows = "\n".join(
        f"| {i} | {s.status if s.status is not None else 'lost'} | {s.tokens} | {s.finish_reason} "
        f"| {s.seconds:.0f} | {s.tokens / s.seconds if s.seconds else 0:.1f} | {s.detail or ''} |"
        for i, s in enumerate(result.streams)
    )
    plain = ", ".join(f"{label}: {count}" for label, count in sorted(result.plain.items())) or "none"
    running = result.running_samples
    usages = [s.usage for s in running]
    residents = [s.kv_resident for s in running]
    quarter, end = result.quarter, result.end
    rss_line = (
        f"{quarter.rss / MIB:.0f} MiB a quarter of the way in ({quarter.seconds:.0f} s), "
        f"{end.rss / MIB:.0f} MiB at the end ({end.seconds:.0f} s): {result.rss_growth:.3f}x"
        if quarter is not None and end is not None
        else "not enough samples"
    )
    held = (-(-config.sinks // 16) + -(-config.window // 16) + 2) * 16
    return f"""# Endless streams in bounded memory

Run: `{invocation}` on {datetime.now(UTC):%Y-%m-%d %H:%M} UTC; {server}.
Load: {config.streams} streamed generations of {config.tokens} tokens each under
`pe_attention` `{json.dumps(config.rule)}` (EOS ignored), {config.plain_clients} clients of plain
`/generate` and `/score` beside them until the last stream ended; `/metrics` read every {config.sample_s:g} s.
The pool holds {result.capacity_tokens} tokens ({result.kv_bytes / MIB:.1f} MiB); a streaming row
reserves its sinks' block, its window's blocks and two of slack ({held} tokens).

Verdict: **{verdict}**: streams {"all finished" if result.streams_ok else "NOT all finished"}
({sum(s.tokens for s in result.streams)} tokens in {result.seconds:.0f} s), plain requests {plain};
pool usage at most {result.peak_usage * 100:.1f}% (limit {max_usage * 100:.0f}%); resident memory (API +
engine) {rss_line} (limit {max_rss_growth:.2f}x).

While the streams ran ({len(running)} samples; {result.skipped_samples} scrapes the busy engine
process left without its figures are not counted): pool usage {min(usages, default=0) * 100:.1f}% to
{max(usages, default=0) * 100:.1f}% (median {statistics.median(usages) * 100 if usages else 0:.1f}%);
the pool's pages in memory {min(residents, default=0) / MIB:.1f} to
{max(residents, default=0) / MIB:.1f} MiB of {result.kv_bytes / MIB:.1f}. Plain requests answered 200: p50
{_percentile(result.plain_seconds, 0.5) * 1000:.0f} ms, p99
{_percentile(result.plain_seconds, 0.99) * 1000:.0f} ms.

| stream | status | tokens | finish | seconds | tok/s | detail |
|---|---|---|---|---|---|---|
{stream_rows}

Samples at each tenth of the streams' progress (tokens received over all they asked for):

| mark | s | progress | pool usage | KV pages (MiB) | API RSS (MiB) | engine RSS (MiB) | total (MiB) |
|---|---|---|---|---|---|---|---|
{chr(10).join(_progress_rows(result))}
"""


def server_options(args: argparse.Namespace) -> dict[str, OptionValue]:
    """The server's flags. One torch thread: rows under a rule run the model's own layers, made of
    small products, which at two threads on a busy two-core machine ran 23x slower than at one
    (6 streaming rows of zoo-rope: 528 against 23 ms a step, `bench/results/streaming_load.md`)."""
    return {
        "device": "cpu",
        "max_context": args.max_context,
        "kv_cache_mb": args.kv_cache_mb,
        "max_stream_tokens": max(args.tokens, 1),
        "torch_threads": args.torch_threads,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=5000)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--window", type=int, default=120)
    parser.add_argument("--plain-clients", type=int, default=2)
    parser.add_argument("--max-context", type=int, default=1024)
    parser.add_argument("--kv-cache-mb", type=int, default=16)
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--torch-threads", type=int, default=1, help="the server's --torch-threads")
    parser.add_argument("--max-usage", type=float, default=MAX_USAGE)
    parser.add_argument("--max-rss-growth", type=float, default=MAX_RSS_GROWTH)
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument(
        "--base-url", help="load a server that is already running (serving --model-dir's model)"
    )
    args = parser.parse_args(argv)
    config = LoadConfig(
        model=args.model_dir.name,
        streams=args.streams,
        tokens=args.tokens,
        sinks=args.sinks,
        window=args.window,
        plain_clients=args.plain_clients,
    )
    if args.base_url:
        server = f"the server at {args.base_url}"
        result = asyncio.run(run_load(args.base_url, config))
    else:
        options = server_options(args)
        flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in options.items())
        server = f"a server on {args.model_dir.name} with `{flags}`, CPU"
        with live_server([args.model_dir], options=options) as running:
            result = asyncio.run(run_load(running.base_url, config))
    invocation = shlex.join(
        ["python", "-m", "bench.streaming_load", *(argv if argv is not None else sys.argv[1:])]
    )
    report = markdown(
        result,
        invocation=invocation,
        server=server,
        max_usage=args.max_usage,
        max_rss_growth=args.max_rss_growth,
    )
    args.output.write_text(report)
    print(report)
    return 0 if result.passed(args.max_usage, args.max_rss_growth) else 1


if __name__ == "__main__":
    sys.exit(main())
