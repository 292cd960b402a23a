"""Soak: N clients for M minutes against the real server, mixing every route, scheme and scaling.

Each client loops until the time is up, picking at random: a generation (JSON), a streamed
generation read to the end, a stream it abandons after 1-3 events (a client disconnect), a
`/score` (some near the context limit), a bad request that must get a 4xx, or a cheap GET
(`/models`, `/healthz`, `/readyz`). Every request picks a zoo member and one of the scalings that
its scheme supports (dynamic NTK included); a scaled request runs past the native context.

The script prints, and writes to `bench/results/soak.md` with the command:

- requests by kind and status, p50 and p99 latency per kind;
- resident memory of the API process and of the engine process after warm-up and at every minute
  (from `/metrics`: `process_resident_memory_bytes` and `pe_engine_process_resident_memory_bytes`),
  and how much the total grew from the first minute to the end;
- the same once the load has stopped for a moment (what the process gives back);
- requests lost: sent but never answered (no status, a broken connection, a stream that ended
  without its final event), which must be 0;
- `/readyz` afterwards.

It exits 1 unless: nothing was lost, every status is 200, a 4xx for bad input or 429, the total
RSS grew by at most 10% after the first minute, and `/readyz` is 200 at the end.

    python -m bench.soak [--clients 64] [--minutes 10] [--output PATH] [--base-url URL]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import shlex
import statistics
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from service.model.positional import SUPPORTED_SCALINGS
from tests.live_server import OptionValue, live_server
from training.recipe import ZOO_SCHEMES

RESULTS = Path(__file__).resolve().parent / "results" / "soak.md"
MAX_CONTEXT = 2048
NATIVE_CONTEXT = 256  # the bundled zoo's
ROTARY_FREQUENCIES = 16  # the zoo's RoPE model: head_dim 32
REQUEST_TIMEOUT_S = 300.0
SAMPLE_EVERY_S = 5.0
IDLE_WAIT_S = 15.0
RSS_GROWTH_LIMIT = 0.10
BAD_INPUT_STATUSES = frozenset({404, 413, 415, 422})
_RSS = {
    "api": re.compile(r"^process_resident_memory_bytes (\S+)$", re.M),
    "engine": re.compile(r"^pe_engine_process_resident_memory_bytes (\S+)$", re.M),
}
_SCALINGS: tuple[dict[str, Any], ...] = (
    {"type": "none"},
    {"type": "linear", "factor": 8.0},
    {"type": "ntk", "factor": 8.0},
    {"type": "dynamic", "factor": 8.0},
    {"type": "yarn", "factor": 8.0},
    {"type": "llama3", "factor": 8.0},
    {
        "type": "longrope",
        "short_factor": [1.0] * ROTARY_FREQUENCIES,
        "long_factor": [8.0] * ROTARY_FREQUENCIES,
    },
)
_BAD_BODIES: tuple[dict[str, Any], ...] = (
    {"prompt": "a", "pe_scaling": {"type": "linear", "factor": 0.5}},
    {"prompt": "a", "max_new_tokens": 0},
    {"prompt": "a", "model": "no-such-model"},
    {"prompt": "a", "pe": "alibi", "pe_scaling": {"type": "yarn", "factor": 4.0}},
    {"prompt": "a" * (MAX_CONTEXT + 10)},
    {"prompt": "0", "max_new_tokens": 2, "pe_scaling": {"type": "yarn", "factor": 1.0, "beta_slow": 5e-324}},
)


@dataclass
class Outcome:
    kind: str
    status: int | None  # None: lost (no answer)
    seconds: float
    detail: str = ""


@dataclass
class Tally:
    outcomes: list[Outcome] = field(default_factory=list)
    rss: list[tuple[float, int, int]] = field(default_factory=list)  # (seconds, api, engine)
    idle_rss: tuple[int, int] = (0, 0)  # once the load has stopped


def _text(rng: random.Random, longest: int) -> str:
    """Code-like text of a random length; byte-level zoo models see one token per character."""
    words = ("def ", "return ", "x", " = ", "(", ")", ":\n    ", "for i in range(n)", "+ 1", "\n")
    pieces: list[str] = []
    length = rng.randint(8, longest)
    while sum(map(len, pieces)) < length:
        pieces.append(rng.choice(words))
    return "".join(pieces)[:length]


def _inference_body(rng: random.Random, longest_prompt: int) -> dict[str, Any]:
    scheme = rng.choice(ZOO_SCHEMES)
    scaling = rng.choice([s for s in _SCALINGS if s["type"] in SUPPORTED_SCALINGS[scheme]])
    # A scaling is what lets a prompt run past the native context; without one a prompt stays
    # within what the model was trained for (learned positions end with their table).
    longest = longest_prompt if scaling["type"] != "none" else NATIVE_CONTEXT - 80
    return {"pe": scheme, "pe_scaling": scaling, "prompt": _text(rng, longest)}


def _generation(rng: random.Random, *, stream: bool) -> dict[str, Any]:
    body = _inference_body(rng, longest_prompt=700)
    body |= {"max_new_tokens": rng.randint(4, 48), "temperature": rng.choice((0.0, 0.8)), "seed": 7}
    if stream:
        body["stream"] = True
    return body


async def _post(client: httpx.AsyncClient, kind: str, path: str, body: dict[str, Any]) -> Outcome:
    started = time.perf_counter()
    response = await client.post(path, json=body)
    return Outcome(kind, response.status_code, time.perf_counter() - started)


async def _stream(client: httpx.AsyncClient, body: dict[str, Any], abandon_after: int | None) -> Outcome:
    """Read a stream to `[DONE]`, or walk away after `abandon_after` events (a disconnect)."""
    kind = "stream" if abandon_after is None else "stream_abandoned"
    started = time.perf_counter()
    async with client.stream("POST", "/generate", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return Outcome(kind, response.status_code, time.perf_counter() - started)
        events = 0
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            events += 1
            payload = line.removeprefix("data: ")
            if payload == "[DONE]" or (abandon_after is not None and events >= abandon_after):
                return Outcome(kind, 200, time.perf_counter() - started)
            if "error" in json.loads(payload):
                return Outcome(kind, 200, time.perf_counter() - started, detail=f"error event: {payload}")
    return Outcome(kind, None, time.perf_counter() - started, detail=f"stream ended after {events} events")


def _request(client: httpx.AsyncClient, rng: random.Random) -> tuple[str, Callable[[], Awaitable[Outcome]]]:
    """One request drawn from the mix: (kind, how to send it)."""
    draw = rng.random()
    if draw < 0.30:
        return "generate", lambda: _post(client, "generate", "/generate", _generation(rng, stream=False))
    if draw < 0.50:
        return "stream", lambda: _stream(client, _generation(rng, stream=True), None)
    if draw < 0.60:
        return "stream_abandoned", lambda: _stream(client, _generation(rng, stream=True), rng.randint(1, 3))
    if draw < 0.85:
        body = _inference_body(rng, longest_prompt=MAX_CONTEXT - 100 if rng.random() < 0.2 else 600)
        return "score", lambda: _post(client, "score", "/score", body)
    if draw < 0.93:
        bad = rng.choice(_BAD_BODIES)
        return "bad_input", lambda: _post(client, "bad_input", rng.choice(("/generate", "/score")), bad)
    path = rng.choice(("/models", "/healthz", "/readyz"))

    async def get() -> Outcome:
        started = time.perf_counter()
        response = await client.get(path)
        return Outcome("get", response.status_code, time.perf_counter() - started)

    return "get", get


async def _client(base_url: str, deadline: float, seed: int, tally: Tally) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=base_url, timeout=REQUEST_TIMEOUT_S) as client:
        while time.monotonic() < deadline:
            kind, send = _request(client, rng)
            started = time.perf_counter()
            try:
                outcome = await send()
            except httpx.HTTPError as error:
                outcome = Outcome(kind, None, time.perf_counter() - started, detail=repr(error))
            tally.outcomes.append(outcome)
            if outcome.status == 429:
                await asyncio.sleep(rng.uniform(0.5, 1.5))  # what the SDK's retry policy would do


def rss_bytes(metrics_text: str) -> tuple[int, int]:
    """(API process, engine process) resident memory from a /metrics page."""
    values = []
    for pattern in _RSS.values():
        match = pattern.search(metrics_text)
        values.append(int(float(match.group(1))) if match else 0)
    return values[0], values[1]


async def _sampler(base_url: str, started: float, deadline: float, tally: Tally) -> None:
    async with httpx.AsyncClient(base_url=base_url, timeout=60.0) as client:
        while time.monotonic() < deadline:
            response = await client.get("/metrics")
            api, engine = rss_bytes(response.text)
            tally.rss.append((time.monotonic() - started, api, engine))
            await asyncio.sleep(SAMPLE_EVERY_S)


async def soak(base_url: str, *, clients: int, seconds: float, seed: int) -> Tally:
    tally = Tally()
    started = time.monotonic()
    deadline = started + seconds
    await asyncio.gather(
        _sampler(base_url, started, deadline, tally),
        *(_client(base_url, deadline, seed + index, tally) for index in range(clients)),
    )
    await asyncio.sleep(IDLE_WAIT_S)
    async with httpx.AsyncClient(base_url=base_url, timeout=60.0) as client:
        tally.idle_rss = rss_bytes((await client.get("/metrics")).text)
    return tally


def _percentile(values: list[float], fraction: float) -> float:
    if len(values) < 2:
        return values[0] if values else 0.0
    return statistics.quantiles(values, n=100, method="inclusive")[round(fraction * 100) - 1]


def _at_minutes(samples: list[tuple[float, int, int]]) -> list[tuple[str, int, int]]:
    """The first sample of each whole minute, and the last one: (time label, api, engine)."""
    firsts: dict[int, tuple[str, int, int]] = {}
    for seconds, api, engine in samples:
        firsts.setdefault(int(seconds // 60), (f"{seconds / 60:.1f} min", api, engine))
    rows = list(firsts.values())
    if samples:
        seconds, api, engine = samples[-1]
        rows.append((f"{seconds / 60:.1f} min (last)", api, engine))
    return rows


@dataclass(frozen=True)
class Verdict:
    lost: int
    unexpected_statuses: Counter[str]
    rss_after_warmup: int
    rss_end: int
    readyz: int

    @property
    def growth(self) -> float:
        return self.rss_end / self.rss_after_warmup - 1.0 if self.rss_after_warmup else 0.0

    @property
    def passed(self) -> bool:
        return (
            self.lost == 0
            and not self.unexpected_statuses
            and self.growth <= RSS_GROWTH_LIMIT
            and self.readyz == 200
        )


def _unexpected(outcome: Outcome) -> str | None:
    """What is wrong with an answered request, if anything: a status outside what its kind may
    get, or an error event inside a stream that began well."""
    if outcome.status is None:
        return None
    allowed = BAD_INPUT_STATUSES if outcome.kind == "bad_input" else {200, 429, *BAD_INPUT_STATUSES}
    if outcome.status not in allowed:
        return str(outcome.status)
    return "error event" if outcome.detail.startswith("error event") else None


def judge(tally: Tally, readyz: int) -> Verdict:
    unexpected = Counter(label for label in map(_unexpected, tally.outcomes) if label is not None)
    after_warmup = [api + engine for seconds, api, engine in tally.rss if seconds >= 60]
    return Verdict(
        lost=sum(1 for outcome in tally.outcomes if outcome.status is None),
        unexpected_statuses=unexpected,
        rss_after_warmup=after_warmup[0] if after_warmup else 0,
        rss_end=after_warmup[-1] if after_warmup else 0,
        readyz=readyz,
    )


def markdown(tally: Tally, verdict: Verdict, *, invocation: str, clients: int, seconds: float) -> str:
    by_kind: dict[str, list[Outcome]] = defaultdict(list)
    for outcome in tally.outcomes:
        by_kind[outcome.kind].append(outcome)
    kind_rows = []
    for kind, outcomes in sorted(by_kind.items()):
        statuses = Counter("lost" if o.status is None else str(o.status) for o in outcomes)
        answered = [o.seconds for o in outcomes if o.status == 200]
        kind_rows.append(
            f"| {kind} | {len(outcomes)} | {', '.join(f'{s}: {n}' for s, n in sorted(statuses.items()))} "
            f"| {_percentile(answered, 0.5) * 1000:.0f} | {_percentile(answered, 0.99) * 1000:.0f} |"
        )
    everything = [o.seconds for o in tally.outcomes if o.status == 200]
    mib = 2**20
    rss_rows = "\n".join(
        f"| {label} | {api / mib:.0f} | {engine / mib:.0f} | {(api + engine) / mib:.0f} |"
        for label, api, engine in [*_at_minutes(tally.rss), ("idle", *tally.idle_rss)]
    )
    lost = [o for o in tally.outcomes if o.status is None][:10]
    lost_lines = "\n".join(f"- {o.kind} after {o.seconds:.1f} s: {o.detail}" for o in lost) or "none"
    return f"""# Soak: {clients} clients for {seconds / 60:g} minutes

Run: `{invocation}` on {datetime.now(UTC):%Y-%m-%d %H:%M} UTC;
the bundled zoo, CPU, max_context {MAX_CONTEXT}.
Verdict: **{"PASS" if verdict.passed else "FAIL"}**: {verdict.lost} lost, unexpected statuses
{dict(verdict.unexpected_statuses) or "none"}, RSS growth after the first minute
{verdict.growth * 100:+.1f}% (limit {RSS_GROWTH_LIMIT * 100:.0f}%), `/readyz` afterwards {verdict.readyz}.

Requests: {len(tally.outcomes)}; p50 {_percentile(everything, 0.5) * 1000:.0f} ms, p99
{_percentile(everything, 0.99) * 1000:.0f} ms over the 200s.

| kind | requests | by status | p50 ms (200) | p99 ms (200) |
|---|---|---|---|---|
{chr(10).join(kind_rows)}

Resident memory (MiB) at each minute; the first sample past 1 min is the after-warm-up reference,
and the idle figure is {IDLE_WAIT_S:g} s after the load stopped:

| time | API process | engine process | total |
|---|---|---|---|
{rss_rows}

Lost requests (first 10): {lost_lines}
"""


def _run(base_url: str, args: argparse.Namespace) -> tuple[Tally, int]:
    tally = asyncio.run(soak(base_url, clients=args.clients, seconds=args.minutes * 60, seed=args.seed))
    return tally, httpx.get(f"{base_url}/readyz", timeout=30.0).status_code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument(
        "--base-url", help="soak a server that is already running (started with max_context 2048 on the zoo)"
    )
    args = parser.parse_args(argv)
    if args.base_url:
        tally, readyz = _run(args.base_url, args)
    else:
        options: dict[str, OptionValue] = {"device": "cpu", "max_context": MAX_CONTEXT}
        with live_server([], options=options) as server:
            tally, readyz = _run(server.base_url, args)
    verdict = judge(tally, readyz)
    invocation = shlex.join(["python", "-m", "bench.soak", *(argv if argv is not None else sys.argv[1:])])
    report = markdown(tally, verdict, invocation=invocation, clients=args.clients, seconds=args.minutes * 60)
    args.output.write_text(report)
    print(report)
    return 0 if verdict.passed else 1


if __name__ == "__main__":
    sys.exit(main())
