"""The one place where failures become the SPEC's error body `{"error": {type, message, param}}`.

Every status the service answers with an error goes through `error_response`, whether it comes
from request validation, `pe_runtime`'s config checks, the engine, the middlewares (401, 413) or
an unexpected exception (500, logged with its stack trace but never echoed to the client).

Under `/v1` the same failures take OpenAI's shape, `{"error": {message, type, param, code}}`,
and invalid input is a 400 as OpenAI answers it (OpenAI clients raise BadRequestError for it);
`code` carries our specific error type. That translation is `error_payload`'s and `_status`'s.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pe_runtime import PEConfigError
from service.engine.errors import (
    ContextLengthError,
    EngineError,
    EngineUnavailableError,
    InvalidRequestError,
    ModelNotFoundError,
    QueueFullError,
    RequestCancelledError,
)

logger = logging.getLogger("service.api")

SCALING_FIELD = "pe_scaling"
OPENAI_PREFIX = "/v1/"

# OpenAI's error types by status; anything else is a server error.
_OPENAI_TYPES: Mapping[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
}

_STATUS_TYPES: Mapping[int, str] = {
    400: "bad_request",
    401: "authentication_error",
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
    409: "conflict",
    415: "unsupported_media_type",
    422: "invalid_request_error",
    429: "queue_full",
    503: "service_unavailable",
}

# Most specific class first: ContextLengthError is an InvalidRequestError.
_ENGINE_STATUS: Sequence[tuple[type[EngineError], int]] = (
    (ContextLengthError, 422),
    (InvalidRequestError, 422),
    (ModelNotFoundError, 404),
    (QueueFullError, 429),
    (EngineUnavailableError, 503),
    (RequestCancelledError, 503),
)


class APIError(Exception):
    """A client-facing failure raised by the HTTP layer itself (bad content type, not ready, ...)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        error_type: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.error_type = error_type or _STATUS_TYPES.get(status, "error")
        self.headers = dict(headers or {})


def error_body(error_type: str, message: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"type": error_type, "message": message, "param": param}}


def is_openai_path(path: str) -> bool:
    return path.startswith(OPENAI_PREFIX)


def error_payload(error: APIError, *, openai: bool = False) -> dict[str, Any]:
    """The error body in the SPEC's shape, or in OpenAI's for the `/v1` routes."""
    if not openai:
        return error_body(error.error_type, error.message, error.param)
    kind = _OPENAI_TYPES.get(_status(error, openai=True), "server_error")
    return {"error": {"message": error.message, "type": kind, "param": error.param, "code": error.error_type}}


def _status(error: APIError, *, openai: bool) -> int:
    return 400 if openai and error.status == 422 else error.status


def error_response(error: APIError, *, openai: bool = False) -> JSONResponse:
    body = error_payload(error, openai=openai)
    return JSONResponse(body, status_code=_status(error, openai=openai), headers=error.headers)


def internal_error(request_id: str) -> APIError:
    """The 500 a client sees: a request id to quote, nothing about our code."""
    message = f"Internal server error; quote request id {request_id} when reporting it."
    return APIError(500, message, error_type="internal_error")


def from_engine_error(error: EngineError) -> APIError:
    """Map an engine failure to its status; unknown engine failures are our fault (500)."""
    status = next((code for cls, code in _ENGINE_STATUS if isinstance(error, cls)), 500)
    headers: dict[str, str] = {}
    if isinstance(error, QueueFullError):
        headers["Retry-After"] = str(max(1, math.ceil(error.retry_after_s)))
    return APIError(status, error.message, param=error.param, error_type=error.error_type, headers=headers)


def from_pe_config_error(error: PEConfigError) -> APIError:
    """pe_runtime names the scaling's own field; the request nests it under `pe_scaling`."""
    return APIError(422, error.message, param=f"{SCALING_FIELD}.{error.field}")


def param_from_location(location: Sequence[str | int], error_type: str) -> str | None:
    """Dotted request field from a pydantic error location.

    Drops the leading "body" and the discriminator tag pydantic inserts for tagged unions
    (`pe_scaling.yarn.factor` -> `pe_scaling.factor`); a bad or missing tag names `pe_scaling.type`.
    """
    if error_type == "json_invalid":
        return None
    parts = [str(part) for part in location]
    if parts[:1] == ["body"]:
        parts = parts[1:]
    if parts[:1] == [SCALING_FIELD]:
        if error_type in ("union_tag_invalid", "union_tag_not_found"):
            return f"{SCALING_FIELD}.type"
        parts = [SCALING_FIELD, *parts[2:]]
    return ".".join(parts) or None


# Errors about the body as a whole (absent, an array, a string) rather than one of its fields.
_NOT_AN_OBJECT = frozenset({"missing", "model_attributes_type", "model_type", "dict_type"})


def from_validation_errors(errors: Sequence[Mapping[str, Any]]) -> APIError:
    """The first problem, named by its dotted field; pydantic's wording, prefixed with the field.

    Takes the error list of FastAPI's `RequestValidationError` (locations under "body") as well as
    a pydantic `ValidationError`'s (the gRPC API validates its requests with the same schemas).
    """
    first = errors[0]
    error_type = str(first.get("type", ""))
    param = param_from_location(first.get("loc", ()), error_type)
    detail = str(first.get("msg", "invalid request"))
    if error_type == "json_invalid":
        reason = first.get("ctx", {}).get("error")
        detail = f"Request body is not valid JSON: {reason}" if reason else "Request body is not valid JSON"
    elif param is None and error_type in _NOT_AN_OBJECT:
        detail = "Request body must be a JSON object"
    message = f"{param}: {detail}" if param else detail
    return APIError(422, message, param=param)


def as_api_error(error: Exception, request_id: str) -> APIError:
    """Any failure of a request as the client-facing error; what is not a known failure is a bug.

    Used where an exception is answered outside FastAPI's handlers (a stream already started, the
    gRPC API). Bugs are logged here with their stack trace and become a 500 quoting the request id.
    """
    if isinstance(error, APIError):
        return error
    if isinstance(error, EngineError):
        return from_engine_error(error)
    if isinstance(error, PEConfigError):
        return from_pe_config_error(error)
    if isinstance(error, ValidationError):
        return from_validation_errors(error.errors())
    logger.exception("request failed", extra={"request_id": request_id})
    return internal_error(request_id)


def from_http_exception(error: StarletteHTTPException) -> APIError:
    """Routing errors (404, 405) keep their status; a body FastAPI could not decode is invalid input.

    FastAPI turns a JSON syntax error into a validation error but bytes that are not UTF-8 into a
    bare 400 whose cause is the UnicodeDecodeError; both are the same mistake to a client.
    """
    if isinstance(error.__cause__, UnicodeDecodeError):
        return APIError(422, f"Request body is not valid JSON: not UTF-8 ({error.__cause__.reason})")
    headers = dict(error.headers or {})
    return APIError(error.status_code, str(error.detail), headers=headers)


def _responding_with(convert: Callable[[Any], APIError]) -> Callable[[Request, Exception], Any]:
    async def handle(request: Request, exc: Exception) -> JSONResponse:
        return error_response(convert(exc), openai=is_openai_path(request.url.path))

    return handle


def install_error_handlers(app: FastAPI) -> None:
    """Register the translators above; unexpected exceptions are handled by the request middleware."""
    converters: Mapping[type[Exception], Callable[[Any], APIError]] = {
        APIError: lambda exc: exc,
        RequestValidationError: lambda exc: from_validation_errors(exc.errors()),
        EngineError: from_engine_error,
        PEConfigError: from_pe_config_error,
        StarletteHTTPException: from_http_exception,
    }
    for exc_class, convert in converters.items():
        app.add_exception_handler(exc_class, _responding_with(convert))
