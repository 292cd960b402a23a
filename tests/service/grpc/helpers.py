"""Raw gRPC calls to a live server (bytes in, so malformed requests can be sent) and status checks."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import grpc
from pe_client.grpc._codec import request_message

from service.grpc_api import pe_serve_pb2 as pb
from service.grpc_api.status import PARAM_KEY
from tests.service.api.helpers import ANY_PARAM

SERVICE = "pe_serve.v1.PEServe"
_RESPONSES: Mapping[str, Any] = {
    "Generate": pb.GenerateResponse,
    "Score": pb.ScoreResponse,
    "ListModels": pb.ListModelsResponse,
    "Abort": pb.AbortResponse,
}
_REQUESTS: Mapping[str, Any] = {"Generate": pb.GenerateRequest, "Score": pb.ScoreRequest}


def raw_call(channel: grpc.Channel, method: str) -> Any:
    """A callable taking the request's bytes; Generate's yields messages, the others return one."""
    path = f"/{SERVICE}/{method}"
    parse = _RESPONSES[method].FromString
    if method == "Generate":
        return channel.unary_stream(path, response_deserializer=parse)
    return channel.unary_unary(path, response_deserializer=parse)


def request_bytes(method: str, body: Mapping[str, Any]) -> bytes:
    """The message for a JSON body (the same conversion the SDK makes)."""
    data: bytes = request_message(_REQUESTS[method], body).SerializeToString()
    return data


def generate(
    channel: grpc.Channel, body: Mapping[str, Any], **call_options: Any
) -> list[pb.GenerateResponse]:
    return list(raw_call(channel, "Generate")(request_bytes("Generate", body), **call_options))


def stream(
    channel: grpc.Channel, body: Mapping[str, Any], **call_options: Any
) -> Iterator[pb.GenerateResponse]:
    """A running Generate call (iterate it; `.cancel()` it)."""
    call: Iterator[pb.GenerateResponse] = raw_call(channel, "Generate")(
        request_bytes("Generate", body), **call_options
    )
    return call


def as_generation(responses: list[pb.GenerateResponse]) -> dict[str, Any]:
    """Chunks and end message in the shape of `/generate`'s JSON (the fields compared across protocols)."""
    chunks = [response.token for response in responses if response.HasField("token")]
    end = responses[-1].end
    return {
        "tokens": [chunk.token for chunk in chunks],
        "logprobs": [chunk.logprob for chunk in chunks]
        if all(chunk.HasField("logprob") for chunk in chunks)
        else None,
        "top_logprobs": [[alternative(entry) for entry in chunk.top_logprobs] for chunk in chunks]
        if chunks and all(chunk.top_logprobs for chunk in chunks)
        else None,
        "text": "".join(chunk.text for chunk in chunks),
        "finish_reason": end.finish_reason,
        "usage": {
            "prompt_tokens": end.usage.prompt_tokens,
            "completion_tokens": end.usage.completion_tokens,
            "cached_tokens": end.usage.cached_tokens,
        },
        "model": end.model,
    }


def alternative(entry: pb.TopLogprob) -> dict[str, Any]:
    return {"token": entry.token, "text": entry.text, "logprob": entry.logprob}


def trailing(error: grpc.RpcError) -> dict[str, str]:
    return {key: value for key, value in (error.trailing_metadata() or ())}


def assert_status(error: grpc.RpcError, code: grpc.StatusCode, param: object = ANY_PARAM) -> dict[str, str]:
    """The code, a message, no stack trace, and `pe-serve-param` when a field is expected; the metadata."""
    assert error.code() is code, (error.code(), error.details())
    details = error.details() or ""
    assert details and "Traceback" not in details and ".py" not in details
    metadata = trailing(error)
    if param is not ANY_PARAM:
        assert metadata.get(PARAM_KEY) == param, (metadata, details)
    return metadata
