"""Decode speed per family: models of one shape, random weights, 16 concurrent clients.

Llama, GPT-NeoX and Qwen3 configs (hidden 512, 8 layers, 8 heads, a vocabulary of 8192; Llama and
Qwen3 with a gated MLP of 1536, NeoX with its ungated 4x MLP of 2048 and parallel residual) are
translated by our Hugging Face loader, built with random weights and served together by one
engine at its default settings. Each family's clients run alone, the families taking turns
(`bench.throughput.interleaved_runs`), and each family's tok/s is compared with Llama's as the
median of per-repeat ratios. Run:

    python -m bench.families [--clients 16] [--new-tokens 64] [--repeats 5]
"""

from __future__ import annotations

import argparse
import functools
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from bench.throughput import interleaved_runs, prompts
from service.engine.engine import InferenceEngine
from service.engine.types import GenerationRequest, GenerationResult, SamplingParams
from service.model.checkpoint import save_checkpoint
from service.model.hf import hf_config_to_model_config
from service.model.transformer import Transformer

DEFAULT_OUTPUT = Path(__file__).parent / "results" / "families.md"
SHAPE: dict[str, Any] = {
    "vocab_size": 8192,
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "max_position_embeddings": 2048,
}
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": SHAPE | {"model_type": "llama", "intermediate_size": 1536},
    "gpt_neox": SHAPE | {"model_type": "gpt_neox", "intermediate_size": 2048, "use_parallel_residual": True},
    "qwen3": SHAPE | {"model_type": "qwen3", "intermediate_size": 1536, "head_dim": 64},
}


def write_models(workdir: Path) -> list[Path]:
    directories = []
    for family, hf_config in FAMILIES.items():
        torch.manual_seed(0)
        model = Transformer(replace(hf_config_to_model_config(hf_config), eos_id=None))
        save_checkpoint(model, workdir / family)
        directories.append(workdir / family)
    return directories


def tokens_per_second(engine: InferenceEngine, family: str, clients: int, new_tokens: int) -> float:
    start = time.perf_counter()
    handles = [
        engine.submit(
            GenerationRequest(
                request_id=f"{family}-{index}",
                model=family,
                prompt_tokens=prompt,
                sampling=SamplingParams(max_new_tokens=new_tokens, temperature=0.0),
                stream=False,
            )
        )
        for index, prompt in enumerate(prompts(clients, 32))
    ]
    results = [list(handle)[-1] for handle in handles]
    elapsed = time.perf_counter() - start
    assert all(isinstance(result, GenerationResult) for result in results)
    return clients * new_tokens / elapsed


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as workdir:
        engine = InferenceEngine.from_model_dirs(write_models(Path(workdir)), device="cpu", dtype="float32")
        engine.start()
        try:
            backends = {info.name: info.backend for info in engine.models()}
            clients, new_tokens = args.clients, args.new_tokens
            runs: dict[str, Callable[[], float]] = {
                family: functools.partial(tokens_per_second, engine, family, clients, new_tokens)
                for family in FAMILIES
            }
            samples = interleaved_runs(args.repeats, runs)
        finally:
            engine.shutdown()
    lines = [
        "# Decode speed per family (`python -m bench.families`)",
        "",
        f"{platform.machine()}, {torch.get_num_threads()} torch threads, {args.clients} concurrent clients, "
        f"{args.new_tokens} new tokens each after a 32-token prompt, medians of {args.repeats} repeats "
        "(families taking turns). Hidden 512, 8 layers, 8 heads, vocabulary 8192, random weights.",
        "",
        "| family | backend | tok/s (median) | against Llama (median of per-repeat ratios) |",
        "|---|---|---|---|",
    ]
    for family in FAMILIES:
        ratios = [ours / llama for ours, llama in zip(samples[family], samples["llama"], strict=True)]
        lines.append(
            f"| {family} | {backends[family]} | {statistics.median(samples[family]):.1f} | "
            f"{statistics.median(ratios):.2f}x |"
        )
    report = "\n".join(lines) + "\n"
    args.output.write_text(report)
    sys.stdout.write(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
