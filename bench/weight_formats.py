"""What each `--weights` format costs in quality and buys in speed, on SmolLM2-135M-Instruct.

`python -m bench.weight_formats [--tokens 4096] [--repeats 3]` writes
`bench/results/weight_formats.md`: per format, bits per token on the first `--tokens` tokens of
`pydoc_data.topics` (English text every Python install has) through the engine's scoring path
(`POST /score`'s), the difference from float, and greedy decode tokens per second (one request,
16 prompt tokens, 64 new) through the engine, with torch on every core as the server runs it.
The float weights are the GGUF file's Q4_1 blocks dequantized, so "float" is the file's own
quality and each format re-quantizes from it.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
from datetime import UTC, datetime
from pathlib import Path

import torch

from bench.real_checkpoints import decode_rate, english_tokens
from bench.serving import code_revision
from service.engine.engine import InferenceEngine
from service.engine.types import ScoreResult, ScoringRequest
from service.model.bundled import bundled_model
from service.model.quantized import WEIGHT_FORMATS

RESULTS = Path(__file__).parent / "results" / "weight_formats.md"


def bits_per_token(engine: InferenceEngine, model: str, tokens: list[int]) -> float:
    result = list(engine.submit(ScoringRequest("bits", model, tuple(tokens))))[-1]
    assert isinstance(result, ScoreResult)
    return -result.total_logprob / (len(tokens) - 1) / math.log(2)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    path = bundled_model("smollm2")
    rows = []
    for weights in WEIGHT_FORMATS:
        engine = InferenceEngine.from_model_dirs([path], device="cpu", dtype="float32", weights=weights)
        engine.start()
        try:
            name = engine.models()[0].name
            tokens = english_tokens(engine, name, args.tokens)
            rows.append(
                (weights, bits_per_token(engine, name, tokens), decode_rate(engine, name, args.repeats))
            )
        finally:
            engine.shutdown()
        print(f"{weights}: {rows[-1][1]:.4f} bits/token, {rows[-1][2]:.1f} tok/s", flush=True)
    float_bits, float_rate = rows[0][1], rows[0][2]
    lines = [
        "# Weight formats on SmolLM2-135M-Instruct",
        "",
        f"Run {datetime.now(UTC):%Y-%m-%d %H:%M} UTC at `{code_revision()}`, {os.cpu_count()} cores "
        f"({platform.processor() or platform.machine()}), torch {torch.__version__} on every core. "
        "Reproduce: `python -m bench.weight_formats`.",
        "",
        f"Bits per token over the first {args.tokens} tokens of `pydoc_data.topics`; decode: median of "
        f"{args.repeats} greedy requests (16 prompt tokens, 64 new), in-process engine.",
        "",
        "| weights | bits/token | vs float | decode tok/s | vs float |",
        "|---|---|---|---|---|",
    ]
    for weights, bits, rate in rows:
        lines.append(
            f"| {weights} | {bits:.4f} | {bits - float_bits:+.4f} | {rate:.1f} | {rate / float_rate:.2f}x |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    args.output.write_text(text)


if __name__ == "__main__":
    main()
