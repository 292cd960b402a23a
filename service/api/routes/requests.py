"""GET /requests/{id} and POST /requests/{id}/cancel: a caller's own running request, looked up or cancelled.

The id is the request's `X-Request-ID` (the client's, or the one the server answered with) or a
gRPC request's `request_id`: both transports file their requests in one ledger, so either route
finds a request whichever protocol made it. Another key's request answers 404, as none would.
"""

from __future__ import annotations

from fastapi import APIRouter

from service.api.deps import CallerDep, RunningDep
from service.api.openapi import error_responses
from service.requests.responses import RunningRequestInfo

router = APIRouter(tags=["requests"])


@router.get("/requests/{request_id}", responses=error_responses(401, 404))
async def lookup_request(request_id: str, caller: CallerDep, running: RunningDep) -> RunningRequestInfo:
    """One of the caller's requests while it runs; 404 once it has ended (or if it is not theirs)."""
    return running.lookup(caller, request_id).info()


@router.post("/requests/{request_id}/cancel", responses=error_responses(401, 404))
async def cancel_request(request_id: str, caller: CallerDep, running: RunningDep) -> RunningRequestInfo:
    """Stop one of the caller's running requests: its client's answer ends as cancelled (499, or
    an error event in a stream) and its batch slot is freed at the engine's next step."""
    return running.abort(caller, request_id).info()
