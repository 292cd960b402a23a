"""Failures that are not the client's: a 500 with a request id and no trace, and in-stream errors.

Nothing a client sends can make the real engine raise an unexpected exception, so these tests plant
faults in a subclass of the real engine and serve it with the real app on a real uvicorn server,
in this process (so the log records can be inspected).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from service.engine.engine import InferenceEngine
from service.engine.errors import RequestFailedError
from service.engine.types import (
    ENGINE_NAMES,
    EngineEvent,
    FieldNames,
    GenerationRequest,
    RequestHandle,
    ScoringRequest,
    TokenEvent,
)
from service.settings import Settings
from tests.live_server import free_port
from tests.service.api.helpers import DONE, assert_error_shape, sse_data
from tests.service.api.in_process import serve_in_process
from tests.service.grpc.helpers import assert_status, generate, stream, trailing

PLANTED_PROMPT = "raise please"
PLANTED_DETAIL = "/srv/secret/engine_internals.py"


class _FailsAfterFirstToken:
    """A real handle whose stream breaks, as an engine failure would, once a token was sent."""

    def __init__(self, handle: RequestHandle) -> None:
        self._handle = handle
        self.request_id = handle.request_id

    async def __aiter__(self) -> AsyncIterator[EngineEvent]:
        async for event in self._handle:
            yield event
            if isinstance(event, TokenEvent):
                self._handle.cancel()
                raise RequestFailedError("the request failed in the engine: planted")

    def __iter__(self) -> Iterator[EngineEvent]:
        return iter(self._handle)

    def cancel(self) -> None:
        self._handle.cancel()


class FaultyEngine(InferenceEngine):
    """The real engine, with a bug planted in `encode` and a failing stream for seed 13."""

    def tokenize(self, model: str, text: str, *, add_special_tokens: bool = True) -> list[int]:
        if text == PLANTED_PROMPT:
            raise RuntimeError(f"planted bug in {PLANTED_DETAIL}")
        return super().tokenize(model, text, add_special_tokens=add_special_tokens)

    # The Engine protocol returns a RequestHandle; InferenceEngine narrows it to its own class.
    def submit(  # type: ignore[override]
        self, request: GenerationRequest | ScoringRequest, names: FieldNames = ENGINE_NAMES
    ) -> RequestHandle:
        handle = super().submit(request, names)
        if isinstance(request, GenerationRequest) and request.sampling.seed == 13:
            return _FailsAfterFirstToken(handle)
        return handle


@pytest.fixture(scope="module")
def faulty_grpc_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def faulty(tiny_checkpoints: dict[str, Path], faulty_grpc_port: int) -> Iterator[httpx.Client]:
    engine = FaultyEngine.from_model_dirs(
        [tiny_checkpoints["rope"]], device="cpu", dtype="float32", max_context=256
    )
    with serve_in_process(engine, Settings(warmup=False, grpc_port=faulty_grpc_port)) as client:
        yield client


def test_unexpected_exception_is_a_500_with_request_id_and_no_trace(
    faulty: httpx.Client, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR, logger="service.api"):
        response = faulty.post(
            "/generate", json={"prompt": PLANTED_PROMPT}, headers={"X-Request-ID": "bug-1"}
        )
    error = assert_error_shape(response, 500, None)
    assert error["type"] == "internal_error"
    assert "bug-1" in error["message"] and response.headers["X-Request-ID"] == "bug-1"
    assert PLANTED_DETAIL not in response.text and "RuntimeError" not in response.text
    logged = [record for record in caplog.records if record.exc_info]
    assert logged and PLANTED_DETAIL in str(logged[0].exc_info[1])  # type: ignore[index]
    assert faulty.post("/generate", json={"prompt": "fine", "max_new_tokens": 2}).status_code == 200


def test_a_failure_after_streaming_began_is_an_error_event(faulty: httpx.Client) -> None:
    request = {"prompt": "a", "max_new_tokens": 8, "seed": 13, "stream": True}
    with faulty.stream("POST", "/generate", json=request) as response:
        assert response.status_code == 200
        events = list(sse_data(response))
    first, failure = events
    assert "token" in first
    assert failure["error"]["type"] == "request_failed"
    assert set(failure["error"]) == {"type", "message", "param"}
    assert DONE not in events


def test_over_grpc_a_bug_is_internal_with_the_request_id_and_a_failure_keeps_its_type(
    faulty: httpx.Client, faulty_grpc_port: int
) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{faulty_grpc_port}") as channel:
        with pytest.raises(grpc.RpcError) as bug:
            generate(channel, {"prompt": PLANTED_PROMPT, "request_id": "grpc-bug-1"}, timeout=30)
        metadata = assert_status(bug.value, grpc.StatusCode.INTERNAL)
        assert (
            metadata["pe-serve-error-type"] == "internal_error" and metadata["x-request-id"] == "grpc-bug-1"
        )
        assert "grpc-bug-1" in (bug.value.details() or "") and PLANTED_DETAIL not in (
            bug.value.details() or ""
        )
        call = stream(channel, {"prompt": "a", "max_new_tokens": 8, "seed": 13}, timeout=30)
        assert next(call).HasField("token")
        with pytest.raises(grpc.RpcError) as failed:
            list(call)
        assert trailing(failed.value)["pe-serve-error-type"] == "request_failed"
        assert failed.value.code() is grpc.StatusCode.INTERNAL
        assert generate(channel, {"prompt": "fine", "max_new_tokens": 2}, timeout=30)[-1].HasField("end")
