"""A cut stream resumed with `resume_from` goes on as if it had not been cut.

Against the shared live server: each case streams a generation to its end, then asks for it again
with the first k tokens in `resume_from`, as a client whose stream was cut after k tokens does.
The resumed stream must be the uncut stream's events after those k: the same tokens (greedy, and
sampled with a seed), the same text pieces (stop strings and held-back text across the cut), and
an end event that counts the whole generation. The SDK resuming by itself, through a connection
that is really cut, is tests/clients/test_sdk_resume.py; gRPC is tests/service/grpc/test_resume.py.
"""

from __future__ import annotations

import itertools
import uuid
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.service.api.helpers import DONE, assert_error_shape, sse_data

PROMPT = "def fib(n):"
NEW_TOKENS = 24
# Long enough to be running still when the resume that replaces it comes (tenths of a second).
LONG_TOKENS = 160
SAMPLINGS: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "seeded": {"temperature": 0.9, "top_k": 40, "seed": 11},
    # Every control that counts the output: penalties, min_tokens, alternatives.
    "seeded with controls": {
        "temperature": 1.2,
        "seed": 5,
        "repetition_penalty": 1.3,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.7,
        "min_tokens": 12,
        "logprobs": True,
        "top_logprobs": 2,
    },
}


def body(sampling: str, **fields: Any) -> dict[str, Any]:
    return {"prompt": PROMPT, "max_new_tokens": NEW_TOKENS, "stream": True, **SAMPLINGS[sampling], **fields}


@dataclass
class Streamed:
    events: list[dict[str, Any]]  # token events
    end: dict[str, Any]

    @property
    def tokens(self) -> list[int]:
        return [event["token"] for event in self.events]

    @property
    def text(self) -> str:
        return "".join(event["text"] for event in self.events)


def stream(client: httpx.Client, payload: dict[str, Any], **headers: str) -> Streamed:
    with client.stream("POST", "/generate", json=payload, headers=headers) as response:
        assert response.status_code == 200, response.read()
        data = list(sse_data(response))
    assert data[-1] == DONE, data[-1]
    *events, end = data[:-1]
    assert "finish_reason" in end, end
    return Streamed(events=events, end=end)


def resumed(client: httpx.Client, payload: dict[str, Any], held: list[int], **headers: str) -> Streamed:
    return stream(client, {**payload, "resume_from": {"tokens": held}}, **headers)


def assert_continues(uncut: Streamed, cut_at: int, rest: Streamed) -> None:
    """`rest` is `uncut` after its first `cut_at` events; its end counts the whole generation."""
    assert rest.events == uncut.events[cut_at:]
    assert rest.end["finish_reason"] == uncut.end["finish_reason"]
    usage, expected = rest.end["usage"], uncut.end["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (
        expected["prompt_tokens"],
        expected["completion_tokens"],
    )
    assert 0 <= usage["cached_tokens"] <= usage["prompt_tokens"]
    assert rest.end["pe"] == uncut.end["pe"]


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
def test_a_resumed_stream_is_the_rest_of_the_uncut_stream(client: httpx.Client, sampling: str) -> None:
    payload = body(sampling)
    uncut = stream(client, payload)
    assert len(uncut.tokens) == NEW_TOKENS
    for cut_at in (1, NEW_TOKENS // 2, NEW_TOKENS - 1):
        assert_continues(uncut, cut_at, resumed(client, payload, uncut.tokens[:cut_at]))


def two_token_stop(events: list[dict[str, Any]]) -> str:
    """Two neighbouring tokens' texts, each one printable character: a stop string that spans them."""
    for before, after in itertools.pairwise(events):
        pair: str = before["text"] + after["text"]
        if len(before["text"]) == len(after["text"]) == 1 and pair.isprintable():
            return pair
    raise AssertionError(f"no two printable neighbours in {events}")


def test_a_stop_string_across_the_cut_still_stops(client: httpx.Client) -> None:
    """Cut between a stop string's two tokens: the first one's text was held back (it might start
    the stop string), and the resumed stream stops on the second, releasing nothing of either."""
    stop = two_token_stop(stream(client, body("seeded")).events)
    payload = body("seeded", stop=[stop])
    uncut = stream(client, payload)
    assert uncut.end["finish_reason"] == "stop" and stop not in uncut.text
    assert uncut.events[-2]["text"] == ""  # the stop string's first character, held back
    cut_at = len(uncut.events) - 1
    assert_continues(uncut, cut_at, resumed(client, payload, uncut.tokens[:cut_at]))


@pytest.mark.parametrize("ending", ["length", "stop string", "stop token"])
def test_a_stream_cut_after_the_token_that_ended_it_gets_just_its_end(
    client: httpx.Client, ending: str
) -> None:
    """The cut fell between the last token and the end event: resumed, nothing is generated."""
    first = stream(client, body("seeded"))
    endings: dict[str, dict[str, Any]] = {
        "length": {},
        "stop string": {"stop": [two_token_stop(first.events)]},
        "stop token": {"stop_token_ids": [first.tokens[NEW_TOKENS // 2]]},
    }
    payload = body("seeded", **endings[ending])
    uncut = stream(client, payload)
    assert uncut.end["finish_reason"] == ("length" if ending == "length" else "stop")
    assert_continues(uncut, len(uncut.events), resumed(client, payload, uncut.tokens))


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"stream": False}, "resume_from"),
        ({"resume_from": {"tokens": []}}, "resume_from.tokens"),
        ({"resume_from": {"tokens": [65] * (NEW_TOKENS + 1)}}, "resume_from.tokens"),
        ({"resume_from": {"tokens": [65, 10**6]}}, "resume_from.tokens.1"),
        ({"resume_from": {"tokens": [65], "text": "A"}}, "resume_from.text"),
    ],
    ids=["not streamed", "no tokens", "more than max_new_tokens", "outside the vocabulary", "unknown field"],
)
def test_a_bad_resume_is_422_naming_the_field(
    client: httpx.Client, fields: dict[str, Any], param: str
) -> None:
    payload = {**body("greedy"), "resume_from": {"tokens": [65]}, **fields}
    assert_error_shape(client.post("/generate", json=payload), 422, param)


def test_a_resume_replaces_the_stream_it_continues_while_that_still_runs(client: httpx.Client) -> None:
    """The server may not have noticed yet that the client of a cut stream is gone: a resume under
    its request id replaces it (any other request under that id is still refused while it runs)."""
    request_id = f"resume-{uuid.uuid4().hex}"
    payload = {**body("greedy"), "max_new_tokens": LONG_TOKENS}
    with client.stream("POST", "/generate", json=payload, headers={"x-request-id": request_id}) as first:
        events = sse_data(first)
        held = [next(events)["token"] for _ in range(3)]
        again = client.post("/generate", json=payload, headers={"x-request-id": request_id})
        assert_error_shape(again, 409, "request_id")
        rest = resumed(client, payload, held, **{"x-request-id": request_id})
        assert rest.end["usage"]["completion_tokens"] == payload["max_new_tokens"]
        remaining = list(events)
    assert "error" in remaining[-1], remaining[-1]  # the replaced stream ends, typed
