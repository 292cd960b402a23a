"""How the lab's results are shown: terminal tables, a progress bar, and plots (`pe-client[plot]`).

matplotlib is imported only when a plot is asked for, so the SDK itself stays httpx + pydantic.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from pe_client.errors import PEServeError
from pe_client.grid import label
from pe_client.passkey import PasskeyResult
from pe_client.sweep import SweepCell, SweepResult

if TYPE_CHECKING:
    from matplotlib.axes import Axes

PLOT_SUFFIXES = (".png", ".svg")


class ProgressBar:
    """`[#####.....] 12/24 cells 31 s` redrawn in place on stderr; silent when not enabled."""

    WIDTH = 30

    def __init__(
        self, total: int, *, enabled: bool, unit: str = "cells", stream: TextIO | None = None
    ) -> None:
        self.total = total
        self.done = 0
        self._enabled = enabled
        self._unit = unit
        self._stream = stream if stream is not None else sys.stderr
        self._started = time.perf_counter()

    def advance(self, *_: object) -> None:
        self.done += 1
        if not self._enabled:
            return
        filled = self.WIDTH * self.done // max(1, self.total)
        elapsed = time.perf_counter() - self._started
        bar = "#" * filled + "." * (self.WIDTH - filled)
        self._stream.write(f"\r[{bar}] {self.done}/{self.total} {self._unit} {elapsed:.0f} s")
        if self.done >= self.total:
            self._stream.write("\n")
        self._stream.flush()


def sweep_table(result: SweepResult) -> str:
    """Bits per token, one row per scaling and one column per length; then the same past native."""
    lengths = sorted({cell.length for cell in result.cells})
    rows = _by_scaling(result)
    whole = _table(
        "bits/token", lengths, {name: [cell.bits_per_token for cell in cells] for name, cells in rows}
    )
    tail = _table(
        f"past {result.native_context}",
        lengths,
        {name: [cell.tail_bits_per_token for cell in cells] for name, cells in rows},
    )
    return (
        f"{result.model}: bits per token over each prefix "
        f"({len(result.cells)} cells, {result.wall_s:.1f} s)\n"
        f"{whole}\n\nover the tokens past the native context ({result.native_context}):\n{tail}"
    )


def passkey_table(result: PasskeyResult) -> str:
    """One block per scaling: depths down, lengths across, correct/trials in each cell."""
    lengths = sorted({cell.length for cell in result.cells})
    blocks = [
        f"{result.model}: passkey retrieval ({'chat template' if result.chat else 'completion prompt'})"
    ]
    scalings = list(dict.fromkeys(label(cell.scaling) for cell in result.cells))
    for name in scalings:
        cells = [cell for cell in result.cells if label(cell.scaling) == name]
        depths = list(dict.fromkeys(cell.depth for cell in cells))
        found = {(cell.depth, cell.length): f"{cell.correct}/{cell.trials}" for cell in cells}
        table = _table(
            "depth",
            lengths,
            {f"{depth:g}": [found[depth, length] for length in lengths] for depth in depths},
        )
        blocks.append(f"{name}:\n{table}")
    return "\n\n".join(blocks)


def _by_scaling(result: SweepResult) -> list[tuple[str, list[SweepCell]]]:
    """Each scaling's label and its cells by length, scalings in grid order."""
    names = list(dict.fromkeys(label(cell.scaling) for cell in result.cells))
    return [
        (name, sorted((c for c in result.cells if label(c.scaling) == name), key=lambda c: c.length))
        for name in names
    ]


def _table(corner: str, lengths: Sequence[int], rows: dict[str, Sequence[object]]) -> str:
    head = [corner, *map(str, lengths)]
    body = [[name, *map(_format, values)] for name, values in rows.items()]
    widths = [max(len(row[column]) for row in [head, *body]) for column in range(len(head))]
    lines = [head, ["-" * width for width in widths], *body]
    return "\n".join(
        "  ".join(
            cell.ljust(width) if index == 0 else cell.rjust(width)
            for index, (cell, width) in enumerate(zip(line, widths, strict=True))
        )
        for line in lines
    )


def _format(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def _pyplot() -> Any:
    """matplotlib's pyplot on the file-only backend; a clear error when the extra is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise PEServeError("plots need matplotlib: pip install 'pe-client[plot]'") from exc
    return plt


def check_plot_path(path: Path) -> None:
    """Refuse an unknown format before any request is sent, not after the sweep ran."""
    if path.suffix.lower() not in PLOT_SUFFIXES:
        raise PEServeError(f"--plot {path}: the format is chosen by the suffix, {' or '.join(PLOT_SUFFIXES)}")


def plot_sweep(result: SweepResult, path: Path) -> None:
    """Bits per token against length, one line per scaling: the whole prefix, and past native."""
    plt = _pyplot()
    figure, (whole, tail) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=False)
    for name, cells in _by_scaling(result):
        lengths = [cell.length for cell in cells]
        whole.plot(lengths, [cell.bits_per_token for cell in cells], marker="o", label=name)
        past = [
            (cell.length, cell.tail_bits_per_token) for cell in cells if cell.tail_bits_per_token is not None
        ]
        if past:
            tail.plot(*zip(*past, strict=True), marker="o", label=name)
    for axes, title in ((whole, "whole prefix"), (tail, f"tokens past native {result.native_context}")):
        _length_axis(axes, result.native_context)
        axes.set_title(f"{result.model}: {title}")
        axes.set_ylabel("bits per token")
    whole.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def plot_passkey(result: PasskeyResult, path: Path) -> None:
    """One heatmap per scaling: the share of keys found, depth down and length across."""
    plt = _pyplot()
    scalings = list(dict.fromkeys(label(cell.scaling) for cell in result.cells))
    lengths = sorted({cell.length for cell in result.cells})
    depths = list(dict.fromkeys(cell.depth for cell in result.cells))
    figure, panels = plt.subplots(
        1, len(scalings), figsize=(3.6 * len(scalings) + 1, 3.8), squeeze=False, layout="constrained"
    )
    image = None
    for axes, name in zip(panels[0], scalings, strict=True):
        share = {(c.depth, c.length): c.correct / c.trials for c in result.cells if label(c.scaling) == name}
        grid = [[share[depth, length] for length in lengths] for depth in depths]
        image = axes.imshow(grid, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
        axes.set_xticks(range(len(lengths)), [str(length) for length in lengths])
        axes.set_yticks(range(len(depths)), [f"{depth:g}" for depth in depths])
        axes.set_xlabel("length (tokens)")
        axes.set_ylabel("depth")
        axes.set_title(name)
        for row, depth in enumerate(depths):
            for column, length in enumerate(lengths):
                axes.text(column, row, f"{share[depth, length]:.0%}", ha="center", va="center", fontsize=8)
    figure.suptitle(f"{result.model}: passkey retrieval")
    if image is not None:
        figure.colorbar(image, ax=panels[0].tolist(), label="keys found")
    figure.savefig(path)
    plt.close(figure)


def _length_axis(axes: Axes, native: int) -> None:
    axes.set_xscale("log", base=2)
    axes.set_xlabel("length (tokens)")
    axes.axvline(native, color="grey", linestyle=":", linewidth=1)
    axes.grid(alpha=0.3)
