"""How much PECache saves: building a RoPE cos/sin table vs. fetching it from the cache.

A decode pass asks the cache for its tables once per step, so the hit path must be orders of
magnitude cheaper than a build, at every context length the service runs at. Run:

    python -m bench.pe_cache [--device cpu|cuda] [--dtype bfloat16] [--output bench/results/pe_cache.md]
"""

from __future__ import annotations

import argparse
import functools
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from pe_runtime import PECache, RopeScaling

LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768, 65536)
HEAD_DIM = 128
BASE = 500000.0
SCALING = RopeScaling(type="yarn", factor=16.0, original_max_position_embeddings=4096)
DEFAULT_OUTPUT = Path(__file__).parent / "results" / "pe_cache.md"


@dataclass(frozen=True)
class Row:
    length: int
    build_s: float
    hit_s: float

    @property
    def ratio(self) -> float:
        return self.build_s / self.hit_s


def _timed(action: Callable[[], object], device: torch.device, calls: int = 1) -> float:
    """Seconds per call of `action`, device work included."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(calls):
        action()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / calls


def measure(length: int, device: torch.device, dtype: torch.dtype, repeats: int, hit_calls: int) -> Row:
    """Median build time on a fresh cache (a miss) and median per-call time of a warm hit."""

    def fetch(cache: PECache) -> object:
        return cache.rope(HEAD_DIM, BASE, SCALING, length, device=device, dtype=dtype, seq_len=length)

    build_times = []
    for _ in range(repeats):
        build_times.append(_timed(functools.partial(fetch, PECache(registry=None)), device))
    warm = PECache(registry=None)
    fetch(warm)
    hit_times = [_timed(functools.partial(fetch, warm), device, hit_calls) for _ in range(repeats)]
    return Row(length, statistics.median(build_times), statistics.median(hit_times))


def render(rows: Sequence[Row], device: torch.device, dtype: torch.dtype, command: str) -> str:
    header = [
        "# PECache: table build vs. cached fetch",
        "",
        f"RoPE cos+sin, head_dim {HEAD_DIM}, base {BASE:g}, scaling {SCALING.to_dict()}, "
        f"{dtype}, device `{device}`.",
        f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
        f"torch threads {torch.get_num_threads()}.",
        "Build = first request on an empty cache (frequencies, float32 angles, cos/sin, cast, insert); "
        "hit = a repeated request (lock, dict lookup, two slice views). Medians.",
        "Absolute times depend on machine load (the hit is pure Python overhead); the ratio is the point.",
        "",
        f"Command: `{command}`",
        "",
        "| length | build (ms) | cached fetch (µs) | build / fetch |",
        "|---:|---:|---:|---:|",
    ]
    lines = [f"| {r.length} | {r.build_s * 1e3:.3f} | {r.hit_s * 1e6:.2f} | {r.ratio:,.0f}x |" for r in rows]
    return "\n".join(header + lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--hit-calls", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (shared machines: 1)")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    rows = []
    for length in LENGTHS:
        row = measure(length, device, dtype, args.repeats, args.hit_calls)
        rows.append(row)
        print(
            f"{length:>6}: build {row.build_s * 1e3:.3f} ms, hit {row.hit_s * 1e6:.2f} us, {row.ratio:,.0f}x"
        )
    command = "python -m bench.pe_cache " + " ".join(sys.argv[1:] if argv is None else argv)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(render(rows, device, dtype, command.strip()))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
