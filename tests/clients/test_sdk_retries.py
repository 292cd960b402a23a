"""Retry policy, Retry-After and error mapping, over httpx's mock transport.

The live tests cannot make a real server answer 502 or time out on cue, so these drive the SDK with
scripted responses; the injected `sleep` records each backoff instead of waiting.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
from pe_client import (
    APIConnectionError,
    APITimeoutError,
    AsyncPEClient,
    AuthenticationError,
    BadRequestError,
    InternalServerError,
    NotFoundError,
    PEClient,
    RateLimitError,
    ServiceUnavailableError,
    StreamToken,
    UnprocessableEntityError,
)
from pe_client._base import RetryPolicy

from tests.clients.bodies import GENERATION, STREAM_END, sse, token_event

Outcome = httpx.Response | Exception


def error_response(status: int, headers: dict[str, str] | None = None) -> httpx.Response:
    body = {"error": {"type": f"status_{status}", "message": "scripted", "param": "pe_scaling.factor"}}
    return httpx.Response(status, json=body, headers=headers)


class Script:
    """A transport answering each request with the next scripted outcome; records requests and sleeps."""

    def __init__(self, *outcomes: Outcome) -> None:
        self._outcomes: Iterator[Outcome] = iter(outcomes)
        self.requests: list[httpx.Request] = []
        self.sleeps: list[float] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        outcome = next(self._outcomes)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome


def sync_client(script: Script, **options: object) -> PEClient:
    http = httpx.Client(transport=httpx.MockTransport(script))
    return PEClient("http://pe.test", http_client=http, sleep=script.sleeps.append, **options)  # type: ignore[arg-type]


def run_async(script: Script, call: Callable[[AsyncPEClient], object]) -> object:
    async def record(delay: float) -> None:
        script.sleeps.append(delay)

    async def main() -> object:
        http = httpx.AsyncClient(transport=httpx.MockTransport(script))
        async with AsyncPEClient("http://pe.test", http_client=http, sleep=record) as client:
            return await call(client)  # type: ignore[misc]

    return asyncio.run(main())


@pytest.mark.parametrize("status", [408, 429, 502, 503, 504])
def test_retryable_status_is_retried_then_succeeds(status: int) -> None:
    script = Script(error_response(status), httpx.Response(200, json=GENERATION))
    result = sync_client(script).generate(prompt="hi")
    assert result.text == "hi"
    assert len(script.requests) == 2
    assert len(script.sleeps) == 1


@pytest.mark.parametrize(
    ("status", "error_class"),
    [
        (400, BadRequestError),
        (401, AuthenticationError),
        (404, NotFoundError),
        (422, UnprocessableEntityError),
        (500, InternalServerError),
    ],
)
def test_other_statuses_are_not_retried(status: int, error_class: type[Exception]) -> None:
    script = Script(error_response(status))
    with pytest.raises(error_class) as caught:
        sync_client(script).generate(prompt="hi")
    assert len(script.requests) == 1
    assert script.sleeps == []
    assert caught.value.param == "pe_scaling.factor"  # type: ignore[attr-defined]
    assert caught.value.type == f"status_{status}"  # type: ignore[attr-defined]


def test_retry_after_seconds_is_honoured() -> None:
    script = Script(error_response(429, {"Retry-After": "3"}), httpx.Response(200, json=GENERATION))
    sync_client(script).generate(prompt="hi")
    assert script.sleeps == [3.0]


def test_retry_after_http_date_is_honoured() -> None:
    when = email.utils.formatdate(time.time() + 30, usegmt=True)
    script = Script(error_response(503, {"Retry-After": when}), httpx.Response(200, json=GENERATION))
    sync_client(script).generate(prompt="hi")
    assert 25.0 < script.sleeps[0] <= 30.0


def test_unreasonable_retry_after_falls_back_to_backoff() -> None:
    script = Script(error_response(429, {"Retry-After": "3600"}), httpx.Response(200, json=GENERATION))
    sync_client(script).generate(prompt="hi")
    assert 0.375 <= script.sleeps[0] <= 0.5


def test_backoff_doubles_with_jitter_and_gives_up_after_max_retries() -> None:
    connect_error = httpx.ConnectError("refused")
    script = Script(connect_error, connect_error, connect_error)
    with pytest.raises(APIConnectionError):
        sync_client(script).models()
    assert len(script.requests) == 3  # the first attempt plus max_retries=2
    assert 0.375 <= script.sleeps[0] <= 0.5
    assert 0.75 <= script.sleeps[1] <= 1.0


def test_backoff_is_capped() -> None:
    policy = RetryPolicy(max_retries=10, jitter=lambda: 0.0)
    error = APIConnectionError(request=httpx.Request("GET", "http://pe.test"))
    assert [policy.delay_or_raise(n, error) for n in range(6)] == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0]


def test_rate_limit_exhausting_retries_raises_rate_limit_error() -> None:
    script = Script(*(error_response(429, {"Retry-After": "1"}) for _ in range(3)))
    with pytest.raises(RateLimitError):
        sync_client(script).generate(prompt="hi")
    assert script.sleeps == [1.0, 1.0]


def test_max_retries_zero_makes_one_attempt() -> None:
    script = Script(error_response(503))
    with pytest.raises(ServiceUnavailableError):
        sync_client(script, max_retries=0).generate(prompt="hi")
    assert len(script.requests) == 1


def test_timeout_raises_timeout_error_after_retries() -> None:
    timeout = httpx.ReadTimeout("slow")
    script = Script(timeout, timeout, timeout)
    with pytest.raises(APITimeoutError):
        sync_client(script).generate(prompt="hi")
    assert len(script.sleeps) == 2


def test_async_client_retries_the_same_way() -> None:
    script = Script(error_response(503, {"Retry-After": "2"}), httpx.Response(200, json=GENERATION))
    result = run_async(script, lambda client: client.generate(prompt="hi"))
    assert result.text == "hi"  # type: ignore[attr-defined]
    assert script.sleeps == [2.0]


def test_async_client_does_not_retry_422() -> None:
    script = Script(error_response(422))
    with pytest.raises(UnprocessableEntityError):
        run_async(script, lambda client: client.generate(prompt="hi"))
    assert len(script.requests) == 1


def test_stream_open_is_retried_before_any_event() -> None:
    script = Script(error_response(502), sse(token_event(104), json.dumps(STREAM_END), "[DONE]"))
    with sync_client(script).generate_stream(prompt="x") as stream:
        events = list(stream)
    assert [type(event).__name__ for event in events] == ["StreamToken", "StreamEnd"]
    assert len(script.sleeps) == 1


def test_every_attempt_of_a_call_carries_the_same_request_id() -> None:
    connect_error = httpx.ConnectError("refused")
    script = Script(connect_error, error_response(503), httpx.Response(200, json=GENERATION))
    sync_client(script).generate(prompt="hi")
    ids = {request.headers["x-request-id"] for request in script.requests}
    assert len(script.requests) == 3 and len(ids) == 1


def test_each_call_has_its_own_request_id() -> None:
    script = Script(*(httpx.Response(200, json=GENERATION) for _ in range(2)))
    client = sync_client(script)
    client.generate(prompt="hi")
    client.generate(prompt="hi")
    first, second = (request.headers["x-request-id"] for request in script.requests)
    assert first != second


def test_a_retried_stream_open_keeps_its_request_id_and_so_does_the_async_client() -> None:
    script = Script(error_response(502), sse(token_event(104), json.dumps(STREAM_END), "[DONE]"))
    with sync_client(script).generate_stream(prompt="x") as stream:
        list(stream)
    assert len({request.headers["x-request-id"] for request in script.requests}) == 1
    script = Script(httpx.ReadError("reset"), httpx.Response(200, json=GENERATION))
    run_async(script, lambda client: client.generate(prompt="hi"))
    assert len({request.headers["x-request-id"] for request in script.requests}) == 1


# -- a stream cut on the way is resumed from the tokens received ---------------------------------

REPLICA_LOST = '{"error": {"type": "replica_lost", "message": "gone", "param": null}}'


def events_of(script: Script, **options: object) -> tuple[list[str], int]:
    """Event types read from one `generate_stream` through `script`, and how often it resumed."""
    with sync_client(script, **options).generate_stream(prompt="x") as stream:
        events = [type(event).__name__ for event in stream]
    return events, stream.resumes


def resume_bodies(script: Script) -> list[object]:
    return [json.loads(request.content).get("resume_from") for request in script.requests]


@pytest.mark.parametrize("cut", ["connection", "replica_lost"])
def test_a_cut_stream_is_resumed_from_the_tokens_received_under_its_request_id(cut: str) -> None:
    """Cut after token 104 (the connection ends before [DONE], or the proxy says the replica died):
    the stream is asked for again with `resume_from`, and its reader sees one stream."""
    first = sse(token_event(104)) if cut == "connection" else sse(token_event(104), REPLICA_LOST)
    script = Script(first, sse(token_event(105), json.dumps(STREAM_END), "[DONE]"))
    events, resumes = events_of(script)
    assert events == ["StreamToken", "StreamToken", "StreamEnd"] and resumes == 1
    assert resume_bodies(script) == [None, {"tokens": [104]}]
    assert len({request.headers["x-request-id"] for request in script.requests}) == 1
    assert len(script.sleeps) == 1


def test_cuts_in_a_row_without_a_token_give_up_after_max_retries() -> None:
    script = Script(sse(token_event(104)), sse(), sse(), sse())
    with pytest.raises(APIConnectionError):
        events_of(script, max_retries=2)
    assert resume_bodies(script) == [None, {"tokens": [104]}, {"tokens": [104]}]


def test_a_cut_after_the_end_event_is_not_resumed() -> None:
    script = Script(sse(token_event(104), json.dumps(STREAM_END)))
    assert events_of(script) == (["StreamToken", "StreamEnd"], 0)
    assert len(script.requests) == 1


def test_the_async_stream_resumes_the_same_way() -> None:
    script = Script(sse(token_event(104)), sse(token_event(105), json.dumps(STREAM_END), "[DONE]"))

    async def read(client: AsyncPEClient) -> list[int]:
        async with client.generate_stream(prompt="x", resume_from={"tokens": [99]}) as stream:
            return [event.token async for event in stream if isinstance(event, StreamToken)]

    assert run_async(script, read) == [104, 105]
    assert resume_bodies(script) == [{"tokens": [99]}, {"tokens": [99, 104]}], "after the tokens it held"
