"""Model aliases as served: `NAME@SPEC[@SPEC]` and `--alias NAME=TARGET`, on a real server on loopback.

A name that sets a scaling or an attention rule must run exactly what the same explicit fields
run (`/v1/completions` echo + logprobs against `/score` with `pe_attention`, `/score` and greedy
`/generate` against `pe_scaling`), over HTTP and gRPC; responses name the model as it was asked;
the prefix cache keys on the resolved configuration, not the name; `--alias` names are listed by
`/v1/models` and work everywhere a model name does; a name and a field for the same thing, or a bad
SPEC, is 422 (400 on `/v1`, INVALID_ARGUMENT over gRPC) naming `model` and the field; a bad alias
stops the server at start-up naming the flag.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import pytest
import torch

from service.grpc_api import pe_serve_pb2 as pb
from service.grpc_api.status import PARAM_KEY
from tests.conftest import TinyCheckpointFactory
from tests.live_server import LiveServer, OptionValue, launch_server, live_server
from tests.service.api.conftest import SERVER_ENV
from tests.service.grpc.helpers import as_generation, generate, raw_call, request_bytes
from tests.service.test_attention_model import BASE, text

RULES_MODEL = "tiny-rules"
ROPE_MODEL = "tiny-rope"
ALIBI_MODEL = "tiny-alibi-named"
SELF_EXTEND = "self_extend:group_size=3,window=16"
SELF_EXTEND_FIELD = {"type": "self_extend", "group_size": 3, "window": 16}
YARN = "yarn:factor=2,original_max_position_embeddings=64"
YARN_FIELD = {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64}
ALIASES = {
    "long": f"{ROPE_MODEL}@{YARN}",
    "extended": f"{RULES_MODEL}@{SELF_EXTEND}",
    "renamed": ROPE_MODEL,
}
TIMEOUT = 120.0


@pytest.fixture(scope="module")
def checkpoints(make_tiny_checkpoint: TinyCheckpointFactory) -> list[Any]:
    rules = make_tiny_checkpoint("rope", name=RULES_MODEL, seed=5, rope_base=BASE, native_context=128)
    rope = make_tiny_checkpoint("rope", name=ROPE_MODEL, seed=3)
    alibi = make_tiny_checkpoint("alibi", name=ALIBI_MODEL)
    return [rules, rope, alibi]


@pytest.fixture(scope="module")
def server(checkpoints: list[Any]) -> Iterator[LiveServer]:
    options: dict[str, OptionValue] = {
        "device": "cpu",
        "dtype": "float32",
        "max_context": 512,
        "alias": [f"{name}={target}" for name, target in ALIASES.items()],
    }
    with live_server(checkpoints, options=options, env=SERVER_ENV) as running:
        yield running


def post(server: LiveServer, path: str, body: dict[str, Any], status: int = 200) -> dict[str, Any]:
    response = httpx.post(server.url(path), json=body, timeout=TIMEOUT)
    assert response.status_code == status, response.text
    result: dict[str, Any] = response.json()
    return result


def logprobs(values: list[float | None]) -> torch.Tensor:
    return torch.tensor(values[1:], dtype=torch.float64)


def assert_close(first: list[float | None], second: list[float | None], tolerance: float = 1e-5) -> None:
    assert len(first) == len(second)
    assert (logprobs(first) - logprobs(second)).abs().max().item() <= tolerance


def test_openai_completions_with_the_rule_in_the_name_equal_score_with_the_field(server: LiveServer) -> None:
    tokens = text(4)
    name = f"{RULES_MODEL}@{SELF_EXTEND}"
    body = {"model": name, "prompt": tokens, "max_tokens": 1, "echo": True, "logprobs": 0}
    completion = post(server, "/v1/completions", body)
    assert completion["model"] == name
    assert completion["pe"]["attention"] == SELF_EXTEND_FIELD
    echoed = completion["choices"][0]["logprobs"]["token_logprobs"][: len(tokens)]
    scored = post(
        server, "/score", {"model": RULES_MODEL, "tokens": tokens, "pe_attention": SELF_EXTEND_FIELD}
    )
    assert_close(echoed, scored["token_logprobs"])
    plain = post(server, "/score", {"model": RULES_MODEL, "tokens": tokens})
    assert (logprobs(scored["token_logprobs"]) - logprobs(plain["token_logprobs"])).abs().max() > 1e-3
    named = post(server, "/score", {"model": name, "tokens": tokens})
    assert named["model"] == name
    assert named["pe"]["attention"] == SELF_EXTEND_FIELD
    assert_close(named["token_logprobs"], scored["token_logprobs"])


def test_a_scaling_in_the_name_equals_the_explicit_field(server: LiveServer) -> None:
    tokens = text(7)
    name = f"{ROPE_MODEL}@{YARN}"
    explicit = post(server, "/score", {"model": ROPE_MODEL, "tokens": tokens, "pe_scaling": YARN_FIELD})
    named = post(server, "/score", {"model": name, "tokens": tokens})
    assert named["model"] == name
    assert named["pe"] == explicit["pe"]
    assert named["pe"]["scaling"]["type"] == "yarn"
    assert_close(named["token_logprobs"], explicit["token_logprobs"])
    plain = post(server, "/score", {"model": ROPE_MODEL, "tokens": tokens})
    assert (logprobs(named["token_logprobs"]) - logprobs(plain["token_logprobs"])).abs().max() > 1e-3

    prompt = {"tokens": tokens[:50], "max_new_tokens": 6, "temperature": 0.0, "logprobs": True}
    by_name = post(server, "/generate", {"model": name, **prompt})
    by_field = post(server, "/generate", {"model": ROPE_MODEL, "pe_scaling": YARN_FIELD, **prompt})
    assert by_name["model"] == name and by_field["model"] == ROPE_MODEL
    assert by_name["tokens"] == by_field["tokens"]
    assert by_name["pe"] == by_field["pe"]
    assert by_name["logprobs"] == pytest.approx(by_field["logprobs"], abs=1e-5)


def test_both_specs_in_one_name_equal_both_fields(server: LiveServer) -> None:
    tokens = text(8)
    name = f"{ROPE_MODEL}@{YARN}@self_extend:group_size=4,window=16"
    rule = {"type": "self_extend", "group_size": 4, "window": 16}
    named = post(server, "/score", {"model": name, "tokens": tokens})
    fields = {"model": ROPE_MODEL, "tokens": tokens, "pe_scaling": YARN_FIELD, "pe_attention": rule}
    explicit = post(server, "/score", fields)
    assert named["pe"] == explicit["pe"] and named["pe"]["attention"] == rule
    assert_close(named["token_logprobs"], explicit["token_logprobs"])


def test_the_prefix_cache_keys_on_the_resolved_configuration(server: LiveServer) -> None:
    prompt = text(9)[:40]
    body = {"tokens": prompt, "max_new_tokens": 1, "temperature": 0.0}
    first = post(server, "/generate", {"model": f"{ROPE_MODEL}@{YARN}", **body})
    assert first["usage"]["cached_tokens"] == 0
    # The same configuration by fields and by a fixed alias reuses the blocks the name filled ...
    by_field = post(server, "/generate", {"model": ROPE_MODEL, "pe_scaling": YARN_FIELD, **body})
    assert by_field["usage"]["cached_tokens"] == 32
    assert post(server, "/generate", {"model": "long", **body})["usage"]["cached_tokens"] == 32
    # ... and another configuration of the same model does not.
    plain = post(server, "/generate", {"model": ROPE_MODEL, **body})
    assert plain["usage"]["cached_tokens"] == 0


def test_fixed_aliases_are_listed_and_work(server: LiveServer) -> None:
    listed = {model["id"]: model for model in httpx.get(server.url("/v1/models")).json()["data"]}
    assert list(listed) == [RULES_MODEL, ROPE_MODEL, ALIBI_MODEL, *ALIASES]
    for name, target in ALIASES.items():
        assert listed[name]["target"] == target
        assert listed[name]["root"] == target.split("@")[0]
        assert listed[name]["scheme"] == "rope"
    assert listed[ROPE_MODEL]["target"] is None and listed[ROPE_MODEL]["root"] == ROPE_MODEL
    served = {card["name"] for card in httpx.get(server.url("/models")).json()["models"]}
    assert served == {RULES_MODEL, ROPE_MODEL, ALIBI_MODEL}  # cards are the resident models

    tokens = text(10)
    long = post(server, "/score", {"model": "long", "tokens": tokens})
    explicit = post(server, "/score", {"model": ROPE_MODEL, "tokens": tokens, "pe_scaling": YARN_FIELD})
    assert long["model"] == "long"
    assert_close(long["token_logprobs"], explicit["token_logprobs"])
    body = {"model": "extended", "prompt": tokens, "max_tokens": 1, "echo": True, "logprobs": 0}
    completion = post(server, "/v1/completions", body)
    assert completion["model"] == "extended"
    rule = post(server, "/score", {"model": RULES_MODEL, "tokens": tokens, "pe_attention": SELF_EXTEND_FIELD})
    assert_close(
        completion["choices"][0]["logprobs"]["token_logprobs"][: len(tokens)], rule["token_logprobs"]
    )
    # An alias takes further SPECs, and a plain rename runs the model as it is.
    more = post(server, "/score", {"model": "long@rerope:window=8", "tokens": tokens})
    assert more["pe"]["attention"] == {"type": "rerope", "window": 8}
    assert more["pe"]["scaling"] == explicit["pe"]["scaling"]
    renamed = post(server, "/score", {"model": "renamed", "tokens": tokens})
    plain = post(server, "/score", {"model": ROPE_MODEL, "tokens": tokens})
    assert renamed["model"] == "renamed" and renamed["token_logprobs"] == plain["token_logprobs"]
    generated = post(server, "/generate", {"model": "long", "tokens": tokens[:8], "max_new_tokens": 2})
    assert generated["model"] == "long"
    tokenized = post(server, "/tokenize", {"model": "long", "prompt": "abc"})
    assert tokenized["tokens"] == post(server, "/tokenize", {"model": ROPE_MODEL, "prompt": "abc"})["tokens"]
    info = httpx.get(server.url("/tokenizer_info"), params={"model": "long"}).json()
    assert info["model"] == "long"


@pytest.mark.parametrize(
    ("model", "fields", "status", "mentions"),
    [
        (f"{ROPE_MODEL}@{YARN}", {"pe_scaling": YARN_FIELD}, 422, "pe_scaling"),
        ("long", {"pe_scaling": {"type": "linear", "factor": 2.0}}, 422, "pe_scaling"),
        (f"{RULES_MODEL}@{SELF_EXTEND}", {"pe_attention": SELF_EXTEND_FIELD}, 422, "pe_attention"),
        ("extended", {"pe_attention": {"type": "rerope", "window": 4}}, 422, "pe_attention"),
        (f"{ROPE_MODEL}@{YARN}@ntk:factor=2", {}, 422, "two scaling SPECs"),
        (f"{ROPE_MODEL}@rerope:window=4@{SELF_EXTEND}", {}, 422, "two attention SPECs"),
        ("long@linear:factor=2", {}, 422, "two scaling SPECs"),
        (f"{ROPE_MODEL}@warp:factor=2", {}, 422, "neither a scaling"),
        (f"{ROPE_MODEL}@yarn:factor=0.5", {}, 422, "pe_scaling.factor"),
        (f"{ROPE_MODEL}@yarn:factr=2", {}, 422, "pe_scaling.factr"),
        (f"{RULES_MODEL}@self_extend:group_size=3,window=0", {}, 422, "pe_attention.window"),
        (f"{ROPE_MODEL}@{YARN}@", {}, 422, "empty SPEC"),
        (f"{ROPE_MODEL}@longrope:short_factor=1;1,long_factor=2;2", {}, 422, "pe_scaling.short_factor"),
        (f"{ALIBI_MODEL}@linear:factor=2", {}, 422, "pe_scaling.type"),
        (f"{ALIBI_MODEL}@rerope:window=4", {}, 422, "pe_attention.type"),
        (f"missing@{YARN}", {}, 404, "missing"),
    ],
)
def test_conflicts_and_bad_specs_name_the_field(
    server: LiveServer, model: str, fields: dict[str, Any], status: int, mentions: str
) -> None:
    body = {"model": model, "tokens": [1, 2, 3], **fields}
    error = post(server, "/score", body, status=status)["error"]
    assert error["param"] == "model" and mentions in error["message"]
    assert status == 404 or model in error["message"]
    openai = {"model": model, "prompt": [1, 2, 3], "max_tokens": 1, **fields}
    error = post(server, "/v1/completions", openai, status=400 if status == 422 else status)["error"]
    assert error["param"] == "model" and mentions in error["message"]


def test_grpc_takes_a_name_with_specs_and_an_alias(server: LiveServer) -> None:
    assert server.grpc_target is not None
    tokens = text(11)
    name = f"{ROPE_MODEL}@{YARN}@{SELF_EXTEND}"
    with grpc.insecure_channel(server.grpc_target) as channel:
        score = raw_call(channel, "Score")
        named = score(request_bytes("Score", {"model": name, "tokens": tokens}), timeout=TIMEOUT)
        fields = {
            "model": ROPE_MODEL,
            "tokens": tokens,
            "pe_scaling": YARN_FIELD,
            "pe_attention": SELF_EXTEND_FIELD,
        }
        explicit = score(request_bytes("Score", fields), timeout=TIMEOUT)
        assert named.model == name and explicit.model == ROPE_MODEL
        assert named.pe == explicit.pe
        assert list(named.token_logprobs) == pytest.approx(list(explicit.token_logprobs), abs=1e-5)
        http = post(server, "/score", {"model": name, "tokens": tokens})
        assert list(named.token_logprobs) == pytest.approx(http["token_logprobs"][1:], abs=1e-5)

        prompt = {"tokens": tokens[:30], "max_new_tokens": 4, "temperature": 0.0}
        by_alias = as_generation(generate(channel, {"model": "long", **prompt}, timeout=TIMEOUT))
        by_field = as_generation(
            generate(channel, {"model": ROPE_MODEL, "pe_scaling": YARN_FIELD, **prompt}, timeout=TIMEOUT)
        )
        assert by_alias["model"] == "long" and by_alias["tokens"] == by_field["tokens"]

        for body in (
            {"model": "long", "tokens": tokens, "pe_scaling": YARN_FIELD},
            {"model": "long@ntk:factor=2"},
        ):
            with pytest.raises(grpc.RpcError) as refused:
                score(request_bytes("Score", {"tokens": tokens, **body}), timeout=TIMEOUT)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert dict(refused.value.trailing_metadata() or ())[PARAM_KEY] == "model"
            assert "scaling" in (refused.value.details() or "")
        listed = raw_call(channel, "ListModels")(pb.ListModelsRequest().SerializeToString(), timeout=TIMEOUT)
        assert {card.name for card in listed.models} == {RULES_MODEL, ROPE_MODEL, ALIBI_MODEL}


@pytest.mark.parametrize(
    ("alias", "problem"),
    [
        (f"ghost=missing@{YARN}", "missing"),
        (f"{ROPE_MODEL}={ROPE_MODEL}@{YARN}", "resident model's name"),
        (f"flat={ALIBI_MODEL}@{YARN}", "pe_scaling.type"),
    ],
)
def test_an_alias_the_models_cannot_serve_stops_the_server(
    checkpoints: list[Any], alias: str, problem: str
) -> None:
    options: dict[str, OptionValue] = {
        "device": "cpu",
        "dtype": "float32",
        "no_warmup": True,
        "grpc_port": 0,
        "alias": [alias],
    }
    server = launch_server(checkpoints, options=options, env=SERVER_ENV)
    try:
        assert server.wait(timeout=TIMEOUT) != 0
        logs = server.logs()
        assert f"--alias {alias}" in logs and problem in logs, logs
    finally:
        server.stop()
        server.log_path.unlink(missing_ok=True)
