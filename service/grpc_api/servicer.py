"""The `pe_serve.v1.PEServe` methods, over the same `ServiceState` (engine, phase) as the HTTP routes.

Each request is validated exactly as its JSON twin: the message becomes the JSON body's dict and
goes through the request core's schemas and `prepare_input`, so a bad field is reported by the same code
with the same name. Every method runs inside `_rpc`, the one place that checks the API key, turns
failures into status codes with trailing metadata, and records the request's metrics and log line.

A generation or scoring request is filed in the request core's ledger (`RunningRequests`, shared
with HTTP) under its request id and the caller's key while it runs, so its owner, and only its
owner, can `Abort` it, and the per-key limits count it; leaving a method early for any reason
(client cancel, expired deadline, error) cancels the engine request, which frees its batch slot
at the engine's next step.

A request id the client chose (`request_id`, else `x-request-id` metadata, read as HTTP reads its
`X-Request-ID` header) names one request of that caller: a `Generate` or `Score` sent again with
the same id and body attaches to the run in progress, or gets its kept answer, through the request
core's `RunOnce` (the same rules and bounds as HTTP). The same id with another body, or for the
other method, is INVALID_ARGUMENT. Answers are kept serialized, so the handlers return bytes.
A resumed stream (`resume_from`) is the exception: it runs from the tokens its client holds, on
its own (neither shared nor kept), replacing the run it continues if that still runs here.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass
from functools import partial
from types import TracebackType
from typing import Any

import grpc

from service.engine.types import GenerationResult, ScoreResult, TokenEvent
from service.grpc_api import pe_serve_pb2 as pb
from service.grpc_api.codec import parse_request, request_fields
from service.grpc_api.responses import generate_end, models_message, score_message, token_chunk
from service.grpc_api.status import REQUEST_ID_KEY, status_code, trailing_metadata
from service.logs import request_id_var
from service.requests.auth import ANONYMOUS, CLIENT_REQUEST_ID, bearer_caller
from service.requests.bodies import GenerateRequest, ScoreRequest
from service.requests.build import generate_job, score_job
from service.requests.convert import token_text
from service.requests.errors import ErrorKind, RequestError, as_request_error
from service.requests.metrics import ServiceMetrics
from service.requests.once import RunOnce, fingerprint_of
from service.requests.prepare import prepare_generation, prepare_scored
from service.requests.running import REQUEST_ID_FIELD, FirstTokenTimer, RunningRequests
from service.requests.state import ServiceState

logger = logging.getLogger("service.grpc.access")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["PEServe"].full_name
# A cancellation this close to the deadline is the deadline. The server's deadline starts when it
# reads the call, later than the client's by however long the request waited to be read; the
# client cancels at its own deadline, so on a busy host the cancel arrives before the server's.
# 50 ms, then 250 ms, were too little on loaded 2-core CI runs (a deadline counted as CANCELLED).
# The label only sorts the server's metrics and logs (a client that cancels reads no status), so
# a wide margin costs little: a client's own cancel in its deadline's last second counts as expiry.
_DEADLINE_SLACK_S = 1.0


@dataclass
class _Call:
    """One RPC as `_rpc` records it; the request id is replaced once the request names its own."""

    method: str
    request_id: str
    started: float
    caller: str = ANONYMOUS
    code: grpc.StatusCode = grpc.StatusCode.OK
    # Under a client-chosen id, what its submissions share a run by (`RunOnce`); None: runs alone.
    once_key: tuple[str, str] | None = None

    @property
    def endpoint(self) -> str:
        return f"/{SERVICE_NAME}/{self.method}"


class PEServeServicer:
    """The four methods; handlers take the raw request bytes so that parsing errors are ours to name."""

    def __init__(
        self,
        state: ServiceState,
        metrics: ServiceMetrics,
        api_keys: Collection[bytes],
        running: RunningRequests,
    ) -> None:
        self._state = state
        self._metrics = metrics
        self._api_keys = tuple(api_keys)
        self._running = running
        self._once = RunOnce()

    async def generate(self, data: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        async with self._rpc("Generate", context) as call:
            message = parse_request(pb.GenerateRequest, data)
            fields = self._take_request_id(call, request_fields(message), context, prefix="gen")
            body = GenerateRequest.model_validate(fields)
            start = partial(self._generation, call, body)
            key = call.once_key if body.resume_from is None else None
            async with self._once.streamed(key, start, fingerprint_of("Generate", body)) as chunks:
                # Accepted: headers go out now, so a client can tell a queued request from a refused one.
                await context.send_initial_metadata(((REQUEST_ID_KEY, call.request_id),))
                async for chunk in chunks:
                    yield chunk

    async def score(self, data: bytes, context: grpc.aio.ServicerContext) -> bytes:
        async with self._rpc("Score", context) as call:
            message = parse_request(pb.ScoreRequest, data)
            fields = self._take_request_id(call, request_fields(message), context, prefix="score")
            body = ScoreRequest.model_validate(fields)
            start = partial(self._scoring, call, body)
            with self._once.attached(call.once_key, start, fingerprint_of("Score", body)) as answer:
                return await asyncio.shield(answer)

    async def list_models(self, data: bytes, context: grpc.aio.ServicerContext) -> bytes:
        async with self._rpc("ListModels", context):
            parse_request(pb.ListModelsRequest, data)
            return models_message(self._state.engine_for_request().models()).SerializeToString()

    async def abort(self, data: bytes, context: grpc.aio.ServicerContext) -> bytes:
        """Stop one of the caller's own running requests; another key's answers NOT_FOUND."""
        async with self._rpc("Abort", context) as call:
            message = parse_request(pb.AbortRequest, data)
            self._running.abort(call.caller, message.request_id)
            return pb.AbortResponse().SerializeToString()

    def _generation(self, call: _Call, body: GenerateRequest) -> AsyncIterator[bytes]:
        """Submit the generation (raising if it is refused); its messages, serialized, as they come."""
        engine = self._state.engine_for_request()
        prepared = prepare_generation(engine, body, stream=True, aliases=self._state.aliases)
        job = generate_job(call.request_id, body, prepared, stream=True)
        first_token = FirstTokenTimer(self._metrics, call.started)
        text = token_text(engine, job.model)
        model = prepared.target.name  # as the request named it
        handle = self._running.open(call.caller, call.request_id, call.endpoint).submit(
            engine, job, prepared.names
        )

        async def messages() -> AsyncIterator[bytes]:
            try:
                async for event in handle:
                    first_token(event)
                    if isinstance(event, TokenEvent):
                        yield token_chunk(event, text).SerializeToString()
                    elif isinstance(event, GenerationResult):
                        yield generate_end(call.request_id, model, event).SerializeToString()
            finally:
                handle.cancel()

        return messages()

    async def _scoring(self, call: _Call, body: ScoreRequest) -> bytes:
        engine = self._state.engine_for_request()
        prepared = prepare_scored(engine, body, self._state.aliases)
        job = score_job(call.request_id, body, prepared)
        handle = self._running.open(call.caller, call.request_id, call.endpoint).submit(
            engine, job, prepared.names
        )
        try:
            async for event in handle:
                if isinstance(event, ScoreResult):
                    text = token_text(engine, job.model)
                    name = prepared.target.name
                    return score_message(call.request_id, name, event, text).SerializeToString()
        finally:
            handle.cancel()
        raise RuntimeError(f"request {call.request_id} ended without a result")

    def _rpc(self, method: str, context: grpc.aio.ServicerContext) -> _Rpc:
        return _Rpc(method, context, self._metrics, self._api_keys)

    def _take_request_id(
        self, call: _Call, fields: dict[str, Any], context: grpc.aio.ServicerContext, *, prefix: str
    ) -> dict[str, Any]:
        """Name the call: the request's own id (checked like HTTP's `X-Request-ID`), else a sane
        `x-request-id` metadata value (one that is not is ignored, as HTTP ignores such a header),
        else a fresh one. Returns the other fields."""
        offered = fields.pop(REQUEST_ID_FIELD, None)
        if offered is not None and not CLIENT_REQUEST_ID.fullmatch(offered):
            message = "request_id: at most 128 letters, digits and '._:-'."
            raise RequestError(ErrorKind.INVALID, message, param=REQUEST_ID_FIELD)
        if offered is None:
            sent = str(dict(context.invocation_metadata() or ()).get(REQUEST_ID_KEY, ""))
            offered = sent if CLIENT_REQUEST_ID.fullmatch(sent) else None
        if offered is None:
            call.request_id = f"{prefix}-{uuid.uuid4().hex}"
        else:
            call.request_id = offered
            call.once_key = (call.caller, offered)
        request_id_var.set(call.request_id)
        return fields


class _Rpc:
    """One RPC's frame: API key first, then the method body; failures become its status code.

    `__aexit__` never swallows an exception: it either lets it through (cancellation) or replaces
    it with the status the client receives (`context.abort` raises).
    """

    def __init__(
        self,
        method: str,
        context: grpc.aio.ServicerContext,
        metrics: ServiceMetrics,
        api_keys: tuple[bytes, ...],
    ) -> None:
        self._context = context
        self._metrics = metrics
        self._api_keys = api_keys
        self.call = _Call(method=method, request_id=uuid.uuid4().hex, started=time.perf_counter())
        remaining = context.time_remaining()
        self._deadline = None if remaining is None else time.monotonic() + remaining
        self._log_token = request_id_var.set(self.call.request_id)

    async def __aenter__(self) -> _Call:
        if self._api_keys:
            metadata = dict(self._context.invocation_metadata() or ())
            caller = bearer_caller(str(metadata.get("authorization", "")), self._api_keys)
            if caller is None:
                denied = RequestError(ErrorKind.UNAUTHENTICATED, "Missing or invalid API key.")
                await self.__aexit__(RequestError, denied, None)
            else:
                self.call.caller = caller
        return self.call

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        call = self.call
        try:
            # A stream waiting in its `yield` (its send held up by the client's window) when the call
            # ends is closed by grpc (GeneratorExit) rather than cancelled: the same end of the call.
            if isinstance(exc, asyncio.CancelledError | GeneratorExit):
                expired = (
                    self._deadline is not None and time.monotonic() >= self._deadline - _DEADLINE_SLACK_S
                )
                call.code = grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED
            elif isinstance(exc, Exception):
                error = as_request_error(exc, call.request_id)
                call.code = status_code(error)
                metadata = trailing_metadata(error, call.request_id)
                await self._context.abort(call.code, error.message, trailing_metadata=metadata)
        finally:
            self._record()

    def _record(self) -> None:
        call = self.call
        elapsed = time.perf_counter() - call.started
        endpoint = call.endpoint
        self._metrics.observe_request(endpoint, call.code.name, elapsed, protocol="grpc")
        quiet = call.method == "ListModels" and call.code is grpc.StatusCode.OK
        logger.log(
            logging.DEBUG if quiet else logging.INFO,
            "request",
            extra={
                "method": "grpc",
                "path": endpoint,
                "status": call.code.name,
                "duration_ms": round(elapsed * 1000, 3),
            },
        )
        request_id_var.reset(self._log_token)
