"""FastAPI dependencies, as `Annotated` aliases the routes declare as parameter types.

They are coroutines although none of them awaits: FastAPI runs a plain `def` dependency on its
thread pool, and six thread hops per request cost more than the rest of the request's handling.
"""

from __future__ import annotations

import email.message
from typing import Annotated

from fastapi import Depends, Request

from service.engine.types import Engine
from service.requests.auth import ANONYMOUS
from service.requests.errors import ErrorKind, RequestError
from service.requests.metrics import ServiceMetrics
from service.requests.model_names import ModelAliases
from service.requests.running import FirstTokenTimer, RunningRequests, Submission
from service.requests.state import ServiceState


async def get_state(request: Request) -> ServiceState:
    state: ServiceState = request.app.state.service
    return state


async def get_metrics(request: Request) -> ServiceMetrics:
    metrics: ServiceMetrics = request.app.state.metrics
    return metrics


async def get_engine(state: Annotated[ServiceState, Depends(get_state)]) -> Engine:
    return state.engine_for_request()


async def get_aliases(state: Annotated[ServiceState, Depends(get_state)]) -> ModelAliases:
    """The `--alias` names, which the request core resolves with every model name."""
    return state.aliases


async def get_request_id(request: Request) -> str:
    request_id: str = request.scope["state"]["request_id"]
    return request_id


async def get_caller(request: Request) -> str:
    """Whose request this is: the key's name `ApiKeyMiddleware` recorded, else the one anonymous caller."""
    caller: str = request.scope["state"].get("caller", ANONYMOUS)
    return caller


async def get_running(request: Request) -> RunningRequests:
    running: RunningRequests = request.app.state.running
    return running


async def get_submission(
    request: Request,
    running: Annotated[RunningRequests, Depends(get_running)],
    caller: Annotated[str, Depends(get_caller)],
    request_id: Annotated[str, Depends(get_request_id)],
) -> Submission:
    """Where this request's engine jobs go: filed under its `X-Request-ID` and its caller."""
    return running.open(caller, request_id, request.url.path)


async def get_first_token_timer(request: Request) -> FirstTokenTimer:
    """Time-to-first-token from when the request reached the server (the middleware's clock)."""
    return FirstTokenTimer(request.app.state.metrics, request.scope["state"]["started_at"])


async def require_json(request: Request) -> None:
    """415 unless the body is declared as JSON (`application/json` or `application/*+json`).

    Runs before the body is validated, so a form post or a missing content type is named as
    what it is rather than as a confusing schema error.
    """
    message = email.message.Message()
    message["content-type"] = request.headers.get("content-type", "")
    subtype = message.get_content_subtype()
    is_json = message.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json")
    )
    if not is_json:
        raise RequestError(ErrorKind.UNSUPPORTED_MEDIA_TYPE, "Content-Type must be application/json.")


StateDep = Annotated[ServiceState, Depends(get_state)]
MetricsDep = Annotated[ServiceMetrics, Depends(get_metrics)]
EngineDep = Annotated[Engine, Depends(get_engine)]
AliasesDep = Annotated[ModelAliases, Depends(get_aliases)]
RequestIdDep = Annotated[str, Depends(get_request_id)]
FirstTokenDep = Annotated[FirstTokenTimer, Depends(get_first_token_timer)]
CallerDep = Annotated[str, Depends(get_caller)]
RunningDep = Annotated[RunningRequests, Depends(get_running)]
SubmissionDep = Annotated[Submission, Depends(get_submission)]
