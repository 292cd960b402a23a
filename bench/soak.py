"""Soak: N clients for M minutes against the real server, mixing every route, scheme and scaling.

Each client loops until the time is up, picking at random: a generation (JSON), a streamed
generation read to the end, a stream it abandons after 1-3 events (a client disconnect), a
`/score` (some near the context limit), a `/v1/completions` naming its configuration in the model
(an alias), a bad request that must get a 4xx, or a cheap GET (`/models`, `/healthz`, `/readyz`).
Every request picks a zoo member and one of the scalings that its scheme supports (dynamic NTK
included); a scaled request runs past the native context. One request in three also takes an
attention rule its scheme serves (`pe_attention`, `logn` on some), and one in five says its
scaling and rule in the model's name instead: `zoo-rope@yarn:factor=8@rerope:window=64`, or a
fixed name the server was started with (`--alias`, `ALIASES`). Bad requests include invalid rules
and malformed model names.

The script prints, and writes to `bench/results/soak.md` with the command:

- requests by kind and status, p50 and p99 latency per kind;
- resident memory of the API process and of the engine process after warm-up and at every minute
  (from `/metrics`: `process_resident_memory_bytes` and `pe_engine_process_resident_memory_bytes`),
  the KV pools' pages in memory (`pe_kv_cache_resident_bytes`, summed over the models), and how
  much the total grew from the first minute to the end, with and without the pools' pages;
- the same once the load has stopped for a moment (what the process gives back);
- requests lost: sent but never answered (no status, a broken connection, a stream that ended
  without its final event), which must be 0;
- `/readyz` afterwards.

It exits 1 unless: nothing was lost, every status is 200, a 4xx for bad input or 429, the total
RSS less the KV pools' pages grew by at most 10% after the first minute, the pools' pages stayed
within the pools' size, and `/readyz` is 200 at the end.

Why the pools apart: a CPU pool is sized at start-up but takes its pages as rows first write
them (2 MiB at a time where the system gives huge pages), and the prefix cache keeps finished
prompts' blocks, so under load each pool's pages come into memory over minutes until the whole
pool has been written once. That memory is committed on purpose and bounded by `--kv-cache-mb`
(`pe_kv_cache_bytes`); what is left of the resident memory is what must stay flat.

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

from service.engine.types import Scheme
from service.model.positional import SUPPORTED_ATTENTION, SUPPORTED_SCALINGS
from tests.live_server import OptionValue, cli_args, live_server
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
V1_BAD_INPUT_STATUSES = frozenset({400, 404})
_RSS = {
    "api": re.compile(r"^process_resident_memory_bytes (\S+)$", re.M),
    "engine": re.compile(r"^pe_engine_process_resident_memory_bytes (\S+)$", re.M),
}
_TABLES_SAMPLE = re.compile(r"^pe_cache_bytes\{[^}]*\} (\S+)$", re.M)
_KV_SAMPLE = re.compile(r"^(pe_kv_cache_bytes|pe_kv_cache_resident_bytes)\{[^}]*\} (\S+)$", re.M)
# Fixed names the soak's server is started with (`--alias NAME=TARGET`), and the scheme of each.
ALIASES: dict[str, str] = {
    "zoo-long": "zoo-rope@yarn:factor=8",
    "zoo-extend": "zoo-rope@linear:factor=8@self_extend:group_size=4,window=64",
    "zoo-window": "zoo-alibi@streaming:sink_tokens=4,window=64",
    "zoo-dca": "zoo-rope_alibi@ntk:factor=8@dca:chunk_size=256,local_window=32,logn=256",
}
_ALIAS_SCHEMES = {"zoo-long": "rope", "zoo-extend": "rope", "zoo-window": "alibi", "zoo-dca": "rope_alibi"}
# Tables that change with the length: a streaming row cannot follow them (422).
_LENGTH_DEPENDENT = frozenset({"dynamic", "longrope"})
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
    # Attention rules and model names that carry a configuration, each wrong in its own way.
    {"prompt": "a", "pe_attention": {"type": "self_extend", "group_size": 0, "window": 4}},
    {"prompt": "a", "pe_attention": {"type": "warp"}},
    {"prompt": "a", "pe_attention": {"type": "rerope"}},
    {"prompt": "a", "pe_attention": {"type": "streaming", "sink_tokens": 4, "window": 8, "leak": 2}},
    {"prompt": "a", "pe_attention": {"type": "dca", "chunk_size": 32, "local_window": 32}},
    {"prompt": "a", "pe_attention": {"type": "standard", "logn": 1}},
    {"prompt": "a", "pe_attention": {"type": "leaky_rerope", "window": 4, "leak": 0.5}},
    {"prompt": "a", "pe_attention": {"type": "rerope", "window": 1e300}},
    {"prompt": "a", "pe": "alibi", "pe_attention": {"type": "rerope", "window": 16}},
    {
        "prompt": "a",
        "pe": "rope",
        "pe_attention": {"type": "streaming", "sink_tokens": 4, "window": 8},
        "pe_scaling": {"type": "dynamic", "factor": 2.0},
    },
    {"prompt": "a", "model": "zoo-rope@warp:factor=2"},
    {"prompt": "a", "model": "zoo-rope@@rerope:window=4"},
    {"prompt": "a", "model": "zoo-rope@rerope:window"},
    {"prompt": "a", "model": "zoo-rope@linear:factor=8", "pe_scaling": {"type": "linear", "factor": 8.0}},
    {"prompt": "a", "model": "zoo-rope@rerope:window=4@streaming:sink_tokens=1,window=8"},
    {"prompt": "a", "model": "zoo-long@ntk:factor=2"},
    {"prompt": "a", "model": "zoo-alibi@rerope:window=16"},
    {"prompt": "a", "model": "no-such-model@rerope:window=16"},
)
_BAD_V1_BODIES: tuple[dict[str, Any], ...] = (
    {"prompt": "a", "model": "zoo-rope@rerope:window=0"},
    {"prompt": "a", "model": "zoo-rope@"},
    {"prompt": "a", "model": "zoo-long@streaming:sink_tokens=4,window=8@dca:chunk_size=8,local_window=2"},
    {"prompt": "a", "model": "zoo-rope", "pe_attention": {"type": "dca", "chunk_size": 8}},
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
    # (seconds, api RSS, engine RSS, the KV pools' pages in memory, the PE tables' bytes), every
    # SAMPLE_EVERY_S
    rss: list[tuple[float, int, int, int, int]] = field(default_factory=list)
    idle_rss: tuple[int, int, int, int] = (0, 0, 0, 0)  # once the load has stopped
    kv_pool_bytes: int = 0  # the pools' size, what their pages in memory may reach
    skipped_samples: int = 0  # scrapes the busy engine process did not answer in time


def _text(rng: random.Random, longest: int) -> str:
    """Code-like text of a random length; byte-level zoo models see one token per character."""
    words = ("def ", "return ", "x", " = ", "(", ")", ":\n    ", "for i in range(n)", "+ 1", "\n")
    pieces: list[str] = []
    length = rng.randint(8, longest)
    while sum(map(len, pieces)) < length:
        pieces.append(rng.choice(words))
    return "".join(pieces)[:length]


def _rule(rng: random.Random, scheme: Scheme) -> dict[str, Any]:
    """An attention rule the scheme serves, with fields drawn from a range that runs; `logn` on
    some (a plain `standard` always has it, else it would be no rule)."""
    kind = rng.choice(SUPPORTED_ATTENTION[scheme])
    fields: dict[str, Any] = {"type": kind}
    if kind == "self_extend":
        fields |= {"group_size": rng.choice((2, 4, 8)), "window": rng.choice((16, 32, 64, 128))}
    elif kind == "rerope":
        fields |= {"window": rng.choice((16, 32, 64, 128))}
    elif kind == "leaky_rerope":
        fields |= {"window": rng.choice((16, 32, 64, 128)), "leak": rng.choice((2.0, 4.0, 16.0))}
    elif kind == "dca":
        fields |= {"chunk_size": rng.choice((64, 128, 256)), "local_window": rng.choice((0, 16, 32))}
    elif kind == "streaming":
        fields |= {"sink_tokens": rng.choice((0, 1, 4)), "window": rng.choice((16, 32, 64, 128))}
    if kind == "standard" or rng.random() < 0.3:
        fields["logn"] = rng.choice((64, 256, 1024))
    return fields


def spec(fields: dict[str, Any]) -> str:
    """A scaling or rule as the lab's `TYPE:key=value,...` (a list as its numbers joined by ';')."""
    values = [
        f"{key}={';'.join(map(str, value)) if isinstance(value, list) else value}"
        for key, value in fields.items()
        if key != "type"
    ]
    kind = str(fields["type"])
    return kind + (":" + ",".join(values) if values else "")


def _inference_body(rng: random.Random, longest_prompt: int) -> tuple[dict[str, Any], str]:
    """A body for `/generate` or `/score`, and its variant: `plain`, `rule` (with `pe_attention`),
    or `alias` (its scaling and any rule in the model's name, or a fixed `--alias` name)."""
    if rng.random() < 0.05:
        alias = rng.choice(sorted(ALIASES))
        longest = longest_prompt if _ALIAS_SCHEMES[alias] != "alibi" else NATIVE_CONTEXT - 80
        return {"model": alias, "prompt": _text(rng, longest)}, "alias"
    scheme = rng.choice(ZOO_SCHEMES)
    rule = _rule(rng, scheme) if rng.random() < 1 / 3 else None
    scalings = [s for s in _SCALINGS if s["type"] in SUPPORTED_SCALINGS[scheme]]
    if rule is not None and rule["type"] == "streaming":
        scalings = [s for s in scalings if s["type"] not in _LENGTH_DEPENDENT]
    scaling = rng.choice(scalings)
    # A scaling is what lets a prompt run past the native context; without one a prompt stays
    # within what the model was trained for (learned positions end with their table).
    longest = longest_prompt if scaling["type"] != "none" else NATIVE_CONTEXT - 80
    prompt = _text(rng, longest)
    name = "@".join([f"zoo-{scheme}", spec(scaling), *([spec(rule)] if rule is not None else [])])
    if rng.random() < 0.2 and len(name) <= 256:
        return {"model": name, "prompt": prompt}, "alias"
    body: dict[str, Any] = {"pe": scheme, "pe_scaling": scaling, "prompt": prompt}
    if rule is not None:
        body["pe_attention"] = rule
    return body, "plain" if rule is None else "rule"


def _generation(rng: random.Random, *, stream: bool) -> tuple[dict[str, Any], str]:
    body, variant = _inference_body(rng, longest_prompt=700)
    body |= {"max_new_tokens": rng.randint(4, 48), "temperature": rng.choice((0.0, 0.8)), "seed": 7}
    if stream:
        body["stream"] = True
    return body, variant


def _completion(rng: random.Random) -> dict[str, Any]:
    """`/v1/completions` as an OpenAI client sends it: the configuration in the model's name."""
    body, _ = _inference_body(rng, longest_prompt=700)
    if "pe" in body:  # the draw gave body fields: say them in the name instead
        fields = [body["pe_scaling"], *([body["pe_attention"]] if "pe_attention" in body else [])]
        body = {"model": "@".join([f"zoo-{body['pe']}", *map(spec, fields)]), "prompt": body["prompt"]}
    return body | {"max_tokens": rng.randint(4, 32), "temperature": rng.choice((0.0, 0.8)), "seed": 7}


def _labelled(kind: str, variant: str) -> str:
    return kind if variant == "plain" else f"{kind} ({variant})"


async def _post(client: httpx.AsyncClient, kind: str, path: str, body: dict[str, Any]) -> Outcome:
    started = time.perf_counter()
    response = await client.post(path, json=body)
    detail = ""
    if response.status_code >= 500:  # what was sent and answered, for the report
        detail = f"{path} {json.dumps(body)[:400]} -> {response.text[:300]}"
    return Outcome(kind, response.status_code, time.perf_counter() - started, detail=detail)


async def _stream(
    client: httpx.AsyncClient, drawn: tuple[dict[str, Any], str], abandon_after: int | None
) -> Outcome:
    """Read a stream to `[DONE]`, or walk away after `abandon_after` events (a disconnect)."""
    body, variant = drawn
    kind = _labelled("stream" if abandon_after is None else "stream_abandoned", variant)
    started = time.perf_counter()
    async with client.stream("POST", "/generate", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            detail = (
                f"{json.dumps(body)[:400]} -> {response.text[:300]}" if response.status_code >= 500 else ""
            )
            return Outcome(kind, response.status_code, time.perf_counter() - started, detail=detail)
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
    if draw < 0.28:
        body, variant = _generation(rng, stream=False)
        kind = _labelled("generate", variant)
        return kind, lambda: _post(client, kind, "/generate", body)
    if draw < 0.55:
        drawn = _generation(rng, stream=True)
        abandon_after = None if draw < 0.46 else rng.randint(1, 3)
        kind = _labelled("stream" if abandon_after is None else "stream_abandoned", drawn[1])
        return kind, lambda: _stream(client, drawn, abandon_after)
    if draw < 0.78:
        body, variant = _inference_body(rng, longest_prompt=MAX_CONTEXT - 100 if rng.random() < 0.2 else 600)
        kind = _labelled("score", variant)
        return kind, lambda: _post(client, kind, "/score", body)
    if draw < 0.84:
        completion = _completion(rng)
        return "v1_completion (alias)", lambda: _post(
            client, "v1_completion (alias)", "/v1/completions", completion
        )
    if draw < 0.90:
        bad = rng.choice(_BAD_BODIES)
        return "bad_input", lambda: _post(client, "bad_input", rng.choice(("/generate", "/score")), bad)
    if draw < 0.92:
        bad = rng.choice(_BAD_V1_BODIES)
        return "bad_input_v1", lambda: _post(client, "bad_input_v1", "/v1/completions", bad)
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


def kv_bytes(metrics_text: str) -> tuple[int, int]:
    """(the KV pools' size, their pages in memory), summed over the models, from a /metrics page."""
    totals = {"pe_kv_cache_bytes": 0.0, "pe_kv_cache_resident_bytes": 0.0}
    for name, value in _KV_SAMPLE.findall(metrics_text):
        totals[name] += float(value)
    return int(totals["pe_kv_cache_bytes"]), int(totals["pe_kv_cache_resident_bytes"])


def memory(metrics_text: str) -> tuple[int, int, int, int]:
    """(API RSS, engine RSS, the KV pools' pages in memory, the PE tables' bytes) from a /metrics
    page."""
    tables = sum(int(float(value)) for value in _TABLES_SAMPLE.findall(metrics_text))
    return (*rss_bytes(metrics_text), kv_bytes(metrics_text)[1], tables)


async def _sampler(base_url: str, started: float, deadline: float, tally: Tally) -> None:
    async with httpx.AsyncClient(base_url=base_url, timeout=60.0) as client:
        while time.monotonic() < deadline:
            text = (await client.get("/metrics")).text
            api, engine, kv, tables = memory(text)
            # A busy engine process may not answer the scrape in time (its figures are then left
            # out of the page): such a sample says nothing of its memory and is skipped.
            if engine:
                tally.kv_pool_bytes = kv_bytes(text)[0]
                tally.rss.append((time.monotonic() - started, api, engine, kv, tables))
            else:
                tally.skipped_samples += 1
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
        for _ in range(20):  # until the engine process answers the scrape
            tally.idle_rss = memory((await client.get("/metrics")).text)
            if tally.idle_rss[1]:
                break
    return tally


def _percentile(values: list[float], fraction: float) -> float:
    if len(values) < 2:
        return values[0] if values else 0.0
    return statistics.quantiles(values, n=100, method="inclusive")[round(fraction * 100) - 1]


def _at_minutes(
    samples: list[tuple[float, int, int, int, int]],
) -> list[tuple[str, int, int, int, int]]:
    """The first sample of each whole minute, and the last one: (time label, api, engine, kv,
    tables)."""
    firsts: dict[int, tuple[str, int, int, int, int]] = {}
    for seconds, *figures in samples:
        firsts.setdefault(int(seconds // 60), (f"{seconds / 60:.1f} min", *figures))  # type: ignore[arg-type]
    rows = list(firsts.values())
    if samples:
        seconds, *figures = samples[-1]
        rows.append((f"{seconds / 60:.1f} min (last)", *figures))  # type: ignore[arg-type]
    return rows


@dataclass(frozen=True)
class Verdict:
    lost: int
    unexpected_statuses: Counter[str]
    # Resident memory (API + engine) at the first sample past a minute and at the last, and the
    # KV pools' pages in memory at the same two samples, and at most.
    rss_after_warmup: int
    rss_end: int
    kv_after_warmup: int
    kv_end: int
    kv_peak: int
    kv_pool_bytes: int
    readyz: int

    @property
    def growth(self) -> float:
        """Growth of the resident memory less the KV pools' pages: what must stay flat."""
        before = self.rss_after_warmup - self.kv_after_warmup
        return (self.rss_end - self.kv_end) / before - 1.0 if before > 0 else 0.0

    @property
    def total_growth(self) -> float:
        return self.rss_end / self.rss_after_warmup - 1.0 if self.rss_after_warmup else 0.0

    @property
    def kv_bounded(self) -> bool:
        return self.kv_peak <= self.kv_pool_bytes

    @property
    def passed(self) -> bool:
        return (
            self.lost == 0
            and not self.unexpected_statuses
            and self.growth <= RSS_GROWTH_LIMIT
            and self.kv_bounded
            and self.readyz == 200
        )


def _allowed(kind: str) -> frozenset[int]:
    """The statuses a kind of request may get: bad input a 4xx naming it, anything else 200 or a
    429, or a 4xx for a draw that is invalid as drawn (a prompt over what its scaling allows)."""
    if kind == "bad_input":
        return BAD_INPUT_STATUSES
    if kind == "bad_input_v1":
        return V1_BAD_INPUT_STATUSES
    if kind.startswith("v1_"):
        return frozenset({200, 429, *V1_BAD_INPUT_STATUSES, 413, 415})
    return frozenset({200, 429, *BAD_INPUT_STATUSES})


def _unexpected(outcome: Outcome) -> str | None:
    """What is wrong with an answered request, if anything: a status outside what its kind may
    get, or an error event inside a stream that began well."""
    if outcome.status is None:
        return None
    if outcome.status not in _allowed(outcome.kind):
        return str(outcome.status)
    return "error event" if outcome.detail.startswith("error event") else None


def judge(tally: Tally, readyz: int) -> Verdict:
    unexpected = Counter(label for label in map(_unexpected, tally.outcomes) if label is not None)
    after_warmup = [(api + engine, kv) for seconds, api, engine, kv, _ in tally.rss if seconds >= 60]
    first, last = (after_warmup[0], after_warmup[-1]) if after_warmup else ((0, 0), (0, 0))
    return Verdict(
        lost=sum(1 for outcome in tally.outcomes if outcome.status is None),
        unexpected_statuses=unexpected,
        rss_after_warmup=first[0],
        rss_end=last[0],
        kv_after_warmup=first[1],
        kv_end=last[1],
        kv_peak=max((kv for *_, kv, _ in tally.rss), default=0),
        kv_pool_bytes=tally.kv_pool_bytes,
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
        f"| {label} | {api / mib:.0f} | {engine / mib:.0f} | {(api + engine) / mib:.0f} | {kv / mib:.0f} "
        f"| {(api + engine - kv) / mib:.0f} | {tables / mib:.1f} |"
        for label, api, engine, kv, tables in [*_at_minutes(tally.rss), ("idle", *tally.idle_rss)]
    )
    lost = [o for o in tally.outcomes if o.status is None][:10]
    lost_lines = "\n".join(f"- {o.kind} after {o.seconds:.1f} s: {o.detail}" for o in lost) or "none"
    unexpected = [o for o in tally.outcomes if _unexpected(o) is not None][:10]
    unexpected_lines = "\n".join(f"- {o.kind}, {o.status}: `{o.detail or '-'}`" for o in unexpected) or "none"
    return f"""# Soak: {clients} clients for {seconds / 60:g} minutes

Run: `{invocation}` on {datetime.now(UTC):%Y-%m-%d %H:%M} UTC;
the bundled zoo, CPU, max_context {MAX_CONTEXT}.
Server: `{shlex.join(server_flags())}`.
Verdict: **{"PASS" if verdict.passed else "FAIL"}**: {verdict.lost} lost, unexpected statuses
{dict(verdict.unexpected_statuses) or "none"}, RSS less the KV pools' pages: growth after the first
minute {verdict.growth * 100:+.1f}% (limit {RSS_GROWTH_LIMIT * 100:.0f}%); the KV pools' pages in memory
{verdict.kv_after_warmup / mib:.0f} MiB after the first minute, {verdict.kv_end / mib:.0f} MiB at the end,
at most {verdict.kv_peak / mib:.0f} MiB of the pools' {verdict.kv_pool_bytes / mib:.0f} MiB; total RSS
{verdict.rss_after_warmup / mib:.0f} MiB -> {verdict.rss_end / mib:.0f} MiB
({verdict.total_growth * 100:+.1f}%);
`/readyz` afterwards {verdict.readyz}.

Requests: {len(tally.outcomes)}; p50 {_percentile(everything, 0.5) * 1000:.0f} ms, p99
{_percentile(everything, 0.99) * 1000:.0f} ms over the 200s.

| kind | requests | by status | p50 ms (200) | p99 ms (200) |
|---|---|---|---|---|
{chr(10).join(kind_rows)}

Resident memory (MiB) at each minute; the first sample past 1 min is the after-warm-up reference,
and the idle figure is {IDLE_WAIT_S:g} s after the load stopped ({tally.skipped_samples} scrapes the busy
engine process left without its figures are not counted). "KV pages" is the pools' memory
(`pe_kv_cache_resident_bytes`, committed on purpose as rows first write blocks, bounded by the
pools' size); "total less KV pages" is what must stay flat. "PE tables" is the engine's cache of
RoPE tables (`pe_cache_bytes`, part of the engine's memory, bounded by its LRU):

| time | API process | engine process | total | KV pages | total less KV pages | PE tables |
|---|---|---|---|---|---|---|
{rss_rows}

Lost requests (first 10): {lost_lines}

Unexpected answers (first 10): {unexpected_lines}
"""


def server_options() -> dict[str, OptionValue]:
    """The soak's server: the bundled zoo, `MAX_CONTEXT`, and the fixed names of `ALIASES`."""
    return {
        "device": "cpu",
        "max_context": MAX_CONTEXT,
        # Rows under a rule run the model's own layers, made of small products: at two torch
        # threads on a busy two-core machine those ran 23x slower than at one (6 streaming rows of
        # zoo-rope, 528 against 23 ms a step), and a 1.5-minute soak at 16 clients answered 30
        # requests. One thread is also what the C pass of every other row uses.
        "torch_threads": 1,
        "alias": [f"{name}={target}" for name, target in ALIASES.items()],
    }


def server_flags() -> list[str]:
    return cli_args([], server_options())


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
    parser.add_argument("--server-log", type=Path, help="keep the started server's log (JSON lines) there")
    parser.add_argument(
        "--base-url",
        help="soak a server that is already running (the zoo, with the flags of `server_flags()`)",
    )
    args = parser.parse_args(argv)
    if args.base_url:
        tally, readyz = _run(args.base_url, args)
    else:
        with live_server([], options=server_options()) as server:
            try:
                tally, readyz = _run(server.base_url, args)
            finally:
                if args.server_log is not None:
                    args.server_log.write_text(server.logs())
    verdict = judge(tally, readyz)
    invocation = shlex.join(["python", "-m", "bench.soak", *(argv if argv is not None else sys.argv[1:])])
    report = markdown(tally, verdict, invocation=invocation, clients=args.clients, seconds=args.minutes * 60)
    args.output.write_text(report)
    print(report)
    return 0 if verdict.passed else 1


if __name__ == "__main__":
    sys.exit(main())
