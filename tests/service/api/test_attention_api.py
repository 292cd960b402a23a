"""`pe_attention` as served: a real server on loopback, a tiny random Llama, every rule.

`/score` under each rule must equal the float64 model with the method's published attention
(`tests/references/`, through `tests.service.test_attention_model`) within 2e-4, and greedy
`/generate` must continue as that reference does. The same requests sent at once, mixed with plain
ones, must equal each alone within 1e-5; `/v1/completions` (echo + logprobs) with the field at the
top level equals `/score`; a bad rule is 422 (400 on `/v1`) naming the field; cards list the rules
a scheme applies, responses echo the resolved rule, `/metrics` counts requests per rule.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from service.model.attention_rules import AttentionRule
from service.model.checkpoint import load_checkpoint
from tests.conftest import TinyCheckpointFactory
from tests.live_server import LiveServer, OptionValue, live_server
from tests.service.api.conftest import SERVER_ENV
from tests.service.test_attention_model import BASE, CASES, IDS, model, reference_logprobs, text

MODEL = "tiny-rules"
TOLERANCE = 2e-4
GENERATED = 8
TIMEOUT = 120.0


@pytest.fixture(scope="module")
def server(make_tiny_checkpoint: TinyCheckpointFactory) -> Iterator[LiveServer]:
    rope = make_tiny_checkpoint("rope", name=MODEL, seed=5, rope_base=BASE, native_context=128)
    alibi = make_tiny_checkpoint("alibi", name="tiny-alibi-rules")
    options: dict[str, OptionValue] = {"device": "cpu", "dtype": "float32", "max_context": 512}
    with live_server([rope, alibi], options=options, env=SERVER_ENV) as running:
        yield running


def score(server: LiveServer, tokens: list[int], rule: AttentionRule | None, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "tokens": tokens, **extra}
    if rule is not None:
        body["pe_attention"] = rule.to_dict()
    response = httpx.post(server.url("/score"), json=body, timeout=TIMEOUT)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def logprobs_of(result: dict[str, Any]) -> torch.Tensor:
    return torch.tensor(result["token_logprobs"][1:], dtype=torch.float64)


@pytest.mark.parametrize(("rule", "attention"), CASES, ids=IDS)
def test_score_and_greedy_generation_equal_the_authors_attention(
    server: LiveServer, rule: AttentionRule, attention: Any
) -> None:
    tokens = text()
    reference = reference_logprobs(model(), tokens, attention)  # [T, V]
    expected = reference[:-1].gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]
    result = score(server, tokens, rule)
    assert result["pe"]["attention"] == rule.to_dict()
    error = (logprobs_of(result) - expected).abs().max().item()
    assert error <= TOLERANCE, f"/score vs reference: {error:.3g}"

    prompt = tokens[:60]
    body = {"model": MODEL, "tokens": prompt, "max_new_tokens": GENERATED, "temperature": 0.0}
    body["pe_attention"] = rule.to_dict()
    response = httpx.post(server.url("/generate"), json=body, timeout=TIMEOUT)
    assert response.status_code == 200, response.text
    generated = response.json()["tokens"]
    continued = list(prompt)
    for _ in range(GENERATED):
        continued.append(int(reference_logprobs(model(), continued, attention)[-1].argmax()))
    assert generated == continued[len(prompt) :]
    assert response.json()["pe"]["attention"] == rule.to_dict()


def test_rules_mixed_at_once_with_plain_requests_equal_each_alone(server: LiveServer) -> None:
    rules: list[AttentionRule | None] = [rule for rule, _ in CASES] + [None, None]
    texts = [text(seed) for seed in range(len(rules))]
    alone = [logprobs_of(score(server, tokens, rule)) for tokens, rule in zip(texts, rules, strict=True)]
    generations = [
        {"model": MODEL, "tokens": tokens[:40], "max_new_tokens": 6, "temperature": 0.0}
        | ({"pe_attention": rule.to_dict()} if rule is not None else {})
        for tokens, rule in zip(texts, rules, strict=True)
    ]

    def generate(body: dict[str, Any]) -> list[int]:
        response = httpx.post(server.url("/generate"), json=body, timeout=TIMEOUT)
        assert response.status_code == 200, response.text
        tokens: list[int] = response.json()["tokens"]
        return tokens

    generated_alone = [generate(body) for body in generations]
    with ThreadPoolExecutor(2 * len(rules)) as pool:
        scored = [pool.submit(score, server, tokens, rule) for tokens, rule in zip(texts, rules, strict=True)]
        generated = [pool.submit(generate, body) for body in generations]
        together = [logprobs_of(future.result()) for future in scored]
        generated_together = [future.result() for future in generated]
    for rule, first, second in zip(rules, alone, together, strict=True):
        assert (first - second).abs().max().item() <= 1e-5, rule
    assert generated_together == generated_alone


def test_openai_completions_with_the_field_equal_score(server: LiveServer) -> None:
    rule, _ = CASES[1]
    tokens = text(4)
    body = {
        "model": MODEL,
        "prompt": tokens,
        "max_tokens": 1,
        "echo": True,
        "logprobs": 0,
        "pe_attention": rule.to_dict(),
    }
    response = httpx.post(server.url("/v1/completions"), json=body, timeout=TIMEOUT)
    assert response.status_code == 200, response.text
    echoed = response.json()["choices"][0]["logprobs"]["token_logprobs"][1 : len(tokens)]
    expected = logprobs_of(score(server, tokens, rule))
    assert (torch.tensor(echoed, dtype=torch.float64) - expected).abs().max().item() <= 1e-5
    assert (expected - logprobs_of(score(server, tokens, None))).abs().max().item() > 1e-3


@pytest.mark.parametrize(
    ("model_name", "attention", "param"),
    [
        (MODEL, {"type": "sliding"}, "pe_attention.type"),
        (MODEL, {"type": "self_extend", "group_size": 4, "window": 0}, "pe_attention.window"),
        (MODEL, {"type": "self_extend", "window": 8}, "pe_attention.group_size"),
        (MODEL, {"type": "dca", "chunk_size": 8, "local_window": 8}, "pe_attention.local_window"),
        (MODEL, {"type": "rerope", "window": 8, "group_size": 2}, "pe_attention.group_size"),
        (MODEL, {"type": "standard", "logn": 1}, "pe_attention.logn"),
        (MODEL, {"type": "leaky_rerope", "window": 8, "leak": "2"}, "pe_attention.leak"),
        ("tiny-alibi-rules", {"type": "rerope", "window": 8}, "pe_attention.type"),
    ],
)
def test_bad_rules_are_refused_naming_the_field(
    server: LiveServer, model_name: str, attention: dict[str, Any], param: str
) -> None:
    body = {"model": model_name, "tokens": [1, 2, 3], "pe_attention": attention}
    response = httpx.post(server.url("/score"), json=body, timeout=TIMEOUT)
    assert response.status_code == 422, response.text
    assert response.json()["error"]["param"] == param
    openai = {"model": model_name, "prompt": [1, 2, 3], "max_tokens": 1, "pe_attention": attention}
    response = httpx.post(server.url("/v1/completions"), json=openai, timeout=TIMEOUT)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_streaming_serves_alibi_and_cards_list_the_rules(server: LiveServer) -> None:
    cards = {card["name"]: card for card in httpx.get(server.url("/models")).json()["models"]}
    assert cards[MODEL]["supported_attention"] == [
        "standard",
        "self_extend",
        "rerope",
        "leaky_rerope",
        "dca",
        "streaming",
    ]
    assert cards["tiny-alibi-rules"]["supported_attention"] == ["standard", "streaming"]
    body = {
        "model": "tiny-alibi-rules",
        "tokens": text(5)[:50],
        "pe_attention": {"type": "streaming", "sink_tokens": 2, "window": 8},
    }
    windowed = httpx.post(server.url("/score"), json=body, timeout=TIMEOUT).json()
    standard = {"pe_attention": {"type": "standard"}}
    plain = httpx.post(server.url("/score"), json=body | standard, timeout=TIMEOUT).json()
    assert windowed["pe"]["attention"] == {"type": "streaming", "sink_tokens": 2, "window": 8}
    assert plain["pe"]["attention"] == {"type": "standard"}
    near = 2 + 8 + 1  # every query up to here sees every key either way
    assert windowed["token_logprobs"][1:near] == pytest.approx(plain["token_logprobs"][1:near], abs=1e-5)
    assert windowed["token_logprobs"][near:] != pytest.approx(plain["token_logprobs"][near:], abs=1e-4)


def test_metrics_count_requests_per_rule(server: LiveServer) -> None:
    def count(label: str) -> float:
        metrics = httpx.get(server.url("/metrics")).text
        for line in metrics.splitlines():
            series = line.startswith("pe_attention_requests_total{") and f'model="{MODEL}"' in line
            if series and f'attention="{label}"' in line:
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    before = count("self_extend+logn")
    score(server, text(6)[:20], CASES[2][0])
    assert count("self_extend+logn") == before + 1


def test_the_checkpoint_under_test_is_the_reference_model(
    make_tiny_checkpoint: TinyCheckpointFactory,
) -> None:
    """The server's weights are `model()`'s: the parity above compares like with like."""
    directory: Path = make_tiny_checkpoint("rope", name=MODEL, seed=5, rope_base=BASE, native_context=128)
    reference = model().state_dict()
    for name, value in load_checkpoint(directory).state_dict().items():
        assert torch.equal(value, reference[name]), name
