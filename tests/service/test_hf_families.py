"""Every supported Hugging Face family loads with logits equal to transformers' own (float32).

Each case writes a tiny random model with `save_pretrained` (the files a Hub checkpoint holds),
with every weight, norm and bias perturbed so that a wrong mapping of any of them shows, and reads
it back with our loader, which never imports transformers. The engine then serves the same files:
greedy tokens equal `generate()`'s, scored logprobs equal transformers' log-softmax. The rope
families are also compared under scalings set in their config (what a request's `pe_scaling`
reproduces), past `original_max_position_embeddings` included.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

transformers = pytest.importorskip("transformers")

from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402

from service.engine.engine import InferenceEngine  # noqa: E402
from service.engine.types import (  # noqa: E402
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    ScoreResult,
    ScoringRequest,
)
from service.model.hf import UnsupportedCheckpointError, hf_config_to_model_config, load_hf_checkpoint  # noqa: E402
from service.model.kernels import batch_pass  # noqa: E402
from tests.live_server import live_server  # noqa: E402

TOLERANCE = 1e-4
VOCAB = 96
POSITIONS = 64
HEADS = {"num_attention_heads": 4}
LLAMA_SHAPE = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": POSITIONS,
}
# model_type -> (config class, model class, config fields, scheme)
FAMILIES: dict[str, tuple[str, str, dict[str, Any], str]] = {
    "gpt2": (
        "GPT2Config",
        "GPT2LMHeadModel",
        {"n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 128},
        "learned",
    ),
    "gptj": (
        "GPTJConfig",
        "GPTJForCausalLM",
        {"n_embd": 32, "n_layer": 2, "n_head": 4, "rotary_dim": 4, "n_positions": 128},
        "rope",
    ),
    "gpt_neox": (
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        LLAMA_SHAPE | {"num_key_value_heads": 4, "rotary_pct": 0.5, "use_parallel_residual": True},
        "rope",
    ),
    "gpt_neox-sequential": (
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        LLAMA_SHAPE | {"num_key_value_heads": 4, "use_parallel_residual": False},
        "rope",
    ),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", LLAMA_SHAPE | {"use_qkv_bias": True}, "rope"),
    "stablelm-parallel": (
        "StableLmConfig",
        "StableLmForCausalLM",
        LLAMA_SHAPE | {"use_parallel_residual": True},
        "rope",
    ),
    "bloom": ("BloomConfig", "BloomForCausalLM", {"hidden_size": 32, "n_layer": 2, "n_head": 4}, "alibi"),
    "bloom-6-heads": (
        "BloomConfig",
        "BloomForCausalLM",
        {"hidden_size": 36, "n_layer": 2, "n_head": 6},
        "alibi",
    ),
    "mpt": (
        "MptConfig",
        "MptForCausalLM",
        {"d_model": 36, "n_layers": 2, "n_heads": 6, "max_seq_len": 128},
        "alibi",
    ),
    "mpt-expansion-2": (  # transformers builds its 4x MLP whatever the ratio says (test_hf_shapes.py)
        "MptConfig",
        "MptForCausalLM",
        {"d_model": 36, "n_layers": 2, "n_heads": 6, "max_seq_len": 128, "expansion_ratio": 2},
        "alibi",
    ),
    "falcon": (
        "FalconConfig",
        "FalconForCausalLM",
        {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "multi_query": True},
        "rope",
    ),
    "falcon-sequential": (
        "FalconConfig",
        "FalconForCausalLM",
        {
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "multi_query": False,
            "parallel_attn": False,
            "bias": True,
        },
        "rope",
    ),
    "falcon-grouped": (
        "FalconConfig",
        "FalconForCausalLM",
        {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_kv_heads": 2}
        | {"new_decoder_architecture": True},
        "rope",
    ),
    "falcon-alibi": (  # Falcon-RW's layout
        "FalconConfig",
        "FalconForCausalLM",
        {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "multi_query": False}
        | {"parallel_attn": False, "bias": True, "alibi": True},
        "alibi",
    ),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", LLAMA_SHAPE | {"pad_token_id": 0}, "rope"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", LLAMA_SHAPE | {"head_dim": 16}, "rope"),
    "llama-attention-bias": (
        "LlamaConfig",
        "LlamaForCausalLM",
        LLAMA_SHAPE | {"attention_bias": True},
        "rope",
    ),
}
ORIGINAL = {"factor": 4.0, "original_max_position_embeddings": 16}
SCALINGS: dict[str, dict[str, Any]] = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", **ORIGINAL},
}


def longrope(head_dim: int, rotary_fraction: float = 1.0) -> dict[str, Any]:
    pairs = int(head_dim * rotary_fraction) // 2
    return {
        "rope_type": "longrope",
        **ORIGINAL,
        "short_factor": [1.0 + 0.25 * i for i in range(pairs)],
        "long_factor": [1.5 + i for i in range(pairs)],
    }


def save_random(directory: Path, case: str, **extra: Any) -> Any:
    config_name, model_name, fields, _ = FAMILIES[case]
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(vocab_size=VOCAB, **(fields | extra))
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.2)
    model.save_pretrained(directory)
    return model


def compare(reference: Any, directory: Path, lengths: tuple[int, ...] = (20, 96)) -> float:
    ours = load_hf_checkpoint(directory)
    generator = torch.Generator().manual_seed(1)
    worst = 0.0
    with torch.inference_mode():
        for length in lengths:
            tokens = torch.randint(1, VOCAB, (1, length), generator=generator)
            worst = max(worst, (ours(tokens) - reference(tokens).logits).abs().max().item())
    return worst


@pytest.mark.parametrize("case", list(FAMILIES))
def test_family_logits_match_transformers(tmp_path: Path, case: str) -> None:
    reference = save_random(tmp_path, case)
    lengths = (20, 96) if FAMILIES[case][3] != "learned" else (20, 120)
    assert compare(reference, tmp_path, lengths) <= TOLERANCE
    assert load_hf_checkpoint(tmp_path).config.pe == FAMILIES[case][3]


ROPE_CASES = [case for case, (*_, scheme) in FAMILIES.items() if scheme == "rope"]


@pytest.mark.parametrize("scaling", list(SCALINGS))
# GPT-J's reference ignores rope parameters (fixed sinusoids) and Phi-3's accepts only longrope:
# for those two transformers is no oracle of other scalings (Phi-3's longrope has its own test).
@pytest.mark.parametrize("case", ["gpt_neox", "stablelm", "falcon", "qwen3", "llama-attention-bias"])
def test_rope_families_match_under_scalings(tmp_path: Path, case: str, scaling: str) -> None:
    reference = save_random(tmp_path, case, rope_parameters=SCALINGS[scaling] | rope_defaults(case))
    assert compare(reference, tmp_path) <= TOLERANCE


def rope_defaults(case: str) -> dict[str, Any]:
    """The family's own rope parameters, which a `rope_parameters` given to its config replaces."""
    return {"rope_theta": 10000.0} | (
        {"partial_rotary_factor": 0.5} if case.startswith(("stablelm", "gpt_neox")) else {}
    )


def test_phi3_longrope_matches_past_the_original_length(tmp_path: Path) -> None:
    """Phi-3's LongRoPE: short factors up to original_max_position_embeddings (16), long ones past it."""
    reference = save_random(tmp_path, "phi3", rope_parameters=longrope(8) | {"rope_theta": 10000.0})
    assert compare(reference, tmp_path, lengths=(12, 40)) <= TOLERANCE


def tokenizer_for(directory: Path) -> None:
    vocabulary = {f"w{i}": i for i in range(VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocabulary, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))


@pytest.mark.parametrize(
    "case",
    ["gpt2", "gptj", "gpt_neox", "stablelm", "bloom", "mpt", "falcon", "falcon-alibi", "phi3", "qwen3"],
)
def test_engine_generates_and_scores_like_transformers(tmp_path: Path, case: str) -> None:
    """The served model, on the C pass: 32 greedy tokens equal `generate()`'s, scored logprobs equal
    transformers'."""
    directory = tmp_path / case
    reference = save_random(directory, case, eos_token_id=None, bos_token_id=None)
    tokenizer_for(directory)
    engine = InferenceEngine.from_model_dirs([directory], device="cpu", dtype="float32")
    engine.start()
    if batch_pass.available():
        assert [info.backend for info in engine.models()] == ["c"]
    prompt = [5, 17, 42, 3, 9, 11]
    try:
        request = GenerationRequest(
            request_id=case,
            model=case,
            prompt_tokens=tuple(prompt),
            sampling=SamplingParams(max_new_tokens=32, temperature=0.0),
        )
        result = list(engine.submit(request))[-1]
        assert isinstance(result, GenerationResult)
        document = (*prompt, *result.tokens)
        scored = list(engine.submit(ScoringRequest(f"{case}-score", case, document)))[-1]
        assert isinstance(scored, ScoreResult)
    finally:
        engine.shutdown()
    expected = reference.generate(
        torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0
    )[0, len(prompt) :]
    assert list(result.tokens) == expected.tolist()
    with torch.inference_mode():
        logprobs = torch.log_softmax(reference(torch.tensor([document])).logits[0].float(), dim=-1)
    reference_logprobs = logprobs[torch.arange(len(document) - 1), torch.tensor(document[1:])]
    assert scored.token_logprobs[0] is None
    ours = torch.tensor(scored.token_logprobs[1:], dtype=torch.float32)
    assert (ours - reference_logprobs).abs().max().item() <= TOLERANCE


def test_unsupported_features_are_refused_by_key() -> None:
    base = {"model_type": "stablelm", "vocab_size": VOCAB} | LLAMA_SHAPE
    with pytest.raises(UnsupportedCheckpointError, match="qk_layernorm"):
        hf_config_to_model_config(base | {"qk_layernorm": True})
    with pytest.raises(UnsupportedCheckpointError, match="model_type"):
        hf_config_to_model_config(base | {"model_type": "gemma2"})
    with pytest.raises(UnsupportedCheckpointError, match="num_kv_heads"):
        hf_config_to_model_config(
            {"model_type": "falcon", "vocab_size": VOCAB, "hidden_size": 32}
            | HEADS
            | {"multi_query": False, "num_kv_heads": 2, "num_hidden_layers": 2}
        )
    with pytest.raises(UnsupportedCheckpointError, match="final_logit_softcapping"):
        hf_config_to_model_config(base | {"model_type": "llama", "final_logit_softcapping": 30.0})


PER_REQUEST = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}


def test_live_server_serves_the_families_with_per_request_scalings(tmp_path: Path) -> None:
    """Nine families behind one real server, every one on the C pass where it is built: `/score`
    equals transformers (Qwen3 also under a request's own YaRN scaling, transformers given the
    same scaling in its config, same weights), and greedy `/generate` equals `generate()`."""
    extras: dict[str, dict[str, Any]] = {"phi3": {"rope_parameters": longrope(8) | {"rope_theta": 10000.0}}}
    cases = ("gpt2", "gptj", "gpt_neox", "stablelm", "bloom", "mpt-expansion-2", "falcon", "phi3", "qwen3")
    references = {}
    for case in cases:
        references[case] = save_random(
            tmp_path / case, case, eos_token_id=None, bos_token_id=None, **extras.get(case, {})
        )
        tokenizer_for(tmp_path / case)
    config_name, model_name, fields, _ = FAMILIES["qwen3"]
    scaled_config = getattr(transformers, config_name)(
        vocab_size=VOCAB, **fields, rope_parameters={"rope_type": "yarn", **ORIGINAL, "rope_theta": 10000.0}
    )
    scaled = getattr(transformers, model_name)(scaled_config).eval()
    scaled.load_state_dict(references["qwen3"].state_dict())
    document = [
        int(token) for token in torch.randint(1, VOCAB, (40,), generator=torch.Generator().manual_seed(3))
    ]

    def reference_logprobs(model: Any) -> torch.Tensor:
        with torch.inference_mode():
            logprobs = torch.log_softmax(model(torch.tensor([document])).logits[0], dim=-1)
        return logprobs[torch.arange(len(document) - 1), torch.tensor(document[1:])]

    with live_server([tmp_path / case for case in cases], options={"grpc_port": 0}) as server:
        listed = httpx.get(server.url("/models")).json()["models"]
        assert {card["name"]: card["scheme"] for card in listed} == {
            case: FAMILIES[case][3] for case in cases
        }
        if batch_pass.available():
            assert {card["name"]: card["backend"] for card in listed} == dict.fromkeys(cases, "c")
        for case, reference, scaling in [
            *((case, references[case], None) for case in cases),
            ("qwen3", scaled, PER_REQUEST),
        ]:
            body: dict[str, Any] = {"model": case, "tokens": document}
            if scaling is not None:
                body["pe_scaling"] = scaling
            answer = httpx.post(server.url("/score"), json=body, timeout=60).json()
            ours = torch.tensor(answer["token_logprobs"][1:])
            assert (ours - reference_logprobs(reference)).abs().max().item() <= TOLERANCE, (case, scaling)
        prompt = document[:6]
        for case in cases:
            answer = httpx.post(
                server.url("/generate"),
                json={"model": case, "tokens": prompt, "max_new_tokens": 32, "temperature": 0},
                timeout=60,
            ).json()
            expected = references[case].generate(
                torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0
            )[0, len(prompt) :]
            assert answer["tokens"] == expected.tolist(), case
