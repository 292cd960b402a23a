"""A gRPC request id runs once: an identical retry attaches to the run or gets its kept answer.

Against the shared live server, over real gRPC. How many runs the engine made is read from its
metrics: for `Score`, the PE-table lookups of the RoPE model (`pe_cache_hits_total` plus
`pe_cache_misses_total`), compared with one plain run of the same body; for `Generate`,
`pe_serve_generated_tokens_total` against the tokens one answer reports.
"""

from __future__ import annotations

import uuid
from typing import Any

import grpc
import httpx
import pytest

from service.grpc_api import pe_serve_pb2 as pb
from tests.service.api.conftest import MAX_CONTEXT, model_name
from tests.service.api.helpers import metric_sum, metric_value
from tests.service.grpc.helpers import assert_status, generate, raw_call, request_bytes, stream

# Long enough that two calls sent together overlap in the server.
SCORED: dict[str, Any] = {"tokens": [(7 * index) % 97 + 3 for index in range(MAX_CONTEXT - 8)], "pe": "rope"}
# Sampled without a seed, so a second run would answer differently; on a model the C step cannot
# run, so that it is still running when the retry comes.
SAMPLED: dict[str, Any] = {
    "model": model_name("shaw"),
    "prompt": "a",
    "max_new_tokens": 200,
    "temperature": 1.0,
}


def fresh_id() -> str:
    return f"once-{uuid.uuid4().hex}"


def score_runs(client: httpx.Client) -> float:
    lookups = ("pe_cache_hits_total", "pe_cache_misses_total")
    return sum(metric_sum(client, name, 'kind="rope"') for name in lookups)


def generated_tokens(client: httpx.Client) -> float:
    return metric_value(client, "pe_serve_generated_tokens_total")


def score_calls(client: httpx.Client, status: str) -> float:
    labels = f'endpoint="/pe_serve.v1.PEServe/Score",protocol="grpc",status="{status}"'
    return metric_sum(client, "pe_serve_requests_total", labels)


def score(channel: grpc.Channel, body: dict[str, Any], **call_options: Any) -> bytes:
    """The answer's bytes, as the server sent them."""
    call = channel.unary_unary("/pe_serve.v1.PEServe/Score")
    answer: bytes = call(request_bytes("Score", body), timeout=60, **call_options)
    return answer


def test_two_identical_score_calls_under_one_x_request_id_at_once_run_once(
    grpc_channel: grpc.Channel, client: httpx.Client
) -> None:
    before = score_runs(client)
    score(grpc_channel, SCORED)
    one_run = score_runs(client) - before
    assert one_run > 0

    before, ok_before = score_runs(client), score_calls(client, "OK")
    metadata = (("x-request-id", fresh_id()),)
    calls = [
        raw_call(grpc_channel, "Score").future(request_bytes("Score", SCORED), metadata=metadata, timeout=60)
        for _ in range(2)
    ]
    answers = [call.result() for call in calls]
    assert answers[0] == answers[1] and answers[0].id == metadata[0][1]
    assert score_calls(client, "OK") - ok_before == 2, "both calls OK"
    assert score_runs(client) - before == one_run, "two calls, one run"


def test_an_identical_score_after_the_first_ended_gets_the_kept_answer(
    grpc_channel: grpc.Channel, client: httpx.Client
) -> None:
    body = {**SCORED, "request_id": fresh_id()}
    before = score_runs(client)
    first = score(grpc_channel, body)
    one_run = score_runs(client) - before
    assert score(grpc_channel, body) == first
    assert score_runs(client) - before == one_run


def test_a_generation_retried_while_it_streams_reads_the_same_stream_and_later_the_kept_one(
    grpc_channel: grpc.Channel, client: httpx.Client
) -> None:
    body = {**SAMPLED, "request_id": fresh_id()}
    before = generated_tokens(client)
    first = stream(grpc_channel, body, timeout=60)
    head = next(first)
    assert head.HasField("token")
    retried = generate(grpc_channel, body, timeout=60)
    answer = [head, *first]
    assert retried == answer
    assert generated_tokens(client) - before == answer[-1].end.usage.completion_tokens, "one run"
    assert generate(grpc_channel, body, timeout=60) == answer, "the kept answer"
    assert generated_tokens(client) - before == answer[-1].end.usage.completion_tokens


@pytest.mark.parametrize("other", ["body", "method"])
def test_a_used_id_with_another_body_or_method_is_invalid_argument(
    grpc_channel: grpc.Channel, client: httpx.Client, other: str
) -> None:
    request_id = fresh_id()
    score(grpc_channel, {**SCORED, "request_id": request_id})
    before = score_runs(client)
    with pytest.raises(grpc.RpcError) as caught:
        if other == "body":
            score(grpc_channel, {**SCORED, "tokens": SCORED["tokens"][:-1], "request_id": request_id})
        else:
            generate(grpc_channel, {"prompt": "a", "max_new_tokens": 2, "request_id": request_id}, timeout=60)
    metadata = assert_status(caught.value, grpc.StatusCode.INVALID_ARGUMENT, "request_id")
    assert metadata["pe-serve-error-type"] == "request_id_reused"
    assert score_runs(client) == before, "nothing ran"


def test_without_a_sane_id_every_call_runs(grpc_channel: grpc.Channel, client: httpx.Client) -> None:
    before = score_runs(client)
    score(grpc_channel, SCORED)
    one_run = score_runs(client) - before
    before = score_runs(client)
    answers = [
        pb.ScoreResponse.FromString(score(grpc_channel, SCORED, metadata=(("x-request-id", "not sane!"),)))
        for _ in range(2)
    ]
    assert answers[0].id != answers[1].id and answers[0].id.startswith("score-")
    assert score_runs(client) - before == 2 * one_run
