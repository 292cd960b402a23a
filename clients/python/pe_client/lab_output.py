"""How the lab's results are shown: terminal tables, a progress bar, and plots (`pe-client[plot]`).

matplotlib is imported only when a plot is asked for, so the SDK itself stays httpx + pydantic.
"""

from __future__ import annotations

import math
import sys
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO, TypeVar

from pe_client.errors import PEServeError
from pe_client.grid import configuration_label
from pe_client.passkey import PasskeyCell, PasskeyResult
from pe_client.ruler import RulerCell, RulerResult
from pe_client.sweep import SweepCell, SweepResult

if TYPE_CHECKING:
    from matplotlib.axes import Axes

PLOT_SUFFIXES = (".png", ".svg")
HEATMAPS_PER_LINE = 4  # panels of passkey and RULER plots side by side, before the next line
TITLE_WIDTH = 34  # characters of a panel's title (a configuration's label) a line
_Cell = TypeVar("_Cell", PasskeyCell, RulerCell, SweepCell)


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
    """Bits per token, one row per configuration and one column per length; then the same over the
    tokens past the native context, when some length passes it (else there is nothing to show)."""
    lengths = sorted({cell.length for cell in result.cells})
    rows = _by_length(result)
    whole = _table(
        "bits/token", lengths, {name: [cell.bits_per_token for cell in cells] for name, cells in rows}
    )
    head = (
        f"{result.model}: bits per token over each prefix "
        f"({len(result.cells)} cells, {result.wall_s:.1f} s)\n{whole}"
    )
    past = [length for length in lengths if length > result.native_context]
    if not past:
        return head
    tail = _table(
        f"past {result.native_context}",
        past,
        {
            name: [cell.tail_bits_per_token for cell in cells if cell.length > result.native_context]
            for name, cells in rows
        },
    )
    return f"{head}\n\nover the tokens past the native context ({result.native_context}):\n{tail}"


def passkey_table(result: PasskeyResult) -> str:
    """One block per configuration: depths down, lengths across, correct/trials and the 95%
    interval of the share found in each cell."""
    lengths = sorted({cell.length for cell in result.cells})
    blocks = [
        f"{result.model}: passkey retrieval ({'chat template' if result.chat else 'completion prompt'})"
    ]
    for name, cells in _by_configuration(result.cells):
        depths = list(dict.fromkeys(cell.depth for cell in cells))
        found = {(cell.depth, cell.length): _found(cell) for cell in cells}
        table = _table(
            "depth",
            lengths,
            {f"{depth:g}": [found[depth, length] for length in lengths] for depth in depths},
        )
        blocks.append(f"{name}:\n{table}")
    return "\n\n".join(blocks)


def ruler_table(result: RulerResult) -> str:
    """One block per configuration: tasks down, lengths across, the mean score in each cell."""
    lengths = sorted({cell.length for cell in result.cells})
    samples = max(cell.samples for cell in result.cells)
    blocks = [
        f"{result.model}: RULER, {samples} samples per cell "
        f"({'chat template' if result.chat else 'completion prompt'}, {result.wall_s:.1f} s)"
    ]
    for name, cells in _by_configuration(result.cells):
        score = {(cell.task, cell.length): cell.score for cell in cells}
        tasks = list(dict.fromkeys(cell.task for cell in cells))
        table = _table("task", lengths, {task: [score[task, length] for length in lengths] for task in tasks})
        blocks.append(f"{name}:\n{table}")
    return "\n\n".join(blocks)


def _found(cell: PasskeyCell) -> str:
    return f"{cell.correct}/{cell.trials} ({_percents(cell.interval)})"


def _by_configuration(cells: Sequence[_Cell]) -> list[tuple[str, list[_Cell]]]:
    """Each configuration's label and its cells, configurations in grid order."""
    groups: dict[str, list[_Cell]] = {}
    for cell in cells:
        groups.setdefault(configuration_label((cell.scaling, cell.attention)), []).append(cell)
    return list(groups.items())


def _by_length(result: SweepResult) -> list[tuple[str, list[SweepCell]]]:
    """Each configuration's label and its cells by length, configurations in grid order."""
    return [
        (name, sorted(cells, key=lambda cell: cell.length)) for name, cells in _by_configuration(result.cells)
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
    """Bits per token against length, one line per configuration: the whole prefix, and past native.

    Only panels with data are drawn: without a length past the native context there is no tail
    figure, and the plot is the whole-prefix panel alone.
    """
    plt = _pyplot()
    rows = _by_length(result)
    panels = [
        (
            "whole prefix",
            [(name, [(cell.length, cell.bits_per_token) for cell in cells]) for name, cells in rows],
        ),
        (
            f"tokens past native {result.native_context}",
            [
                (
                    name,
                    [(c.length, c.tail_bits_per_token) for c in cells if c.tail_bits_per_token is not None],
                )
                for name, cells in rows
            ],
        ),
    ]
    drawn = [(title, lines) for title, lines in panels if any(points for _, points in lines)]
    figure, axes_row = plt.subplots(1, len(drawn), figsize=(6 * len(drawn), 4.5), squeeze=False)
    for axes, (title, lines) in zip(axes_row[0], drawn, strict=True):
        for name, points in lines:
            if points:
                axes.plot(*zip(*points, strict=True), marker="o", label=name)
        _length_axis(axes, result.native_context)
        axes.set_title(f"{result.model}: {title}")
        axes.set_ylabel("bits per token")
    axes_row[0][0].legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def plot_passkey(result: PasskeyResult, path: Path) -> None:
    """One heatmap per configuration: the share of keys found, depth down and length across, each
    cell annotated with its 95% interval."""
    lengths = sorted({cell.length for cell in result.cells})
    depths = list(dict.fromkeys(cell.depth for cell in result.cells))
    panels = []
    for name, cells in _by_configuration(result.cells):
        # Results merged from separate runs may cover different lengths: a cell a configuration
        # lacks is blank, as in `plot_ruler`.
        by_place = {(cell.depth, cell.length): cell for cell in cells}
        grid = [[by_place.get((depth, length)) for length in lengths] for depth in depths]
        panels.append(
            (
                name,
                [[math.nan if cell is None else cell.correct / cell.trials for cell in row] for row in grid],
                [["—" if cell is None else _passkey_text(cell) for cell in line] for line in grid],
            )
        )
    _heatmaps(
        panels,
        path,
        title=f"{result.model}: passkey retrieval (95% Wilson intervals)",
        rows=("depth", [f"{depth:g}" for depth in depths]),
        columns=[str(length) for length in lengths],
        colorbar="keys found",
    )


def _passkey_text(cell: PasskeyCell) -> str:
    return f"{cell.correct / cell.trials:.0%}\n{_percents(cell.interval)}"


def plot_ruler(result: RulerResult, path: Path) -> None:
    """One heatmap per configuration: the mean score, task down and length across."""
    lengths = sorted({cell.length for cell in result.cells})
    tasks = list(dict.fromkeys(cell.task for cell in result.cells))
    panels = []
    for name, cells in _by_configuration(result.cells):
        # Groups run apart may cover different lengths: a cell a configuration lacks is blank.
        score = {(cell.task, cell.length): cell.score for cell in cells}
        grid = [[score.get((task, length), math.nan) for length in lengths] for task in tasks]
        texts = [["—" if math.isnan(value) else f"{value:.0%}" for value in row] for row in grid]
        panels.append((name, grid, texts))
    _heatmaps(
        panels,
        path,
        title=f"{result.model}: RULER",
        rows=("task", tasks),
        columns=[str(length) for length in lengths],
        colorbar="score (string_match_all)",
    )


def _percents(interval: tuple[float, float]) -> str:
    low, high = interval
    return f"{low:.0%}-{high:.0%}"


def _heatmaps(
    panels: Sequence[tuple[str, list[list[float]], list[list[str]]]],
    path: Path,
    *,
    title: str,
    rows: tuple[str, Sequence[str]],
    columns: Sequence[str],
    colorbar: str,
) -> None:
    """Heatmaps of shares (0..1), one per (name, values, cell texts), lengths across; at most
    `HEATMAPS_PER_LINE` a line, so that a grid of many configurations stays readable (eight in one
    line ran their titles into each other)."""
    plt = _pyplot()
    row_name, row_labels = rows
    across = max(1, min(len(panels), HEATMAPS_PER_LINE))
    lines = max(1, math.ceil(len(panels) / across))
    figure, grid = plt.subplots(
        lines,
        across,
        figsize=(3.6 * across + 1, 0.6 + lines * (0.9 + 0.45 * max(len(row_labels), 6))),
        squeeze=False,
        layout="constrained",
    )
    drawn = list(grid.ravel()[: len(panels)])
    for unused in grid.ravel()[len(panels) :]:
        figure.delaxes(unused)
    image = None
    for axes, (name, values, texts) in zip(drawn, panels, strict=True):
        image = axes.imshow(values, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
        axes.set_xticks(range(len(columns)), list(columns))
        axes.set_yticks(range(len(row_labels)), list(row_labels))
        axes.set_xlabel("length (tokens)")
        axes.set_ylabel(row_name)
        axes.set_title("\n".join(textwrap.wrap(name, TITLE_WIDTH)), fontsize="medium")
        for row, line in enumerate(texts):
            for column, text in enumerate(line):
                axes.text(column, row, text, ha="center", va="center", fontsize=7)
    figure.suptitle(title)
    if image is not None:
        figure.colorbar(image, ax=drawn, label=colorbar)
    figure.savefig(path)
    plt.close(figure)


def _length_axis(axes: Axes, native: int) -> None:
    axes.set_xscale("log", base=2)
    axes.set_xlabel("length (tokens)")
    axes.axvline(native, color="grey", linestyle=":", linewidth=1)
    axes.grid(alpha=0.3)
