"""`pe_attention` over gRPC: the `PEAttention` oneof runs the rule HTTP runs, and echoes it.

Each type (some with `logn`) scored over gRPC equals the same rule over HTTP `/score` within 1e-6,
and a greedy `Generate` equals `/generate`; the end message, the score response and the cards
carry the resolved rule as the JSON does; a bad rule is INVALID_ARGUMENT with `pe-serve-param`
naming the field as HTTP's 422 does.
"""

from __future__ import annotations

from typing import Any

import grpc
import httpx
import pytest
import torch

from service.grpc_api import pe_serve_pb2 as pb
from tests.service import wire
from tests.service.grpc.helpers import as_generation, assert_status, generate, raw_call, request_bytes

PROMPT = "0123456789" * 10  # past the tiny models' native context (64), and far past every window
TOLERANCE = 1e-6
PE_ATTENTION_FIELD = 23
RULES: dict[str, dict[str, Any]] = {
    "standard+logn": {"type": "standard", "logn": 16},
    "self_extend": {"type": "self_extend", "group_size": 4, "window": 8},
    "rerope": {"type": "rerope", "window": 8},
    "leaky_rerope+logn": {"type": "leaky_rerope", "window": 8, "leak": 2.5, "logn": 16},
    "dca": {"type": "dca", "chunk_size": 16, "local_window": 4},
    "streaming": {"type": "streaming", "sink_tokens": 2, "window": 8},
}
STANDARD = {"type": "standard"}


def echoed(attention: pb.PEAttention) -> dict[str, Any]:
    """The rule a response's `PEAttention` carries, as the JSON `pe.attention` writes it."""
    kind = attention.WhichOneof("attention")
    assert kind is not None
    return {"type": kind, **{field.name: value for field, value in getattr(attention, kind).ListFields()}}


def score(channel: grpc.Channel, body: dict[str, Any]) -> pb.ScoreResponse:
    response: pb.ScoreResponse = raw_call(channel, "Score")(request_bytes("Score", body), timeout=60)
    return response


def http_post(client: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def max_difference(first: list[float], second: list[float]) -> float:
    assert len(first) == len(second)
    return (
        (torch.tensor(first, dtype=torch.float64) - torch.tensor(second, dtype=torch.float64))
        .abs()
        .max()
        .item()
    )


@pytest.mark.parametrize("rule", RULES.values(), ids=RULES.keys())
def test_a_rule_over_grpc_scores_as_over_http(
    grpc_channel: grpc.Channel, client: httpx.Client, rule: dict[str, Any]
) -> None:
    body = {"model": "tiny-rope", "prompt": PROMPT, "pe_attention": rule}
    over_http = http_post(client, "/score", body)
    over_grpc = score(grpc_channel, body)
    assert list(over_grpc.tokens) == over_http["tokens"]
    assert max_difference(list(over_grpc.token_logprobs), over_http["token_logprobs"][1:]) <= TOLERANCE
    assert over_grpc.total_logprob == pytest.approx(over_http["total_logprob"], abs=1e-5)
    assert echoed(over_grpc.pe.attention) == over_http["pe"]["attention"] == rule
    assert over_grpc.pe.scheme == "rope" and over_grpc.pe.native_context == over_http["pe"]["native_context"]
    # The rule is applied, not dropped: the text past the windows scores differently without it.
    plain = score(grpc_channel, {"model": "tiny-rope", "prompt": PROMPT})
    assert max_difference(list(plain.token_logprobs), list(over_grpc.token_logprobs)) > 1e-4


@pytest.mark.parametrize("name", ["self_extend", "streaming"])
def test_a_rule_over_grpc_generates_as_over_http(
    grpc_channel: grpc.Channel, client: httpx.Client, name: str
) -> None:
    body = {
        "model": "tiny-rope",
        "prompt": PROMPT,
        "max_new_tokens": 6,
        "temperature": 0.0,
        "logprobs": True,
        "ignore_eos": True,
        "pe_attention": RULES[name],
    }
    over_http = http_post(client, "/generate", body)
    responses = generate(grpc_channel, body, timeout=60)
    over_grpc = as_generation(responses)
    assert over_grpc["tokens"] == over_http["tokens"]
    assert max_difference(over_grpc["logprobs"], over_http["logprobs"]) <= TOLERANCE
    assert echoed(responses[-1].end.pe.attention) == over_http["pe"]["attention"] == RULES[name]


def test_without_a_rule_the_echo_is_standard(grpc_channel: grpc.Channel) -> None:
    responses = generate(grpc_channel, {"prompt": "ab", "max_new_tokens": 2}, timeout=60)
    assert echoed(responses[-1].end.pe.attention) == STANDARD
    assert echoed(score(grpc_channel, {"prompt": "abc"}).pe.attention) == STANDARD
    # A `PEAttention` with no member set is `{}` in JSON: standard attention, as HTTP reads it.
    empty = score(grpc_channel, {"prompt": "abc", "pe_attention": pb.PEAttention()})
    assert echoed(empty.pe.attention) == STANDARD


def test_cards_list_the_rules_each_scheme_applies(grpc_channel: grpc.Channel, client: httpx.Client) -> None:
    listed = raw_call(grpc_channel, "ListModels")(pb.ListModelsRequest().SerializeToString(), timeout=30)
    over_grpc = {card.name: list(card.supported_attention) for card in listed.models}
    over_http = {card["name"]: card["supported_attention"] for card in client.get("/models").json()["models"]}
    assert over_grpc == over_http
    assert over_grpc["tiny-rope"] == ["standard", "self_extend", "rerope", "leaky_rerope", "dca", "streaming"]
    assert "streaming" in over_grpc["tiny-alibi"] and "rerope" not in over_grpc["tiny-alibi"]


BAD_RULES = [
    pytest.param(
        "tiny-rope", {"type": "self_extend", "group_size": 4, "window": 0}, "pe_attention.window", id="zero"
    ),
    pytest.param("tiny-rope", {"type": "self_extend", "window": 8}, "pe_attention.group_size", id="missing"),
    pytest.param(
        "tiny-rope",
        {"type": "dca", "chunk_size": 8, "local_window": 8},
        "pe_attention.local_window",
        id="dca",
    ),
    pytest.param("tiny-rope", {"type": "standard", "logn": 1}, "pe_attention.logn", id="logn"),
    pytest.param(
        "tiny-rope", {"type": "leaky_rerope", "window": 8, "leak": 0.5}, "pe_attention.leak", id="leak"
    ),
    pytest.param("tiny-alibi", {"type": "rerope", "window": 8}, "pe_attention.type", id="scheme"),
]


@pytest.mark.parametrize(("model", "rule", "param"), BAD_RULES)
@pytest.mark.parametrize("method", ["Score", "Generate"])
def test_a_bad_rule_is_invalid_argument_naming_the_field_as_http_does(
    grpc_channel: grpc.Channel,
    client: httpx.Client,
    method: str,
    model: str,
    rule: dict[str, Any],
    param: str,
) -> None:
    body = {"model": model, "prompt": "abc", "pe_attention": rule}
    path = "/score" if method == "Score" else "/generate"
    response = client.post(path, json=body)
    assert response.status_code == 422 and response.json()["error"]["param"] == param, response.text
    with pytest.raises(grpc.RpcError) as caught:
        answer = raw_call(grpc_channel, method)(request_bytes(method, body), timeout=30)
        if method == "Generate":
            list(answer)
    assert_status(caught.value, grpc.StatusCode.INVALID_ARGUMENT, param)


def test_an_unknown_member_of_the_oneof_is_an_unknown_type(grpc_channel: grpc.Channel) -> None:
    """A member number this server does not know (a newer client's type) is `pe_attention.type`."""
    unknown = wire.length_delimited(PE_ATTENTION_FIELD, wire.length_delimited(9, wire.varint_field(2, 8)))
    with pytest.raises(grpc.RpcError) as caught:
        raw_call(grpc_channel, "Score")(request_bytes("Score", {"prompt": "abc"}) + unknown, timeout=30)
    assert_status(caught.value, grpc.StatusCode.INVALID_ARGUMENT, "pe_attention.type")
