"""`Generate` with `resume_from`: the chunks after the tokens a cut call's client holds, as if uncut.

The gRPC twin of tests/service/api/test_resume.py, against the shared live server, plus what is
gRPC's own: a request id runs once (`RunOnce`), and a resume is the exception. Sent under the id
of the call it continues, it runs from its tokens whether that call's answer is kept or the call
still runs (then it replaces it), and an identical retry of the call still gets the kept answer.
"""

from __future__ import annotations

import uuid
from typing import Any

import grpc
import pytest

from service.grpc_api import pe_serve_pb2 as pb
from tests.service.grpc.helpers import assert_status, generate, stream

NEW_TOKENS = 24
LOGPROB_TOLERANCE = 1e-5  # what a row may move by with its batch (SPEC: each row gets what it gets alone)
# Long enough to be running still when the resume that replaces it comes (tenths of a second).
LONG_TOKENS = 160
SAMPLINGS: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "seeded": {"temperature": 0.9, "top_k": 40, "seed": 11, "logprobs": True},
}


def body(sampling: str, **fields: Any) -> dict[str, Any]:
    return {"prompt": "def fib(n):", "max_new_tokens": NEW_TOKENS, **SAMPLINGS[sampling], **fields}


def tokens_of(responses: list[pb.GenerateResponse]) -> list[int]:
    return [response.token.token for response in responses if response.HasField("token")]


def assert_continues(uncut: list[pb.GenerateResponse], cut_at: int, rest: list[pb.GenerateResponse]) -> None:
    """`rest` is `uncut` after its first `cut_at` chunks; its end counts the whole generation.
    Tokens and texts are equal; logprobs within the batch tolerance, not to the bit (the resumed
    call reads its tokens in other passes than the uncut one did: 5e-7 apart in one CI run)."""
    chunks, expected_chunks = rest[:-1], uncut[cut_at:-1]
    assert [(c.token.token, c.token.text) for c in chunks] == [
        (c.token.token, c.token.text) for c in expected_chunks
    ]
    for chunk, uncut_chunk in zip(chunks, expected_chunks, strict=True):
        assert chunk.token.logprob == pytest.approx(uncut_chunk.token.logprob, abs=LOGPROB_TOLERANCE)
    end, expected = rest[-1].end, uncut[-1].end
    assert (end.id, end.finish_reason) == (expected.id, expected.finish_reason)
    assert (end.usage.prompt_tokens, end.usage.completion_tokens) == (
        expected.usage.prompt_tokens,
        expected.usage.completion_tokens,
    )


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
def test_a_resumed_generate_is_the_rest_of_the_uncut_one(grpc_channel: grpc.Channel, sampling: str) -> None:
    request = body(sampling, request_id=f"resume-{uuid.uuid4().hex}")
    uncut = generate(grpc_channel, request, timeout=60)
    held = tokens_of(uncut)
    assert len(held) == NEW_TOKENS
    for cut_at in (1, NEW_TOKENS // 2, NEW_TOKENS):
        rest = generate(grpc_channel, {**request, "resume_from": {"tokens": held[:cut_at]}}, timeout=60)
        assert_continues(uncut, cut_at, rest)
    assert generate(grpc_channel, request, timeout=60) == uncut, "a retry of the call: its kept answer"


def test_a_resume_replaces_the_call_it_continues_while_that_still_runs(grpc_channel: grpc.Channel) -> None:
    request = body("greedy", max_new_tokens=LONG_TOKENS, request_id=f"resume-{uuid.uuid4().hex}")
    first = stream(grpc_channel, request, timeout=60)
    held = [next(first).token.token for _ in range(3)]
    rest = generate(grpc_channel, {**request, "resume_from": {"tokens": held}}, timeout=60)
    assert rest[-1].end.usage.completion_tokens == request["max_new_tokens"]
    with pytest.raises(grpc.RpcError) as caught:
        for _ in first:
            pass
    assert_status(caught.value, grpc.StatusCode.UNAVAILABLE)


@pytest.mark.parametrize(
    ("resume_from", "param"),
    [({}, "resume_from.tokens"), ({"tokens": [65] * (NEW_TOKENS + 1)}, "resume_from.tokens")],
    ids=["no tokens", "more than max_new_tokens"],
)
def test_a_bad_resume_is_invalid_argument_naming_the_field(
    grpc_channel: grpc.Channel, resume_from: dict[str, Any], param: str
) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        generate(grpc_channel, body("greedy", resume_from=resume_from), timeout=60)
    assert_status(caught.value, grpc.StatusCode.INVALID_ARGUMENT, param)
