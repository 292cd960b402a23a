"""`/score` on the served path: its speed, and the gaps it leaves in streams, for two revisions.

`/score` is the lab's whole workload. This benchmark starts two real servers on the same model,
one from this checkout and one from another worktree (`--baseline-root`, say the commit before
`/score` went through the engine's runner: `git worktree add /tmp/old <commit>`), and alternates
between them within every repeat, so drifting load on a shared machine hits both alike:

1. a `/score` of `--score-tokens` tokens with nothing else running: tokens per second, from the
   client's wall time;
2. `bench.serving`'s stall run: 4 clients stream tokens; once each has a quarter of its tokens,
   the same `/score` arrives. The longest inter-token gap of the streams during the run, over
   the streams' p99 gap alone (measured on the same server in the same repeat); goal <= 5x.
   The streams are long (`STREAM_NEW` tokens, where `bench.serving` streams 400) so that they
   outlive the document on either revision: gaps after the streams end measure nothing.

Both servers run the zoo model EOS-disabled (`bench.throughput.prepare_models`), float32, CPU,
under the serving bench's flags; the idle one waits on its socket. Each server's
`pe_scored_positions_total` is read from `/metrics` before and after the runs: which pass ran the
benchmark's documents (the server's own warm-up document is scored before; a revision without
the counter reports none). Run:

    python -m bench.score_path --baseline-root /tmp/old [--repeats N] [--output PATH] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path

import httpx
import torch
from prometheus_client.parser import text_string_to_metric_families

from bench.serving import (
    DEFAULT_MODEL_DIR,
    FULL,
    QUICK,
    REPO_ROOT,
    STALL_GOAL,
    Body,
    ServerOptions,
    Sizes,
    StallRun,
    code_revision,
    post_lean,
    running_server,
    served_native_context,
    server_command,
    stall_run,
)
from bench.throughput import interleaved_runs, prepare_models, prompts, scaling_specs

DEFAULT_OUTPUT = Path(__file__).parent / "results" / "score_path.md"
STREAM_NEW = 2000
SIDES = ("baseline", "this")


@dataclasses.dataclass(frozen=True)
class Side:
    """One server's runs: /score alone (seconds per request) and the stall runs."""

    score_s: list[float]
    alone: list[StallRun]
    with_score: list[StallRun]
    scored_positions: dict[str, float]  # pe_scored_positions_total by path; empty: no such counter


def score_body(sizes: Sizes, native: int) -> Body:
    """`bench.serving`'s long document: dynamic NTK x4, which reads the table for the whole length."""
    dynamic = next(scaling for scaling in scaling_specs(native) if scaling["type"] == "dynamic")
    return {"tokens": list(prompts(1, sizes.interloper_tokens)[0]), "pe_scaling": dynamic}


def timed_score(base_url: str, body: Body) -> float:
    """Seconds for one /score on a fresh connection, checked to cover every token."""
    start = time.perf_counter()
    reply = asyncio.run(post_lean(base_url, "/score", body))
    elapsed = time.perf_counter() - start
    if len(reply["token_logprobs"]) != len(body["tokens"]):
        raise RuntimeError(f"/score answered {len(reply['token_logprobs'])} logprobs")
    return elapsed


def positions_since(before: dict[str, float], now: dict[str, float]) -> dict[str, float]:
    """The positions scored between two readings of `scored_positions`, by path."""
    return {path: count - before.get(path, 0.0) for path, count in now.items()}


def scored_positions(base_url: str) -> dict[str, float]:
    """`pe_scored_positions_total` by path, summed over models, from the server's /metrics."""
    text = httpx.get(base_url + "/metrics", timeout=30.0, trust_env=False).text
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "pe_scored_positions":
            continue
        for sample in family.samples:
            if sample.name == "pe_scored_positions_total":
                path = sample.labels["path"]
                totals[path] = totals.get(path, 0.0) + sample.value
    return totals


def measure(
    urls: dict[str, str], sizes: Sizes, repeats: int
) -> tuple[dict[str, list[float]], dict[str, list[StallRun]]]:
    """Every kind on both servers, taking turns (`interleaved_runs`, a warm-up each)."""
    native = served_native_context(urls["this"])
    body = score_body(sizes, native)
    runs: dict[str, Callable[[], float | StallRun]] = {}
    for side, url in urls.items():
        runs[f"{side}/score"] = functools.partial(timed_score, url, body)
        runs[f"{side}/alone"] = functools.partial(stall_run, url, sizes, None)
        runs[f"{side}/with_score"] = functools.partial(stall_run, url, sizes, ("/score", body))
    samples = interleaved_runs(repeats, runs)
    times = {
        side: [sample for sample in samples[f"{side}/score"] if isinstance(sample, float)] for side in urls
    }
    stalls = {
        f"{side}/{kind}": [run for run in samples[f"{side}/{kind}"] if isinstance(run, StallRun)]
        for side in urls
        for kind in ("alone", "with_score")
    }
    return times, stalls


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--baseline-root", type=Path, required=True, help="the other revision's worktree")
    parser.add_argument("--repeats", type=int, default=None, help="default 3 (1 with --quick)")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test only")
    parser.add_argument("--score-tokens", type=int, default=None, help="default 4000 (1024 with --quick)")
    parser.add_argument(
        "--stream-new",
        type=int,
        default=None,
        help=f"per stream (default {STREAM_NEW}, 24 with --quick)",
    )
    arguments = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(arguments)
    sizes = QUICK if args.quick else FULL
    sizes = dataclasses.replace(
        sizes,
        interloper_tokens=args.score_tokens or sizes.interloper_tokens,
        stream_new=args.stream_new or (sizes.stream_new if args.quick else STREAM_NEW),
    )
    repeats = args.repeats if args.repeats is not None else sizes.repeats
    roots = {"baseline": args.baseline_root.resolve(), "this": REPO_ROOT}
    load_before = os.getloadavg()[0]
    started = datetime.now(UTC)
    options = ServerOptions()
    with tempfile.TemporaryDirectory(prefix="bench-score-path-") as workdir:
        model_dir, _, source = prepare_models(args.model_dir, Path(workdir))
        with (
            running_server(model_dir, Path(workdir) / "baseline.log", options, roots["baseline"]) as old,
            running_server(model_dir, Path(workdir) / "this.log", options, roots["this"]) as new,
        ):
            urls = {"baseline": old, "this": new}
            # The servers' own start-up warm-up scores a short text: counted apart from the runs.
            before = {side: scored_positions(url) for side, url in urls.items()}
            times, stalls = measure(urls, sizes, repeats)
            results = {
                side: Side(
                    times[side],
                    stalls[f"{side}/alone"],
                    stalls[f"{side}/with_score"],
                    positions_since(before[side], scored_positions(url)),
                )
                for side, url in urls.items()
            }
    revisions = {side: code_revision(root) for side, root in roots.items()}
    machine = (
        f"{platform.platform()}, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs "
        f"(load average {load_before:.1f} at start, {os.getloadavg()[0]:.1f} at end)"
    )
    lines = report(
        command=shlex.join(["python", "-m", "bench.score_path", *arguments]),
        machine=machine,
        date=f"{started:%Y-%m-%d %H:%M} UTC, {(datetime.now(UTC) - started).total_seconds():.0f} s",
        source=source,
        revisions=revisions,
        sizes=sizes,
        repeats=repeats,
        quick=args.quick,
        results=results,
    )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text("\n".join(lines) + "\n")
    print(args.output.read_text())
    return 0


def report(
    *,
    command: str,
    machine: str,
    date: str,
    source: str,
    revisions: dict[str, str],
    sizes: Sizes,
    repeats: int,
    quick: bool,
    results: dict[str, Side],
) -> list[str]:
    server = shlex.join(["python", *server_command("MODEL_COPY", "PORT", ServerOptions())])
    tokens = sizes.interloper_tokens
    lines = [
        f"# `/score` on the served path: {tokens} tokens alone and beside {sizes.stream_clients} streams",
        "",
        f"Command: `{command}`",
        "",
        f"- Machine: {machine}",
        f"- torch {torch.__version__}, Python {platform.python_version()}; date: {date}",
        f"- Model: {source}, EOS disabled, float32, each server on its default intra-op threads",
        f"- Servers (two, one per revision, alternating; MODEL_COPY is the EOS-disabled copy): `{server}`",
        f"- Revisions: baseline git {revisions['baseline']}, this git {revisions['this']}",
        f"- Document: {tokens} tokens, dynamic NTK x4 (`bench.serving`'s); medians of {repeats} "
        "repeat(s) after one warm-up run of every kind; ratios are medians of per-repeat ratios.",
    ]
    if quick:
        lines += ["", "**`--quick` run: sizes shrunk to a smoke test; these numbers mean nothing.**"]
    lines += [
        "",
        "## 1. `/score` alone",
        "",
        "| revision | seconds | tok/s | positions scored on c / eager (every run, from /metrics) |",
        "|---|---:|---:|---|",
    ]
    for side in SIDES:
        result = results[side]
        seconds = statistics.median(result.score_s)
        counted = result.scored_positions
        paths = f"{counted.get('c', 0):.0f} / {counted.get('eager', 0):.0f}" if counted else "(no counter)"
        lines.append(f"| {side} | {seconds:.2f} | {(tokens - 1) / seconds:.0f} | {paths} |")
    speedup = statistics.median(
        old / new for old, new in zip(results["baseline"].score_s, results["this"].score_s, strict=True)
    )
    lines += [
        "",
        f"This revision scores {speedup:.2f}x the baseline's tok/s (median of per-repeat ratios).",
        "",
        "## 2. Gaps in the streams while the document is scored",
        "",
        f'{sizes.stream_clients} clients stream (`"stream": true`) {sizes.stream_new} tokens each from '
        f"{sizes.stream_prompt}-token prompts; gaps between consecutive token events of one stream, "
        f"all streams pooled. Once every stream has a quarter of its tokens the {tokens}-token "
        f"`/score` arrives. Ratio: max gap with the document / p99 gap of the streams alone on the "
        f"same server in the same repeat (goal <= {STALL_GOAL:.0f}x).",
        "",
        "| revision | p99 alone ms | max alone ms | p99 with /score ms | max with /score ms "
        "| max / p99 alone | /score ms | streams still running at its end |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for side in SIDES:
        result = results[side]
        ratio = statistics.median(
            run.max / alone.p99 for run, alone in zip(result.with_score, result.alone, strict=True)
        )
        interloper = [run.interloper_ms for run in result.with_score if run.interloper_ms is not None]
        overlapped = sum(run.overlapped for run in result.with_score)
        lines.append(
            f"| {side} | {statistics.median(r.p99 for r in result.alone):.1f} "
            f"| {statistics.median(r.max for r in result.alone):.1f} "
            f"| {statistics.median(r.p99 for r in result.with_score):.1f} "
            f"| {statistics.median(r.max for r in result.with_score):.1f} | {ratio:.1f}x "
            f"| {statistics.median(interloper):.0f} | {overlapped}/{len(result.with_score)} |"
        )
        if side == "this":
            lines += [
                "",
                f"This revision: max / p99 alone {ratio:.1f}x, goal "
                f"{'met' if ratio <= STALL_GOAL else '**not met**'}.",
            ]
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
