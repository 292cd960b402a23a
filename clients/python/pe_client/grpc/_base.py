"""What the sync and async gRPC clients share: configuration, messages, errors and stream state.

Arguments are checked and filled by the HTTP client's own request models (`build_body`), retries
follow the same `RetryPolicy` (UNAVAILABLE and RESOURCE_EXHAUSTED are its 503 and 429, and the
server's `retry-after` metadata is its `Retry-After` header), and errors are the same classes.
A call's `request_id` is chosen once, in its message, and every retry resends that message: the
server answers a retry of a request it already ran, or is running, from that one run. A stream
resumed after a cut sends it too, with the tokens received (`resumed_message`).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import grpc

from pe_client._base import RetryPolicy, build_body
from pe_client._version import __version__
from pe_client.errors import APIConnectionError, APIError, APITimeoutError, status_error_class
from pe_client.grpc import pe_serve_pb2 as pb
from pe_client.grpc._codec import request_message, response_fields
from pe_client.tls import TLS
from pe_client.types import (
    GenerateParams,
    GenerateRequest,
    GenerateResponse,
    ModelInfo,
    ScoreParams,
    ScoreRequest,
    ScoreResponse,
    StreamEnd,
    StreamEvent,
    StreamToken,
    TopLogprob,
)

DEFAULT_TARGET = "127.0.0.1:50051"
DEFAULT_TIMEOUT_S = 60.0
SERVICE = pb.DESCRIPTOR.services_by_name["PEServe"].full_name
ERROR_TYPE_KEY = "pe-serve-error-type"
PARAM_KEY = "pe-serve-param"
RETRY_AFTER_KEY = "retry-after"

# The HTTP status each gRPC code stands for, which picks the exception class (and retryability).
_HTTP_STATUS: Mapping[grpc.StatusCode, int] = {
    grpc.StatusCode.INVALID_ARGUMENT: 422,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.UNIMPLEMENTED: 501,
}
_PAYLOAD_TOO_LARGE = 413


def method(name: str) -> str:
    return f"/{SERVICE}/{name}"


def rpc_error(error: grpc.RpcError) -> APIError:
    """The SDK's exception for a failed call.

    UNAVAILABLE without pe-serve's metadata never reached the service (no connection): a
    connection error. RESOURCE_EXHAUSTED without `retry-after` is gRPC's own message size limit,
    not a full queue: the 413 class, which is not retried.
    """
    code = error.code()
    metadata = {key: value for key, value in (error.trailing_metadata() or ()) if isinstance(value, str)}
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return APITimeoutError(request=None)
    if code is grpc.StatusCode.UNAVAILABLE and ERROR_TYPE_KEY not in metadata:
        return APIConnectionError(request=None, message=f"Connection error: {error.details()}")
    status = _HTTP_STATUS.get(code, 500)
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED and RETRY_AFTER_KEY not in metadata:
        status = _PAYLOAD_TOO_LARGE
    return status_error_class(status)(
        error.details() or code.name,
        response=None,
        status_code=status,
        headers=metadata,
        error_type=metadata.get(ERROR_TYPE_KEY),
        param=metadata.get(PARAM_KEY),
        grpc_code=code.name,
    )


class BaseGrpcClient:
    """Settings and message construction common to `GrpcPEClient` and `AsyncGrpcPEClient`."""

    def __init__(
        self,
        *,
        target: str | None,
        api_key: str | None,
        timeout: float | None,
        max_retries: int,
        tls: TLS | None = None,
    ) -> None:
        self.target = target or os.environ.get("PE_SERVE_GRPC_TARGET") or DEFAULT_TARGET
        self.api_key = api_key if api_key is not None else os.environ.get("PE_SERVE_API_KEY")
        self.timeout = timeout
        self.retry_policy = RetryPolicy(max_retries=max_retries)
        self.tls = tls

    def _credentials(self) -> grpc.ChannelCredentials | None:
        """A secure channel's credentials with `tls` (its CA, and our certificate for mTLS); else None."""
        if self.tls is None:
            return None
        root, key, chain = self.tls.pem()
        return grpc.ssl_channel_credentials(root_certificates=root, private_key=key, certificate_chain=chain)

    def _metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.api_key}"),) if self.api_key else ()


def serialize(message: Any) -> bytes:
    data: bytes = message.SerializeToString()
    return data


def channel_options() -> list[tuple[str, Any]]:
    return [("grpc.primary_user_agent", f"pe-client/{__version__}")]


def generate_message(
    request: GenerateRequest | None, params: GenerateParams, request_id: str | None
) -> pb.GenerateRequest:
    """The message for a generation; the request id is chosen here when not given, so it is known at once."""
    body = build_body(GenerateRequest, request, params)
    body.pop("stream", None)
    return request_message(
        pb.GenerateRequest, {**body, "request_id": request_id or f"gen-{uuid.uuid4().hex}"}
    )


def resumed_message(message: pb.GenerateRequest, received: Sequence[int]) -> pb.GenerateRequest:
    """The message that resumes a stream cut after `received` (the message itself before any token),
    after the tokens a hand-made `resume_from` already held."""
    if not received:
        return message
    resumed = pb.GenerateRequest()
    resumed.CopyFrom(message)
    resumed.resume_from.tokens.extend(received)
    return resumed


def score_message(
    request: ScoreRequest | None, params: ScoreParams, request_id: str | None
) -> pb.ScoreRequest:
    body = build_body(ScoreRequest, request, params)
    return request_message(pb.ScoreRequest, {**body, "request_id": request_id or f"score-{uuid.uuid4().hex}"})


def score_response(message: pb.ScoreResponse) -> ScoreResponse:
    """As `/score` answers: `token_logprobs` (and `top_logprobs`, when asked for) get their
    leading None back."""
    fields = response_fields(message)
    fields["token_logprobs"] = [None, *fields["token_logprobs"]]
    alternatives = [position["alternatives"] for position in fields["top_logprobs"]]
    fields["top_logprobs"] = [None, *alternatives] if alternatives else None
    return ScoreResponse.model_validate(fields)


def model_list(message: pb.ListModelsResponse) -> list[ModelInfo]:
    return [ModelInfo.model_validate(response_fields(card)) for card in message.models]


class GrpcStreamState:
    """What both stream kinds accumulate: the text, logprobs and alternatives so far, and the end
    (the tokens are the lazy stream's, which resumes with them).

    A chunk's `top_logprobs` is an empty repeated field when none were asked for; it becomes None,
    as the HTTP stream leaves the key out.
    """

    tokens: list[int]

    def __init__(self, message: pb.GenerateRequest) -> None:
        self.request_id = message.request_id
        self.text = ""
        self.logprobs: list[float] | None = [] if message.logprobs else None
        self.top_logprobs: list[list[TopLogprob]] | None = [] if message.top_logprobs else None
        self.final: StreamEnd | None = None

    def _accept(self, response: pb.GenerateResponse) -> StreamEvent:
        if response.HasField("end"):
            self.final = StreamEnd.model_validate(response_fields(response.end))
            return self.final
        fields = response_fields(response.token)
        if self.top_logprobs is None:
            fields["top_logprobs"] = None
        token = StreamToken.model_validate(fields)
        self.text += token.text
        if self.logprobs is not None and token.logprob is not None:
            self.logprobs.append(token.logprob)
        if self.top_logprobs is not None and token.top_logprobs is not None:
            self.top_logprobs.append(token.top_logprobs)
        return token

    def result(self) -> GenerateResponse:
        """The whole generation, as `generate()` returns it over HTTP; only once the stream ended."""
        if self.final is None:
            raise APIConnectionError(request=None, message="The stream ended before its final message.")
        return GenerateResponse(
            id=self.final.id,
            model=self.final.model,
            text=self.text,
            tokens=self.tokens,
            logprobs=self.logprobs,
            top_logprobs=self.top_logprobs,
            finish_reason=self.final.finish_reason,
            usage=self.final.usage,
            pe=self.final.pe,
            timing=self.final.timing,
        )
