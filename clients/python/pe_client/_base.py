"""What the sync and async clients share: configuration, request building, retry policy, errors.

The two clients differ only in how they send and sleep; everything that decides *what* to send and
*whether* to try again lives here, so both behave identically.
"""

from __future__ import annotations

import email.utils
import os
import random
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from pe_client._version import __version__
from pe_client.errors import (
    APIConnectionError,
    APIError,
    APIStatusError,
    APIStreamError,
    APITimeoutError,
    status_error_class,
)
from pe_client.types import ErrorBody

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
DEFAULT_TIMEOUT = httpx.Timeout(60.0, connect=5.0)
DEFAULT_MAX_RETRIES = 2
RETRYABLE_STATUSES = frozenset({408, 429, 502, 503, 504})
REQUEST_ID_HEADER = "x-request-id"
# Error events that mean the server streaming went away, not that the request failed: the stream
# is resumed elsewhere or later. (`request_cancelled` is not one: it is also an owner's abort.)
RESUMABLE_STREAM_ERRORS = frozenset({"replica_lost", "service_unavailable"})

RequestT = TypeVar("RequestT", bound=BaseModel)


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter, overridden by the server's `Retry-After` when it is sane.

    Jitter takes up to a quarter off each delay so that clients turned away together by a full
    queue do not all come back at the same instant.
    """

    max_retries: int = DEFAULT_MAX_RETRIES
    initial_delay_s: float = 0.5
    max_delay_s: float = 8.0
    max_retry_after_s: float = 60.0
    jitter: Callable[[], float] = field(default=random.random, repr=False)

    def delay_or_raise(self, retries_taken: int, error: APIError) -> float:
        """Seconds to wait before the next attempt; raises `error` when it must not be retried.

        Connection errors and timeouts are always worth another attempt; statuses only when the
        server says the condition is temporary.
        """
        if retries_taken >= self.max_retries:
            raise error
        if isinstance(error, APIStatusError):
            if error.status_code not in RETRYABLE_STATUSES:
                raise error
            retry_after = parse_retry_after(error.headers.get("retry-after"))
            if retry_after is not None and 0 <= retry_after <= self.max_retry_after_s:
                return retry_after
        backoff = min(self.initial_delay_s * 2.0**retries_taken, self.max_delay_s)
        return backoff * (1.0 - 0.25 * self.jitter())

    def resume_delay_or_raise(self, cuts: int, error: APIError) -> float:
        """Seconds to wait before resuming a stream cut by `error`, the `cuts`-th cut in a row with
        no token between; raises `error` when it is no cut to resume.

        A cut is what would be retried before the stream began (a broken connection, a 503), or
        an error event saying the server went away (`RESUMABLE_STREAM_ERRORS`); another error
        event is the request's own failure. Counting only cuts in a row bounds a stream that
        makes no progress, while a long one survives any number of cuts it recovers from.
        """
        if isinstance(error, APIStreamError) and error.type not in RESUMABLE_STREAM_ERRORS:
            raise error
        return self.delay_or_raise(cuts, error)


def parse_retry_after(value: str | None) -> float | None:
    """`Retry-After` is either delta-seconds or an HTTP date; None when absent or unreadable."""
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def status_error(response: httpx.Response) -> APIStatusError:
    """The exception for an error response; its body must already be read.

    A body not in the API's error shape (a proxy's HTML page, say) becomes the message as is.
    """
    error_class = status_error_class(response.status_code)
    try:
        detail = ErrorBody.model_validate_json(response.content).error
    except ValidationError:
        return error_class(response.text or response.reason_phrase, response=response)
    return error_class(detail.message, response=response, error_type=detail.type, param=detail.param)


def connection_error(exc: httpx.TransportError, request: httpx.Request) -> APIConnectionError:
    """Wrap an httpx transport failure; timeouts get their own class so callers can tell them apart."""
    if isinstance(exc, httpx.TimeoutException):
        return APITimeoutError(request=request)
    return APIConnectionError(request=request, message=f"Connection error: {exc}")


def build_body(
    model: type[RequestT], request: RequestT | None, params: Mapping[str, object], **fixed: object
) -> dict[str, object]:
    """The JSON body from a request object or keyword arguments (not both), plus fields the method fixes.

    None means "absent" everywhere in the API, so None fields (nested scaling fields included) are
    left out and the server's defaults apply.
    """
    if request is not None and params:
        raise TypeError("pass either a request object or keyword arguments, not both")
    validated = request if request is not None else model.model_validate(params)
    return validated.model_copy(update=fixed).model_dump(mode="json", exclude_none=True)


def resumed_body(body: Mapping[str, object], received: Sequence[int]) -> Mapping[str, object]:
    """The body that resumes a stream cut after `received` (the body itself before any token),
    after the tokens a hand-made `resume_from` already held."""
    if not received:
        return body
    held = body.get("resume_from")
    earlier = list(held["tokens"]) if isinstance(held, Mapping) else []
    return {**body, "resume_from": {"tokens": [*earlier, *received]}}


class BaseClient:
    """Settings and request construction common to `PEClient` and `AsyncPEClient`."""

    def __init__(
        self,
        *,
        base_url: str | None,
        api_key: str | None,
        timeout: float | httpx.Timeout,
        max_retries: int,
    ) -> None:
        self.base_url = (base_url or os.environ.get("PE_SERVE_URL") or DEFAULT_BASE_URL).rstrip("/")
        self.api_key = api_key if api_key is not None else os.environ.get("PE_SERVE_API_KEY")
        self.timeout = timeout if isinstance(timeout, httpx.Timeout) else httpx.Timeout(timeout)
        self.retry_policy = RetryPolicy(max_retries=max_retries)

    def _headers(self) -> dict[str, str]:
        """A fresh `X-Request-ID` per call: its retries (and a stream's resumes) resend the same
        request, so the server runs it once however many attempts reach it."""
        headers = {"user-agent": f"pe-client/{__version__}", REQUEST_ID_HEADER: uuid.uuid4().hex}
        if self.api_key:
            headers["authorization"] = f"Bearer {self.api_key}"
        return headers

    def _build_request(
        self,
        http: httpx.Client | httpx.AsyncClient,
        method: str,
        path: str,
        body: object = None,
        headers: Mapping[str, str] | None = None,
    ) -> httpx.Request:
        """`headers`: the call's own (`_headers()`), where it sends more than one request."""
        return http.build_request(
            method,
            self.base_url + path,
            json=body,
            headers=headers if headers is not None else self._headers(),
            timeout=self.timeout,
        )
