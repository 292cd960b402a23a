"""Hugging Face Llama-family checkpoints load with logits equal to transformers' own (float32).

Random-weight models are written with `save_pretrained` (so the files are exactly what the Hub
holds) and read back by our loader, which never imports transformers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402

from service.engine.engine import InferenceEngine  # noqa: E402
from service.engine.types import GenerationRequest, GenerationResult, SamplingParams  # noqa: E402
from service.model.hf import load_hf_checkpoint  # noqa: E402
from tests.conftest import sharpen_attention  # noqa: E402

TOLERANCE = 1e-4
VOCAB = 96
MAX_POSITIONS = 64
LENGTHS = (20, 96)  # within and 1.5x past max_position_embeddings
ORIGINAL = {"factor": 4.0, "original_max_position_embeddings": 16}
HEAD_PAIRS = 4  # head_dim 8
ROPE_PARAMETERS: dict[str, dict[str, Any]] = {
    "none": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", **ORIGINAL},
    "llama3": {"rope_type": "llama3", **ORIGINAL, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
    "longrope": {
        "rope_type": "longrope",
        **ORIGINAL,
        "short_factor": [1.0 + 0.25 * i for i in range(HEAD_PAIRS)],
        "long_factor": [1.5 + i for i in range(HEAD_PAIRS)],
    },
}
ARCHITECTURE = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": MAX_POSITIONS,
}


def save_random_model(directory: Path, model_type: str = "llama", **config: Any) -> Any:
    torch.manual_seed(0)
    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }
    config_class, model_class = classes[model_type]
    model = model_class(config_class(**(ARCHITECTURE | config))).eval()
    sharpen_attention([layer.self_attn for layer in model.model.layers], "q_proj", "k_proj")
    model.save_pretrained(directory, max_shard_size=config.pop("max_shard_size", "1GB"))
    return model


def assert_same_logits(reference: Any, directory: Path) -> None:
    ours = load_hf_checkpoint(directory)
    generator = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for length in LENGTHS:
            tokens = torch.randint(0, VOCAB, (1, length), generator=generator)
            expected = reference(tokens).logits
            assert (ours(tokens) - expected).abs().max().item() <= TOLERANCE, f"length {length}"


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("scaling", list(ROPE_PARAMETERS))
def test_llama_logits_match_transformers(tmp_path: Path, scaling: str, tied: bool) -> None:
    rope_parameters = ROPE_PARAMETERS[scaling] | {"rope_theta": 10000.0}
    reference = save_random_model(tmp_path, rope_parameters=rope_parameters, tie_word_embeddings=tied)
    assert_same_logits(reference, tmp_path)


@pytest.mark.parametrize("model_type", ["mistral", "qwen2"])
def test_other_llama_family_members_match_transformers(tmp_path: Path, model_type: str) -> None:
    reference = save_random_model(tmp_path, model_type)
    assert_same_logits(reference, tmp_path)


def test_sharded_checkpoint_loads(tmp_path: Path) -> None:
    reference = save_random_model(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert_same_logits(reference, tmp_path)


# Chunked: a prompt of 50 read in chunks of 16. Dynamic NTK runs past max_position_embeddings
# (64): the prompt stays within it, generation leaves it, so transformers switches tables
# mid-generation and keeps its cached keys, as the "hf" mode does.
GENERATE_CASES: dict[str, tuple[dict[str, Any], int, int]] = {
    "default": ({"rope_type": "default"}, 4, 12),
    "default-chunked": ({"rope_type": "default"}, 50, 12),
    "dynamic-hf": ({"rope_type": "dynamic", "factor": 2.0}, 50, 40),
}


@pytest.mark.parametrize("case", list(GENERATE_CASES))
def test_engine_serves_a_hugging_face_directory_like_generate(tmp_path: Path, case: str) -> None:
    """Greedy tokens from the engine equal transformers' greedy `generate()` on the same files."""
    rope_parameters, prompt_length, new_tokens = GENERATE_CASES[case]
    directory = tmp_path / "tiny-llama"
    reference = save_random_model(  # eos None: generate the full length in both
        directory, eos_token_id=None, rope_parameters=rope_parameters | {"rope_theta": 10000.0}
    )
    vocabulary = {f"w{i}": i for i in range(VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocabulary, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))
    # A budget of 2 (16 while nothing decodes) reads the 50-token prompt in four chunks.
    engine = InferenceEngine.from_model_dirs([directory], device="cpu", dtype="float32", step_token_budget=2)
    engine.start()
    words = [5, 17, 42, 3, *range(48, 44 + prompt_length)]  # never 0, the pad id generate() masks
    try:
        prompt = engine.tokenize("tiny-llama", " ".join(f"w{word}" for word in words))
        assert prompt == words
        request = GenerationRequest(
            request_id="hf",
            model="tiny-llama",
            prompt_tokens=tuple(prompt),
            sampling=SamplingParams(max_new_tokens=new_tokens, temperature=0.0),
        )
        result = list(engine.submit(request))[-1]
        assert isinstance(result, GenerationResult)
    finally:
        engine.shutdown()
    expected = reference.generate(
        torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )[0, len(prompt) :]
    assert list(result.tokens) == expected.tolist()
    assert json.loads((directory / "config.json").read_text())["model_type"] == "llama"
    if case == "dynamic-hf":
        assert result.pe.scaling is not None and result.pe.scaling.dynamic_mode == "hf"
