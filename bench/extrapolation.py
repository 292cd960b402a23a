"""Extrapolation benchmark: held-out bits per byte against context length, per scheme and scaling.

`python -m bench.extrapolation` scores the same held-out stdlib text, cut into non-overlapping
windows of 256..4096 bytes, with every zoo model: each scheme without scaling, RoPE with every
scaling type, the absolute schemes with position interpolation, Transformer-XL with interpolated
relative distances and RoPE + ALiBi with dynamic NTK, all at factor = length / 256.
Windows go through `InferenceEngine.submit(ScoringRequest)`, the path behind `POST /score`, so a
refusal here (learned positions past their table) is the refusal a client gets.

Writes `bench/results/extrapolation.md` (tables and run details) and `extrapolation.png`.

The training-side members are scored by `bench.extrapolation_training`, with this module's parts.
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
from service.engine.types import ScoreResult, ScoringRequest
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
    """One line of the benchmark: a zoo model and the scaling type it runs past 256 with.

    `factor_multiplier` and `overrides` (transformers field names) describe the ablations that
    test why NTK and YaRN, whose defaults were tuned for contexts of thousands of tokens, do
    less well at a 256-byte trained context than their papers report.

    `model` names the model when the scheme alone would not pick it (the training-side members
    all use `rope`), and `fixed_factor` replaces length / trained context by the one factor a
    fine-tune was trained with.
    """

    scheme: Scheme
    scaling: str
    factor_multiplier: float = 1.0
    overrides: tuple[tuple[str, float], ...] = ()
    model: str | None = None
    fixed_factor: float | None = None

    @property
    def label(self) -> str:
        changes = [f"factor x{self.factor_multiplier:g}"] if self.factor_multiplier != 1.0 else []
        changes += [f"{field}={value:g}" for field, value in self.overrides]
        fixed = f" x{self.fixed_factor:g}" if self.fixed_factor is not None else ""
        scaled = f"{self.model or self.scheme} / {self.scaling}{fixed}"
        return scaled + (f" ({', '.join(changes)})" if changes else "")

    def rope_scaling(self, length: int, native_context: int) -> RopeScaling:
        """The scaling sent with a `length`-byte window: factor = length / trained context, or fixed."""
        if self.scaling == "none":
            return RopeScaling()
        factor = self.fixed_factor or self.factor_multiplier * length / native_context
        return RopeScaling.from_hf(
            {
                "rope_type": self.scaling,
                "factor": factor,
                **dict(self.overrides),
            },
            max_position_embeddings=native_context,
        )


_CANDIDATES = (
    *(Setting(scheme, "none") for scheme in ZOO_SCHEMES),
    *(Setting("rope", scaling) for scaling in ROPE_SCALINGS),
    Setting("sinusoidal", "linear"),
    Setting("learned", "linear"),
    # Transformer-XL's one scaling interpolates its relative distances; RoPE + ALiBi's RoPE half
    # takes RoPE's scalings, of which dynamic NTK is the one that needs no tuning.
    Setting("transformer_xl", "linear"),
    Setting("rope_alibi", "dynamic"),
    # beta_fast counts rotations over the trained context: 32 of them in 256 bytes leaves only
    # wavelengths under 8 unscaled, where a 4k-token model keeps everything under 128.
    Setting("rope", "yarn", overrides=(("beta_fast", 8.0),)),
    # Static NTK at factor = length / 256 still stretches the middle channels past the angles
    # seen in training; a larger factor moves them back inside.
    Setting("rope", "ntk", factor_multiplier=4.0),
)
# Only the zoo's bundled members can be scored.
SETTINGS = tuple(setting for setting in _CANDIDATES if setting.scheme in ZOO_SCHEMES)


@dataclass(frozen=True)
class Cell:
    """Bits per byte over the last `TAIL` positions and over all positions, or why it could not run.

    `tail_bits_short` scores the same bytes as `tail_bits` in the shortest windows: the tails of
    different lengths fall on different text, so only this pairing isolates the effect of the
    longer context from how hard those particular bytes are.
    """

    tail_bits: float | None = None
    all_bits: float | None = None
    tail_bits_short: float | None = None
    refusal: str | None = None

    @property
    def tail_change(self) -> float | None:
        if self.tail_bits is None or self.tail_bits_short is None:
            return None
        return self.tail_bits - self.tail_bits_short


Results = dict[Setting, dict[int, Cell]]


def score_window(
    engine: InferenceEngine, model: str, window: Sequence[int], scaling: RopeScaling
) -> list[float]:
    """Log-probabilities (nats) of tokens 1..L-1 of one window, from one `/score`-style request."""
    request = ScoringRequest(request_id=uuid.uuid4().hex, model=model, tokens=tuple(window), scaling=scaling)
    final = list(engine.submit(request))[-1]
    if not isinstance(final, ScoreResult):
        raise TypeError(f"a score request ended with {type(final).__name__}, not a ScoreResult")
    return [value for value in final.token_logprobs[1:] if value is not None]


def score_bits(engine: InferenceEngine, setting: Setting, windows: torch.Tensor) -> torch.Tensor:
    """Bits for tokens 1..L-1 of every window `[N, L]` under one setting, `[N, L - 1]`.

    Raises the engine's InvalidRequestError when the setting cannot run at this length.
    """
    model = engine.resolve_model(setting.model, setting.scheme)
    scaling = setting.rope_scaling(windows.shape[1], model.native_context)
    logprobs = torch.tensor(
        [score_window(engine, model.name, window.tolist(), scaling) for window in windows]
    )
    return -logprobs / math.log(2.0)


def summarise(bits: torch.Tensor, shortest: torch.Tensor | None) -> Cell:
    """A cell from `bits` `[N, L - 1]` and the same text's `shortest` window bits `[M, S - 1]`.

    Windows of every length start at the same offset, so the last S bytes of long window j are
    short window (j + 1) * L / S - 1; its S - 1 scored bytes stand in for the tail's S.
    """
    tail_bits_short = None
    if shortest is not None:
        per_window = (bits.shape[1] + 1) // (shortest.shape[1] + 1)
        tail_bits_short = shortest[per_window - 1 :: per_window][: bits.shape[0]].mean().item()
    return Cell(bits[:, -TAIL:].mean().item(), bits.mean().item(), tail_bits_short)


def run(
    engine: InferenceEngine,
    stream: torch.Tensor,
    lengths: Sequence[int],
    settings: Sequence[Setting] = SETTINGS,
) -> Results:
    """Every setting at every length (shortest first, multiples of it, all cut from `stream`).

    Progress goes to stderr because a full run takes minutes.
    """
    results: Results = {}
    for setting in settings:
        results[setting] = {}
        shortest: torch.Tensor | None = None
        for length in lengths:
            started = time.perf_counter()
            try:
                bits = score_bits(engine, setting, consecutive_windows(stream, length))
            except InvalidRequestError as refusal:
                cell = Cell(refusal=refusal.message)
            else:
                shortest = bits if length == lengths[0] else shortest
                cell = summarise(bits, shortest)
            results[setting][length] = cell
            shown = "refused" if cell.refusal else f"{cell.tail_bits:.3f} / {cell.all_bits:.3f}"
            print(
                f"{setting.label:22} {length:5}  {shown}  ({time.perf_counter() - started:.0f}s)",
                file=sys.stderr,
            )
    return results


def markdown_table(
    results: Results, lengths: Sequence[int], value: str, *, signed: bool = False
) -> list[str]:
    """One row per setting, one column per length, cells the `Cell` attribute `value`.

    Refused cells read "refused" (the notes below the tables quote the engine's reason).
    """
    lines = ["| scheme / scaling | " + " | ".join(str(length) for length in lengths) + " |"]
    lines.append("|---|" + "---:|" * len(lengths))
    for setting, cells in results.items():
        shown = []
        for length in lengths:
            bits = getattr(cells[length], value)
            shown.append("refused" if bits is None else f"{bits:+.3f}" if signed else f"{bits:.3f}")
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


ZOO_INTRO = (
    f"Zoo models trained at {TRAINED_CONTEXT} bytes; scaled settings use factor = length / {TRAINED_CONTEXT}."
)


def render_markdown(
    results: Results,
    lengths: Sequence[int],
    tokens: int,
    seconds: float,
    command: str,
    intro: str = ZOO_INTRO,
) -> str:
    lines = [
        "# Extrapolation: held-out bits per byte vs. context length",
        "",
        intro,
        f"Text: the first {tokens} tokens of the held-out stdlib split, cut into non-overlapping windows of",
        "exactly each length, each window scored in one forward pass through the engine's `/score` path.",
        "Lower is better.",
        "",
        f"## Last {TAIL} positions of each window",
        "",
        *markdown_table(results, lengths, "tail_bits"),
        "",
        f"## Last {TAIL} positions: change against the same bytes scored in {lengths[0]}-byte windows",
        "",
        "Negative: the longer context helped; positive: running past the trained context hurt.",
        "",
        *markdown_table(results, lengths, "tail_change", signed=True),
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


def spread_colour(index: int, colours: int) -> int:
    """tab20 pairs a dark and a light shade per hue: take every dark one first, then the light."""
    return (2 * index) % colours + (2 * index) // colours


def plot(results: Results, lengths: Sequence[int], path: Path, heading: str | None = None) -> None:
    """Three panels (tail, tail change, all positions), one line per setting; refusals left out."""
    figure, axes = plt.subplots(1, 3, figsize=(19, 5.5))
    palette = plt.get_cmap("tab20")
    panels = (
        ("tail_bits", f"last {TAIL} positions: bits per byte"),
        ("tail_change", f"last {TAIL} positions: change vs. same bytes at {lengths[0]}"),
        ("all_bits", "all positions: bits per byte"),
    )
    for axis, (value, title) in zip(axes, panels, strict=True):
        for index, (setting, cells) in enumerate(results.items()):
            points = [(length, getattr(cells[length], value)) for length in lengths]
            points = [(length, bits) for length, bits in points if bits is not None]
            if points:
                xs, ys = zip(*points, strict=True)
                axis.plot(
                    xs,
                    ys,
                    marker="o",
                    color=palette(spread_colour(index, palette.N)),
                    linestyle="-" if setting.scaling == "none" else "--",
                    label=setting.label,
                )
        axis.set_xscale("log", base=2)
        axis.set_xticks(list(lengths), [str(length) for length in lengths])
        axis.set_xlabel("context length (bytes)")
        axis.set_title(title)
        axis.grid(True, alpha=0.3)
    axes[0].set_ylabel("held-out bits per byte")
    axes[-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    figure.suptitle(heading or f"Zoo models trained at {TRAINED_CONTEXT} bytes")
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
