"""PI against YaRN fine-tuning: held-out loss at 1024 bytes against steps, and what each run cost.

`python -m bench.extension_training` reads the training logs of the training-side members
(`models/zoo-rope-*/training_log.csv` and `training.json`, written by `training.extend`) and
writes `bench/results/extension_training.md` and `extension_training.png`.

The seeds claim that YaRN needs only a few hundred fine-tuning steps where PI needs more. Both
fine-tunes here follow one schedule and log the same held-out windows at 1024 bytes under their
own x4 scaling every few steps, so the claim becomes a number: for a loss both runs reach, the
first logged step at which each reaches it, and their ratio.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from training.extension import METHODS, Stage, recipe, rope_scaling

RESULTS_DIR = Path("bench/results")
# Loss levels compared: the one both runs reach at their end, and a few easier ones above it.
MARGINS = (0.0, 0.05, 0.1, 0.2, 0.4)
SETTLING = (0.02, 0.05, 0.1, 0.2)


@dataclass(frozen=True)
class Curve:
    """A member's logged held-out loss: (step, bits per byte) pairs, step 0 being the start."""

    name: str
    points: tuple[tuple[int, float], ...]

    @property
    def final(self) -> float:
        return self.points[-1][1]

    def first_step_at(self, loss: float) -> int | None:
        """The first logged step whose loss is at most `loss`; None if the run never got there."""
        return next((step for step, bits in self.points if bits <= loss), None)


def read_curve(directory: Path) -> Curve:
    with (directory / "training_log.csv").open() as log_file:
        rows = [row for row in csv.DictReader(log_file) if row["eval_bits_per_byte"]]
    return Curve(directory.name, tuple((int(row["step"]), float(row["eval_bits_per_byte"])) for row in rows))


def steps_table(pi: Curve, yarn: Curve) -> tuple[list[str], float | None]:
    """Markdown rows (loss, PI steps, YaRN steps, ratio) and the ratio at the loss both reach."""
    common = max(pi.final, yarn.final)
    lines = [
        "| held-out loss at 1024 (bits/byte) | PI steps | YaRN steps | PI / YaRN |",
        "|---:|---:|---:|---:|",
    ]
    headline = None
    for margin in MARGINS:
        loss = common + margin
        pi_steps, yarn_steps = pi.first_step_at(loss), yarn.first_step_at(loss)
        ratio = ratio_text(pi_steps, yarn_steps)
        if margin == 0.0 and pi_steps and yarn_steps:
            headline = pi_steps / yarn_steps
        lines.append(f"| {loss:.3f} | {steps_text(pi_steps)} | {steps_text(yarn_steps)} | {ratio} |")
    return lines, headline


def settling_table(curves: Sequence[Curve]) -> list[str]:
    """Steps each run needs to come within a margin of its own final loss: how fast it settles."""
    lines = ["| run | final loss | " + " | ".join(f"within {margin:g}" for margin in SETTLING) + " |"]
    lines.append("|---|---:|" + "---:|" * len(SETTLING))
    for curve in curves:
        steps = [steps_text(curve.first_step_at(curve.final + margin)) for margin in SETTLING]
        lines.append(f"| {curve.name} | {curve.final:.3f} | " + " | ".join(steps) + " |")
    return lines


def steps_text(steps: int | None) -> str:
    return "never" if steps is None else "0 (at the start)" if steps == 0 else str(steps)


def ratio_text(pi_steps: int | None, yarn_steps: int | None) -> str:
    if pi_steps is None or yarn_steps is None:
        return "n/a"
    if yarn_steps == 0:
        return "YaRN needs none" if pi_steps else "both need none"
    return f"{pi_steps / yarn_steps:.2f}"


def cost_rows(records: Sequence[dict[str, Any]]) -> list[str]:
    lines = [
        "| member | method | steps | tokens | wall time (s) | threads | held-out at start | at end "
        "| command |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for record in records:
        start = record["initial_eval_bits_per_byte"]
        lines.append(
            f"| {record['name']} | {record['method']} | {record['steps']} | {record['tokens']:,} | "
            f"{record['seconds']:.0f} | {record['threads']} | "
            f"{'-' if start is None else f'{start:.3f}'} | {record['final_eval_bits_per_byte']:.3f} "
            f"(at {record['eval_context']}) | `{record['command']}` |"
        )
    return lines


def render(pi: Curve, yarn: Curve, records: Sequence[dict[str, Any]]) -> str:
    table, headline = steps_table(pi, yarn)
    measured = (
        f"**measured PI / YaRN = {headline:.2f}** at {max(pi.final, yarn.final):.3f} bits per byte"
        if headline is not None
        else "no ratio at the common loss: one run already starts there (see the table)"
    )
    pi_record = next(record for record in records if record["method"] == "pi-ft")
    return "\n".join(
        [
            "# PI against YaRN fine-tuning: steps to the same loss at 1024 bytes",
            "",
            "Both fine-tune `zoo-rope` (trained at 256 bytes) on one schedule: "
            + ", then ".join(stage_text(Stage(**stage)) for stage in pi_record["stages"])
            + f", AdamW at a constant {pi_record['peak_lr']:g} after {pi_record['warmup_steps']} warm-up "
            f"steps. Every {pi.points[2][0] - pi.points[1][0]} steps each scores the same "
            f"{pi_record['eval_windows']} held-out windows of 1024 bytes under its final x4 scaling; "
            "step 0 is the inference-time scaling alone.",
            "",
            "The seeds' claim: YaRN needs only a few hundred fine-tuning steps where PI needs more. "
            f"Here: {measured}.",
            "",
            *table,
            "",
            "A loss row reads: the first logged step at which each run scored at most that loss.",
            "",
            "How fast each settles: the first logged step within a margin of its own final loss.",
            "",
            *settling_table((pi, yarn)),
            "",
            "## Training runs",
            "",
            *cost_rows(records),
            "",
            "Wall times are on the shared 2-core development machine under `nice -n 19`, beside other "
            "work, with one torch thread per run and runs side by side: they show what the runs cost "
            "there, not what the recipes cost on a quiet machine.",
            "",
        ]
    )


def stage_text(stage: Stage) -> str:
    factor = rope_scaling(stage.scaling).factor
    return f"{stage.steps} steps of {stage.batch_size} x {stage.context} bytes at x{factor:g}"


def plot(curves: Sequence[Curve], path: Path, stage_ends: Sequence[int] = ()) -> None:
    """One loss curve per run; dotted lines where a stage ends and the context grows."""
    figure, axis = plt.subplots(figsize=(8, 5))
    for end in stage_ends:
        axis.axvline(end, color="grey", linestyle=":", linewidth=1)
    for curve in curves:
        steps, bits = zip(*curve.points, strict=True)
        axis.plot(steps, bits, marker="o", markersize=3, label=curve.name)
    axis.set_xlabel("fine-tuning step")
    axis.set_ylabel("held-out bits per byte at 1024 (own x4 scaling)")
    axis.set_title("PI vs YaRN fine-tuning of zoo-rope to 1024 bytes")
    low = min(bits for curve in curves for _, bits in curve.points)
    high = max(bits for curve in curves for _, bits in curve.points)
    axis.set_ylim(low - 0.1, min(high, low + 3.0) + 0.1 if math.isfinite(high) else None)
    axis.grid(True, alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models-dir", type=Path, default=Path("models"))
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    directories = [args.models_dir / recipe(method).name for method in METHODS]
    records = [json.loads((directory / "training.json").read_text()) for directory in directories]
    pi, yarn = (read_curve(args.models_dir / recipe(method).name) for method in ("pi-ft", "yarn-ft"))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "extension_training.md").write_text(render(pi, yarn, records))
    pi_stages = next(record["stages"] for record in records if record["method"] == "pi-ft")
    ends = list(itertools.accumulate(stage["steps"] for stage in pi_stages))[:-1]
    plot([pi, yarn], args.out / "extension_training.png", ends)


if __name__ == "__main__":
    main()
