"""Generation throughput and per-token latency: our continuous-batching engine vs. transformers.

Both sides run the same weights: our RoPE model is exported as a `LlamaForCausalLM` directory
(`service.model.hf.export_llama`, logits identical) and driven by `generate()` with a static
batch of `c` prompts, while `c` concurrent requests go through `InferenceEngine`. Every request
generates exactly `--new-tokens` tokens (EOS is disabled on both sides) from a prompt of the
same length, so the two sides do the same work. A second table compares a batch whose requests
all use one scaling with a batch mixing every scaling type (the per-request `pe_scaling` this
service exists for). Medians of `--repeats` runs. Run:

    python -m bench.throughput [--model-dir models/zoo-rope] [--threads 1] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import torch

from pe_runtime import RopeScaling
from service.engine.core import DecodeSettings
from service.engine.engine import InferenceEngine
from service.engine.types import GenerationRequest, GenerationResult, SamplingParams
from service.model.checkpoint import load_checkpoint, save_checkpoint
from service.model.config import ModelConfig
from service.model.hf import export_llama
from service.model.transformer import Transformer

CONCURRENCY = (1, 4, 16, 64)
DEFAULT_MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / "zoo-rope"
DEFAULT_OUTPUT = Path(__file__).parent / "results" / "throughput.md"
OUR_NAME = "bench-rope"

Result = TypeVar("Result")


@dataclass(frozen=True)
class Measurement:
    tokens_per_s: float
    token_latency_ms: float  # median time between two tokens of one request


def scaling_specs(native_context: int) -> list[dict[str, Any]]:
    """One `pe_scaling` of every type, each extending the model's native context 4x.

    Written as an HTTP request writes them, so the in-process engine and the server run the same
    scalings (dynamic NTK in the service's default bucketed mode on both sides).
    """
    extension = {"factor": 4.0, "original_max_position_embeddings": native_context}
    return [
        {"type": "none"},
        {"type": "linear", "factor": 4.0},
        {"type": "ntk", "factor": 4.0},
        {"type": "dynamic", **extension, "dynamic_mode": "bucketed"},
        {"type": "yarn", **extension},
        {"type": "llama3", **extension},
    ]


def scaling_mix(native_context: int) -> list[RopeScaling]:
    """`scaling_specs` resolved as the server resolves a request's `pe_scaling`."""
    specs = scaling_specs(native_context)
    return [RopeScaling.from_hf(spec, max_position_embeddings=native_context) for spec in specs]


def prepare_models(model_dir: Path, workdir: Path) -> tuple[Path, Path, str]:
    """Our checkpoint (EOS disabled) and its Llama export, from `model_dir` or random weights."""
    if (model_dir / "config.json").is_file():
        model = load_checkpoint(model_dir)
        source = f"`{model_dir.name}` (trained weights)"
    else:
        torch.manual_seed(0)
        model = Transformer(ModelConfig(pe="rope"))
        source = "random weights, zoo architecture (`ModelConfig()` defaults; no zoo checkpoint found)"
    model.config = replace(model.config, eos_id=None)
    save_checkpoint(model, workdir / OUR_NAME)
    export_llama(model, workdir / "llama")
    return workdir / OUR_NAME, workdir / "llama", source


def prompts(count: int, length: int) -> list[tuple[int, ...]]:
    generator = torch.Generator().manual_seed(count)
    return [tuple(torch.randint(0, 256, (length,), generator=generator).tolist()) for _ in range(count)]


def run_engine(
    engine: InferenceEngine, batch: list[tuple[int, ...]], new_tokens: int, scalings: Sequence[RopeScaling]
) -> Measurement:
    start = time.perf_counter()
    handles = [
        engine.submit(
            GenerationRequest(
                request_id=f"bench-{index}",
                model=OUR_NAME,
                prompt_tokens=prompt,
                sampling=SamplingParams(max_new_tokens=new_tokens, temperature=0.0),
                scaling=scalings[index % len(scalings)],
                stream=False,  # only the result is read, as a non-streaming HTTP request does
            )
        )
        for index, prompt in enumerate(batch)
    ]
    results = [list(handle)[-1] for handle in handles]
    elapsed = time.perf_counter() - start
    assert all(isinstance(result, GenerationResult) for result in results)
    latencies = [r.timing.decode_ms / (len(r.tokens) - 1) for r in results if isinstance(r, GenerationResult)]
    return Measurement(len(batch) * new_tokens / elapsed, statistics.median(latencies))


def timed_generate(model: Any, batch: list[tuple[int, ...]], new_tokens: int) -> float:
    """Seconds `generate()` takes for exactly `new_tokens` greedy tokens per prompt."""
    inputs = torch.tensor(batch, device=model.device)
    start = time.perf_counter()
    with torch.inference_mode():
        output = model.generate(
            inputs,
            attention_mask=torch.ones_like(inputs),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    finished(output.device)
    elapsed = time.perf_counter() - start
    assert output.shape[1] == inputs.shape[1] + new_tokens
    return elapsed


def run_generate(model: Any, batch: list[tuple[int, ...]], new_tokens: int) -> Measurement:
    elapsed = timed_generate(model, batch, new_tokens)
    return Measurement(len(batch) * new_tokens / elapsed, elapsed / new_tokens * 1000.0)


def finished(device: torch.device) -> None:
    """Wait for the device's queued work, so a timer read next counts all of it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved_runs(
    repeats: int, runs: dict[str, Callable[[], Result]], *, warm_up: bool = True
) -> dict[str, list[Result]]:
    """`repeats` measurements per kind, taking turns so drifting machine load hits them alike.

    The order rotates every repeat: whichever kind runs right after another (say after
    `generate()` has churned the allocator) is not always the same one. The warm-up run per kind
    (tables, allocator, kernel selection) is skipped for runs already warm.
    """
    if warm_up:
        for run in runs.values():
            run()
    kinds = list(runs)
    samples: dict[str, list[Result]] = {kind: [] for kind in kinds}
    for repeat in range(repeats):
        shift = repeat % len(kinds)
        for kind in kinds[shift:] + kinds[:shift]:
            samples[kind].append(runs[kind]())
    return samples


def median(measurements: list[Measurement]) -> Measurement:
    return Measurement(
        statistics.median(m.tokens_per_s for m in measurements),
        statistics.median(m.token_latency_ms for m in measurements),
    )


def paired_overhead(uniform: list[Measurement], mixed: list[Measurement]) -> float:
    """Median over repeats of uniform/mixed tokens/s - 1, each pair measured back to back."""
    return (
        statistics.median(u.tokens_per_s / m.tokens_per_s for u, m in zip(uniform, mixed, strict=True)) - 1.0
    )


def decode_step_ms(
    model: Transformer, scalings: Sequence[RopeScaling], prompt_tokens: int, steps: int
) -> float:
    """Median time of one batched decode forward (model only, no scheduling or sampling)."""
    batch = len(scalings)
    times = []
    with torch.inference_mode():
        cache = model.new_cache(batch, prompt_tokens + steps + 1)
        model(torch.randint(0, 256, (batch, prompt_tokens)), scaling=scalings, cache=cache, last_n=1)
        for _ in range(steps):
            start = time.perf_counter()
            model(torch.randint(0, 256, (batch, 1)), scaling=scalings, cache=cache, last_n=1)
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000.0


def measure_step(model_dir: Path, batch: int, args: argparse.Namespace) -> dict[str, float]:
    """Uniform vs mixed decode passes, alternating so machine load hits both alike."""
    model = load_checkpoint(model_dir)
    mix = scaling_mix(model.config.native_context)
    kinds = {
        "uniform": [RopeScaling(type="linear", factor=4.0)] * batch,
        "mixed": [mix[i % len(mix)] for i in range(batch)],
    }
    samples: dict[str, list[float]] = {kind: [] for kind in kinds}
    for _ in range(args.repeats):
        for kind, scalings in kinds.items():
            samples[kind].append(decode_step_ms(model, scalings, args.prompt_tokens, args.new_tokens))
    return {kind: statistics.median(values) for kind, values in samples.items()}


def measure_concurrency(
    engine: InferenceEngine, reference: Any, concurrency: int, args: argparse.Namespace
) -> dict[str, list[Measurement]]:
    batch = prompts(concurrency, args.prompt_tokens)
    native = engine.models()[0].native_context
    uniform = [RopeScaling(type="linear", factor=4.0)]
    runs = {
        "ours": lambda: run_engine(engine, batch, args.new_tokens, uniform),
        "generate": lambda: run_generate(reference, batch, args.new_tokens),
    }
    if concurrency > 1:  # a single request has nothing to mix with
        runs["mixed"] = lambda: run_engine(engine, batch, args.new_tokens, scaling_mix(native))
    return interleaved_runs(args.repeats, runs)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--concurrency", type=int, nargs="+", default=list(CONCURRENCY))
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="our engine with the compiled decode pass (default on)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import LlamaForCausalLM

    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as workdir:
        ours_dir, llama_dir, source = prepare_models(args.model_dir, Path(workdir))
        reference = LlamaForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
        reference.train(False)
        engine = InferenceEngine.from_model_dirs(
            [ours_dir],
            device="cpu",
            dtype="float32",
            max_batch_size=64,
            decode=DecodeSettings(compile=args.compile),
        )
        engine.start()
        try:
            results = {c: measure_concurrency(engine, reference, c, args) for c in args.concurrency}
        finally:
            engine.shutdown()
        step = measure_step(ours_dir, max(args.concurrency), args)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    load = f"{load_before:.1f} at start, {os.getloadavg()[0]:.1f} at end, {os.cpu_count()} CPUs"
    args.output.write_text(report(args, source, results, load, step))
    print(args.output.read_text())
    return 0


def report(
    args: argparse.Namespace,
    source: str,
    results: dict[int, dict[str, list[Measurement]]],
    load: str,
    step: dict[str, float],
) -> str:
    command = " ".join(["python -m bench.throughput", *sys.argv[1:]])
    lines = [
        "# Throughput: pe-serve engine vs. transformers `generate()`",
        "",
        f"Command: `{command}`",
        "",
        f"Model: {source}; {args.prompt_tokens}-token prompts, {args.new_tokens} new tokens each, greedy, "
        f"float32. CPU: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"{args.threads} intra-op thread(s), decode pass {'compiled' if args.compile else 'eager'}. "
        f"Medians of {args.repeats} interleaved runs after a warm-up. "
        f"The machine is shared (load average {load}), so expect run-to-run noise.",
        "",
        "Tokens/s counts generated tokens of all requests over the wall time from the first submit "
        "to the last result. Per-token latency is the median time between two tokens of one request "
        "(for `generate()`, wall time / new tokens: every step yields one token per sequence).",
        "",
        "## Same weights, same work",
        "",
        "| concurrency | ours tok/s | generate() tok/s | ours ms/token | generate() ms/token |",
        "|---:|---:|---:|---:|---:|",
    ]
    for concurrency, kinds in results.items():
        ours, theirs = median(kinds["ours"]), median(kinds["generate"])
        lines.append(
            f"| {concurrency} | {ours.tokens_per_s:.1f} | {theirs.tokens_per_s:.1f} "
            f"| {ours.token_latency_ms:.2f} | {theirs.token_latency_ms:.2f} |"
        )
    lines += [
        "",
        "## Mixed `pe_scaling` in one batch vs. a uniform batch (ours)",
        "",
        "Uniform: every request `linear` x4. Mixed: requests cycle through none, linear, ntk, dynamic, "
        "yarn and llama3, all in the same decode passes. Overhead: median over repeats of uniform tok/s "
        "/ mixed tok/s - 1, each pair run back to back (so machine load drift cancels).",
        "",
        "| concurrency | uniform tok/s | mixed tok/s | overhead |",
        "|---:|---:|---:|---:|",
    ]
    for concurrency, kinds in results.items():
        if "mixed" not in kinds:
            continue
        uniform, mixed = median(kinds["ours"]), median(kinds["mixed"])
        overhead = paired_overhead(kinds["ours"], kinds["mixed"]) * 100.0
        lines.append(
            f"| {concurrency} | {uniform.tokens_per_s:.1f} | {mixed.tokens_per_s:.1f} | {overhead:+.1f}% |"
        )
    lines += [
        "",
        f"The model alone, one decode pass for a batch of {max(args.concurrency)} (median of "
        f"{args.new_tokens} steps, {args.repeats} alternating runs): uniform {step['uniform']:.2f} ms, "
        f"mixed {step['mixed']:.2f} ms ({(step['mixed'] / step['uniform'] - 1) * 100:+.1f}%). "
        "Each row reads its own cos/sin from the cached table of its scaling in one gather, so "
        "mixing scalings adds a few table lookups per step, not work per token.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
