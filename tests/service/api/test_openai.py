"""The OpenAI-compatible routes through the real `openai` package, against a live server.

The client is OpenAI's own (base_url set to the server), so request encoding, response parsing,
the SSE reader and the typed exceptions are exactly what users of OpenAI clients get.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.live_server import LiveServer
from tests.service.api.conftest import NATIVE_CONTEXT, model_name
from tests.service.api.helpers import assert_stream_matches_openapi

MODEL = model_name("rope")
PROMPT = "def fib(n):"
LONG_PROMPT = "".join(chr(97 + i % 26) for i in range(NATIVE_CONTEXT * 2))  # past the native context
YARN = {"type": "yarn", "factor": 4.0}


@pytest.fixture
def oai(server: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=60.0) as client:
        yield client


def generate(client: httpx.Client, **body: Any) -> dict[str, Any]:
    response = client.post("/generate", json=body)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def score(client: httpx.Client, **body: Any) -> dict[str, Any]:
    response = client.post("/score", json=body)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def test_models_lists_every_model_with_its_positions(oai: openai.OpenAI, client: httpx.Client) -> None:
    listed = {model.id: model.model_dump() for model in oai.models.list()}
    cards = {card["name"]: card for card in client.get("/models").json()["models"]}
    assert set(listed) == set(cards)
    for name, model in listed.items():
        assert model["object"] == "model"
        for field in ("scheme", "native_context", "max_context", "supported_scalings"):
            assert model[field] == cards[name][field]


def test_a_completion_is_the_generation_of_the_same_prompt(oai: openai.OpenAI, client: httpx.Client) -> None:
    completion = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    expected = generate(client, prompt=PROMPT, model=MODEL, max_new_tokens=8, temperature=0)
    (choice,) = completion.choices
    assert choice.text == expected["text"]
    assert choice.finish_reason == "length"
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (
        expected["usage"]["prompt_tokens"],
        8,
    )
    assert completion.model_dump()["pe"]["scheme"] == "rope"


def test_a_streamed_completion_parses_with_openais_reader_and_adds_up(oai: openai.OpenAI) -> None:
    whole = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0)
    chunks = list(
        oai.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(choice.text for chunk in chunks for choice in chunk.choices)
    assert text == whole.choices[0].text
    assert [c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 10


def test_n_choices_and_several_prompts_are_numbered_like_openai(oai: openai.OpenAI) -> None:
    completion = oai.completions.create(
        model=MODEL, prompt=["ab", "cd"], max_tokens=6, n=3, temperature=1.0, seed=4
    )
    assert [choice.index for choice in completion.choices] == list(range(6))
    again = oai.completions.create(
        model=MODEL, prompt=["ab", "cd"], max_tokens=6, n=3, temperature=1.0, seed=4
    )
    assert [c.text for c in completion.choices] == [c.text for c in again.choices]
    assert len({c.text for c in completion.choices[:3]}) > 1  # the choices of one prompt differ


def test_logprobs_have_the_legacy_shape_and_match_generate(oai: openai.OpenAI, client: httpx.Client) -> None:
    completion = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    expected = generate(client, prompt=PROMPT, model=MODEL, max_new_tokens=6, temperature=0, logprobs=True)
    logprobs = completion.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None and logprobs.top_logprobs is not None
    assert logprobs.token_logprobs == pytest.approx(expected["logprobs"], abs=1e-5)
    assert logprobs.tokens is not None and logprobs.text_offset is not None
    for token, logprob, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        # Keyed by text, as OpenAI's legacy shape is: bytes >= 0x80 alone all read U+FFFD and merge.
        assert 1 <= len(top) <= 4 and top[token] == pytest.approx(logprob)
        assert max(top.values()) == pytest.approx(logprob)  # greedy: the chosen token is the best
    assert logprobs.text_offset == sorted(logprobs.text_offset)


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_with_logprobs_is_the_prompts_score(
    oai: openai.OpenAI, client: httpx.Client, max_tokens: int
) -> None:
    completion = oai.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=max_tokens, temperature=0, echo=True, logprobs=1
    )
    scored = score(client, prompt=PROMPT, model=MODEL)
    (choice,) = completion.choices
    logprobs = choice.logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None and logprobs.top_logprobs is not None
    prompt_part = logprobs.token_logprobs[: scored["num_tokens"]]
    assert prompt_part[0] is None and scored["token_logprobs"][0] is None
    assert prompt_part[1:] == pytest.approx(scored["token_logprobs"][1:], abs=1e-5)
    assert len(logprobs.token_logprobs) == scored["num_tokens"] + max_tokens
    assert logprobs.top_logprobs[0] is None and all(logprobs.top_logprobs[1:])
    assert choice.text.startswith(PROMPT)


def test_extra_body_pe_scaling_changes_logprobs_past_the_native_context_as_score_does(
    oai: openai.OpenAI, client: httpx.Client
) -> None:
    def echoed(**extra: Any) -> list[float | None]:
        completion = oai.completions.create(
            model=MODEL, prompt=LONG_PROMPT, max_tokens=0, echo=True, logprobs=1, extra_body=extra
        )
        logprobs = completion.choices[0].logprobs
        assert logprobs is not None and logprobs.token_logprobs is not None
        return list(logprobs.token_logprobs)

    scaled, plain = echoed(pe_scaling=YARN), echoed()
    assert scaled[1:] == pytest.approx(
        score(client, prompt=LONG_PROMPT, pe_scaling=YARN)["token_logprobs"][1:], abs=1e-5
    )
    assert plain[1:] == pytest.approx(score(client, prompt=LONG_PROMPT)["token_logprobs"][1:], abs=1e-5)
    differences = [abs(float(a or 0.0) - float(b or 0.0)) for a, b in zip(scaled, plain, strict=True)]
    assert max(differences) > 1e-3


def test_extension_sampling_controls_reach_the_engine(oai: openai.OpenAI, client: httpx.Client) -> None:
    controls = {"repetition_penalty": 3.0, "min_tokens": 4, "top_k": 5, "min_p": 0.1, "ignore_eos": True}
    completion = oai.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, extra_body=controls
    )
    expected = generate(client, prompt=PROMPT, model=MODEL, max_new_tokens=8, temperature=0, **controls)
    plain = generate(client, prompt=PROMPT, model=MODEL, max_new_tokens=8, temperature=0)
    assert completion.choices[0].text == expected["text"] != plain["text"]


def test_a_stop_token_id_finishes_with_stop(oai: openai.OpenAI, client: httpx.Client) -> None:
    expected = generate(client, prompt=PROMPT, model=MODEL, max_new_tokens=8, temperature=0)
    stop = expected["tokens"][3]
    completion = oai.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"stop_token_ids": [stop]}
    )
    assert completion.choices[0].finish_reason == "stop"
    assert (
        completion.usage is not None
        and completion.usage.completion_tokens == expected["tokens"].index(stop) + 1
    )


@pytest.mark.parametrize(
    ("arguments", "param"),
    [
        ({"temperature": -1}, "temperature"),
        ({"logprobs": 6}, "logprobs"),
        ({"suffix": "x"}, "suffix"),
        ({"best_of": 3}, "best_of"),
        ({"extra_body": {"min_p": 1.5}}, "min_p"),
        ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
        ({"extra_body": {"pe_scaling": {"type": "yarn", "factor": 0.5}}}, "pe_scaling.factor"),
        ({"extra_body": {"min_tokens": 9}}, "min_tokens"),
        ({"extra_body": {"not_a_field": 1}}, "not_a_field"),
        ({"frequency_penalty": 3}, "frequency_penalty"),
    ],
)
def test_bad_input_is_a_400_openai_clients_raise(
    oai: openai.OpenAI, arguments: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, **arguments)
    assert raised.value.status_code == 400
    body = raised.value.body
    assert isinstance(body, dict) and set(body) == {"message", "type", "param", "code"}
    assert body["param"] == param and body["type"] == "invalid_request_error"


def test_an_unknown_model_is_openais_not_found(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="gpt-nothing", prompt=PROMPT, max_tokens=2)


def test_chat_on_a_model_without_a_template_is_a_400_naming_it(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match=MODEL):
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])


def test_tokenize_detokenize_and_tokenizer_info(client: httpx.Client) -> None:
    tokens = client.post("/tokenize", json={"model": MODEL, "prompt": PROMPT}).json()
    assert tokens["tokens"] == score(client, prompt=PROMPT, model=MODEL)["tokens"]
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 512
    bare = client.post("/tokenize", json={"prompt": PROMPT, "add_special_tokens": False}).json()
    assert bare["tokens"] == tokens["tokens"][1:]
    text = client.post("/detokenize", json={"model": MODEL, "tokens": tokens["tokens"]}).json()
    assert text == {"prompt": PROMPT}
    info = client.get("/tokenizer_info", params={"model": model_name("alibi")}).json()
    assert info["model"] == model_name("alibi") and info["eos_token_id"] == 257
    assert info["chat_template"] is None and info["model_max_length"] == 512
    assert client.get("/tokenizer_info").json()["model"] == MODEL  # the default model


@pytest.mark.parametrize(
    ("method", "path", "body", "param"),
    [
        ("POST", "/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, "prompt"),
        ("POST", "/detokenize", {"tokens": [999]}, "tokens.0"),
        ("POST", "/tokenize", {"prompt": "a", "model": "nope"}, "model"),
    ],
)
def test_tokenizer_routes_refuse_bad_input(
    client: httpx.Client, method: str, path: str, body: dict[str, Any], param: str
) -> None:
    response = client.request(method, path, json=body)
    assert response.status_code in (404, 422) and response.json()["error"]["param"] == param


def test_streamed_completion_events_match_the_documented_event_schema(client: httpx.Client) -> None:
    """Found by `make fuzz` (ST105): the `/v1` routes streamed `text/event-stream` that their
    OpenAPI description did not list. Every event now validates against the one described."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5}
    assert_stream_matches_openapi(client, "/v1/completions", body)
