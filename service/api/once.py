"""A JSON answer computed once per client-chosen request id (`X-Request-ID`), whoever asks again.

The SDK sends one `X-Request-ID` per call and keeps it across its retries; a retry that reaches
this server while the first attempt runs, or shortly after it answered, gets that attempt's
answer instead of a second run (`service.requests.once`). Two submissions are the same only if
they share the path, the id, the credentials and the body, so an id reused by another caller or
for another body runs on its own. Without an `X-Request-ID` every request runs.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Hashable

from fastapi import Request, Response
from pydantic import BaseModel

from service.api.errors import CLIENT_CLOSED_REQUEST
from service.api.handles import ClientDisconnectedError, until_disconnected
from service.api.middleware import REQUEST_ID_HEADER
from service.requests.once import RunOnce, Start


def submission_key(request: Request, body: BaseModel) -> Hashable | None:
    """What makes two submissions one request; None when the client chose no id."""
    request_id: str = request.scope["state"]["request_id"]
    if request.headers.get(REQUEST_ID_HEADER) != request_id:
        return None
    digest = hashlib.sha256(request.headers.get("authorization", "").encode())
    digest.update(b"\0" + body.model_dump_json().encode())
    return request.url.path, request_id, digest.hexdigest()


async def answer_once(request: Request, body: BaseModel, answer: Start) -> Response:
    """`answer()`'s JSON body, run once per submission key; 499 if the client leaves first."""
    once: RunOnce = request.app.state.run_once
    key = submission_key(request, body)
    try:
        if key is None:
            content = await until_disconnected(asyncio.ensure_future(answer()), request.receive)
        else:
            with once.attached(key, answer) as shared:
                content = await until_disconnected(asyncio.shield(shared), request.receive)
    except ClientDisconnectedError:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return Response(content, media_type="application/json")
