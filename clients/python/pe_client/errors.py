"""The exceptions the SDK raises: one base class, one class per HTTP status family.

Callers catch by meaning (`RateLimitError`, `UnprocessableEntityError`) rather than by inspecting
status codes; every status error still carries the server's `type`, `message` and `param`. The
gRPC client raises the same classes: a gRPC status is classed by the HTTP status it stands for
(INVALID_ARGUMENT is a 422, RESOURCE_EXHAUSTED with `retry-after` a 429, ...), and then `request`
and `response` are None while `grpc_code` names the gRPC code.
"""

from __future__ import annotations

from collections.abc import Mapping

import httpx


class PEServeError(Exception):
    """Base of every error this SDK raises."""


class APIError(PEServeError):
    """An error tied to one request to the server."""

    def __init__(self, message: str, *, request: httpx.Request | None) -> None:
        super().__init__(message)
        self.message = message
        self.request = request


class APIConnectionError(APIError):
    """The server could not be reached, or the connection broke before an answer."""

    def __init__(self, *, request: httpx.Request | None, message: str = "Connection error.") -> None:
        super().__init__(message, request=request)


class APITimeoutError(APIConnectionError):
    """The request ran past the client's timeout."""

    def __init__(self, *, request: httpx.Request | None) -> None:
        super().__init__(request=request, message="Request timed out.")


class APIStatusError(APIError):
    """The server answered with an error status; `type` and `param` come from its error body."""

    def __init__(
        self,
        message: str,
        *,
        response: httpx.Response | None,
        error_type: str | None = None,
        param: str | None = None,
        status_code: int | None = None,
        headers: Mapping[str, str] | None = None,
        grpc_code: str | None = None,
    ) -> None:
        """HTTP errors pass `response`; gRPC errors `status_code`, `headers` (the trailing metadata)
        and `grpc_code`."""
        super().__init__(message, request=response.request if response is not None else None)
        self.response = response
        self.status_code = response.status_code if response is not None else (status_code or 0)
        self.headers: Mapping[str, str] = response.headers if response is not None else dict(headers or {})
        self.grpc_code = grpc_code
        self.type = error_type
        self.param = param

    def __str__(self) -> str:
        where = f" (param: {self.param})" if self.param else ""
        return f"{self.status_code} {self.type or 'error'}: {self.message}{where}"


class BadRequestError(APIStatusError):
    """400: the body is not valid JSON or not an object."""


class AuthenticationError(APIStatusError):
    """401: the API key is missing or wrong."""


class NotFoundError(APIStatusError):
    """404: unknown model (or path)."""


class PayloadTooLargeError(APIStatusError):
    """413: the body is over the server's limit."""


class UnprocessableEntityError(APIStatusError):
    """422: the request is well-formed JSON but cannot run; `param` names the field at fault."""


class RateLimitError(APIStatusError):
    """429: the server's queue is full; it is retried automatically, honouring `Retry-After`."""


class InternalServerError(APIStatusError):
    """Any 5xx."""


class ServiceUnavailableError(InternalServerError):
    """503: the server is loading its models or draining."""


class APIStreamError(APIError):
    """The server reported an error in the middle of a stream (the HTTP status was already 200)."""

    def __init__(
        self, message: str, *, request: httpx.Request | None, error_type: str | None, param: str | None
    ) -> None:
        super().__init__(message, request=request)
        self.type = error_type
        self.param = param


_STATUS_ERRORS: dict[int, type[APIStatusError]] = {
    400: BadRequestError,
    401: AuthenticationError,
    404: NotFoundError,
    413: PayloadTooLargeError,
    422: UnprocessableEntityError,
    429: RateLimitError,
    503: ServiceUnavailableError,
}


def status_error_class(status_code: int) -> type[APIStatusError]:
    """The most specific class for a status; unknown 5xx are `InternalServerError`."""
    if status_code in _STATUS_ERRORS:
        return _STATUS_ERRORS[status_code]
    return InternalServerError if status_code >= 500 else APIStatusError
