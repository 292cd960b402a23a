"""`--model-dir` also takes a Hugging Face Llama-family directory, named after its basename."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

from tests.live_server import OptionValue, live_server
from tests.service.api.conftest import SERVER_ENV

VOCAB = 64
NATIVE_CONTEXT = 128


def write_tiny_llama(directory: Path) -> Path:
    """Random weights via `save_pretrained`, and a word-level `tokenizer.json` ("w0".."w63")."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=NATIVE_CONTEXT,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


@pytest.fixture(scope="module")
def hf_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    directory = write_tiny_llama(tmp_path_factory.mktemp("hf") / "tiny-llama")
    options: dict[str, OptionValue] = {"device": "cpu", "dtype": "float32", "max_context": 512}
    with (
        live_server([directory], options=options, env=SERVER_ENV) as server,
        httpx.Client(base_url=server.base_url, timeout=60.0) as client,
    ):
        yield client


def test_the_directory_basename_is_the_model_name(hf_client: httpx.Client) -> None:
    (card,) = hf_client.get("/models").json()["models"]
    assert (card["name"], card["scheme"], card["native_context"]) == ("tiny-llama", "rope", NATIVE_CONTEXT)


def test_its_tokenizer_and_a_scaling_serve_a_request(hf_client: httpx.Client) -> None:
    request = {
        "prompt": " ".join(f"w{i % VOCAB}" for i in range(NATIVE_CONTEXT + 10)),
        "model": "tiny-llama",
        "pe_scaling": {"type": "yarn", "factor": 4.0},
        "max_new_tokens": 4,
        "temperature": 0,
    }
    response = hf_client.post("/generate", json=request)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["usage"]["prompt_tokens"] >= NATIVE_CONTEXT + 10
    assert body["pe"]["scaling"]["type"] == "yarn"
    assert body["pe"]["scaling"]["original_max_position_embeddings"] == NATIVE_CONTEXT
    assert all(0 <= token < VOCAB for token in body["tokens"])
