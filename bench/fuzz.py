"""Schemathesis against the live server's `/openapi.json`: every route, every check, counted.

`run_fuzz(base_url, ...)` runs `st run` over the server's own description with all of
schemathesis' checks (no 5xx, responses and SSE events match their schema, documented statuses,
content types and headers, schema-invalid input refused) except `positive_data_acceptance`,
with a response-time limit of 300 s (latency is the soak's to measure).
A body can be valid by the schema and still be refused 422 by design, for rules that JSON Schema
does not carry here (exactly one of `prompt` / `tokens`, prompt plus `max_new_tokens` within the
model's context, scalings a scheme supports), so that check would only report the API working.

The server's own `pe_serve_requests_total` is read before and after, so the figures count what
the server answered, by status, not only what schemathesis thinks it sent.

`pe_attention` and model names (`NAME@SPEC`, `--alias`) are fuzzed through what
`bench/fuzz_hooks.py` tells schemathesis of them (the description has a free-form object and any
string): every rule type with its fields in and out of range, wrong types and huge numbers, and
names with SPECs valid and malformed. The hooks count what was sent of them by status, and the
server's `pe_attention_requests_total` says which rules ran.

    python -m bench.fuzz [--max-examples N] [--max-time-s S] [--min-requests N [--round-s S]]
                         [--workers N] [--seed N] [--output PATH]

starts a server on the bundled zoo, runs the fuzzer and writes `bench/results/fuzz.md`; it exits 1
if any response was a 5xx or any check failed. `make test` runs a bounded pass against the test
server (tests/service/api/test_fuzz.py); `make fuzz` is the long run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from bench.fuzz_hooks import MODELS_ENV, TALLY_ENV
from tests.live_server import REPO_ROOT, OptionValue, live_server

EXCLUDED_CHECKS = ("positive_data_acceptance",)
RESULTS = Path(__file__).resolve().parent / "results" / "fuzz.md"
# Also the response-time check's limit (schemathesis' default is 10 s): latency is the soak's to
# measure, and a long generation on two busy cores must not make the bounded CI run fail.
REQUEST_TIMEOUT_S = 300
_REQUESTS_SAMPLE = re.compile(r"^pe_serve_requests_total\{([^}]*)\} (\S+)$", re.M)
_RULES_SAMPLE = re.compile(r"^pe_attention_requests_total\{([^}]*)\} (\S+)$", re.M)
# The fuzz server's fixed model names (`--alias`), which the hooks also name in `model`.
ALIASES = ("zoo-long=zoo-rope@yarn:factor=4", "zoo-window=zoo-alibi@streaming:sink_tokens=4,window=32")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


@dataclass(frozen=True)
class FuzzResult:
    command: list[str]
    seconds: float
    test_cases: int
    failures: list[dict[str, Any]]
    errors: list[Any]
    statuses: Counter[tuple[str, int]]  # (endpoint, status) -> responses, from the server's metrics
    rounds: int = 1
    # What was sent of pe_attention and model names ("pe_attention dca|4xx" -> requests), from the hooks
    surface: Counter[str] = field(default_factory=Counter)
    rules_run: Counter[str] = field(default_factory=Counter)  # pe_attention_requests_total by rule

    @property
    def requests(self) -> int:
        return sum(self.statuses.values())

    @property
    def server_errors(self) -> int:
        return sum(count for (_, status), count in self.statuses.items() if status >= 500)

    @property
    def clean(self) -> bool:
        return not self.failures and not self.errors and self.server_errors == 0

    def then(self, later: FuzzResult) -> FuzzResult:
        """This run followed by `later`, counted as one (the command shown is the first round's)."""
        return FuzzResult(
            command=self.command,
            seconds=self.seconds + later.seconds,
            test_cases=self.test_cases + later.test_cases,
            failures=self.failures + later.failures,
            errors=self.errors + later.errors,
            statuses=self.statuses + later.statuses,
            rounds=self.rounds + later.rounds,
            surface=self.surface + later.surface,
            rules_run=self.rules_run + later.rules_run,
        )


def answered(base_url: str) -> Counter[tuple[str, int]]:
    """HTTP responses so far by endpoint and status, as the server counts them (all label sets)."""
    text = httpx.get(f"{base_url}/metrics", timeout=30.0).text
    counts: Counter[tuple[str, int]] = Counter()
    for labels, value in _REQUESTS_SAMPLE.findall(text):
        named = dict(_LABEL.findall(labels))
        if named.get("protocol", "http") == "http":
            counts[(named["endpoint"], int(named["status"]))] += int(float(value))
    return counts


def rules_run(base_url: str) -> Counter[str]:
    """Generations and documents queued so far by attention rule (`pe_attention_requests_total`)."""
    text = httpx.get(f"{base_url}/metrics", timeout=30.0).text
    counts: Counter[str] = Counter()
    for labels, value in _RULES_SAMPLE.findall(text):
        counts[dict(_LABEL.findall(labels))["attention"]] += int(float(value))
    return counts


def model_names(base_url: str) -> list[str]:
    """The server's model names: its residents (`/models`) and fixed aliases (`/v1/models`)."""
    residents = [card["name"] for card in httpx.get(f"{base_url}/models", timeout=30.0).json()["models"]]
    listed = [card["id"] for card in httpx.get(f"{base_url}/v1/models", timeout=30.0).json()["data"]]
    return sorted({*residents, *listed})


def run_fuzz(
    base_url: str,
    *,
    max_examples: int,
    workers: int = 1,
    seed: int | None = None,
    max_time_s: float | None = None,
    headers: dict[str, str] | None = None,
) -> FuzzResult:
    """One schemathesis run; raises if schemathesis itself could not run (not for findings)."""
    with tempfile.TemporaryDirectory(prefix="pe-serve-fuzz-") as report_dir:
        command = [
            str(Path(sys.executable).with_name("st")),
            "run",
            f"{base_url}/openapi.json",
            "--checks",
            "all",
            "--exclude-checks",
            ",".join(EXCLUDED_CHECKS),
            "--max-examples",
            str(max_examples),
            "--workers",
            str(workers),
            "--request-timeout",
            str(REQUEST_TIMEOUT_S),
            "--max-response-time",
            str(REQUEST_TIMEOUT_S),
            "--generation-database",
            "none",
            "--report",
            "json",
            "--report-dir",
            report_dir,
        ]
        if seed is not None:
            command += ["--seed", str(seed)]
        if max_time_s is not None:
            command += ["--max-time", str(round(max_time_s))]
        for name, value in (headers or {}).items():
            command += ["--header", f"{name}: {value}"]
        tally = Path(report_dir) / "surface.json"
        environment = {
            **os.environ,
            "SCHEMATHESIS_HOOKS": "bench.fuzz_hooks",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
            MODELS_ENV: ",".join(model_names(base_url)),
            TALLY_ENV: str(tally),
        }
        before, rules_before = answered(base_url), rules_run(base_url)
        started = time.monotonic()
        finished = subprocess.run(
            command, capture_output=True, text=True, check=False, env=environment, cwd=REPO_ROOT
        )
        seconds = time.monotonic() - started
        statuses = answered(base_url)
        statuses.subtract(before)
        rules = rules_run(base_url)
        rules.subtract(rules_before)
        surface: Counter[str] = Counter(json.loads(tally.read_text()) if tally.is_file() else {})
        reports = sorted(Path(report_dir).glob("*.json"))
        reports = [path for path in reports if path != tally]
        if not reports:
            output = finished.stdout + finished.stderr
            raise RuntimeError(f"schemathesis wrote no report (exit {finished.returncode}):\n{output}")
        report = json.loads(reports[-1].read_text())
    # Scrapes of /metrics itself count too; they are requests the server answered like any other.
    return FuzzResult(
        command=command,
        seconds=seconds,
        test_cases=report["test_cases"]["generated"],
        failures=report["failures"],
        errors=report["errors"],
        statuses=+statuses,
        surface=surface,
        rules_run=+rules,
    )


def fuzz_until(
    base_url: str,
    *,
    min_requests: int | None,
    max_time_s: float | None,
    round_s: float,
    max_examples: int,
    workers: int,
    seed: int | None,
) -> FuzzResult:
    """Rounds of at most `round_s` until the server has answered `min_requests` requests or
    `max_time_s` is spent, so a long run stops at its count instead of at a guess of the time it
    needs on a machine of unknown speed. Each round has its own seed (the next one up). Without
    `min_requests`, one run of `max_time_s` (or of `max_examples` alone)."""
    if min_requests is None or max_time_s is None:
        return run_fuzz(
            base_url, max_examples=max_examples, workers=workers, seed=seed, max_time_s=max_time_s
        )
    started = time.monotonic()
    total: FuzzResult | None = None
    while True:
        left = max_time_s - (time.monotonic() - started)
        result = run_fuzz(
            base_url,
            max_examples=max_examples,
            workers=workers,
            seed=None if seed is None or total is None else seed + total.rounds,
            max_time_s=min(round_s, left),
        )
        total = result if total is None else total.then(result)
        print(
            f"round {total.rounds}: {total.requests} requests answered, {total.server_errors} 5xx", flush=True
        )
        if total.requests >= min_requests or left <= round_s:
            return total


def surface_table(surface: Counter[str]) -> list[str]:
    """Rows of what was sent of the new surface: label, 2xx, 4xx, 5xx, and where the 200s were."""
    by_label: dict[str, Counter[str]] = {}
    for key, count in surface.items():
        label, _, outcome = key.partition("|")
        by_label.setdefault(label, Counter())[outcome] += count
    rows = []
    for label, outcomes in sorted(by_label.items()):
        routes = ", ".join(
            f"`{name.removeprefix('200 ')}` {n}"
            for name, n in sorted(outcomes.items())
            if name.startswith("200 ")
        )
        rows.append(f"| {label} | {outcomes['2xx']} | {outcomes['4xx']} | {outcomes['5xx']} | {routes} |")
    return rows


def markdown(result: FuzzResult, invocation: str) -> str:
    rows = "\n".join(
        f"| `{endpoint}` | {status} | {count} |"
        for (endpoint, status), count in sorted(result.statuses.items())
    )
    failures = "\n".join(f"- {json.dumps(failure)}" for failure in result.failures) or "none"
    rounds = "1 round" if result.rounds == 1 else f"{result.rounds} rounds"
    surface_rows = "\n".join(surface_table(result.surface)) or "| none | | | | |"
    ran = ", ".join(f"`{rule}` {count}" for rule, count in sorted(result.rules_run.items())) or "none"
    first_round = " (the first round; later ones take the next seed up)" if result.rounds > 1 else ""
    return f"""# Fuzzing: schemathesis against `/openapi.json`

Run: `{invocation}` on {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {result.seconds / 60:.1f} min in {rounds}.
Schemathesis{first_round}: `{shlex.join(["st", *result.command[1:]])}`
(every check but {", ".join(f"`{name}`" for name in EXCLUDED_CHECKS)}; see `bench/fuzz.py` for why).

| figure | value |
|---|---|
| test cases generated | {result.test_cases} |
| requests the server answered | {result.requests} |
| 5xx responses | {result.server_errors} |
| check failures | {len(result.failures)} |
| schemathesis errors | {len(result.errors)} |

Failures: {failures}

The new surface (`bench/fuzz_hooks.py`): requests that carried a `pe_attention` (by its type, `+logn`
when it set one) or a model name with SPECs or a server name, by status class, as schemathesis
sent them; "200 on" counts the answered ones by route:

| sent | 2xx | 4xx | 5xx | 200 on |
|---|---|---|---|---|
{surface_rows}

Rules the engine ran (`pe_attention_requests_total`, before/after difference; valid rules that
reached a model, from bodies and from names): {ran}.

Responses by endpoint and status (the server's `pe_serve_requests_total`, before/after difference):

| endpoint | status | responses |
|---|---|---|
{rows}
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--max-examples", type=int, default=2000, help="examples per operation and phase")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument(
        "--max-time-s", type=float, default=None, help="time budget; fuzzing repeats until it is spent"
    )
    parser.add_argument(
        "--min-requests",
        type=int,
        default=None,
        help="run rounds of --round-s until the server answered this many (within --max-time-s)",
    )
    parser.add_argument("--round-s", type=float, default=300.0)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.min_requests is not None and args.max_time_s is None:
        parser.error("--min-requests needs --max-time-s, the most it may take")
    options: dict[str, OptionValue] = {
        "device": "cpu",
        "max_context": 1024,
        "max_queue": 0,
        # streaming rules may generate past max_context: as far as a fuzz case's wait allows
        "max_stream_tokens": 2048,
        "alias": list(ALIASES),
    }
    with live_server([], options=options, env={"OMP_NUM_THREADS": "1"}) as server:
        result = fuzz_until(
            server.base_url,
            min_requests=args.min_requests,
            max_time_s=args.max_time_s,
            round_s=args.round_s,
            max_examples=args.max_examples,
            workers=args.workers,
            seed=args.seed,
        )
    invocation = shlex.join(["python", "-m", "bench.fuzz", *(argv if argv is not None else sys.argv[1:])])
    args.output.write_text(markdown(result, invocation))
    print(markdown(result, invocation))
    return 0 if result.clean else 1


if __name__ == "__main__":
    sys.exit(main())
