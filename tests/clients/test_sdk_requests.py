"""What the SDK puts on the wire and how it reads streams, checked at the transport boundary."""

from __future__ import annotations

import json

import httpx
import pytest
from pe_client import (
    APIConnectionError,
    APIStreamError,
    GenerateRequest,
    Llama3Scaling,
    PEClient,
    ScoreRequest,
    StreamEnd,
    StreamToken,
    YarnScaling,
)
from pydantic import ValidationError

from tests.clients.bodies import SCORE, STREAM_END, sse, token_event


class Recorder:
    """Answers every request with one canned response and keeps the requests it saw."""

    def __init__(self, response: httpx.Response) -> None:
        self.response = response
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        return self.response

    def body(self, index: int = -1) -> object:
        return json.loads(self.requests[index].content)


def client_for(recorder: Recorder, base_url: str | None = "http://pe.test", **options: object) -> PEClient:
    http = httpx.Client(transport=httpx.MockTransport(recorder))
    return PEClient(base_url, http_client=http, **options)  # type: ignore[arg-type]


def test_keyword_and_model_forms_send_the_same_body() -> None:
    recorder = Recorder(httpx.Response(200, json=SCORE))
    client = client_for(recorder)
    client.score(prompt="abc", pe="rope", pe_scaling={"type": "yarn", "factor": 4})
    client.score(ScoreRequest(prompt="abc", pe="rope", pe_scaling=YarnScaling(factor=4)))
    assert (
        recorder.body(0)
        == recorder.body(1)
        == {
            "prompt": "abc",
            "pe": "rope",
            "pe_scaling": {"type": "yarn", "factor": 4.0},
        }
    )


def test_request_object_and_keywords_together_are_refused() -> None:
    client = client_for(Recorder(httpx.Response(200, json=SCORE)))
    with pytest.raises(TypeError):
        client.score(ScoreRequest(prompt="a"), prompt="b")


def test_unset_fields_are_left_to_server_defaults() -> None:
    recorder = Recorder(sse("[DONE]"))
    with client_for(recorder).generate_stream(prompt="x", pe_scaling=Llama3Scaling(factor=8)) as stream:
        list(stream)
    assert recorder.body() == {"prompt": "x", "pe_scaling": {"type": "llama3", "factor": 8.0}, "stream": True}


def test_misspelt_fields_fail_before_sending() -> None:
    recorder = Recorder(httpx.Response(200, json=SCORE))
    with pytest.raises(ValidationError):
        client_for(recorder).score(prompt="x", pe_scaling={"type": "yarn", "factor": 4, "beta_fats": 2})
    with pytest.raises(ValidationError):
        GenerateRequest(prompt="x", max_tokens=5)  # type: ignore[call-arg]
    assert recorder.requests == []


def test_environment_supplies_url_and_api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PE_SERVE_URL", "http://from-env.test:9000/")
    monkeypatch.setenv("PE_SERVE_API_KEY", "sekrit")
    recorder = Recorder(httpx.Response(200, json=SCORE))
    client_for(recorder, base_url=None).score(prompt="x")
    request = recorder.requests[0]
    assert str(request.url) == "http://from-env.test:9000/score"
    assert request.headers["authorization"] == "Bearer sekrit"


def test_stream_yields_tokens_then_end_and_accumulates_text() -> None:
    recorder = Recorder(sse(token_event(104), token_event(105), json.dumps(STREAM_END), "[DONE]"))
    with client_for(recorder).generate_stream(prompt="x") as stream:
        events = list(stream)
    assert [type(event) for event in events] == [StreamToken, StreamToken, StreamEnd]
    assert stream.text == "hi"
    assert stream.final is not None and stream.final.finish_reason == "length"


def test_error_event_mid_stream_raises() -> None:
    error = '{"error": {"type": "request_failed", "message": "non-finite logits", "param": null}}'
    recorder = Recorder(sse(token_event(104), error, "[DONE]"))
    received: list[object] = []
    with pytest.raises(APIStreamError) as caught, client_for(recorder).generate_stream(prompt="x") as stream:
        received.extend(stream)
    assert len(received) == 1
    assert caught.value.type == "request_failed"
    assert "non-finite" in str(caught.value)


def test_stream_cut_before_done_raises_connection_error_when_it_may_not_resume() -> None:
    recorder = Recorder(sse(token_event(104)))
    client = client_for(recorder, max_retries=0)
    with pytest.raises(APIConnectionError), client.generate_stream(prompt="x") as stream:
        list(stream)
    assert len(recorder.requests) == 1
