"""The model alone, one decode pass: the eager model vs. the compiled step and the C step.

Rows of `--prompt-tokens` are prefilled into a paged KV pool, then decoded `--steps` tokens; the
eager side is `Transformer.forward` over the pool (the engine's path without `--compile`), the
compiled side `FastDecoder.decode` with the compiled torch step, and the C side `FastDecoder.decode`
running the C step (what the engine runs with `--compile` on a CPU in float32, one thread). All
see the same rows, window growth and weights; runs alternate within every repeat, and ratios are
medians of per-repeat ratios. No scheduling, sampling or HTTP: `bench.serving` measures those.

The torch step's compile time is measured twice: cold, in this process with an empty inductor
cache (what a first start-up on a host pays), and warm, in a fresh process reusing that cache.
Run:

    python -m bench.decode_step [--batches 1 16 64] [--repeats 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from service.model.backend import Backend, choose_backend
from service.model.checkpoint import load_checkpoint
from service.model.fast_decode import FastDecoder
from service.model.paged_cache import PagedKVCache, PagedRows

DEFAULT_MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / "zoo-rope"
DEFAULT_OUTPUT = Path(__file__).parent / "results" / "decode_step.md"
MAX_WINDOW = 512


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument("--warm-start-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.warm_start_only:
        print(f"{compile_seconds(args.model_dir):.2f}")
        return 0
    with tempfile.TemporaryDirectory(prefix="bench-inductor-") as cache_dir:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir  # read when inductor first compiles
        load_before = os.getloadavg()[0]
        cold = compile_seconds(args.model_dir)
        warm = warm_start_seconds(args)
        rows = {batch: measure(args, batch) for batch in args.batches}
    load = f"{load_before:.1f} at start, {os.getloadavg()[0]:.1f} at end, {os.cpu_count()} CPUs"
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(report(args, rows, cold, warm, load))
    print(args.output.read_text())
    return 0


def decoder_for(model_dir: Path, backend: Backend | None = None) -> FastDecoder:
    """A decoder on `backend`, or on the one the engine would choose here (None)."""
    model = load_checkpoint(model_dir, dtype=torch.float32).eval()
    cpu = torch.device("cpu")
    pool = PagedKVCache.within(model.config, 64 << 20, min_tokens=4096, device=cpu, dtype=torch.float32)
    if backend is None:
        threads = torch.get_num_threads()
        backend = choose_backend(
            model.config, device=cpu, dtype=torch.float32, threads=threads, allow_compile=True
        ).backend
    return FastDecoder(model, pool, backend, max_window=MAX_WINDOW)


def compile_seconds(model_dir: Path) -> float:
    """What compiling the torch step costs (the C step, where it runs, compiles nothing)."""
    return float(decoder_for(model_dir, Backend.COMPILED).warm_up())


def warm_start_seconds(args: argparse.Namespace) -> float:
    command = [
        sys.executable,
        "-m",
        "bench.decode_step",
        "--warm-start-only",
        "--model-dir",
        str(args.model_dir),
    ]
    command += ["--threads", str(args.threads)]
    done = subprocess.run(command, capture_output=True, text=True, check=True, cwd=Path(__file__).parents[1])
    return float(done.stdout.strip().splitlines()[-1])


def measure(args: argparse.Namespace, batch: int) -> dict[str, float]:
    """Median ms per step of each side, and the median per-repeat ratios of eager to the others.

    The engine's decoder runs the C step where it applies; a second decoder over the same model
    and pool runs the compiled torch step beside it.
    """
    engine = decoder_for(args.model_dir)
    engine.warm_up()
    torch_step = FastDecoder(engine.model, engine.pool, Backend.COMPILED, max_window=MAX_WINDOW)
    torch_step.warm_up()
    sides: dict[str, Callable[[], float]] = {
        "eager": lambda: run(engine, batch, args, compiled=False),
        "compiled": lambda: run(torch_step, batch, args, compiled=True),
    }
    if engine.c_pass is not None:
        sides["c_step"] = lambda: run(engine, batch, args, compiled=True)
    samples: dict[str, list[float]] = {side: [] for side in sides}
    for _ in range(args.repeats):
        for side, once in sides.items():
            samples[side].append(once())
    result = {side: statistics.median(times) for side, times in samples.items()}
    for side in sides:
        ratios = [e / other for e, other in zip(samples["eager"], samples[side], strict=True)]
        result[f"eager/{side}"] = statistics.median(ratios)
    return result


def run(decoder: FastDecoder, batch: int, args: argparse.Namespace, *, compiled: bool) -> float:
    """Median ms of one decode pass over `args.steps` steps of `batch` fresh rows, with the argmax
    that reads its logits (on a GPU, where the wait for the step's work ends)."""
    model, pool = decoder.model, decoder.pool
    generator = torch.Generator().manual_seed(batch)
    scaling = model.positions.default_scaling
    rows = [pool.allocate(args.prompt_tokens + args.steps + 1) for _ in range(batch)]
    view = PagedRows(pool, rows)
    device = model.embed_tokens.weight.device
    prompts = torch.randint(0, 256, (batch, args.prompt_tokens), generator=generator).to(device)
    times = []
    with torch.inference_mode():
        model(prompts, scaling=[scaling] * batch, cache=view)
        feed = prompts[:, -1].tolist()
        for _ in range(args.steps):
            start = time.perf_counter()
            if compiled:
                logits = decoder.decode(view, feed, [scaling] * batch)
            else:
                step_tokens = torch.tensor(feed, device=device)[:, None]
                logits = model(step_tokens, scaling=[scaling] * batch, cache=view)[:, -1]
            feed = logits.argmax(dim=-1).tolist()  # the device's work ends here
            times.append(time.perf_counter() - start)
    for row in rows:
        pool.release(row)
    return statistics.median(times) * 1000.0


def report(
    args: argparse.Namespace, rows: dict[int, dict[str, float]], cold: float, warm: float, load: str
) -> str:
    command = " ".join(["python -m bench.decode_step", *sys.argv[1:]])
    c_step = all("c_step" in row for row in rows.values())
    lines = [
        "# One decode pass: the eager model vs. the compiled step and the C step",
        "",
        f"Command: `{command}`",
        "",
        f"Model: `{args.model_dir.name}`, float32, CPU ({platform.processor() or platform.machine()}), "
        f"torch {torch.__version__}, {args.threads} intra-op thread(s); load average {load}. "
        f"Each row has a {args.prompt_tokens}-token prompt, then {args.steps} decode passes (keys "
        f"{args.prompt_tokens} to {args.prompt_tokens + args.steps}); ms are medians over the steps, then "
        f"over {args.repeats} alternating repeats; ratios are medians of per-repeat ratios.",
        "",
        "Sides: the eager model (the engine without `--compile`); `FastDecoder.decode` with the compiled "
        "torch step (GPUs, other dtypes, more threads); and, where it applies (a float32 pool on one "
        "torch thread), `FastDecoder.decode` running the whole step as one C call "
        "(`service/model/kernels/batch_pass.c`), which is what the engine runs with `--compile` here. "
        "The two decoders share the model and the pool in one process; two decoders side by side "
        "once gave identical code 0.64-0.86x of each other here, so read their ratio with that margin.",
        "",
    ]
    header = "| batch | eager ms/step | compiled ms/step |" + (" C step ms/step |" if c_step else "")
    header += " eager / compiled |" + (" eager / C step |" if c_step else "")
    lines += [header, "|---:|" + "---:|" * (3 + 2 * c_step)]
    for batch, row in rows.items():
        cells = [f"{row['eager']:.3f}", f"{row['compiled']:.3f}"]
        cells += [f"{row['c_step']:.3f}"] if c_step else []
        cells += [f"{row['eager/compiled']:.2f}x"] + ([f"{row['eager/c_step']:.2f}x"] if c_step else [])
        lines.append(f"| {batch} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Compile time of the torch step at start-up (every window bucket from 64 to {MAX_WINDOW} keys, "
        f"for one row and for batches): **{cold:.1f} s** with an empty inductor cache, **{warm:.1f} s** "
        "in a new process with the cache filled. Models of the same architecture and scheme share the "
        "compiled code; each further scheme pays its own compile."
        + (
            " Where the C step runs, the engine compiles nothing: its library is built once per "
            "machine, in about a second, and cached."
            if c_step
            else ""
        ),
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
