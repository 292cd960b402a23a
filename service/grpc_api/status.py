"""Request failures -> gRPC status codes, and the trailing metadata that carries the error's details.

The gRPC API raises the same `RequestError`s as the HTTP layer (its requests go through the same
request core), so the translation happens once, here, at the edge: an invalid request becomes
INVALID_ARGUMENT with `pe-serve-param` naming the field, a full queue RESOURCE_EXHAUSTED with
`retry-after`, and so on.
"""

from __future__ import annotations

from collections.abc import Mapping

import grpc

from service.requests.errors import ErrorKind, RequestError

PARAM_KEY = "pe-serve-param"
ERROR_TYPE_KEY = "pe-serve-error-type"
RETRY_AFTER_KEY = "retry-after"
REQUEST_ID_KEY = "x-request-id"

GRPC_STATUS: Mapping[ErrorKind, grpc.StatusCode] = {
    ErrorKind.BAD_REQUEST: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    ErrorKind.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorKind.METHOD_NOT_ALLOWED: grpc.StatusCode.UNIMPLEMENTED,
    ErrorKind.CONFLICT: grpc.StatusCode.ALREADY_EXISTS,
    ErrorKind.TOO_LARGE: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.UNSUPPORTED_MEDIA_TYPE: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.QUEUE_FULL: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.CANCELLED: grpc.StatusCode.CANCELLED,
    ErrorKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorKind.INTERNAL: grpc.StatusCode.INTERNAL,
}


def status_code(error: RequestError) -> grpc.StatusCode:
    return GRPC_STATUS[error.kind]


def trailing_metadata(error: RequestError, request_id: str) -> tuple[tuple[str, str], ...]:
    """Error type, request id, the field at fault and the retry delay, each when there is one."""
    metadata = [(ERROR_TYPE_KEY, error.error_type), (REQUEST_ID_KEY, request_id)]
    if error.param is not None:
        metadata.append((PARAM_KEY, error.param))
    if error.retry_after_s is not None:
        metadata.append((RETRY_AFTER_KEY, str(error.retry_after_s)))
    return tuple(metadata)
