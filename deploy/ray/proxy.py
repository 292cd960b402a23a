"""What Serve's HTTP proxy answers when a replica dies under a request: a 502 to retry, or a typed
end of stream, never a bare 500 or a silently truncated stream.

When a replica's actor dies while it holds a request, Serve's proxy sends nothing for it (it only
writes a body itself for 408, 429 and 503), so uvicorn answers its own plain-text 500 if no
response had started, and leaves a started response unfinished. A 500 tells a client nothing it
can act on, and an event stream that just stops looks, to a reader that does not wait for
`[DONE]`, like a short answer. `ReplicaLossGuard` wraps the proxy's ASGI app and finishes what it
left unfinished:

- nothing sent yet: 502 with `Retry-After`, in the API's error shape (type `replica_lost`). The
  request never reached a replica that answered; the SDK retries it under the same request id,
  and Serve routes the retry to a live replica.
- an event stream under way: a last `data: {"error": {"type": "replica_lost", ...}}` event, which
  the SDK raises as `APIStreamError`, and the response is ended cleanly.
- a JSON body cut short: nothing can be added once its length is sent; the connection ends short
  and the client sees a broken connection (the SDK retries that too).

Serve loads it through its proxy callback, from the environment of the Ray cluster's processes:

    RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=deploy.ray.proxy:middlewares ray start --head ...
"""

from __future__ import annotations

import json

from starlette.middleware import Middleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
CALLBACK_PATH = "deploy.ray.proxy:middlewares"
ERROR_TYPE = "replica_lost"
RETRY_AFTER_S = 1
_MESSAGE = "The replica serving this request stopped before it finished; retry the request."


def error_body() -> bytes:
    return json.dumps({"error": {"type": ERROR_TYPE, "message": _MESSAGE, "param": None}}).encode()


class ReplicaLossGuard:
    """Pure ASGI around Serve's proxy: completes a response the proxy left unfinished."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = streaming = finished = False

        async def watched(message: Message) -> None:
            nonlocal started, streaming, finished
            if message["type"] == "http.response.start":
                started = True
                content_type = dict(message.get("headers", [])).get(b"content-type", b"")
                streaming = content_type.startswith(b"text/event-stream")
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                finished = True
            await send(message)

        await self.app(scope, receive, watched)
        if finished:
            return
        if not started:
            headers = [(b"content-type", b"application/json"), (b"retry-after", str(RETRY_AFTER_S).encode())]
            await send({"type": "http.response.start", "status": 502, "headers": headers})
            await send({"type": "http.response.body", "body": error_body()})
        elif streaming:
            await send({"type": "http.response.body", "body": b"data: " + error_body() + b"\n\n"})


def middlewares() -> list[Middleware]:
    """Serve's HTTP proxy callback: the middlewares it wraps its ASGI app in."""
    return [Middleware(ReplicaLossGuard)]
