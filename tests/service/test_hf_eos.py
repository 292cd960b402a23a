"""Hugging Face checkpoints may list several EOS ids (Llama 3 Instruct: end of text, end of message,
end of turn); generation stops on any of them, not only on the first."""

from __future__ import annotations

import json
from pathlib import Path

from service.engine.engine import InferenceEngine
from service.engine.types import GenerationRequest, GenerationResult, SamplingParams
from service.model.hf import hf_config_to_model_config
from tests.service.api.test_hf_model_dir import write_tiny_llama

PROMPT = (1, 2, 3, 4, 5)


def _greedy(directory: Path, new_tokens: int) -> GenerationResult:
    engine = InferenceEngine.from_model_dirs([directory], device="cpu", dtype="float32")
    engine.start()
    try:
        request = GenerationRequest(
            request_id="eos",
            model=directory.name,
            prompt_tokens=PROMPT,
            sampling=SamplingParams(max_new_tokens=new_tokens, temperature=0.0),
        )
        final = list(engine.submit(request))[-1]
    finally:
        engine.shutdown()
    assert isinstance(final, GenerationResult)
    return final


def _set_eos(directory: Path, eos: int | list[int] | None) -> None:
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config["eos_token_id"] = eos
    config_path.write_text(json.dumps(config))


def test_every_listed_eos_id_is_kept() -> None:
    config = hf_config_to_model_config(
        {
            "model_type": "llama",
            "vocab_size": 128256,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "max_position_embeddings": 128,
            "eos_token_id": [128001, 128008, 128009],
        }
    )
    assert config.eos_id == 128001
    assert config.eos_ids == frozenset({128001, 128008, 128009})


def test_generation_stops_on_a_later_eos_id_of_the_list(tmp_path: Path) -> None:
    directory = write_tiny_llama(tmp_path / "tiny-llama")
    _set_eos(directory, None)
    free_run = _greedy(directory, new_tokens=6)
    assert free_run.finish_reason == "length"
    stop_at = free_run.tokens[2]
    unused = next(token for token in range(64) if token not in free_run.tokens)
    _set_eos(directory, [unused, stop_at])
    stopped = _greedy(directory, new_tokens=6)
    assert stopped.finish_reason == "eos"
    assert stopped.tokens == free_run.tokens[: free_run.tokens.index(stop_at) + 1]
