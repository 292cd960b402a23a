"""Every endpoint's happy path against a real server, streaming semantics included."""

from __future__ import annotations

import json
import math

import httpx
import pytest

from service.model.spec import TABLE_OR_BIAS_SCHEMES
from tests.service.api.conftest import MAX_CONTEXT, NATIVE_CONTEXT, SCHEME_ORDER, model_name
from tests.service.api.helpers import DONE, metric_value, sse_data

PROMPT = "def fib(n):"
MAX_NEW_TOKENS = 12
SAMPLED = {"prompt": PROMPT, "max_new_tokens": MAX_NEW_TOKENS, "temperature": 0.8, "seed": 7}


def test_healthz_and_readyz_answer_ok(client: httpx.Client) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").json() == {"status": "ready"}


def test_models_lists_every_resident_model_in_load_order(client: httpx.Client) -> None:
    models = client.get("/models").json()["models"]
    assert [card["name"] for card in models] == [model_name(scheme) for scheme in SCHEME_ORDER]
    rope = models[0]
    assert rope["scheme"] == "rope"
    assert (rope["native_context"], rope["max_context"]) == (NATIVE_CONTEXT, MAX_CONTEXT)
    assert set(rope["supported_scalings"]) >= {
        "none",
        "linear",
        "ntk",
        "dynamic",
        "yarn",
        "llama3",
        "longrope",
    }
    assert rope["parameters"] > 0 and rope["device"] == "cpu" and rope["dtype"] == "float32"
    # The default: the C step where it applies (float32, a scheme whose positions are tables or a
    # bias on the scores), else eager; nothing compiled.
    expected = {card["name"]: "c" if card["scheme"] in TABLE_OR_BIAS_SCHEMES else "eager" for card in models}
    assert {card["name"]: card["backend"] for card in models} == expected
    assert {card["weights"] for card in models} == {"float"}


def test_generate_returns_the_spec_response(client: httpx.Client) -> None:
    response = client.post("/generate", json=SAMPLED)
    assert response.status_code == 200, response.text
    body = response.json()
    assert set(body) == {
        "id",
        "model",
        "text",
        "tokens",
        "logprobs",
        "top_logprobs",
        "finish_reason",
        "usage",
        "pe",
        "timing",
    }
    assert body["model"] == model_name("rope")
    assert body["finish_reason"] in ("length", "stop", "eos")
    assert body["usage"]["completion_tokens"] == len(body["tokens"]) <= MAX_NEW_TOKENS
    assert body["usage"]["prompt_tokens"] >= len(PROMPT)
    assert body["logprobs"] is None
    assert body["pe"]["scheme"] == "rope" and body["pe"]["native_context"] == NATIVE_CONTEXT
    assert set(body["timing"]) == {"queue_ms", "prefill_ms", "decode_ms"}


@pytest.mark.parametrize("content_type", ["application/json; charset=utf-8", "application/merge-patch+json"])
def test_json_content_types_with_parameters_or_suffixes_are_accepted(
    client: httpx.Client, content_type: str
) -> None:
    body = json.dumps({"prompt": "a", "max_new_tokens": 1}).encode()
    assert client.post("/generate", content=body, headers={"Content-Type": content_type}).status_code == 200


def test_the_spec_example_request_is_accepted_verbatim(client: httpx.Client) -> None:
    spec_example = {
        "prompt": "def fib(n):",
        "tokens": None,
        "model": None,
        "pe": "rope",
        "pe_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
        "max_new_tokens": 64,
        "temperature": 0.8,
        "top_k": 0,
        "top_p": 1.0,
        "seed": 7,
        "stop": ["\n\n"],
        "stream": False,
        "logprobs": False,
    }
    response = client.post("/generate", json=spec_example)
    assert response.status_code == 200, response.text
    assert response.json()["pe"]["scaling"]["original_max_position_embeddings"] == 256


@pytest.mark.parametrize("mode", [None, "bucketed", "hf"])
def test_the_pe_block_says_which_dynamic_ntk_semantics_ran(client: httpx.Client, mode: str | None) -> None:
    scaling = {"type": "dynamic", "factor": 4.0} | ({"dynamic_mode": mode} if mode else {})
    body = {"prompt": "def f():", "pe_scaling": scaling, "max_new_tokens": 4, "temperature": 0}
    response = client.post("/generate", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["pe"]["scaling"]["dynamic_mode"] == (mode or "bucketed")
    bad = client.post("/generate", json=body | {"pe_scaling": scaling | {"dynamic_mode": "exact"}})
    assert bad.status_code == 422 and bad.json()["error"]["param"].startswith("pe_scaling")


def test_request_id_is_echoed_or_generated(client: httpx.Client) -> None:
    assert client.get("/healthz", headers={"X-Request-ID": "trace-42"}).headers["X-Request-ID"] == "trace-42"
    generated = client.get("/healthz").headers["X-Request-ID"]
    assert len(generated) >= 16
    replaced = client.get("/healthz", headers={"X-Request-ID": "not a token"}).headers["X-Request-ID"]
    assert replaced != "not a token" and len(replaced) >= 16


def test_same_seed_gives_the_same_answer(client: httpx.Client) -> None:
    first, second = (client.post("/generate", json=SAMPLED).json() for _ in range(2))
    assert first["tokens"] == second["tokens"]


def test_a_vanishing_repetition_penalty_generates_and_the_engine_stays_up(client: httpx.Client) -> None:
    """Found by `make fuzz`: 1e-300 is a valid penalty (> 0), and it used to kill the engine process."""
    body = {**SAMPLED, "repetition_penalty": 1e-300}
    reply = client.post("/generate", json=body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == MAX_NEW_TOKENS
    assert client.get("/readyz").status_code == 200


def test_stream_sends_one_event_per_token_then_usage_then_done(client: httpx.Client) -> None:
    expected = client.post("/generate", json=SAMPLED).json()
    with client.stream("POST", "/generate", json={**SAMPLED, "stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = list(sse_data(response))
    *token_events, end, done = events
    assert done == DONE
    assert all(set(event) == {"token", "text"} for event in token_events)
    assert [event["token"] for event in token_events] == expected["tokens"]
    assert "".join(event["text"] for event in token_events) == expected["text"]
    assert end["finish_reason"] == expected["finish_reason"]
    assert end["usage"] == expected["usage"]
    assert end["pe"] == expected["pe"]


def test_generated_logprobs_match_score(client: httpx.Client) -> None:
    prompt = list(b"import os\n")
    generated = client.post(
        "/generate", json={"tokens": prompt, "max_new_tokens": 8, "temperature": 0, "logprobs": True}
    ).json()
    scored = client.post("/score", json={"tokens": prompt + generated["tokens"]}).json()
    tail = scored["token_logprobs"][len(prompt) :]
    assert tail == pytest.approx(generated["logprobs"], abs=1e-3)


def test_score_returns_one_logprob_per_token(client: httpx.Client) -> None:
    tokens = list(b"for i in range(10):\n")
    body = client.post("/score", json={"tokens": tokens}).json()
    assert set(body) == {"model", "tokens", "token_logprobs", "total_logprob", "perplexity", "num_tokens"}
    assert body["tokens"] == tokens and body["num_tokens"] == len(tokens)
    assert body["token_logprobs"][0] is None and len(body["token_logprobs"]) == len(tokens)
    assert body["total_logprob"] == pytest.approx(sum(body["token_logprobs"][1:]), rel=1e-5)
    assert body["perplexity"] == pytest.approx(math.exp(-body["total_logprob"] / (len(tokens) - 1)), rel=1e-6)


def test_score_of_a_prompt_uses_the_tokenizer(client: httpx.Client) -> None:
    body = client.post("/score", json={"prompt": "x = 1\n", "pe": "alibi"}).json()
    assert body["model"] == model_name("alibi")
    assert body["num_tokens"] >= len("x = 1\n")


def test_metrics_expose_every_spec_metric(client: httpx.Client) -> None:
    client.post("/generate", json=SAMPLED)
    text = client.get("/metrics").text
    for name in (
        "pe_serve_requests_total",
        "pe_serve_request_duration_seconds",
        "pe_serve_time_to_first_token_seconds",
        "pe_serve_generated_tokens_total",
        "pe_serve_queue_depth",
        "pe_serve_batch_size",
        "pe_cache_hits_total",
        "pe_cache_misses_total",
        "pe_cache_evictions_total",
        "pe_cache_bytes",
    ):
        assert f"# HELP {name} " in text, name
    assert 'pe_serve_requests_total{endpoint="/generate",protocol="http",status="200"}' in text
    assert metric_value(client, "pe_serve_time_to_first_token_seconds_count") > 0
    assert metric_value(client, "pe_serve_generated_tokens_total") > 0


def test_metrics_report_each_models_kv_pool(client: httpx.Client) -> None:
    """The pool is sized at start-up and idle between requests: capacity and bytes fixed, usage 0."""
    client.post("/generate", json=SAMPLED)
    text = client.get("/metrics").text
    names = (
        "pe_kv_cache_usage_perc",
        "pe_kv_cache_capacity_tokens",
        "pe_kv_cache_bytes",
        "pe_kv_cache_resident_bytes",
        "pe_kv_side_bytes",
    )
    for name in names:
        assert f"# HELP {name} " in text, name
    assert metric_value(client, 'pe_kv_cache_usage_perc{model="tiny-rope"}') == 0.0
    assert metric_value(client, 'pe_kv_cache_capacity_tokens{model="tiny-rope"}') >= MAX_CONTEXT
    assert metric_value(client, 'pe_kv_cache_bytes{model="tiny-rope"}') > 0
    resident = metric_value(client, 'pe_kv_cache_resident_bytes{model="tiny-rope"}')
    assert 0 < resident <= metric_value(client, 'pe_kv_cache_bytes{model="tiny-rope"}')
    assert metric_value(client, 'pe_kv_side_bytes{model="tiny-rope"}') == 0.0  # no row holds copies
    assert metric_value(client, 'pe_decode_backend{backend="c",model="tiny-rope"}') == 1.0


def test_openapi_has_an_example_per_scaling_type(client: httpx.Client) -> None:
    schema = client.get("/openapi.json").json()
    assert {"/generate", "/score", "/models", "/healthz", "/readyz", "/metrics"} <= set(schema["paths"])
    examples = schema["paths"]["/generate"]["post"]["requestBody"]["content"]["application/json"]["examples"]
    scaling_types = {example["value"].get("pe_scaling", {}).get("type") for example in examples.values()}
    assert scaling_types >= {"none", "linear", "ntk", "dynamic", "yarn", "llama3", "longrope"}


def test_stream_with_a_stop_string_matches_the_json_answer(client: httpx.Client) -> None:
    sampled = {"tokens": list(b"def main():\n"), "max_new_tokens": 24, "temperature": 0.8, "seed": 1}
    generated = client.post("/generate", json=sampled).json()["tokens"]
    stop = next(
        (chr(token) for token in generated[3:] if chr(token).isascii() and chr(token).isalnum()), None
    )
    if stop is None:
        pytest.skip("the tiny model generated no ASCII letter or digit to stop on")
    request = {**sampled, "stop": [stop]}
    expected = client.post("/generate", json=request).json()
    assert expected["finish_reason"] == "stop"
    with client.stream("POST", "/generate", json={**request, "stream": True}) as response:
        *token_events, end, _ = list(sse_data(response))
    assert "".join(event["text"] for event in token_events) == expected["text"]
    assert end["finish_reason"] == "stop"


def test_streamed_logprobs_match_the_json_answer(client: httpx.Client) -> None:
    request = {**SAMPLED, "logprobs": True}
    expected = client.post("/generate", json=request).json()
    with client.stream("POST", "/generate", json={**request, "stream": True}) as response:
        *token_events, _, _ = list(sse_data(response))
    assert [event["logprob"] for event in token_events] == pytest.approx(expected["logprobs"], abs=1e-5)


def test_top_logprobs_are_sorted_alternatives_with_text_in_responses_and_streams(
    client: httpx.Client,
) -> None:
    request = {
        "prompt": "def fib(n):",
        "max_new_tokens": 5,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 4,
    }
    body = client.post("/generate", json=request).json()
    assert len(body["top_logprobs"]) == 5
    for token, logprob, alternatives in zip(
        body["tokens"], body["logprobs"], body["top_logprobs"], strict=True
    ):
        assert [set(entry) for entry in alternatives] == [{"token", "text", "logprob"}] * 4
        values = [entry["logprob"] for entry in alternatives]
        assert values == sorted(values, reverse=True)
        assert alternatives[0]["token"] == token and values[0] == pytest.approx(logprob)  # greedy: the best
    with client.stream("POST", "/generate", json={**request, "stream": True}) as response:
        *events, _end, _done = list(sse_data(response))
    assert [event["top_logprobs"] for event in events] == body["top_logprobs"]


def test_a_repeated_prompt_reports_its_cached_tokens_and_counts_in_metrics(client: httpx.Client) -> None:
    """The second run of a 40-token prompt reads its first two blocks of 16 from the prefix cache."""
    tokens = [256, *range(10, 49)]
    request = {"tokens": tokens, "max_new_tokens": 4, "temperature": 0, "logprobs": True}
    hits_before = metric_value(client, 'pe_prefix_cache_hits_total{model="tiny-rope"}')
    first = client.post("/generate", json=request).json()
    second = client.post("/generate", json=request).json()
    assert second["usage"]["cached_tokens"] == 32 and second["usage"]["prompt_tokens"] == 40
    assert second["tokens"] == first["tokens"]
    assert second["logprobs"] == pytest.approx(first["logprobs"], abs=1e-4)
    assert metric_value(client, 'pe_prefix_cache_hits_total{model="tiny-rope"}') - hits_before >= 32
    assert metric_value(client, 'pe_prefix_cache_blocks{model="tiny-rope"}') >= 2
    completion = client.post(
        "/v1/completions", json={"model": "tiny-rope", "prompt": tokens, "max_tokens": 2}
    )
    assert completion.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
