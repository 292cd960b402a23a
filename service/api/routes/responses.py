"""OpenAPI descriptions of the error statuses routes can answer with, all in the SPEC's error shape."""

from __future__ import annotations

from typing import Any

from service.api.schemas.responses import ErrorResponse

_DESCRIPTIONS = {
    401: "Missing or wrong API key (when one is configured).",
    404: "Unknown model.",
    413: "Request body over the size limit.",
    415: "Body not declared as JSON.",
    422: "Invalid input; `param` names the field.",
    429: "Queue full; retry after `Retry-After` seconds.",
    503: "Loading or draining.",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {status: {"model": ErrorResponse, "description": _DESCRIPTIONS[status]} for status in statuses}


INFERENCE_ERRORS = error_responses(401, 404, 413, 415, 422, 429, 503)
