"""The asyncio gRPC client: the same methods as `GrpcPEClient`, awaitable."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from types import TracebackType
from typing import Any, Self, Unpack

import grpc

from pe_client._base import DEFAULT_MAX_RETRIES
from pe_client.errors import APIError
from pe_client.grpc import pe_serve_pb2 as pb
from pe_client.grpc._base import (
    DEFAULT_TIMEOUT_S,
    BaseGrpcClient,
    GrpcStreamState,
    channel_options,
    generate_message,
    method,
    model_list,
    rpc_error,
    score_message,
    score_response,
    serialize,
)
from pe_client.grpc._health import HEALTH_CHECK, health_request, health_result, parse_health
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

OpenCall = Callable[[], Awaitable[tuple[Any, pb.GenerateResponse]]]


class AsyncGrpcStream(GrpcStreamState):
    """Async twin of `GrpcStream`; `async with client.generate_stream(...) as stream:`."""

    def __init__(self, message: pb.GenerateRequest, open_call: OpenCall) -> None:
        super().__init__(message)
        self._open_call = open_call
        self._call: Any = None
        self._first: pb.GenerateResponse | None = None
        self._events: AsyncIterator[StreamEvent] | None = None

    async def _opened(self) -> Any:
        if self._call is None:
            self._call, self._first = await self._open_call()
        return self._call

    async def __aenter__(self) -> Self:
        await self._opened()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> StreamEvent:
        if self._events is None:
            self._events = self._read_events()
        return await anext(self._events)

    async def _read_events(self) -> AsyncIterator[StreamEvent]:
        call = await self._opened()
        try:
            if self._first is not None:
                yield self._accept(self._first)
            while (response := await call.read()) is not grpc.aio.EOF:
                yield self._accept(response)
        except grpc.RpcError as exc:
            raise rpc_error(exc) from None
        finally:
            self.close()

    def close(self) -> None:
        """Cancel the call if it is still running; safe to call more than once."""
        if self._call is not None:
            self._call.cancel()

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
    ) -> None:
        super().__init__(target=target, api_key=api_key, timeout=timeout, max_retries=max_retries)
        self._owns_channel = channel is None
        self._channel = (
            channel if channel is not None else grpc.aio.insecure_channel(self.target, channel_options())
        )
        self._sleep = sleep
        self._generate = self._channel.unary_stream(
            method("Generate"),
            request_serializer=serialize,
            response_deserializer=pb.GenerateResponse.FromString,
        )
        self._score = self._channel.unary_unary(
            method("Score"), request_serializer=serialize, response_deserializer=pb.ScoreResponse.FromString
        )
        self._list_models = self._channel.unary_unary(
            method("ListModels"),
            request_serializer=serialize,
            response_deserializer=pb.ListModelsResponse.FromString,
        )
        self._abort = self._channel.unary_unary(
            method("Abort"), request_serializer=serialize, response_deserializer=pb.AbortResponse.FromString
        )
        self._health = self._channel.unary_unary(
            HEALTH_CHECK, request_serializer=serialize, response_deserializer=parse_health
        )

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
        return AsyncGrpcStream(message, lambda: self._open_stream(message))

    async def score(
        self,
        request: ScoreRequest | None = None,
        /,
        *,
        request_id: str | None = None,
        **params: Unpack[ScoreParams],
    ) -> ScoreResponse:
        """Log-probability of every token of a text given its prefix, and the perplexity."""
        return score_response(await self._unary(self._score, score_message(request, params, request_id)))

    async def models(self) -> list[ModelInfo]:
        """The resident models, in load order."""
        return model_list(await self._unary(self._list_models, pb.ListModelsRequest()))

    async def cancel(self, request_id: str) -> None:
        """Stop a running generation or scoring (`Abort`); its stream then raises with CANCELLED."""
        await self._unary(self._abort, pb.AbortRequest(request_id=request_id))

    async def health(self) -> Health:
        """One `grpc.health.v1` check of the service, no retries: ready means SERVING."""
        try:
            response = await self._health(health_request(), metadata=self._metadata(), timeout=self.timeout)
        except grpc.RpcError as exc:
            raise rpc_error(exc) from None
        return health_result(response)

    async def close(self) -> None:
        if self._owns_channel:
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

    async def _open_stream(self, message: pb.GenerateRequest) -> tuple[Any, pb.GenerateResponse]:
        retries_taken = 0
        while True:
            error: APIError
            call = self._generate(message, metadata=self._metadata(), timeout=self.timeout)
            try:
                return call, await call.read()
            except grpc.RpcError as exc:
                error = rpc_error(exc)
            await self._sleep(self.retry_policy.delay_or_raise(retries_taken, error))
            retries_taken += 1
