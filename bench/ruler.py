"""RULER-style tasks on SmolLM2 through a real server and the real CLI, with the checks a reader
can make on every sample.

Starts `pe-serve` on SmolLM2-135M-Instruct with its default flags and `--max-context 16384`, then
runs `pe-client ruler --json --dump` (a subprocess: the command a user types) once per group of
configurations: the table scalings (none, YaRN x2, dynamic NTK x2; no attention field sent) and
the attention rules (`bench.attention`'s specs, unscaled). Every group asks the same prompts
(seed 0). From each dump it checks, per sample, that every expected answer is in the prompt and
that the prompt is 90-100% of its cell's length in tokens, and, per cell, that the CLI's score is
the mean of RULER's `string_match_all` over the cell's dumped samples.

    python -m bench.ruler                                   # the headline grid (hours on 2 cores)
    python -m bench.ruler --lengths 4096,8192 --configs none,self_extend --samples 10
    python -m bench.ruler --resume --lengths 16384 --configs none          # adds a length

Writes `bench/results/ruler.{json,md}` and `ruler.{png,svg}` (one heatmap per configuration); each
group is recorded as it ends, so a run cut short keeps what it measured; each group's dump (every
prompt, up to 16k tokens each) is left in `/tmp/ruler-<configurations>-<lengths>.jsonl`, the
record keeps each sample's answers, output and size. `--resume` skips a group already recorded at
the same lengths; the report merges every group's cells into one table. `--report` rewrites the
report and plots from the JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pe_client import PEClient
from pe_client.lab_output import plot_ruler
from pe_client.ruler import RulerCell, RulerResult, RulerSample
from pe_client.ruler_tasks import string_match_all

from bench.attention import METHODS, NATIVE
from bench.run_record import log, revision
from tests.live_server import live_server

RESULTS = Path(__file__).resolve().parent / "results"
RECORD = RESULTS / "ruler.json"
REPORT = RESULTS / "ruler.md"
REPO = Path(__file__).resolve().parents[1]
MAX_CONTEXT = 16384
LENGTHS = (4096, 8192, 16384)
TASKS = ("niah_single", "niah_multikey", "vt", "cwe")
CONFIGS = ("none", "yarn", "dynamic", "self_extend", "dca", "rerope+logn")
PLOT_FORMATS = (".png", ".svg")
MIN_FILL = 0.9  # the SDK's promise: a prompt has 90-100% of its cell's length in tokens
SCORE_TOLERANCE = 1e-9


@dataclass(frozen=True)
class Group:
    """One `pe-client ruler` call: the configurations it crosses (scalings x attention rules)."""

    names: tuple[str, ...]
    scalings: tuple[str, ...]
    attentions: tuple[str, ...]

    def arguments(self) -> list[str]:
        flags = [["--scaling", spec] for spec in self.scalings] + [
            ["--attention", spec] for spec in self.attentions
        ]
        return [part for flag in flags for part in flag]


def groups(names: list[str], longest: int) -> list[Group]:
    """The table scalings in one call, the rules (unscaled) in another; YaRN at the factor the
    longest length needs."""
    methods = {method.name: method for method in METHODS}
    unknown = sorted(set(names) - set(methods))
    if unknown:
        raise SystemExit(f"unknown configurations {unknown}; known: {', '.join(methods)}")
    chosen = [methods[name] for name in names]
    scaled = [method for method in chosen if method.attention is None]
    ruled = [method for method in chosen if method.attention is not None]
    found = []
    if scaled:
        specs = tuple(method.scaling_at(longest) for method in scaled)
        found.append(Group(tuple(method.name for method in scaled), specs, ()))
    if ruled:
        attentions = tuple(method.attention for method in ruled if method.attention is not None)
        found.append(Group(tuple(method.name for method in ruled), ("none",), attentions))
    return found


def run_group(url: str, model: str, group: Group, args: argparse.Namespace, dump: Path) -> dict[str, Any]:
    """One CLI call; its JSON, its wall time and the checks on its dump."""
    command = [
        str(Path(sys.executable).with_name("pe-client")),
        "--url",
        url,
        "ruler",
        "--model",
        model,
        "--lengths",
        args.lengths,
        "--tasks",
        args.tasks,
        "--samples",
        str(args.samples),
        "--json",
        "--no-progress",
        "--dump",
        str(dump),
        *group.arguments(),
    ]
    log("$ " + shlex.join(command[1:]))
    commit = revision()  # the code that runs the call, whatever is committed while it runs
    started = time.perf_counter()
    run = subprocess.run(command, capture_output=True, text=True, check=False)
    if run.returncode != 0:
        raise SystemExit(f"pe-client ruler exited {run.returncode}: {run.stderr[-2000:]}")
    wall_s = time.perf_counter() - started
    result = json.loads(run.stdout)
    samples = [RulerSample.model_validate_json(line) for line in dump.read_text().splitlines() if line]
    return {
        "configurations": list(group.names),
        "lengths": [int(length) for length in args.lengths.split(",")],
        "commit": commit,
        "finished": f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
        "command": "pe-client ruler " + shlex.join(command[command.index("ruler") + 1 :]),
        "wall_s": wall_s,
        "result": result,
        "checks": check_dump(result, samples),
        "samples": [_sample_summary(sample) for sample in samples],
    }


def check_dump(result: dict[str, Any], samples: list[RulerSample]) -> dict[str, Any]:
    """The must-shows over one call's dump: answers in prompts, prompt sizes, cell scores."""
    missing = [index for index, sample in enumerate(samples) if not _answers_in_prompt(sample)]
    fills = [sample.prompt_tokens / sample.length for sample in samples]
    off_size = [index for index, fill in enumerate(fills) if not MIN_FILL <= fill <= 1.0]
    by_cell: dict[tuple[str, int, str], list[float]] = defaultdict(list)
    for sample in samples:
        by_cell[_cell_key(sample)].append(string_match_all(sample.output, sample.answers))
    mismatched = []
    for cell in result["cells"]:
        scores = by_cell.get(_cell_key(RulerCell.model_validate(cell)), [])
        recomputed = math.fsum(scores) / len(scores) if scores else math.nan
        if len(scores) != cell["samples"] or not abs(recomputed - cell["score"]) <= SCORE_TOLERANCE:
            mismatched.append({"cell": _cell_key(RulerCell.model_validate(cell)), "recomputed": recomputed})
    return {
        "samples": len(samples),
        "answers_not_in_prompt": missing,
        "fill_min": min(fills, default=math.nan),
        "fill_max": max(fills, default=math.nan),
        "prompts_off_size": off_size,
        "cells": len(result["cells"]),
        "cells_not_matching_dump": mismatched,
    }


def _answers_in_prompt(sample: RulerSample) -> bool:
    return all(answer in sample.prompt for answer in sample.answers)


def _cell_key(item: RulerCell | RulerSample) -> tuple[str, int, str]:
    configuration = item.model_dump(mode="json", include={"scaling", "attention"})
    return item.task, item.length, json.dumps(configuration, sort_keys=True)


def _sample_summary(sample: RulerSample) -> dict[str, Any]:
    """What the record keeps of a sample (prompts run to 16k tokens: they stay in the dump)."""
    kept = sample.model_dump(mode="json", exclude={"prompt"})
    return {**kept, "score": string_match_all(sample.output, sample.answers)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="cell lengths in tokens")
    parser.add_argument("--tasks", default=",".join(TASKS), help="RULER tasks (pe-client ruler --tasks)")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="rows, by bench.attention's names")
    parser.add_argument("--samples", type=int, default=10, help="samples per cell")
    parser.add_argument("--resume", action="store_true", help="keep the groups ruler.json holds")
    parser.add_argument("--report", action="store_true", help="rewrite the report and plots from the JSON")
    args = parser.parse_args()
    if not args.report:
        run(args)
    record = json.loads(RECORD.read_text())
    save_plots(record)
    REPORT.write_text(render_report(record))
    print(REPORT.read_text())


def run(args: argparse.Namespace) -> None:
    lengths = [int(length) for length in args.lengths.split(",")]
    planned = groups(args.configs.split(","), max(lengths))
    record: dict[str, Any] = {"groups": []}
    if args.resume and RECORD.exists():
        record = json.loads(RECORD.read_text())
    done = {(tuple(group["configurations"]), tuple(group_lengths(group))) for group in record["groups"]}
    # What every group shares; each group records its own command, commit and finish time.
    record["run"] = {
        "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores",
        "server_flags": f"--max-context {MAX_CONTEXT} (else defaults)",
    }
    gguf = subprocess.run(
        [sys.executable, "-m", "service.model.bundled", "smollm2"], capture_output=True, text=True, check=True
    ).stdout.strip()
    with live_server([gguf], options={"max_context": MAX_CONTEXT}, ready_timeout_s=900.0) as server:
        with PEClient(server.base_url) as client:
            model = client.models()[0].name
        for group in planned:
            if (group.names, tuple(lengths)) in done:
                continue
            name = "-".join([*group.names, *map(str, lengths)])
            dump = Path(f"/tmp/ruler-{name}.jsonl".replace("+", "_"))
            stage = run_group(server.base_url, model, group, args, dump)
            checks = {
                key: value for key, value in stage["checks"].items() if key != "cells_not_matching_dump"
            }
            log(f"  {stage['wall_s']:.0f} s, checks: {json.dumps(checks)}")
            record["groups"].append(stage)
            RECORD.write_text(json.dumps(record, indent=1) + "\n")
            save_plots(record)
            REPORT.write_text(render_report(record))


def group_lengths(group: dict[str, Any]) -> list[int]:
    """The lengths a group's call asked (records before this field: its cells' lengths)."""
    return group.get("lengths") or sorted({cell["length"] for cell in group["result"]["cells"]})


def latest_cells(record: dict[str, Any]) -> dict[tuple[str, str, int], dict[str, Any]]:
    """Every (configuration, task, length) cell the groups measured, by configuration name; a
    cell measured again is the later group's."""
    cells: dict[tuple[str, str, int], dict[str, Any]] = {}
    for group in record["groups"]:
        names = dict(zip(_configuration_keys(group), group["configurations"], strict=True))
        for cell in group["result"]["cells"]:
            cells[names[_configuration_key(cell)], cell["task"], cell["length"]] = cell
    return cells


def combined(record: dict[str, Any]) -> RulerResult:
    """Every measured cell as one result, for one plot."""
    return RulerResult(
        model=record["groups"][0]["result"]["model"],
        cells=[RulerCell.model_validate(cell) for cell in latest_cells(record).values()],
        wall_s=math.fsum(group["wall_s"] for group in record["groups"]),
        samples=[],
        chat=True,
    )


def save_plots(record: dict[str, Any]) -> None:
    if not record["groups"]:
        return
    for suffix in PLOT_FORMATS:
        plot_ruler(combined(record), RESULTS / f"ruler{suffix}")


def render_report(record: dict[str, Any]) -> str:
    """The merged table first (configuration x task by length), then each call: its command,
    commit, wall time and the checks on its dump."""
    lines = [
        "# RULER-style tasks on SmolLM2-135M-Instruct",
        "",
        f"Made by `python -m bench.ruler` ({record['run']['machine']}): a real `pe-serve`"
        f" ({record['run']['server_flags']}) driven by the CLI, `pe-client ruler --json --dump`,"
        f" once per group of configurations and lengths below. Native context {NATIVE}. A cell is"
        " the mean of RULER's `string_match_all` (the share of expected answers found in the greedy"
        " output) over its samples (in parentheses); the same prompts under every configuration.",
        "",
    ]
    cells = latest_cells(record)
    lengths = sorted({length for _, _, length in cells})
    rows: dict[tuple[str, str], dict[int, str]] = defaultdict(dict)
    for (name, task, length), cell in cells.items():
        rows[name, task][length] = f"{cell['score']:.0%} ({cell['samples']})"
    lines += [
        "| configuration | task | " + " | ".join(map(str, lengths)) + " |",
        "|---|---" + "|---" * len(lengths) + "|",
        *(
            f"| {name} | {task} | " + " | ".join(scores.get(length, "—") for length in lengths) + " |"
            for (name, task), scores in rows.items()
        ),
        "",
        "## Runs",
        "",
    ]
    for group in record["groups"]:
        checks = group["checks"]
        when = ", ".join(
            [f"at `{group['commit']}`" if "commit" in group else "commit not recorded"]
            + ([group["finished"]] if "finished" in group else [])
        )
        lines += [
            f"**{', '.join(group['configurations'])}** at {', '.join(map(str, group_lengths(group)))}:"
            f" {group['wall_s'] / 60:.1f} min, {when}: `{group['command']}`",
            "",
            f"- {checks['samples']} samples; answers missing from their prompt:"
            f" {len(checks['answers_not_in_prompt'])}; prompt tokens / length"
            f" {checks['fill_min']:.3f}-{checks['fill_max']:.3f} (outside 0.9-1.0:"
            f" {len(checks['prompts_off_size'])}); cells whose score is not the mean over their dumped"
            f" samples: {len(checks['cells_not_matching_dump'])}"
            f" of {checks['cells']}.",
            "",
        ]
    lines += ["![RULER](ruler.png)", ""] if record["groups"] else []
    return "\n".join(lines)


def _configuration_keys(group: dict[str, Any]) -> list[str]:
    """The group's configurations in the order its CLI call crossed them (scalings, then rules)."""
    return list(dict.fromkeys(_configuration_key(cell) for cell in group["result"]["cells"]))


def _configuration_key(cell: dict[str, Any]) -> str:
    return json.dumps([cell["scaling"], cell["attention"]], sort_keys=True)


if __name__ == "__main__":
    main()
