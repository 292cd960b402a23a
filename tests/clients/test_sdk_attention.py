"""`pe_attention` through the SDK against a real server: typed rules, dicts and request objects are
the same request; responses echo the rule, cards list the types; HTTP and gRPC agree; the CLI's
`--attention SPEC` sends the rule its lab syntax names.

Every test taking `client` runs once per protocol (see conftest.py).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from pe_client import (
    DCAAttention,
    GenerateRequest,
    PEClient,
    ReRoPEAttention,
    ScoreRequest,
    SelfExtendAttention,
    StandardAttention,
    StreamEnd,
    StreamingAttention,
    StreamToken,
    UnprocessableEntityError,
)
from pe_client.attention import PEAttention, parse_attention
from pe_client.cli import main
from pe_client.grpc import GrpcPEClient
from pydantic import ValidationError

from tests.clients.conftest import API_KEY, AsyncClient, SyncClient
from tests.live_server import LiveServer

PAST_NATIVE = "0123456789" * 8  # 80 bytes + BOS: past the tiny models' 64-token native context
SELF_EXTEND = SelfExtendAttention(group_size=4, window=8)
SELF_EXTEND_DICT = {"type": "self_extend", "group_size": 4, "window": 8}
RULES: list[PEAttention] = [
    StandardAttention(logn=16),
    SELF_EXTEND,
    ReRoPEAttention(window=8, logn=32),
    DCAAttention(chunk_size=16, local_window=4),
    StreamingAttention(sink_tokens=2, window=8),
]
STANDARD = {"type": "standard"}


def sent(rule: PEAttention) -> dict[str, Any]:
    """The rule as the server resolves and echoes it: its fields, unset `logn` left out."""
    return rule.model_dump(exclude_none=True)


def test_typed_rules_dicts_and_request_objects_are_the_same_request(client: SyncClient) -> None:
    typed = client.score(prompt=PAST_NATIVE, pe_attention=SELF_EXTEND)
    as_dict = client.score(prompt=PAST_NATIVE, pe_attention=SELF_EXTEND_DICT)
    as_request = client.score(ScoreRequest(prompt=PAST_NATIVE, pe_attention=SELF_EXTEND_DICT))  # type: ignore[arg-type]
    assert typed.token_logprobs == as_dict.token_logprobs == as_request.token_logprobs
    assert typed.pe is not None and typed.pe.attention == SELF_EXTEND_DICT
    plain = client.score(prompt=PAST_NATIVE)
    # A plain `/score` answers without the `pe` block (the SPEC's keys); gRPC always sets it.
    assert plain.pe is None or plain.pe.attention == STANDARD
    assert plain.token_logprobs != pytest.approx(typed.token_logprobs, abs=1e-4)


@pytest.mark.parametrize("rule", RULES, ids=lambda rule: rule.type)
def test_grpc_and_http_score_a_rule_alike(server: LiveServer, rule: PEAttention) -> None:
    with (
        PEClient(server.base_url, api_key=API_KEY) as http,
        GrpcPEClient(server.grpc_target, api_key=API_KEY) as grpc,
    ):
        over_http = http.score(prompt=PAST_NATIVE, pe_attention=rule)
        over_grpc = grpc.score(prompt=PAST_NATIVE, pe_attention=rule)
    assert over_grpc.tokens == over_http.tokens
    assert over_grpc.token_logprobs[0] is None and over_http.token_logprobs[0] is None
    assert over_grpc.token_logprobs[1:] == pytest.approx(over_http.token_logprobs[1:], abs=1e-6)
    assert over_grpc.pe == over_http.pe
    assert over_http.pe is not None and over_http.pe.attention == sent(rule)
    assert parse_attention(over_http.pe.attention) == rule


def test_generation_and_its_stream_echo_the_rule(client: SyncClient) -> None:
    params: dict[str, Any] = {
        "prompt": PAST_NATIVE,
        "max_new_tokens": 6,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    whole = client.generate(**params, pe_attention=SELF_EXTEND)
    assert whole.pe.attention == SELF_EXTEND_DICT
    with client.generate_stream(GenerateRequest(**params, pe_attention=SELF_EXTEND)) as stream:
        events = list(stream)
    assert isinstance(events[-1], StreamEnd) and events[-1].pe.attention == SELF_EXTEND_DICT
    assert [event.token for event in events if isinstance(event, StreamToken)] == whole.tokens
    assert client.generate(**params).pe.attention == STANDARD


def test_the_async_client_sends_the_rule(async_client: AsyncClient, client: SyncClient) -> None:
    rule = StreamingAttention(sink_tokens=2, window=8)

    async def run() -> tuple[list[float | None], dict[str, Any]]:
        async with async_client:
            scored = await async_client.score(prompt=PAST_NATIVE, pe_attention=rule)
            generated = await async_client.generate(prompt="ab", max_new_tokens=2, pe_attention=sent(rule))
        assert scored.pe is not None
        return scored.token_logprobs, generated.pe.attention

    logprobs, echoed = asyncio.run(run())
    assert logprobs == client.score(prompt=PAST_NATIVE, pe_attention=rule).token_logprobs
    assert echoed == sent(rule)


def test_cards_list_the_types_each_scheme_applies(client: SyncClient) -> None:
    cards = {card.name: card.supported_attention for card in client.models()}
    assert cards["tiny-rope"] == ["standard", "self_extend", "rerope", "leaky_rerope", "dca", "streaming"]
    assert "streaming" in cards["tiny-alibi"] and "rerope" not in cards["tiny-alibi"]


def test_a_rule_the_scheme_cannot_apply_is_unprocessable_naming_the_field(client: SyncClient) -> None:
    with pytest.raises(UnprocessableEntityError) as caught:
        client.score(prompt="abc", model="tiny-alibi", pe_attention=ReRoPEAttention(window=8))
    assert caught.value.status_code == 422 and caught.value.param == "pe_attention.type"


def test_an_out_of_range_rule_is_refused_before_it_is_sent(client: SyncClient) -> None:
    with pytest.raises(ValidationError, match="window"):
        client.score(prompt="abc", pe_attention={"type": "rerope", "window": 0})


@pytest.fixture
def cli_environment(server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PE_SERVE_URL", server.base_url)
    monkeypatch.setenv("PE_SERVE_API_KEY", API_KEY)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_the_cli_sends_the_rule_its_spec_names(
    cli_environment: None,
    server: LiveServer,
    protocol: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    spec = "self_extend:group_size=4,window=8"
    transport = ["--grpc", str(server.grpc_target)] if protocol == "grpc" else []
    assert main([*transport, "generate", "--attention", spec, "--max-new-tokens", "6", PAST_NATIVE]) == 0
    out = capsys.readouterr().out
    with PEClient(server.base_url, api_key=API_KEY) as http:
        expected = http.generate(
            prompt=PAST_NATIVE, pe_attention=SELF_EXTEND, max_new_tokens=6, temperature=0
        )
    assert out == expected.text

    compare = [*transport, "compare", "--scalings", "none,linear", "--factor", "2", "--attention", spec]
    assert main([*compare, "--max-new-tokens", "4", "--width", "160", PAST_NATIVE]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert [label.strip() for label in header.split(" | ")] == [
        "none + self_extend (group_size=4,window=8)",
        "linear x2 + self_extend (group_size=4,window=8)",
    ]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("sliding:window=8", "unknown attention type 'sliding'"),
        ("rerope:window=0", "window"),
        ("rerope:window=4|8", "one rule per request"),
        ("rerope:window", "expected key=value"),
    ],
)
def test_the_cli_refuses_a_bad_spec_before_sending(
    spec: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Nothing listens on the URL: a request sent would fail otherwise (a connection error)."""
    assert (
        main(["--url", "http://127.0.0.1:9", "--max-retries", "0", "generate", "--attention", spec, "abc"])
        == 1
    )
    err = capsys.readouterr().err
    assert err.startswith("pe-client: ") and message in err and "Traceback" not in err
