"""Chat completions on a Hugging Face directory whose tokenizer_config.json has a chat template.

The prompt must be the one transformers' `apply_chat_template` builds from the same directory
(transformers is the oracle here, never a run-time dependency), and the answer the generation of
that prompt; the client is the real `openai` package.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import transformers
from openai.types.chat import ChatCompletionMessageParam
from tokenizers import Tokenizer

from tests.live_server import LiveServer, OptionValue, live_server
from tests.service.api.conftest import SERVER_ENV
from tests.service.api.helpers import assert_stream_matches_openapi
from tests.service.api.test_hf_model_dir import write_tiny_llama

MODEL = "chat-llama"
# Uses what transformers provides a template: special tokens, loop variables, trimmed blocks,
# raise_exception and the generation prompt.
TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'assistant' %}{{ raise_exception('Start with a user turn.') }}{% endif %}\n"
    "{% for message in messages %}\n"
    "    {% if message['role'] == 'system' %}w1 {{ message['content'] }}\n"
    "    {% elif message['role'] == 'user' %}w2 {{ message['content'] }}\n"
    "    {% else %}w3 {{ message['content'] }} {{ eos_token }}\n"
    "    {% endif %}\n"
    "{% endfor %}\n"
    "{% if add_generation_prompt %}w3{% endif %}"
)
MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "w10 w11"},
    {"role": "user", "content": "w12 w13 w14"},
    {"role": "assistant", "content": "w15"},
    {"role": "user", "content": "w16 w17"},
]


def write_chat_llama(directory: Path) -> Path:
    """The tiny Llama, its special tokens registered in tokenizer.json as real checkpoints do."""
    write_tiny_llama(directory)
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tokenizer.add_special_tokens(["w60", "w61", "w62"])
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "w60",
        "eos_token": "w61",
        "pad_token": "w62",
        "chat_template": TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_chat_llama(tmp_path_factory.mktemp("chat") / MODEL)


@pytest.fixture(scope="module")
def chat_server(chat_dir: Path) -> Iterator[LiveServer]:
    options: dict[str, OptionValue] = {"device": "cpu", "dtype": "float32", "max_context": 512}
    with live_server([chat_dir], options=options, env=SERVER_ENV) as server:
        yield server


@pytest.fixture
def oai(chat_server: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=chat_server.url("/v1"), api_key="x", max_retries=0, timeout=60.0) as client:
        yield client


@pytest.fixture
def http(chat_server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=chat_server.base_url, timeout=60.0) as client:
        yield client


@pytest.fixture(scope="module")
def oracle_ids(chat_dir: Path) -> list[int]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(chat_dir))
    conversation: Any = MESSAGES
    ids: Any = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # newer transformers return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def test_the_prompt_is_the_one_transformers_renders(http: httpx.Client, oracle_ids: list[int]) -> None:
    tokenized = http.post("/tokenize", json={"messages": MESSAGES}).json()
    assert tokenized["tokens"] == oracle_ids
    assert oracle_ids[0] == 60  # the template's bos_token


def test_chat_answers_with_the_generation_of_that_prompt(
    oai: openai.OpenAI, http: httpx.Client, oracle_ids: list[int]
) -> None:
    chat = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0)
    expected = http.post(
        "/generate", json={"tokens": oracle_ids, "max_new_tokens": 6, "temperature": 0}
    ).json()
    (choice,) = chat.choices
    assert choice.message.role == "assistant" and choice.message.content == expected["text"]
    assert chat.usage is not None and chat.usage.prompt_tokens == len(oracle_ids)
    assert chat.model_dump()["pe"]["scheme"] == "rope"


def test_chat_logprobs_have_the_chat_shape(
    oai: openai.OpenAI, http: httpx.Client, oracle_ids: list[int]
) -> None:
    chat = oai.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    expected = http.post(
        "/generate", json={"tokens": oracle_ids, "max_new_tokens": 4, "temperature": 0, "logprobs": True}
    ).json()
    logprobs = chat.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert [entry.logprob for entry in logprobs.content] == pytest.approx(expected["logprobs"], abs=1e-5)
    for entry in logprobs.content:
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token
        assert entry.bytes == list(entry.token.encode())


def test_a_streamed_chat_adds_up_to_the_whole_answer(oai: openai.OpenAI) -> None:
    whole = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0)
    chunks = list(
        oai.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=6,
            temperature=0,
            stream=True,
            n=2,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    for index in (0, 1):
        deltas = [c.delta.content or "" for chunk in chunks for c in chunk.choices if c.index == index]
        assert "".join(deltas) == whole.choices[0].message.content
    assert sorted(c.index for chunk in chunks for c in chunk.choices if c.finish_reason) == [0, 1]


def test_streamed_chat_events_match_the_documented_event_schema(http: httpx.Client) -> None:
    """The chat twin of the completions check (`make fuzz` found both undocumented)."""
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 5}
    assert_stream_matches_openapi(http, "/v1/chat/completions", body)


def test_a_template_refusing_the_messages_is_a_400(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="Start with a user turn"):
        oai.chat.completions.create(model=MODEL, messages=[{"role": "assistant", "content": "w1"}])


def test_tokenizer_info_reports_the_tokenizer_config(http: httpx.Client) -> None:
    info = http.get("/tokenizer_info").json()
    assert (info["bos_token"], info["eos_token"], info["pad_token"]) == ("w60", "w61", "w62")
    assert info["chat_template"] == TEMPLATE and info["model"] == MODEL
