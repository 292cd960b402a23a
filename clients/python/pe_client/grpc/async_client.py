"""The asyncio gRPC client: the same methods as `GrpcPEClient`, awaitable."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from types import TracebackType
from typing import Any, Self, Unpack

import grpc

from pe_client._base import DEFAULT_MAX_RETRIES, RetryPolicy
from pe_client._lazy_stream import AsyncLazyStream, OpenTransport
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


class AsyncGrpcStream(GrpcStreamState, AsyncLazyStream[Any]):
    """Async twin of `GrpcStream`; `async with client.generate_stream(...) as stream:`."""

    def __init__(
        self,
        message: pb.GenerateRequest,
        open_call: OpenTransport[Awaitable[Any]],
        retry_policy: RetryPolicy,
        sleep: Callable[[float], Awaitable[None]],
    ) -> None:
        GrpcStreamState.__init__(self, message)
        AsyncLazyStream.__init__(self, open_call, retry_policy, sleep)

    async def _events_from(self, call: Any) -> AsyncIterator[StreamEvent]:
        try:
            while (response := await call.read()) is not grpc.aio.EOF:
                yield self._accept(response)
        except grpc.RpcError as exc:
            raise rpc_error(exc) from None

    async def _release(self, call: Any) -> None:
        call.cancel()

    def close(self) -> None:
        """Cancel the call if it is still running; safe to call more than once (not a coroutine:
        cancelling a gRPC call does not wait)."""
        if self._transport is not None:
            self._transport.cancel()

    cancel = close


class AsyncGrpcPEClient(BaseGrpcClient):
    """Non-blocking gRPC client for pe-serve; see `GrpcPEClient` for the arguments.

    The channel belongs to the event loop it is first used on, like any `grpc.aio` channel.
    """

    def __init__(
        self,
        target: str | None = None,
        *,
        api_key: str | None = None,
        timeout: float | None = DEFAULT_TIMEOUT_S,
        max_retries: int = DEFAULT_MAX_RETRIES,
        channel: grpc.aio.Channel | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        tls: TLS | None = None,
    ) -> None:
        super().__init__(target=target, api_key=api_key, timeout=timeout, max_retries=max_retries, tls=tls)
        self._owns_channel = channel is None
        self._channel = channel
        self._sleep = sleep
        self._stubs: Stubs | None = None

    def _stub(self) -> Stubs:
        """The method stubs, made on first use: a `grpc.aio` channel must be made in a running loop."""
        if self._stubs is None:
            if self._channel is None:
                credentials = self._credentials()
                self._channel = (
                    grpc.aio.insecure_channel(self.target, channel_options())
                    if credentials is None
                    else grpc.aio.secure_channel(self.target, credentials, channel_options())
                )
            self._stubs = Stubs(self._channel)
        return self._stubs

    async def generate(
        self,
        request: GenerateRequest | None = None,
        /,
        *,
        request_id: str | None = None,
        **params: Unpack[GenerateParams],
    ) -> GenerateResponse:
        """Generate a completion and wait for all of it."""
        async with self.generate_stream(request, request_id=request_id, **params) as stream:
            async for _ in stream:
                pass
        return stream.result()

    def generate_stream(
        self,
        request: GenerateRequest | None = None,
        /,
        *,
        request_id: str | None = None,
        **params: Unpack[GenerateParams],
    ) -> AsyncGrpcStream:
        """Stream a completion; the call starts when the stream is entered or iterated."""
        message = generate_message(request, params, request_id)
        return AsyncGrpcStream(
            message,
            lambda held: self._open_stream(resumed_message(message, held)),
            self.retry_policy,
            self._sleep,
        )

    async def score(
        self,
        request: ScoreRequest | None = None,
        /,
        *,
        request_id: str | None = None,
        **params: Unpack[ScoreParams],
    ) -> ScoreResponse:
        """Log-probability of every token of a text given its prefix, and the perplexity."""
        return score_response(
            await self._unary(self._stub().score, score_message(request, params, request_id))
        )

    async def models(self) -> list[ModelInfo]:
        """The resident models, in load order."""
        return model_list(await self._unary(self._stub().list_models, pb.ListModelsRequest()))

    async def cancel(self, request_id: str) -> None:
        """Stop a running generation or scoring (`Abort`); its stream then raises with CANCELLED."""
        await self._unary(self._stub().abort, pb.AbortRequest(request_id=request_id))

    async def health(self) -> Health:
        """One `grpc.health.v1` check of the service, no retries: ready means SERVING."""
        try:
            response = await self._stub().health(
                health_request(), metadata=self._metadata(), timeout=self.timeout
            )
        except grpc.RpcError as exc:
            raise rpc_error(exc) from None
        return health_result(response)

    async def close(self) -> None:
        if self._owns_channel and self._channel is not None:
            await self._channel.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def _unary(self, stub: Any, message: Any) -> Any:
        retries_taken = 0
        while True:
            error: APIError
            try:
                return await stub(message, metadata=self._metadata(), timeout=self.timeout)
            except grpc.RpcError as exc:
                error = rpc_error(exc)
            await self._sleep(self.retry_policy.delay_or_raise(retries_taken, error))
            retries_taken += 1

    async def _open_stream(self, message: pb.GenerateRequest) -> Any:
        """Start the call under the retry policy; see `GrpcPEClient._open_stream`."""
        retries_taken = 0
        while True:
            call = self._stub().generate(message, metadata=self._metadata(), timeout=self.timeout)
            await call.initial_metadata()
            if not call.done() or await call.code() is grpc.StatusCode.OK:
                return call
            try:
                await call.read()  # raises the call's failure
            except grpc.RpcError as exc:
                error: APIError = rpc_error(exc)
            await self._sleep(self.retry_policy.delay_or_raise(retries_taken, error))
            retries_taken += 1
