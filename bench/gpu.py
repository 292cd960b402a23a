"""The decode pass and the serving path on a GPU: `bench/results/gpu.md`.

One prepared run for a lent GPU machine, sized to finish in a few minutes (a session's device time
includes the machine's start). Two tables:

1. ms per decode pass at batch 1, 16 and 64 on the same weights and GPU: the eager model
   (`Transformer.forward` over the paged pool, the engine without `--compile`); `FastDecoder.decode`
   replaying CUDA graphs of the torch step, compiled (what the engine runs with `--compile` on a
   GPU) and uncompiled; and transformers' `generate()`, whose step is
   (T(1 + steps new tokens) - T(1 new token)) / steps, so its prefill is not counted. The sides
   take turns within every repeat; ratios are medians of per-repeat ratios.
2. `--clients` concurrent clients through HTTP against the server on the GPU (`--compile`) vs. a
   static `generate()` batch of as many prompts, tok/s, taking turns.

The goal is at most 0.15 ms per decode pass at batch 1. Run (on the GPU machine):

    python -m bench.gpu [--dtype bfloat16] [--batches 1 16 64] [--repeats 5] [--clients 16]

`--device cpu --dtype float32 --no-compile --quick` smoke-tests the script anywhere (the graphs then
run uncaptured); its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import functools
import platform
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.decode_step import run as decode_steps
from bench.serving import (
    DEFAULT_MODEL_DIR,
    MAX_BATCH_SIZE,
    ServerOptions,
    code_revision,
    generate_body,
    http_throughput,
    paired_ratio,
    running_server,
    verdict,
)
from bench.throughput import (
    Measurement,
    interleaved_runs,
    prepare_models,
    prompts,
    run_generate,
    timed_generate,
)
from service.engine.models import resolve_dtype
from service.model.backend import Backend
from service.model.checkpoint import load_checkpoint
from service.model.fast_decode import FastDecoder
from service.model.paged_cache import PagedKVCache

DEFAULT_OUTPUT = Path(__file__).parent / "results" / "gpu.md"
# The windows these runs reach (32-token prompts and 64 steps: 96 keys), and no more: every window
# is compiled and captured at start-up, on the lent machine's clock.
MAX_WINDOW = 128
STEP_GOAL_MS = 0.15  # at batch 1
POOL_BYTES = 256 << 20
REQUEST_TIMEOUT_S = 300.0
TIMING_TRIES = 3  # runs per timing of generate(); the least counts


@dataclass(frozen=True)
class StepRow:
    """Median ms per step of each side at one batch size, and each other side's time over the
    fastest graphed side's (how many times faster that one is)."""

    ms: dict[str, float]
    over_fastest: dict[str, float]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default=None, help="default: the server's (bfloat16 on cuda)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64, help="per HTTP request")
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also the compiled step's graphs, and the server with --compile (default on)",
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one repeat: a smoke test only")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    arguments = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(arguments)
    if args.quick:
        args.batches, args.prompt_tokens, args.steps = [1, 2], 8, 16
        args.repeats, args.clients, args.new_tokens = 1, 2, 8
    device = torch.device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as workdir:
        ours_dir, llama_dir, source = prepare_models(args.model_dir, Path(workdir))
        reference = reference_model(llama_dir, device, dtype)
        steps, capture_s = measure_steps(args, ours_dir, reference, device, dtype)
        options = ServerOptions(
            compile=args.compile,
            device=args.device,
            dtype=str(dtype).removeprefix("torch."),
            compile_max_window=MAX_WINDOW,
        )
        with running_server(ours_dir, Path(workdir) / "server.log", options) as base_url:
            http = measure_http(args, base_url, reference)
    text = report(args, arguments, source, dtype, steps, capture_s, http, time.perf_counter() - started)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
    print(text)
    return 0


def reference_model(llama_dir: Path, device: torch.device, dtype: torch.dtype) -> Any:
    from transformers import LlamaForCausalLM

    model: Any = LlamaForCausalLM.from_pretrained(llama_dir, dtype=dtype)
    model.train(False)
    return model.to(device)


def measure_steps(
    args: argparse.Namespace, ours_dir: Path, reference: Any, device: torch.device, dtype: torch.dtype
) -> tuple[dict[int, StepRow], dict[str, float]]:
    """Each side's ms per step by batch size, and the seconds each graphed side took to warm up
    (compiling, then capturing every window and batch bucket)."""
    model = load_checkpoint(ours_dir, device=device, dtype=dtype).eval()
    pool = PagedKVCache.within(model.config, POOL_BYTES, min_tokens=4096, device=device, dtype=dtype)
    graphed = {"graphs": False, "graphs_compiled": True} if args.compile else {"graphs": False}
    decoders = {
        side: FastDecoder(
            model,
            pool,
            Backend.CUDA_GRAPHS,
            max_window=MAX_WINDOW,
            max_batch=max(args.batches),
            inductor=compile,
        )
        for side, compile in graphed.items()
    }
    capture_s = {side: decoder.warm_up() for side, decoder in decoders.items()}
    eager = next(iter(decoders.values()))
    fastest = list(decoders)[-1]
    rows = {}
    for batch in args.batches:
        sides: dict[str, Callable[[], float]] = {
            "eager": functools.partial(decode_steps, eager, batch, args, compiled=False),
            **{
                side: functools.partial(decode_steps, decoder, batch, args, compiled=True)
                for side, decoder in decoders.items()
            },
            "generate": functools.partial(generate_step_ms, reference, batch, args),
        }
        samples = interleaved_runs(args.repeats, sides)
        rows[batch] = StepRow(
            ms={side: statistics.median(times) for side, times in samples.items()},
            over_fastest={
                side: statistics.median(t / f for t, f in zip(times, samples[fastest], strict=True))
                for side, times in samples.items()
                if side != fastest
            },
        )
    return rows, capture_s


def generate_step_ms(reference: Any, batch: int, args: argparse.Namespace) -> float:
    """`generate()`'s ms per decode pass: the time of `args.steps` more tokens, over their count.
    Each of the two times is the least of `TIMING_TRIES` runs, so that a pause of the machine in
    the shorter run cannot make the difference negative."""
    rows = prompts(batch, args.prompt_tokens)
    steps: int = args.steps

    def fastest(new_tokens: int) -> float:
        return min(timed_generate(reference, rows, new_tokens) for _ in range(TIMING_TRIES))

    return (fastest(1 + steps) - fastest(1)) / steps * 1000.0


def measure_http(args: argparse.Namespace, base_url: str, reference: Any) -> dict[str, list[Measurement]]:
    batch = prompts(args.clients, args.prompt_tokens)
    bodies = [generate_body(prompt, args.new_tokens) for prompt in batch]
    return interleaved_runs(
        args.repeats,
        {
            "http": lambda: http_throughput(base_url, bodies, REQUEST_TIMEOUT_S),
            "generate": lambda: run_generate(reference, batch, args.new_tokens),
        },
    )


SIDE_NAMES = {
    "eager": "eager",
    "graphs": "CUDA graphs",
    "graphs_compiled": "CUDA graphs, compiled",
    "generate": "`generate()`",
}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}; graphs uncaptured)"


def report(
    args: argparse.Namespace,
    arguments: list[str],
    source: str,
    dtype: torch.dtype,
    steps: dict[int, StepRow],
    capture_s: dict[str, float],
    http: dict[str, list[Measurement]],
    elapsed_s: float,
) -> str:
    import transformers

    first = next(iter(steps.values()))
    sides = list(first.ms)
    fastest = next(side for side in sides if side not in first.over_fastest)
    others = list(first.over_fastest)
    lone = steps.get(1)
    lines = [
        "# The decode pass and the serving path on a GPU",
        "",
        f"Command: `{shlex.join(['python', '-m', 'bench.gpu', *arguments])}` ({elapsed_s:.0f} s)",
        "",
        f"- Device: {device_name(torch.device(args.device))}; torch {torch.__version__}, "
        f"transformers {transformers.__version__}; code: git {code_revision()}",
        f"- Model: {source}, {str(dtype).removeprefix('torch.')}, EOS disabled, greedy",
        f"- Medians of {args.repeats} repeat(s), sides taking turns; ratios are medians of "
        "per-repeat ratios.",
    ]
    if args.quick:
        lines += ["", "**`--quick` run: sizes shrunk to a smoke test; these numbers mean nothing.**"]
    lines += [
        "",
        "## 1. ms per decode pass",
        "",
        f"Rows with {args.prompt_tokens}-token prompts, then {args.steps} steps; per side the median "
        "step, `generate()`'s from the difference of two runs (its prefill not counted).",
        "",
        "| batch | "
        + " | ".join(f"{SIDE_NAMES[side]} ms" for side in sides)
        + " | "
        + " | ".join(f"{SIDE_NAMES[side]} / {SIDE_NAMES[fastest]}" for side in others)
        + " |",
        "|---:|" + "---:|" * (len(sides) + len(others)),
    ]
    for batch, row in steps.items():
        cells = [f"{row.ms[side]:.3f}" for side in sides]
        cells += [f"{row.over_fastest[side]:.2f}x" for side in others]
        lines.append(f"| {batch} | " + " | ".join(cells) + " |")
    lines += [""]
    if lone is not None:
        lines.append(
            f"Goal at batch 1, at most {STEP_GOAL_MS} ms per step ({SIDE_NAMES[fastest]}): "
            f"{lone.ms[fastest]:.3f} ms, {verdict(lone.ms[fastest] <= STEP_GOAL_MS)}."
        )
    lines.append(
        "Warm-up (compile, then capture every window bucket from 64 to "
        f"{MAX_WINDOW} keys for batch buckets up to {max(args.batches)}): "
        + ", ".join(f"{SIDE_NAMES[side]} {seconds:.1f} s" for side, seconds in capture_s.items())
        + "."
    )
    ratio = paired_ratio(http["http"], http["generate"])
    http_tps = statistics.median(m.tokens_per_s for m in http["http"])
    generate_tps = statistics.median(m.tokens_per_s for m in http["generate"])
    lines += [
        "",
        f"## 2. {args.clients} clients through HTTP vs. a static `generate()` batch of {args.clients}",
        "",
        f"Server: `--device {args.device} --dtype {str(dtype).removeprefix('torch.')}"
        + (f" --compile --compile-max-window {MAX_WINDOW}" if args.compile else " --no-compile")
        + f" --max-batch-size {MAX_BATCH_SIZE}`; {args.prompt_tokens}-token prompts, "
        f"{args.new_tokens} new tokens each.",
        "",
        "| HTTP tok/s | `generate()` tok/s | HTTP / `generate()` |",
        "|---:|---:|---:|",
        f"| {http_tps:.0f} | {generate_tps:.0f} | {ratio:.2f}x |",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
