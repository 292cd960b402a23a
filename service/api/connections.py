"""Connection-level defences against slow and greedy clients, below ASGI where the app cannot see.

A client that sends half a request header and then waits holds a connection, a file descriptor
and parser state for as long as it likes: uvicorn times out idle keep-alive connections, but not
a request whose headers never finish, and it puts no bound on the header size or on how many
connections are open at once. `guarded_protocol` wraps uvicorn's httptools protocol with:

- a header deadline: a request's headers must be complete `header_timeout_s` after the connection
  opened (first request) or after its first byte arrived (later requests on a kept-alive
  connection); otherwise the server answers 408 and closes the connection;
- a header size limit: more than `max_header_bytes` received before the headers are complete is
  answered 431 and the connection closed;
- a connection cap: a connection beyond `max_connections` open ones is answered 503 and closed
  at once, so a flood cannot exhaust file descriptors.

Every answer carries the SPEC's error body and `Connection: close`.
"""

from __future__ import annotations

import asyncio
import json
from http import HTTPStatus
from typing import cast

from starlette.responses import JSONResponse
from starlette.types import Receive, Scope, Send
from uvicorn._types import ASGI3Application
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from service.api.errors import error_body

# How long a kept-alive connection may sit idle before the server closes it. Longer than the
# clients' own pool expiry (httpx 5 s, aiohttp 15 s, nginx upstream 60 s): a client that reuses
# a connection at the instant the server closes it gets a reset, not an answer, so the side that
# gives up on an idle connection first should be the client. uvicorn's default, 5 s, raced httpx's
# and requests' pools (12 resets in 288 requests sent after 5 s of idle; the likely cause of the
# one "Network Error" of an outside fuzz run). Open connections stay capped by `max_connections`.
KEEP_ALIVE_TIMEOUT_S = 75


def raw_error(status: HTTPStatus, error_type: str, message: str) -> bytes:
    """A complete HTTP/1.1 error response, written straight to the transport (no ASGI app runs)."""
    body = json.dumps(error_body(error_type, message)).encode()
    head = (
        f"HTTP/1.1 {status.value} {status.phrase}\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a header deadline, a header size limit and a connection cap.

    The limits are class attributes, set on the subclass `guarded_protocol` makes, because uvicorn
    builds one protocol object per connection from the class alone.
    """

    header_timeout_s: float = 10.0
    max_header_bytes: int = 32 * 1024
    max_connections: int = 1000

    _header_deadline: asyncio.TimerHandle | None = None
    _reading_headers: bool = True
    _received_bytes: int = 0  # bytes of the current request received while its headers were unfinished
    _header_bytes: int = 0  # its request line and headers as parsed

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            message = f"The server holds its maximum of {self.max_connections} connections; retry later."
            self._refuse(HTTPStatus.SERVICE_UNAVAILABLE, "service_unavailable", message)
            return
        self._arm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():
            return
        if self._reading_headers:
            self._received_bytes += len(data)
            self._arm_header_deadline()
        super().data_received(data)
        # Headers still unfinished after everything received was parsed: all of it is header.
        if self._reading_headers and self._received_bytes > self.max_header_bytes:
            self._refuse(
                HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "request_headers_too_large", self._too_large
            )

    def on_url(self, url: bytes) -> None:
        self._header_bytes += len(url)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_bytes += len(name) + len(value) + 4  # ": " and CRLF
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        """Headers that arrived whole in one read are measured as parsed; over the limit, the
        request goes to an app that answers 431 and closes, so uvicorn's cycle stays consistent."""
        self._reading_headers = False
        self._disarm_header_deadline()
        if self._header_bytes > self.max_header_bytes:
            self.app = _refusing_app(self._too_large)
        super().on_headers_complete()

    @property
    def _too_large(self) -> str:
        return f"Request headers exceed the limit of {self.max_header_bytes} bytes."

    def on_response_complete(self) -> None:
        """The next request on this connection reads headers again, timed from its first byte."""
        self._reading_headers = True
        self._received_bytes = self._header_bytes = 0
        super().on_response_complete()

    def _arm_header_deadline(self) -> None:
        if self._header_deadline is None:
            self._header_deadline = self.loop.call_later(self.header_timeout_s, self._headers_timed_out)

    def _disarm_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _headers_timed_out(self) -> None:
        self._header_deadline = None
        if self._reading_headers and not self.transport.is_closing():
            message = f"Request headers were not complete within {self.header_timeout_s:g} s."
            self._refuse(HTTPStatus.REQUEST_TIMEOUT, "request_timeout", message)

    def _refuse(self, status: HTTPStatus, error_type: str, message: str) -> None:
        self._disarm_header_deadline()
        self.transport.write(raw_error(status, error_type, message))
        self.transport.close()


def _refusing_app(message: str) -> ASGI3Application:
    """An ASGI app that answers every request 431 with the SPEC's error body and closes."""
    response = JSONResponse(
        error_body("request_headers_too_large", message),
        status_code=HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE,
        headers={"Connection": "close"},
    )

    async def refuse(scope: Scope, receive: Receive, send: Send) -> None:
        await response(scope, receive, send)

    return cast(ASGI3Application, refuse)


def guarded_protocol(
    *, header_timeout_s: float, max_header_bytes: int, max_connections: int
) -> type[GuardedHttpToolsProtocol]:
    """The protocol class uvicorn is given (`uvicorn.Config(http=...)`), with these limits."""
    limits = {
        "header_timeout_s": header_timeout_s,
        "max_header_bytes": max_header_bytes,
        "max_connections": max_connections,
    }
    return type("PEServeHttpProtocol", (GuardedHttpToolsProtocol,), limits)
