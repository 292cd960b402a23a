"""Extrapolation benchmark: held-out bits per byte against context length, per scheme and scaling.

`python -m bench.extrapolation` scores the same held-out stdlib text, cut into non-overlapping
windows of 256..4096 bytes, with every zoo model: each scheme without scaling, RoPE with every
scaling type, and the absolute schemes with position interpolation, all at factor = length / 256.
Windows go through `InferenceEngine.submit(ScoreRequest)`, the path behind `POST /score`, so a
refusal here (learned positions past their table) is the refusal a client gets.

Writes `bench/results/extrapolation.md` (tables and run details) and `extrapolation.png`.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import shlex
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch

from pe_runtime import RopeScaling
from service.engine.engine import InferenceEngine
from service.engine.errors import InvalidRequestError
from service.engine.types import ScoreRequest, ScoreResult
from service.model.config import Scheme
from training.corpus import consecutive_windows, load_corpus
from training.recipe import TRAINED_CONTEXT, ZOO_SCHEMES

LENGTHS = (256, 512, 1024, 2048, 4096)
# The tail is scored separately because a window's early positions see a short context whatever
# the window length: only its last positions show what the long context does to the model.
TAIL = 256
ROPE_SCALINGS = ("linear", "ntk", "dynamic", "yarn", "llama3")
RESULTS_DIR = Path("bench/results")


@dataclass(frozen=True)
class Setting:
    """One line of the benchmark: a zoo model and the scaling type it runs past 256 with."""

    scheme: Scheme
    scaling: str

    @property
    def label(self) -> str:
        return f"{self.scheme} / {self.scaling}"

    def rope_scaling(self, length: int, native_context: int) -> RopeScaling:
        """The scaling sent with a `length`-byte window: factor = length / trained context."""
        if self.scaling == "none":
            return RopeScaling()
        return RopeScaling.from_hf(
            {"rope_type": self.scaling, "factor": length / native_context},
            max_position_embeddings=native_context,
        )


SETTINGS = (
    *(Setting(scheme, "none") for scheme in ZOO_SCHEMES),
    *(Setting("rope", scaling) for scaling in ROPE_SCALINGS),
    Setting("sinusoidal", "linear"),
    Setting("learned", "linear"),
)


@dataclass(frozen=True)
class Cell:
    """Bits per byte over the last `TAIL` positions and over all positions, or why it could not run."""

    tail_bits: float | None = None
    all_bits: float | None = None
    refusal: str | None = None


Results = dict[Setting, dict[int, Cell]]


def score_window(
    engine: InferenceEngine, model: str, window: Sequence[int], scaling: RopeScaling
) -> list[float]:
    """Log-probabilities (nats) of tokens 1..L-1 of one window, from one `/score`-style request."""
    request = ScoreRequest(request_id=uuid.uuid4().hex, model=model, tokens=tuple(window), scaling=scaling)
    final = list(engine.submit(request))[-1]
    if not isinstance(final, ScoreResult):
        raise TypeError(f"a score request ended with {type(final).__name__}, not a ScoreResult")
    return [value for value in final.token_logprobs[1:] if value is not None]


def measure(engine: InferenceEngine, setting: Setting, windows: torch.Tensor) -> Cell:
    """Score every window `[N, L]` of one length under one setting."""
    model = engine.resolve_model(None, setting.scheme)
    scaling = setting.rope_scaling(windows.shape[1], model.native_context)
    try:
        logprobs = torch.tensor(
            [score_window(engine, model.name, window.tolist(), scaling) for window in windows]
        )
    except InvalidRequestError as refusal:
        return Cell(refusal=refusal.message)
    bits = -logprobs / math.log(2.0)  # [N, L - 1]
    return Cell(tail_bits=bits[:, -TAIL:].mean().item(), all_bits=bits.mean().item())


def run(engine: InferenceEngine, stream: torch.Tensor, lengths: Sequence[int]) -> Results:
    """Every setting at every length; progress goes to stderr because a full run takes minutes."""
    results: Results = {}
    for setting in SETTINGS:
        results[setting] = {}
        for length in lengths:
            started = time.perf_counter()
            cell = measure(engine, setting, consecutive_windows(stream, length))
            results[setting][length] = cell
            shown = "refused" if cell.refusal else f"{cell.tail_bits:.3f} / {cell.all_bits:.3f}"
            print(
                f"{setting.label:22} {length:5}  {shown}  ({time.perf_counter() - started:.0f}s)",
                file=sys.stderr,
            )
    return results


def markdown_table(
    results: Results, lengths: Sequence[int], value: str, *, change: bool = False
) -> list[str]:
    """One row per setting, one column per length; refused cells read "refused" (see notes).

    With `change`, cells show the difference from the setting's value at the first length, which
    is how much running past the trained context cost.
    """
    lines = ["| scheme / scaling | " + " | ".join(str(length) for length in lengths) + " |"]
    lines.append("|---|" + "---:|" * len(lengths))
    for setting, cells in results.items():
        baseline = getattr(cells[lengths[0]], value) if change else 0.0
        shown = []
        for length in lengths:
            bits = getattr(cells[length], value)
            if bits is None or baseline is None:
                shown.append("refused")
            else:
                shown.append(f"{bits - baseline:+.3f}" if change else f"{bits:.3f}")
        lines.append(f"| {setting.label} | " + " | ".join(shown) + " |")
    return lines


def refusals(results: Results) -> list[str]:
    """The engine's own words for each refused cell (one example per setting)."""
    notes = []
    for setting, cells in results.items():
        refused = [length for length, cell in cells.items() if cell.refusal]
        if refused:
            message = cells[refused[0]].refusal
            notes.append(f"- `{setting.label}` at {', '.join(map(str, refused))}: not runnable: {message}")
    return notes


def machine_description() -> str:
    cpu = platform.processor() or "unknown CPU"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [
            line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if "model name" in line
        ]
        cpu = names[0] if names else cpu
    return f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}"


def render_markdown(
    results: Results, lengths: Sequence[int], tokens: int, seconds: float, command: str
) -> str:
    lines = [
        "# Extrapolation: held-out bits per byte vs. context length",
        "",
        f"Zoo models trained at {TRAINED_CONTEXT} bytes; scaled settings use factor = length / "
        f"{TRAINED_CONTEXT}.",
        f"Text: the first {tokens} tokens of the held-out stdlib split, cut into non-overlapping windows of",
        "exactly each length, each window scored in one forward pass through the engine's `/score` path.",
        "Lower is better.",
        "",
        f"## Last {TAIL} positions of each window",
        "",
        *markdown_table(results, lengths, "tail_bits"),
        "",
        f"## Change from {lengths[0]}, last {TAIL} positions",
        "",
        *markdown_table(results, lengths, "tail_bits", change=True),
        "",
        "## All positions",
        "",
        *markdown_table(results, lengths, "all_bits"),
        "",
        "## Not runnable",
        "",
        *(refusals(results) or ["- none"]),
        "",
        "## Run",
        "",
        f"- command: `{command}`",
        f"- machine: {machine_description()}, torch threads {torch.get_num_threads()}",
        f"- torch {torch.__version__}, Python {platform.python_version()}",
        f"- wall time: {seconds:.0f} s",
        "",
    ]
    return "\n".join(lines)


def plot(results: Results, lengths: Sequence[int], path: Path) -> None:
    """Two panels (tail, all positions), one line per setting; refused points are left out."""
    figure, axes = plt.subplots(1, 2, figsize=(13, 5.5), sharey=True)
    colours = {scheme: f"C{index}" for index, scheme in enumerate(ZOO_SCHEMES)}
    styles = {
        "none": "-",
        "linear": "--",
        "ntk": ":",
        "dynamic": "-.",
        "yarn": (0, (5, 1)),
        "llama3": (0, (1, 3)),
    }
    for axis, value, title in (
        (axes[0], "tail_bits", f"last {TAIL} positions"),
        (axes[1], "all_bits", "all positions"),
    ):
        for setting, cells in results.items():
            points = [(length, getattr(cells[length], value)) for length in lengths]
            points = [(length, bits) for length, bits in points if bits is not None]
            if points:
                xs, ys = zip(*points, strict=True)
                axis.plot(
                    xs,
                    ys,
                    marker="o",
                    color=colours[setting.scheme],
                    linestyle=styles[setting.scaling],
                    label=setting.label,
                )
        axis.set_xscale("log", base=2)
        axis.set_xticks(list(lengths), [str(length) for length in lengths])
        axis.set_xlabel("context length (bytes)")
        axis.set_title(title)
        axis.grid(True, alpha=0.3)
    axes[0].set_ylabel("held-out bits per byte")
    axes[1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    figure.suptitle(f"Zoo models trained at {TRAINED_CONTEXT} bytes")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models-dir", type=Path, default=Path("models"))
    parser.add_argument("--tokens", type=int, default=16384, help="held-out tokens scored at every length")
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    parser.add_argument("--threads", type=int, default=1, help="torch threads; 1 is fastest on a busy CPU")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    stream = load_corpus().held_out[: args.tokens]
    engine = InferenceEngine.from_model_dirs(
        [args.models_dir / f"zoo-{scheme}" for scheme in ZOO_SCHEMES],
        device="cpu",
        max_context=max(args.lengths),
    )
    engine.start()
    started = time.perf_counter()
    try:
        results = run(engine, stream, args.lengths)
    finally:
        engine.shutdown()
    command = shlex.join(
        ["python", "-m", "bench.extrapolation", *(argv if argv is not None else sys.argv[1:])]
    )
    args.out.mkdir(parents=True, exist_ok=True)
    markdown = render_markdown(results, args.lengths, stream.numel(), time.perf_counter() - started, command)
    (args.out / "extrapolation.md").write_text(markdown)
    plot(results, args.lengths, args.out / "extrapolation.png")


if __name__ == "__main__":
    main()
