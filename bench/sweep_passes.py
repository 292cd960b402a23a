"""What one pass per configuration saves a sweep: `pe_client.async_sweep` against its cells sent
one after another.

A sweep scores each fixed scaling once, at its longest length, and reads the shorter cells from
that pass's prefix (`pe_client.sweep.score_passes`). This benchmark starts one real `pe-serve` on
the zoo's RoPE model (`models/zoo-rope`, native 256; the server's default flags, `--max-context`
4096) and times, on the same text (`pydoc-topics`) and grid (lengths 1024, 2048 and 4096 under
none, linear x4, ntk x4 and yarn x4: 12 cells, 4 passes):

- `one pass`: `async_sweep`, the SDK's sweep (4 `/score` passes sent together);
- `one after another`: the 12 cells, each a `/score` of its own first L tokens, each sent once
  the previous one is answered (what a script without the lab does);
- `every cell at once`: the same 12 `/score` requests sent together (the sweep before one pass per
  configuration), for reference.

Every repeat runs the three in a rotated order, so drift on a shared machine hits each alike;
the figures are medians over the repeats, and the ratio is the medians' (one after another over
one pass). The sweep's cells are also checked against the one-after-another cells (largest
difference in bits per token). Not part of `make test`:

    python -m bench.sweep_passes [--repeats 3] [--output bench/results/sweep_passes.md]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path

import httpx
from pe_client import AsyncPEClient, async_sweep
from pe_client.corpora import corpus_text
from pe_client.grid import configurations, label, parse_specs
from pe_client.scaling import PEScaling
from pe_client.sweep import leading_tokens, score_passes
from pe_client.types import ScoreRequest

from bench.run_record import command_block
from bench.serving import code_revision
from tests.live_server import live_server

REPO = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO / "models" / "zoo-rope"
MODEL = "zoo-rope"
CORPUS = "pydoc-topics"
LENGTHS = (1024, 2048, 4096)
SCALINGS = ("none", "linear:factor=4", "ntk:factor=4", "yarn:factor=4")
DEFAULT_OUTPUT = REPO / "bench" / "results" / "sweep_passes.md"
TIMEOUT = httpx.Timeout(None, connect=10.0)

Cells = list[tuple[int, PEScaling, float]]
"""(length, scaling, bits per token) in grid order (scalings outer, lengths inner)."""


def bits(logprobs: Sequence[float | None]) -> float:
    values = [value for value in logprobs[1:] if value is not None]
    return -math.fsum(values) / len(values) / math.log(2)


async def one_pass(client: AsyncPEClient, text: str) -> Cells:
    result = await async_sweep(client, text=text, lengths=LENGTHS, scalings=SCALINGS, model=MODEL)
    return [(cell.length, cell.scaling, cell.bits_per_token) for cell in result.cells]


async def cell_by_cell(client: AsyncPEClient, tokens: list[int], *, together: bool) -> Cells:
    """Every cell its own `/score` of its first L tokens: together, or one after another."""
    grid = [(length, scaling) for scaling in parse_specs(SCALINGS) for length in LENGTHS]

    async def score(length: int, scaling: PEScaling) -> float:
        request = ScoreRequest(tokens=tokens[:length], model=MODEL, pe_scaling=scaling)
        return bits((await client.score(request)).token_logprobs)

    if together:
        values = await asyncio.gather(*(score(length, scaling) for length, scaling in grid))
    else:
        values = [await score(length, scaling) for length, scaling in grid]
    return [(length, scaling, value) for (length, scaling), value in zip(grid, values, strict=True)]


async def timed(run: Callable[[], Awaitable[Cells]]) -> tuple[float, Cells]:
    started = time.perf_counter()
    cells = await run()
    return time.perf_counter() - started, cells


async def measure(base_url: str, repeats: int) -> dict[str, object]:
    text = corpus_text(CORPUS)
    async with AsyncPEClient(base_url, timeout=TIMEOUT) as client:
        tokens = await leading_tokens(client, text, LENGTHS[-1], MODEL)
        runs: dict[str, Callable[[], Awaitable[Cells]]] = {
            "one pass": lambda: one_pass(client, text),
            "one after another": lambda: cell_by_cell(client, tokens, together=False),
            "every cell at once": lambda: cell_by_cell(client, tokens, together=True),
        }
        await cell_by_cell(client, tokens[: LENGTHS[0]], together=False)  # warm the server's tables
        walls: dict[str, list[float]] = {name: [] for name in runs}
        largest_difference = 0.0
        names = list(runs)
        for repeat in range(repeats):
            order = names[repeat % len(names) :] + names[: repeat % len(names)]
            cells: dict[str, Cells] = {}
            for name in order:
                wall, cells[name] = await timed(runs[name])
                walls[name].append(wall)
                print(f"repeat {repeat + 1}: {name} {wall:.2f} s", file=sys.stderr, flush=True)
            for (_, _, swept), (_, _, alone) in zip(
                cells["one pass"], cells["one after another"], strict=True
            ):
                largest_difference = max(largest_difference, abs(swept - alone))
    medians = {name: statistics.median(values) for name, values in walls.items()}
    return {
        "walls": walls,
        "medians": medians,
        "ratio": medians["one after another"] / medians["one pass"],
        "ratio_at_once": medians["every cell at once"] / medians["one pass"],
        "largest_difference": largest_difference,
    }


def report(figures: dict[str, object], command: str, repeats: int) -> str:
    walls = figures["walls"]
    medians = figures["medians"]
    load = figures["load"]
    assert isinstance(walls, dict) and isinstance(medians, dict) and isinstance(load, tuple)
    grid = parse_specs(SCALINGS)
    passes = len(score_passes(configurations(SCALINGS, None), sorted(LENGTHS)))
    requests = {"one pass": passes, "one after another": len(grid) * len(LENGTHS)}
    requests["every cell at once"] = requests["one after another"]
    # The work each side asks of the model: tokens through the layers, and causal attention pairs.
    cells = [length for _ in grid for length in LENGTHS]
    passed = [length for _, length, _ in score_passes(configurations(SCALINGS, None), sorted(LENGTHS))]
    tokens_ratio = sum(cells) / sum(passed)
    pairs_ratio = sum(n * (n + 1) // 2 for n in cells) / sum(n * (n + 1) // 2 for n in passed)
    lines = [
        "# One pass per configuration: the sweep against its cells one after another",
        "",
        f"{datetime.now(UTC):%Y-%m-%d}, code `{code_revision(REPO)}`, {platform.machine()}, "
        f"{len(os.sched_getaffinity(0))} cores (shared), Python {platform.python_version()}; "
        f"one `pe-serve` on `{MODEL}` (its default flags), text `{CORPUS}`.",
        "",
        f"Grid: lengths {', '.join(map(str, LENGTHS))} under {', '.join(label(s) for s in grid)} "
        f"({len(grid) * len(LENGTHS)} cells). Medians over {repeats} repeats, the three runs in a "
        "rotated order within each repeat. The machine is shared: its 1-minute load average was "
        f"{load[0]:.1f} before and {load[1]:.1f} after the run.",
        "",
        "| run | `/score` requests | median wall (s) | walls (s) |",
        "|---|---|---|---|",
    ]
    for name, values in walls.items():
        lines.append(
            f"| {name} | {requests[name]} | {medians[name]:.2f} | {', '.join(f'{v:.2f}' for v in values)} |"
        )
    lines += [
        "",
        f"**Ratio: one after another / one pass = {figures['ratio']:.2f}x** "
        f"(every cell at once / one pass = {figures['ratio_at_once']:.2f}x).",
        "",
        f"What the cells one after another ask of the model over the one-pass sweep: {tokens_ratio:.2f}x the "
        f"tokens ({sum(cells)} against {sum(passed)}), {pairs_ratio:.2f}x the causal attention pairs. On "
        "zoo-rope (d_model 192, 4 layers) attention is most of a 4096-token pass's arithmetic, so "
        "what one pass per configuration can save on this grid lies between the two ratios.",
        "",
        "The sweep's cells against the same cells each scored alone: largest difference "
        f"{figures['largest_difference']:.2e} bits per token (the SPEC allows 1e-3).",
        "",
        *command_block(command),
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args()
    command = shlex.join(["python", "-m", "bench.sweep_passes", *sys.argv[1:]])
    load_before = os.getloadavg()[0]
    with live_server([MODEL_DIR]) as server:
        figures = asyncio.run(measure(server.base_url, args.repeats))
    figures["load"] = (load_before, os.getloadavg()[0])
    text = report(figures, command, args.repeats)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
