"""HTTP statuses -> gRPC status codes, and the trailing metadata that carries the error's details.

The gRPC API raises the same `APIError`s as the HTTP layer (its requests go through the same
validation), so the translation happens once, here, at the edge: 422 becomes INVALID_ARGUMENT with
`pe-serve-param` naming the field, 429 RESOURCE_EXHAUSTED with `retry-after`, and so on.
"""

from __future__ import annotations

from collections.abc import Mapping

import grpc

from service.api.errors import APIError

PARAM_KEY = "pe-serve-param"
ERROR_TYPE_KEY = "pe-serve-error-type"
RETRY_AFTER_KEY = "retry-after"
REQUEST_ID_KEY = "x-request-id"

# 499 is what the HTTP layer records for a client that went away; over gRPC it also answers a
# request stopped by `Abort`.
CANCELLED_STATUS = 499

_CODES: Mapping[int, grpc.StatusCode] = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    409: grpc.StatusCode.ALREADY_EXISTS,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    422: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    CANCELLED_STATUS: grpc.StatusCode.CANCELLED,
    503: grpc.StatusCode.UNAVAILABLE,
}


def status_code(error: APIError) -> grpc.StatusCode:
    """The code for an error's HTTP status; a status without its own code is a bug (INTERNAL)."""
    return _CODES.get(error.status, grpc.StatusCode.INTERNAL)


def trailing_metadata(error: APIError, request_id: str) -> tuple[tuple[str, str], ...]:
    """Error type, request id, the field at fault and the retry delay, each when there is one."""
    metadata = [(ERROR_TYPE_KEY, error.error_type), (REQUEST_ID_KEY, request_id)]
    if error.param is not None:
        metadata.append((PARAM_KEY, error.param))
    retry_after = {name.lower(): value for name, value in error.headers.items()}.get(RETRY_AFTER_KEY)
    if retry_after is not None:
        metadata.append((RETRY_AFTER_KEY, retry_after))
    return tuple(metadata)
