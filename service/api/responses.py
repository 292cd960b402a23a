"""JSON answers the routes build themselves."""

from __future__ import annotations

from fastapi import Response
from pydantic import BaseModel


def json_response(body: BaseModel, *, omit: set[str] | None = None) -> Response:
    """A response model the route built itself, serialized once by pydantic; `omit` leaves out
    fields that were not asked for (an optional field added to a SPEC shape).

    Returned as a model, FastAPI would validate it again field by field before serializing it,
    which costs more than the rest of answering a request (for a 4,000-token `/score`, far more).
    """
    return Response(json_body(body, omit=omit), media_type="application/json")


def json_body(body: BaseModel, *, omit: set[str] | None = None) -> bytes:
    """The bytes of `json_response`, for answers kept to be sent again (`service.api.once`)."""
    return body.model_dump_json(exclude=omit).encode()
