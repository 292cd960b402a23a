"""Extrapolation of the training-side members: `python -m bench.extrapolation_training`.

Scores `zoo-rope` and its training-side members (`training.extension`: PI and YaRN x4 fine-tunes,
PoSE, randomized positions) on `bench.extrapolation`'s held-out windows, each model unscaled and
under linear and YaRN at the fine-tunes' fixed factor 4 (a member's own default is one of these,
and the others are what a request could ask instead).

`--members` scores some of them only: each member's cells are stored in `--cells-dir`, and every
run renders `bench/results/extrapolation_training.md` and `.png` from all members stored so far.
That lets each member be scored as soon as its training ends, in a process of its own.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from bench.extrapolation import LENGTHS, RESULTS_DIR, Cell, Results, Setting, plot, render_markdown, run
from service.engine.engine import InferenceEngine
from training.corpus import load_corpus
from training.recipe import TRAINED_CONTEXT

MEMBERS = ("zoo-rope", "zoo-rope-pi4", "zoo-rope-yarn4", "zoo-rope-pose", "zoo-rope-randpos")
SCALINGS = ("none", "linear", "yarn")
TRAINED_FACTOR = 4.0
CELLS_DIR = Path("runs/extrapolation_training")
STEM = "extrapolation_training"
INTRO = (
    f"`zoo-rope` (trained at {TRAINED_CONTEXT} bytes) and its training-side members (docs/zoo.md): "
    "`zoo-rope-pi4` and `zoo-rope-yarn4` (PI and YaRN x4 fine-tunes to 1024), `zoo-rope-pose` "
    "(PoSE: 256-byte windows whose positions cover 1024, linear x4) and `zoo-rope-randpos` (from "
    "scratch on ordered random positions from [0, 4096)). Every model runs unscaled and under "
    f"linear and YaRN at the fine-tunes' fixed factor {TRAINED_FACTOR:g}; a fine-tune's own default "
    "is one of these, and `none` overrides it."
)


def member_settings(member: str) -> tuple[Setting, ...]:
    return tuple(
        Setting("rope", scaling, model=member, fixed_factor=None if scaling == "none" else TRAINED_FACTOR)
        for scaling in SCALINGS
    )


SETTINGS = tuple(setting for member in MEMBERS for setting in member_settings(member))


def save_cells(path: Path, results: Results, run_details: dict[str, Any]) -> None:
    cells = {
        setting.label: {str(length): asdict(cell) for length, cell in by_length.items()}
        for setting, by_length in results.items()
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"run": run_details, "cells": cells}, indent=1) + "\n")


def load_stored(cells_dir: Path) -> tuple[Results, list[dict[str, Any]]]:
    """Every stored member's cells, in `SETTINGS` order, and the runs that scored them."""
    results: Results = {}
    runs = []
    for member in MEMBERS:
        path = cells_dir / f"{member}.json"
        if not path.is_file():
            continue
        stored = json.loads(path.read_text())
        runs.append(stored["run"] | {"member": member})
        for setting in member_settings(member):
            by_length = stored["cells"][setting.label]
            results[setting] = {int(length): Cell(**cell) for length, cell in by_length.items()}
    return results, runs


def render(cells_dir: Path, out: Path) -> None:
    results, runs = load_stored(cells_dir)
    if not results:
        return
    lengths = sorted(next(iter(results.values())))
    tokens = runs[0]["tokens"]
    seconds = sum(details["seconds"] for details in runs)
    markdown = render_markdown(results, lengths, tokens, seconds, "one run per member, below", INTRO)
    lines = ["## Runs", "", "| member | command | wall time (s) |", "|---|---|---:|"]
    lines += [f"| {d['member']} | `{d['command']}` | {d['seconds']:.0f} |" for d in runs]
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{STEM}.md").write_text(markdown + "\n" + "\n".join(lines) + "\n")
    plot(results, lengths, out / f"{STEM}.png", "zoo-rope and its training-side members")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--members", nargs="*", choices=MEMBERS, default=list(MEMBERS))
    parser.add_argument("--models-dir", type=Path, default=Path("models"))
    parser.add_argument("--tokens", type=int, default=16384, help="held-out tokens scored at every length")
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    parser.add_argument("--threads", type=int, default=1, help="torch threads; 1 is fastest on a busy CPU")
    parser.add_argument("--cells-dir", type=Path, default=CELLS_DIR)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    command = shlex.join(
        ["python", "-m", "bench.extrapolation_training", *(argv if argv is not None else sys.argv[1:])]
    )
    if args.members:
        stream = load_corpus().held_out[: args.tokens]
        engine = InferenceEngine.from_model_dirs(
            [args.models_dir / member for member in args.members],
            device="cpu",
            max_context=max(args.lengths),
        )
        engine.start()
        try:
            for member in args.members:
                started = time.perf_counter()
                results = run(engine, stream, args.lengths, member_settings(member))
                details = {
                    "command": command,
                    "seconds": round(time.perf_counter() - started, 1),
                    "tokens": stream.numel(),
                    "threads": torch.get_num_threads(),
                }
                save_cells(args.cells_dir / f"{member}.json", results, details)
        finally:
            engine.shutdown()
    render(args.cells_dir, args.out)


if __name__ == "__main__":
    main()
