"""Pure ASGI middlewares, outermost first: request context, API key, body limit.

They are ASGI rather than `BaseHTTPMiddleware` so that streaming responses pass through untouched
and a client disconnect still reaches the route (which cancels the generation).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Collection

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api.errors import error_response, is_openai_path
from service.logs import request_id_var
from service.requests.auth import CLIENT_REQUEST_ID, bearer_caller
from service.requests.errors import ErrorKind, RequestError, internal_error
from service.requests.metrics import ServiceMetrics

logger = logging.getLogger("service.api.access")

REQUEST_ID_HEADER = "X-Request-ID"
UNKNOWN_ENDPOINT = "other"
# Polled every few seconds by orchestrators and scrapers: logged at debug level unless they fail.
_PROBE_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})


def _request_id(headers: Headers) -> str:
    """The client's id when it is a sane token (it ends up in logs and headers), else a fresh one."""
    offered = headers.get(REQUEST_ID_HEADER, "")
    return offered if CLIENT_REQUEST_ID.fullmatch(offered) else uuid.uuid4().hex


class RequestContextMiddleware:
    """Request id (echoed or generated), access log, request metrics, and the last-resort 500.

    An exception that reaches this layer is a bug: it is logged with its stack trace and the client
    gets the SPEC's error body with the request id, never the trace.
    """

    def __init__(self, app: ASGIApp, *, metrics: ServiceMetrics, endpoints: Collection[str]) -> None:
        self.app = app
        self.metrics = metrics
        self.endpoints = frozenset(endpoints)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = _request_id(Headers(scope=scope))
        started = time.perf_counter()
        scope.setdefault("state", {}).update(request_id=request_id, started_at=started)
        token = request_id_var.set(request_id)
        status = 500
        response_started = False

        async def send_with_id(message: Message) -> None:
            nonlocal status, response_started
            if message["type"] == "http.response.start":
                response_started = True
                status = message["status"]
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = request_id
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            logger.exception("unhandled error", extra={"path": scope["path"]})
            if not response_started:
                failure = error_response(internal_error(request_id), openai=is_openai_path(scope["path"]))
                await failure(scope, receive, send_with_id)
        finally:
            elapsed = time.perf_counter() - started
            endpoint = scope["path"] if scope["path"] in self.endpoints else UNKNOWN_ENDPOINT
            self.metrics.observe_request(endpoint, status, elapsed)
            quiet = scope["path"] in _PROBE_PATHS and status < 400
            logger.log(
                logging.DEBUG if quiet else logging.INFO,
                "request",
                extra={
                    "method": scope["method"],
                    "path": scope["path"],
                    "status": status,
                    "duration_ms": round(elapsed * 1000, 3),
                },
            )
            request_id_var.reset(token)


class ApiKeyMiddleware:
    """`Authorization: Bearer <key>` on every path but the open ones, compared in constant time.

    The key's name is recorded as the request's caller (`scope["state"]["caller"]`): the requests
    it makes are its own (`service.requests.running`).
    """

    def __init__(self, app: ASGIApp, *, keys: Collection[bytes], open_paths: Collection[str]) -> None:
        self.app = app
        self.keys = tuple(keys)
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            caller = bearer_caller(Headers(scope=scope).get("authorization", ""), self.keys)
            if caller is None:
                error = RequestError(ErrorKind.UNAUTHENTICATED, "Missing or invalid API key.")
                await error_response(error, openai=is_openai_path(scope["path"]))(scope, receive, send)
                return
            scope.setdefault("state", {})["caller"] = caller
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """413 for bodies over the limit, declared (Content-Length) or streamed (chunked), before parsing.

    The body is read here, at most `max_body_bytes` of it, and replayed to the app; later
    `receive()` calls go to the server, so the app still sees `http.disconnect`.
    """

    def __init__(self, app: ASGIApp, *, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        declared_too_large = declared.isdigit() and int(declared) > self.max_body_bytes
        buffered = None if declared_too_large else await self._read(receive)
        if buffered is None:
            message = f"Request body exceeds the limit of {self.max_body_bytes} bytes."
            error = RequestError(ErrorKind.TOO_LARGE, message)
            await error_response(error, openai=is_openai_path(scope["path"]))(scope, receive, send)
            return
        pending = [buffered]

        async def replay() -> Message:
            return pending.pop() if pending else await receive()

        await self.app(scope, replay, send)

    async def _read(self, receive: Receive) -> Message | None:
        """The whole body as one `http.request` message (or the disconnect that cut it short);
        None as soon as it grows past the limit."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return message
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
