"""The context-extension lab's headline runs: scaling sweeps and passkey retrieval through a real server.

Two parts, each against a `pe-serve` started with its default flags (the SmolLM2 one with
`--max-context 16384`, as `make serve-smollm2`), driven by the SDK's own `pe_client.async_sweep`
and `pe_client.async_passkey`:

- `zoo`: every bundled model (native 256) on `pydoc_data/topics.py`, lengths 256..4096, every
  scaling its scheme takes (GET /models) at x4 and x16, and a small passkey grid on zoo-rope;
- `smollm2`: SmolLM2-135M-Instruct (native 8192) at 4k, 8k, 12k and 16k under none, linear x2,
  ntk x2, dynamic x2, yarn x2 and llama3 x2 (the lab's sweep: one pass per scaling); passkey at
  the same lengths, three depths, `--trials` keys per cell (default 1), for none, yarn and dynamic.

Each part also times the batching gain: every cell of a grid as its own `/score` of its first L
tokens, all sent at once against one after another, in the same run; the one-at-a-time cells are
each a `/score` sent alone, so the largest difference between a batched cell and the same cell
alone is reported too. (The sweep itself sends one pass per configuration, not one per cell; what
that saves is `bench/sweep_passes.py`'s figure.)

    python -m bench.extension --part zoo
    nice -n 19 python -m bench.extension --part smollm2

Each part writes `bench/results/extension-<part>.json` and its plots (PNG and SVG); the report
`bench/results/extension.md` is rebuilt from whichever parts' JSON exists.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from pe_client import (
    AsyncPEClient,
    LongRopeScaling,
    PasskeyResult,
    SweepCell,
    SweepResult,
    async_passkey,
    async_sweep,
)
from pe_client.corpora import corpus_text
from pe_client.grid import ScalingSpec, label, parse_specs
from pe_client.lab_output import plot_passkey, plot_sweep
from pe_client.scaling import PEScaling, parse_scaling
from pe_client.sweep import bits_per_token, leading_tokens
from pe_client.types import ScoreRequest

from bench.run_record import log, revision
from tests.live_server import OptionValue, live_server

RESULTS = Path(__file__).resolve().parent / "results"
REPORT = RESULTS / "extension.md"
REPO = Path(__file__).resolve().parents[1]
CORPUS = "pydoc-topics"
# Scoring 16k tokens under six scalings at once on two cores takes many minutes per answer.
LAB_TIMEOUT = httpx.Timeout(None, connect=10.0)
PLOT_FORMATS = (".png", ".svg")

ZOO_LENGTHS = (256, 512, 1024, 2048, 4096)
ZOO_FACTORS = (4, 16)
ZOO_PASSKEY_LENGTHS = (256, 1024, 4096)
ZOO_GAIN_LENGTHS = (1024, 4096)
SMOLLM2_LENGTHS = (4096, 8192, 12288, 16384)
SMOLLM2_NATIVE = 8192
SMOLLM2_SCALINGS = (  # in the order a run staged by scaling reaches them
    "none",
    f"yarn:factor=2,original_max_position_embeddings={SMOLLM2_NATIVE}",
    "ntk:factor=2",
    f"dynamic:factor=2,original_max_position_embeddings={SMOLLM2_NATIVE}",
    "linear:factor=2",
    f"llama3:factor=2,original_max_position_embeddings={SMOLLM2_NATIVE}",
)
SMOLLM2_PASSKEY_SCALINGS = (
    SMOLLM2_SCALINGS[0],
    SMOLLM2_SCALINGS[1],
    SMOLLM2_SCALINGS[3],
)  # none, yarn, dynamic
DEPTHS = (0.1, 0.5, 0.9)


def zoo_scalings(card_scalings: Sequence[str], head_dim: int) -> list[ScalingSpec]:
    """Every scaling type the model takes, at each of ZOO_FACTORS; LongRoPE (lists, no SPEC form)
    as uniform factors: 1 within the native context, the factor past it."""
    factors = "|".join(map(str, ZOO_FACTORS))
    specs: list[ScalingSpec] = []
    for scaling_type in card_scalings:
        if scaling_type == "none":
            specs.append("none")
        elif scaling_type == "longrope":
            specs += [
                LongRopeScaling(
                    short_factor=[1.0] * (head_dim // 2), long_factor=[float(f)] * (head_dim // 2)
                )
                for f in ZOO_FACTORS
            ]
        else:
            specs.append(f"{scaling_type}:factor={factors}")
    return specs


async def batching_gain(
    client: AsyncPEClient, text: str, lengths: Sequence[int], scalings: Sequence[ScalingSpec], model: str
) -> dict[str, Any]:
    """Every (scaling, length) cell as its own `/score` of the text's first L tokens: all sent at
    once, then one after another, each sent alone once the previous one is answered. Their wall
    times, and the largest difference between a batched cell and the same cell scored alone.

    Not `async_sweep(..., concurrency=1)`: a sweep scores each scaling once at its longest length
    and reads the shorter cells from that pass's prefix, so its one-at-a-time run would send
    passes, not cells, and its cells would not be `/score`s of their own tokens.
    """
    tokens = await leading_tokens(client, text, max(lengths), model)
    cells = [(scaling, length) for scaling in parse_specs(scalings) for length in sorted(set(lengths))]

    async def score(scaling: PEScaling, length: int) -> float:
        request = ScoreRequest(tokens=tokens[:length], model=model, pe_scaling=scaling)
        logprobs = (await client.score(request)).token_logprobs[1:]
        return bits_per_token([logprob for logprob in logprobs if logprob is not None])

    started = time.perf_counter()
    together = await asyncio.gather(*(score(scaling, length) for scaling, length in cells))
    together_s = time.perf_counter() - started
    started = time.perf_counter()
    alone = [await score(scaling, length) for scaling, length in cells]
    one_after_another_s = time.perf_counter() - started
    return {
        "model": model,
        "cells": len(cells),
        "lengths": list(lengths),
        "together_s": together_s,
        "one_after_another_s": one_after_another_s,
        "gain": one_after_another_s / together_s,
        "max_abs_diff_bits": max(abs(a - b) for a, b in zip(together, alone, strict=True)),
    }


def save_plots(result: SweepResult | PasskeyResult, stem: str) -> list[str]:
    names = []
    for suffix in PLOT_FORMATS:
        path = RESULTS / f"{stem}{suffix}"
        if isinstance(result, SweepResult):
            plot_sweep(result, path)
        else:
            plot_passkey(result, path)
        names.append(path.name)
    return names


async def run_zoo(record: PartRecord) -> None:
    text = corpus_text(CORPUS)
    with live_server([]) as server:
        async with AsyncPEClient(server.base_url, timeout=LAB_TIMEOUT) as client:
            sweeps: list[SweepResult] = []
            grids: dict[str, list[ScalingSpec]] = {}
            for card in await client.models():
                config = json.loads((REPO / "models" / card.name / "config.json").read_text())
                grids[card.name] = zoo_scalings(
                    card.supported_scalings, config["d_model"] // config["n_heads"]
                )
                log(f"zoo sweep {card.name}: {len(ZOO_LENGTHS)} lengths, {card.supported_scalings}")
                if card.scheme == "learned":
                    sweeps.append(await learned_sweep(client, text, card.name, card.native_context))
                else:
                    sweeps.append(
                        await async_sweep(
                            client, text=text, lengths=ZOO_LENGTHS, scalings=grids[card.name], model=card.name
                        )
                    )
                record.add(sweeps=[sweep_json(result) for result in sweeps])
            log(f"zoo batching gain (zoo-rope at {list(ZOO_GAIN_LENGTHS)})")
            gain = await batching_gain(client, text, ZOO_GAIN_LENGTHS, grids["zoo-rope"], "zoo-rope")
            record.add(batching=gain)
            log("zoo passkey")
            passkey = await async_passkey(
                client,
                lengths=ZOO_PASSKEY_LENGTHS,
                depths=DEPTHS,
                scalings=["none", "yarn:factor=16", "dynamic:factor=16"],
                model="zoo-rope",
            )
    record.add(
        passkey=passkey_json(passkey),
        plots=save_zoo_plot(sweeps) + save_plots(passkey, "extension-zoo-passkey"),
    )


async def learned_sweep(client: AsyncPEClient, text: str, model: str, native: int) -> SweepResult:
    """A learned position table has no row past its native context: unscaled it runs to `native`,
    stretched by a factor to `native` times that (the server refuses more with a 422)."""
    parts = [await async_sweep(client, text=text, lengths=[native], scalings=["none"], model=model)]
    for factor in ZOO_FACTORS:
        lengths = [length for length in ZOO_LENGTHS if length <= native * factor]
        parts.append(
            await async_sweep(
                client, text=text, lengths=lengths, scalings=[f"linear:factor={factor}"], model=model
            )
        )
    return parts[0].model_copy(
        update={
            "cells": [cell for part in parts for cell in part.cells],
            "wall_s": sum(part.wall_s for part in parts),
        }
    )


async def run_smollm2(
    record: PartRecord,
    lengths: Sequence[int],
    passkey_lengths: Sequence[int],
    gain_lengths: Sequence[int],
    per_scaling: bool,
    trials: int,
) -> None:
    """Batching gain (short cells), sweep, passkey, each recorded as it finishes: on a busy machine
    a run cut short still leaves what it measured."""
    text = corpus_text(CORPUS)
    gguf = subprocess.run(
        [sys.executable, "-m", "service.model.bundled", "smollm2"], capture_output=True, text=True, check=True
    ).stdout.strip()
    options: dict[str, OptionValue] = {"max_context": 16384}
    with live_server([gguf], options=options, ready_timeout_s=900.0) as server:
        async with AsyncPEClient(server.base_url, timeout=LAB_TIMEOUT) as client:
            model = (await client.models())[0].name
            if gain_lengths:  # `--gain-lengths ""` leaves the gain to the zoo part on a busy machine
                log(f"smollm2 batching gain at {list(gain_lengths)}")
                record.add(batching=await batching_gain(client, text, gain_lengths, SMOLLM2_SCALINGS, model))
            cells: list[SweepCell] = []
            sweep_started = time.perf_counter()  # the sweep's own time: not the start-up's or the gain's
            # The lab's sweep: every scaling at every length in one call, one pass per scaling at the
            # longest length (dynamic: one per length), the passes batched; or (--per-scaling, on a
            # machine too busy for the whole grid at once) one scaling's passes after another, each
            # recorded as it ends.
            stages = (
                [(list(lengths), [scaling]) for scaling in SMOLLM2_SCALINGS]
                if per_scaling
                else [(list(lengths), list(SMOLLM2_SCALINGS))]
            )
            for stage_lengths, stage_scalings in stages:
                log(f"smollm2 sweep at {stage_lengths}: {stage_scalings}")
                result = await async_sweep(
                    client,
                    text=text,
                    lengths=stage_lengths,
                    scalings=stage_scalings,
                    model=model,
                    on_cell=_log_cell,
                )
                cells += result.cells
                swept = result.model_copy(
                    update={"cells": cells, "wall_s": time.perf_counter() - sweep_started}
                )
                record.add(sweeps=[sweep_json(swept)], plots=save_plots(swept, "extension-smollm2-sweep"))
            # One call for every length: a trial's prompts share their filler across lengths and
            # depths, and go in turn so that the prefix cache computes it once (`async_passkey`).
            log(f"smollm2 passkey at {list(passkey_lengths)}")
            found = await async_passkey(
                client,
                lengths=passkey_lengths,
                depths=DEPTHS,
                scalings=SMOLLM2_PASSKEY_SCALINGS,
                model=model,
                trials=trials,
                seed=0,
                on_cell=lambda found: log(f"  passkey answer: {'found' if found else 'missed'}"),
            )
            record.add(
                passkey=passkey_json(found),
                plots=[name for name in record.data["plots"] if "passkey" not in name]
                + save_plots(found, "extension-smollm2-passkey"),
            )


class PartRecord:
    """A part's results so far, rewritten with the report after every stage."""

    def __init__(self, name: str) -> None:
        self.path = RESULTS / f"extension-{name}.json"
        self.started = time.perf_counter()
        self.data: dict[str, Any] = {
            "run": {
                "commit": revision(),
                "machine": f"{platform.machine()}, {_cores()} cores",
                "command": "python -m bench.extension " + shlex.join(sys.argv[1:]),
            }
        }

    def add(self, **stages: Any) -> None:
        self.data.update(stages)
        self.data["run"]["finished"] = f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC"
        self.data["run"]["total_s"] = time.perf_counter() - self.started
        self.path.write_text(json.dumps(self.data, indent=1) + "\n")
        REPORT.write_text(render_report())


def _log_cell(cell: Any) -> None:
    log(f"  {label(cell.scaling)} @ {cell.length}: {cell.bits_per_token:.3f} bits/token")


def sweep_json(result: SweepResult) -> dict[str, Any]:
    return {**result.model_dump(mode="json"), "native_context": result.native_context}


def passkey_json(result: PasskeyResult) -> dict[str, Any]:
    return {
        **result.model_dump(mode="json"),
        "model": result.model,
        "chat": result.chat,
        "wall_s": result.wall_s,
    }


def save_zoo_plot(sweeps: Sequence[SweepResult]) -> list[str]:
    """One panel per zoo model: bits per token past the native context against length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = 5
    rows = -(-len(sweeps) // columns)
    figure, panels = plt.subplots(
        rows, columns, figsize=(4 * columns, 3.4 * rows), squeeze=False, sharey=True
    )
    for axes, result in zip(panels.flat, sweeps, strict=False):
        axes.set_prop_cycle(color=[plt.get_cmap("tab20")(index) for index in range(20)])  # 13 on zoo-rope
        names = list(dict.fromkeys(label(cell.scaling) for cell in result.cells))
        for name in names:
            cells = [
                c for c in result.cells if label(c.scaling) == name and c.tail_bits_per_token is not None
            ]
            axes.plot(
                [c.length for c in cells], [c.tail_bits_per_token for c in cells], marker=".", label=name
            )
        axes.set_xscale("log", base=2)
        axes.set_title(result.model, fontsize=10)
        axes.set_xlabel("length (tokens)")
        axes.grid(alpha=0.3)
        axes.legend(fontsize=6)
    for axes in panels[:, 0]:
        axes.set_ylabel("bits/token past 256")
    for axes in list(panels.flat)[len(sweeps) :]:
        axes.set_visible(False)
    figure.tight_layout()
    names = []
    for suffix in PLOT_FORMATS:
        path = RESULTS / f"extension-zoo-sweep{suffix}"
        figure.savefig(path)
        names.append(path.name)
    plt.close(figure)
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--part", choices=("zoo", "smollm2", "report"), required=True, help="report: redraw and rewrite only"
    )
    parser.add_argument(
        "--lengths", default=",".join(map(str, SMOLLM2_LENGTHS)), help="smollm2 sweep lengths"
    )
    parser.add_argument("--passkey-lengths", default=",".join(map(str, SMOLLM2_LENGTHS)))
    parser.add_argument("--gain-lengths", default="2048", help="smollm2 lengths timed both ways")
    parser.add_argument("--per-scaling", action="store_true", help="smollm2 sweep stages by scaling")
    parser.add_argument("--trials", type=int, default=1, help="smollm2 passkey keys per cell")
    args = parser.parse_args()
    if args.part == "zoo":
        asyncio.run(run_zoo(PartRecord("zoo")))
    elif args.part == "smollm2":
        lengths = (_ints(args.lengths), _ints(args.passkey_lengths), _ints(args.gain_lengths))
        asyncio.run(
            run_smollm2(PartRecord("smollm2"), *lengths, per_scaling=args.per_scaling, trials=args.trials)
        )
    else:
        replot()
    REPORT.write_text(render_report())
    print(REPORT.read_text())


def replot() -> None:
    """Redraw every part's plots from its JSON (after a change to the plots, without a rerun)."""
    for name in ("zoo", "smollm2"):
        path = RESULTS / f"extension-{name}.json"
        if not path.exists():
            continue
        part = json.loads(path.read_text())
        sweeps = [SweepResult.model_validate(sweep) for sweep in part.get("sweeps", [])]
        plots = save_zoo_plot(sweeps) if name == "zoo" else save_plots(sweeps[0], f"extension-{name}-sweep")
        if "passkey" in part:
            plots += save_plots(PasskeyResult.model_validate(part["passkey"]), f"extension-{name}-passkey")
        part["plots"] = plots
        path.write_text(json.dumps(part, indent=1) + "\n")


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def _cores() -> int:
    return len(os.sched_getaffinity(0))


# --- the report -------------------------------------------------------------------------------

SEEDS_CLAIMS = """\
The seeds' table (what the project set out to check), and the published orderings with no fine-tune:

| scaling | the seeds' claim |
|---|---|
| none (standard RoPE) | perplexity rises sharply past 1x |
| linear (PI) | a slight rise, usable at 2-4x |
| ntk (NTK-aware) | stable at 2-8x |
| yarn | the most stable, up to 32x |

Published, without fine-tuning: NTK-aware and dynamic NTK well ahead of PI, and unscaled RoPE
blowing up past the native context (bloc97's NTK-aware post; Peng et al., YaRN, 2023)."""


def render_report() -> str:
    parts = {
        name: json.loads(path.read_text())
        for name in ("zoo", "smollm2")
        if (path := RESULTS / f"extension-{name}.json").exists()
    }
    lines = [
        "# Context-extension lab: scaling sweeps and passkey retrieval",
        "",
        "Made by `make bench-extension` (`python -m bench.extension --part zoo`, then `--part smollm2`):",
        "each part starts a real `pe-serve` with its default flags and drives it with the SDK's",
        "`pe_client.async_sweep` / `async_passkey`. A cell is the mean of −log2 p over tokens 2..L of",
        "the first L tokens of `pydoc_data/topics.py` (one `/score`); *past native* is the same over",
        "the tokens beyond the model's native context.",
        "",
        SEEDS_CLAIMS,
    ]
    for name, title in (("smollm2", "SmolLM2-135M-Instruct (native 8192)"), ("zoo", "The zoo (native 256)")):
        if name in parts:
            lines += ["", f"## {title}", "", *_part_lines(parts[name])]
    return "\n".join(lines) + "\n"


def _part_lines(part: dict[str, Any]) -> list[str]:
    run = part["run"]
    lines = [
        f"Run {run['finished']} at `{run['commit']}`, {run['machine']}, {run['total_s'] / 60:.1f} min in all"
        f" (`{run['command']}`).",
        "",
    ]
    missing = [stage for stage in ("sweeps", "passkey") if stage not in part]
    if missing:
        lines += [f"**Reduced run** (see its command): no {', '.join(missing)} stage.", ""]
    for sweep in part.get("sweeps", []):
        lines += _sweep_lines(sweep)
    if "batching" in part:
        lines += _gain_lines(part["batching"])
    if "passkey" in part:
        lines += _passkey_lines(part["passkey"])
    lines += [f"![{name}]({name})" for name in part.get("plots", []) if name.endswith(".png")]
    lines.append("")
    return lines


def _gain_lines(gain: dict[str, Any]) -> list[str]:
    return [
        f"Batching gain ({gain['model']}, {gain['cells']} cells at lengths {gain['lengths']}, each its own"
        f" `/score`): all at once {gain['together_s']:.1f} s, one after another"
        f" {gain['one_after_another_s']:.1f} s: **{gain['gain']:.2f}x**. Largest difference between a"
        f" batched cell and the same cell scored alone: {gain['max_abs_diff_bits']:.2e} bits/token.",
        "",
    ]


def _sweep_lines(sweep: dict[str, Any]) -> list[str]:
    lengths = sorted({cell["length"] for cell in sweep["cells"]})
    rows: dict[str, dict[int, dict[str, Any]]] = {}
    for cell in sweep["cells"]:
        rows.setdefault(_label_json(cell["scaling"]), {})[cell["length"]] = cell
    header = "| scaling | " + " | ".join(f"{length}" for length in lengths) + " |"
    lines = [
        f"**{sweep['model']}**: bits/token over the prefix (past native {sweep['native_context']}),"
        f" {len(sweep['cells'])} cells in {sweep['wall_s']:.1f} s",
        "",
        header,
        "|---" * (len(lengths) + 1) + "|",
    ]
    for name, cells in rows.items():
        values = []
        for length in lengths:
            if length not in cells:  # a learned table unscaled (or stretched too little) stops short
                values.append("—")
                continue
            cell = cells[length]
            tail = cell["tail_bits_per_token"]
            values.append(f"{cell['bits_per_token']:.3f}" + ("" if tail is None else f" ({tail:.3f})"))
        lines.append(f"| {name} | " + " | ".join(values) + " |")
    return [*lines, ""]


def _passkey_lines(passkey: dict[str, Any]) -> list[str]:
    lengths = sorted({cell["length"] for cell in passkey["cells"]})
    how = "its chat template" if passkey["chat"] else "a completion prompt"
    lines = [
        f"Passkey retrieval on {passkey['model']} ({how}; keys found / asked), {passkey['wall_s']:.0f} s:",
        "",
        "| scaling | depth | " + " | ".join(map(str, lengths)) + " |",
        "|---|---" + "|---" * len(lengths) + "|",
    ]
    table: dict[tuple[str, float], dict[int, str]] = {}
    for cell in passkey["cells"]:
        key = (_label_json(cell["scaling"]), cell["depth"])
        table.setdefault(key, {})[cell["length"]] = f"{cell['correct']}/{cell['trials']}"
    for (name, depth), found in table.items():
        lines.append(f"| {name} | {depth:g} | " + " | ".join(found[length] for length in lengths) + " |")
    return [*lines, ""]


def _label_json(scaling: dict[str, Any]) -> str:
    return label(parse_scaling(scaling))


if __name__ == "__main__":
    main()
