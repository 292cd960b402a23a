"""The synchronous gRPC client: `PEClient`'s methods and result types over pe-serve's gRPC API."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any, Self, Unpack

import grpc

from pe_client._base import DEFAULT_MAX_RETRIES, RetryPolicy
from pe_client._lazy_stream import LazyStream, OpenTransport
from pe_client.errors import APIError
from pe_client.grpc import pe_serve_pb2 as pb
from pe_client.grpc._base import (
    DEFAULT_TIMEOUT_S,
    BaseGrpcClient,
    GrpcStreamState,
    channel_options,
    generate_message,
    model_list,
    resumed_message,
    rpc_error,
    score_message,
    score_response,
)
from pe_client.grpc._health import health_request, health_result
from pe_client.grpc._stubs import Stubs
from pe_client.tls import TLS
from pe_client.types import (
    GenerateParams,
    GenerateRequest,
    GenerateResponse,
    Health,
    ModelInfo,
    ScoreParams,
    ScoreRequest,
    ScoreResponse,
    StreamEvent,
)


class GrpcStream(GrpcStreamState, LazyStream[Any]):
    """Token events then one `StreamEnd`, like `Stream`; `with client.generate_stream(...) as stream:`.

    The call starts on `with` or on the first iteration (retried, like the HTTP stream, until its
    first message arrives) and is resumed if it is cut, as the HTTP stream is; leaving early,
    `close()` or `cancel()` cancels the call, and the server frees the batch slot.
    """

    def __init__(
        self,
        message: pb.GenerateRequest,
        open_call: OpenTransport[Any],
        retry_policy: RetryPolicy,
        sleep: Callable[[float], None],
    ):
        GrpcStreamState.__init__(self, message)
        LazyStream.__init__(self, open_call, retry_policy, sleep)

    def _events_from(self, call: Any) -> Iterator[StreamEvent]:
        try:
            for response in call:
                yield self._accept(response)
        except grpc.RpcError as exc:
            raise rpc_error(exc) from None

    def _release(self, call: Any) -> None:
        call.cancel()

    cancel = LazyStream.close


class GrpcPEClient(BaseGrpcClient):
    """Blocking gRPC client for pe-serve, with `PEClient`'s methods plus `cancel(request_id)`.

    `target` (host:port) and `api_key` default to `PE_SERVE_GRPC_TARGET` and `PE_SERVE_API_KEY`;
    `timeout` is each call's deadline in seconds (a stream's covers the whole stream; None: no
    deadline). `tls` (`pe_client.tls.TLS`) opens a TLS channel. Pass `channel` to bring your own
    (it is then yours to close).
    """

    def __init__(
        self,
        target: str | None = None,
        *,
        api_key: str | None = None,
        timeout: float | None = DEFAULT_TIMEOUT_S,
        max_retries: int = DEFAULT_MAX_RETRIES,
        channel: grpc.Channel | None = None,
        sleep: Callable[[float], None] = time.sleep,
        tls: TLS | None = None,
    ) -> None:
        super().__init__(target=target, api_key=api_key, timeout=timeout, max_retries=max_retries, tls=tls)
        self._owns_channel = channel is None
        self._channel = channel if channel is not None else self._open_channel()
        self._sleep = sleep
        self._stubs = Stubs(self._channel)

    def _open_channel(self) -> grpc.Channel:
        credentials = self._credentials()
        if credentials is None:
            return grpc.insecure_channel(self.target, channel_options())
        return grpc.secure_channel(self.target, credentials, channel_options())

    def generate(
        self,
        request: GenerateRequest | None = None,
        /,
        *,
        request_id: str | None = None,
        **params: Unpack[GenerateParams],
    ) -> GenerateResponse:
        """Generate a completion and wait for all of it."""
        with self.generate_stream(request, request_id=request_id, **params) as stream:
            for _ in stream:
                pass
        return stream.result()

    def generate_stream(
        self,
        request: GenerateRequest | None = None,
        /,
        *,
        request_id: str | None = None,
        **params: Unpack[GenerateParams],
    ) -> GrpcStream:
        """Stream a completion; `stream.request_id` is what `cancel()` takes, known before the call starts."""
        message = generate_message(request, params, request_id)
        return GrpcStream(
            message,
            lambda held: self._open_stream(resumed_message(message, held)),
            self.retry_policy,
            self._sleep,
        )

    def score(
        self,
        request: ScoreRequest | None = None,
        /,
        *,
        request_id: str | None = None,
        **params: Unpack[ScoreParams],
    ) -> ScoreResponse:
        """Log-probability of every token of a text given its prefix, and the perplexity."""
        return score_response(self._unary(self._stubs.score, score_message(request, params, request_id)))

    def models(self) -> list[ModelInfo]:
        """The resident models, in load order."""
        return model_list(self._unary(self._stubs.list_models, pb.ListModelsRequest()))

    def cancel(self, request_id: str) -> None:
        """Stop a running generation or scoring (`Abort`); its stream then raises with CANCELLED."""
        self._unary(self._stubs.abort, pb.AbortRequest(request_id=request_id))

    def health(self) -> Health:
        """One `grpc.health.v1` check of the service, no retries: ready means SERVING."""
        try:
            response = self._stubs.health(health_request(), metadata=self._metadata(), timeout=self.timeout)
        except grpc.RpcError as exc:
            raise rpc_error(exc) from None
        return health_result(response)

    def close(self) -> None:
        if self._owns_channel:
            self._channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _unary(self, stub: Any, message: Any) -> Any:
        """Call under the retry policy; the response, or the last attempt's error."""
        retries_taken = 0
        while True:
            error: APIError
            try:
                return stub(message, metadata=self._metadata(), timeout=self.timeout)
            except grpc.RpcError as exc:
                error = rpc_error(exc)
            self._sleep(self.retry_policy.delay_or_raise(retries_taken, error))
            retries_taken += 1

    def _open_stream(self, message: pb.GenerateRequest) -> Any:
        """Start the call under the retry policy: accepted once the server sends its headers.

        A refused request (full queue, draining, invalid) ends before any header, so it is retried
        or raised here; a queued one waits in the iteration, as over HTTP.
        """
        retries_taken = 0
        while True:
            call = self._stubs.generate(message, metadata=self._metadata(), timeout=self.timeout)
            call.initial_metadata()
            if not call.done() or call.code() is grpc.StatusCode.OK:
                return call
            error: APIError = rpc_error(call)
            self._sleep(self.retry_policy.delay_or_raise(retries_taken, error))
            retries_taken += 1
