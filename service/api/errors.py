"""The one place where failures become the SPEC's error body `{"error": {type, message, param}}`.

Every failure a request can end with is a `RequestError` (`service.requests.errors`) by the time it
is answered, whether it comes from request validation, `pe_runtime`'s config checks, the engine,
the middlewares (401, 413) or an unexpected exception (500, logged with its stack trace but never
echoed to the client). Its kind becomes a status through `HTTP_STATUS`, this transport's one table.

Under `/v1` the same failures take OpenAI's shape, `{"error": {message, type, param, code}}`,
and invalid input is a 400 as OpenAI answers it (OpenAI clients raise BadRequestError for it);
`code` carries our specific error type. That translation is `error_payload`'s and `_status`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pe_runtime import PEConfigError
from service.engine.errors import EngineError
from service.requests.errors import ErrorKind, RequestError, as_request_error, from_validation_errors

OPENAI_PREFIX = "/v1/"

HTTP_STATUS: Mapping[ErrorKind, int] = {
    ErrorKind.BAD_REQUEST: 400,
    ErrorKind.UNAUTHENTICATED: 401,
    ErrorKind.NOT_FOUND: 404,
    ErrorKind.METHOD_NOT_ALLOWED: 405,
    ErrorKind.CONFLICT: 409,
    ErrorKind.TOO_LARGE: 413,
    ErrorKind.UNSUPPORTED_MEDIA_TYPE: 415,
    ErrorKind.INVALID: 422,
    ErrorKind.QUEUE_FULL: 429,
    # nginx's "client closed request": what is recorded for a client that went away.
    ErrorKind.CANCELLED: 499,
    ErrorKind.INTERNAL: 500,
    ErrorKind.UNAVAILABLE: 503,
}
CLIENT_CLOSED_REQUEST = HTTP_STATUS[ErrorKind.CANCELLED]
_KIND_OF_STATUS = {status: kind for kind, status in HTTP_STATUS.items()}

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

# Headers a kind of failure carries over HTTP besides Retry-After.
_KIND_HEADERS: Mapping[ErrorKind, Mapping[str, str]] = {
    ErrorKind.UNAUTHENTICATED: {"WWW-Authenticate": 'Bearer realm="pe-serve"'},
    ErrorKind.TOO_LARGE: {"Connection": "close"},
}


def error_body(error_type: str, message: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"type": error_type, "message": message, "param": param}}


def is_openai_path(path: str) -> bool:
    return path.startswith(OPENAI_PREFIX)


def error_payload(error: RequestError, *, openai: bool = False) -> dict[str, Any]:
    """The error body in the SPEC's shape, or in OpenAI's for the `/v1` routes."""
    if not openai:
        return error_body(error.error_type, error.message, error.param)
    kind = _OPENAI_TYPES.get(_status(error, openai=True), "server_error")
    return {"error": {"message": error.message, "type": kind, "param": error.param, "code": error.error_type}}


def _status(error: RequestError, *, openai: bool) -> int:
    status = HTTP_STATUS[error.kind]
    return 400 if openai and status == 422 else status


def error_headers(error: RequestError) -> dict[str, str]:
    headers = dict(_KIND_HEADERS.get(error.kind, {}))
    if error.retry_after_s is not None:
        headers["Retry-After"] = str(error.retry_after_s)
    return headers


def error_response(error: RequestError, *, openai: bool = False) -> JSONResponse:
    body = error_payload(error, openai=openai)
    return JSONResponse(body, status_code=_status(error, openai=openai), headers=error_headers(error))


def from_http_exception(error: StarletteHTTPException) -> RequestError:
    """Routing errors (404, 405) keep their status; a body FastAPI could not decode is invalid input.

    FastAPI turns a JSON syntax error into a validation error but bytes that are not UTF-8 into a
    bare 400 whose cause is the UnicodeDecodeError; both are the same mistake to a client.
    """
    if isinstance(error.__cause__, UnicodeDecodeError):
        reason = error.__cause__.reason
        return RequestError(ErrorKind.INVALID, f"Request body is not valid JSON: not UTF-8 ({reason})")
    return RequestError(_KIND_OF_STATUS.get(error.status_code, ErrorKind.BAD_REQUEST), str(error.detail))


def _responding_with(convert: Callable[[Any], RequestError]) -> Callable[[Request, Exception], Any]:
    async def handle(request: Request, exc: Exception) -> JSONResponse:
        response = error_response(convert(exc), openai=is_openai_path(request.url.path))
        if isinstance(exc, StarletteHTTPException):  # 405's Allow, say
            response.headers.update(exc.headers or {})
        return response

    return handle


def install_error_handlers(app: FastAPI) -> None:
    """Register the translators above; unexpected exceptions are handled by the request middleware."""

    def known(exc: Exception) -> RequestError:
        return as_request_error(exc, request_id="")

    converters: Mapping[type[Exception], Callable[[Any], RequestError]] = {
        RequestError: known,
        RequestValidationError: lambda exc: from_validation_errors(exc.errors()),
        EngineError: known,
        PEConfigError: known,
        StarletteHTTPException: from_http_exception,
    }
    for exc_class, convert in converters.items():
        app.add_exception_handler(exc_class, _responding_with(convert))
