"""The one failure type a request can end with, whatever protocol carried it.

A `RequestError` has a `kind` (what went wrong, as a client must react to it), a message, the
request field at fault and, for refusals that pass, how long to wait. Each transport maps a kind
to its own vocabulary in one table: HTTP to a status (`service.api.errors`), gRPC to a
`StatusCode` (`service.grpc_api.status`). Failures raised below this layer (the engine's,
`pe_runtime`'s config checks, schema validation) become a `RequestError` here, in
`as_request_error`, so both transports judge them alike.
"""

from __future__ import annotations

import enum
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from pe_runtime import PEConfigError
from service.engine.errors import (
    EngineError,
    EngineUnavailableError,
    InvalidRequestError,
    ModelNotFoundError,
    QueueFullError,
    RequestCancelledError,
)
from service.engine.types import SCALING_FIELD

logger = logging.getLogger("service.requests")


class ErrorKind(enum.StrEnum):
    """What a client must do about a failure; each value is also the error type reported by default."""

    BAD_REQUEST = "bad_request"
    INVALID = "invalid_request_error"
    UNAUTHENTICATED = "authentication_error"
    NOT_FOUND = "not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    CONFLICT = "conflict"
    TOO_LARGE = "request_too_large"
    UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"
    QUEUE_FULL = "queue_full"
    CANCELLED = "request_cancelled"
    UNAVAILABLE = "service_unavailable"
    INTERNAL = "internal_error"


class RequestError(Exception):
    """A client-facing failure: its kind, a message, the field at fault, and when to retry."""

    def __init__(
        self,
        kind: ErrorKind,
        message: str,
        *,
        param: str | None = None,
        error_type: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.param = param
        self.error_type = error_type or kind.value
        self.retry_after_s = retry_after_s


# Most specific class first: ContextLengthError is an InvalidRequestError.
_ENGINE_KINDS: Sequence[tuple[type[EngineError], ErrorKind]] = (
    (InvalidRequestError, ErrorKind.INVALID),
    (ModelNotFoundError, ErrorKind.NOT_FOUND),
    (QueueFullError, ErrorKind.QUEUE_FULL),
    (EngineUnavailableError, ErrorKind.UNAVAILABLE),
    (RequestCancelledError, ErrorKind.UNAVAILABLE),
)


# Not ready, draining or the engine restarting: worth retrying a second later.
UNAVAILABLE_RETRY_AFTER_S = 1


def unavailable(reason: str) -> RequestError:
    """Not ready, draining or the engine lost: the client should come back later."""
    return RequestError(
        ErrorKind.UNAVAILABLE, f"Service unavailable: {reason}.", retry_after_s=UNAVAILABLE_RETRY_AFTER_S
    )


def internal_error(request_id: str) -> RequestError:
    """The failure a client sees for a bug: a request id to quote, nothing about our code."""
    message = f"Internal server error; quote request id {request_id} when reporting it."
    return RequestError(ErrorKind.INTERNAL, message)


def from_engine_error(error: EngineError) -> RequestError:
    """The engine's failure by its class; an engine failure of no known class is our fault."""
    kind = next((kind for cls, kind in _ENGINE_KINDS if isinstance(error, cls)), ErrorKind.INTERNAL)
    retry_after = None
    if isinstance(error, QueueFullError):
        retry_after = max(1, math.ceil(error.retry_after_s))
    elif isinstance(error, EngineUnavailableError):
        # Draining, or the engine process died and is restarting: another replica, or this one
        # a moment later, will take it.
        retry_after = UNAVAILABLE_RETRY_AFTER_S
    return RequestError(
        kind, error.message, param=error.param, error_type=error.error_type, retry_after_s=retry_after
    )


def from_pe_config_error(error: PEConfigError) -> RequestError:
    """pe_runtime names the scaling's own field; a request nests it under `pe_scaling`."""
    return RequestError(ErrorKind.INVALID, error.message, param=f"{SCALING_FIELD}.{error.field}")


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


def from_validation_errors(errors: Sequence[Mapping[str, Any]]) -> RequestError:
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
    return RequestError(ErrorKind.INVALID, message, param=param)


def as_request_error(error: Exception, request_id: str) -> RequestError:
    """Any failure of a request as the client-facing error; what is not a known failure is a bug.

    Bugs are logged here with their stack trace and become an internal error quoting the request id.
    """
    if isinstance(error, RequestError):
        return error
    if isinstance(error, EngineError):
        return from_engine_error(error)
    if isinstance(error, PEConfigError):
        return from_pe_config_error(error)
    if isinstance(error, ValidationError):
        return from_validation_errors(error.errors())
    logger.exception("request failed", extra={"request_id": request_id})
    return internal_error(request_id)
