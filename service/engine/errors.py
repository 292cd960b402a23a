"""Engine errors. Each carries the request field it concerns so the HTTP layer can name it.

The HTTP layer maps classes to statuses (422, 404, 429, 503); the engine never knows about HTTP.
"""

from __future__ import annotations

from typing import Any


class EngineError(Exception):
    """Base class; `param` is the dotted request field at fault, or None."""

    error_type = "engine_error"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def __reduce__(self) -> tuple[Any, ...]:
        """Errors cross the engine process boundary with their keyword fields intact."""
        return _rebuild, (type(self), self.message, dict(self.__dict__))


def _rebuild(cls: type[EngineError], message: str, fields: dict[str, Any]) -> EngineError:
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    error.__dict__.update(fields)
    return error


class InvalidRequestError(EngineError):
    """The request cannot run as asked (unsupported scaling for a scheme, bad token ids, ...)."""

    error_type = "invalid_request_error"


class ContextLengthError(InvalidRequestError):
    """prompt + max_new_tokens exceeds what the model can run (max_context, or a learned table)."""

    error_type = "context_length_exceeded"


class ModelNotFoundError(EngineError):
    error_type = "model_not_found"


class QueueFullError(EngineError):
    """The bounded queue is full; `retry_after_s` is the engine's estimate of when to retry."""

    error_type = "queue_full"

    def __init__(self, message: str, *, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineUnavailableError(EngineError):
    """The engine cannot take or finish this request now (draining, stopped, restarting)."""

    error_type = "service_unavailable"


class EngineDrainingError(EngineUnavailableError):
    pass


class RequestFailedError(EngineError):
    """The request failed inside the engine (e.g. non-finite logits); other requests go on."""

    error_type = "request_failed"


class RequestCancelledError(EngineError):
    error_type = "request_cancelled"


class ModelLoadError(RuntimeError):
    """The models could not be loaded. Not a request's error: the server cannot start.

    The message is one line that names the directory at fault and what is wrong with it, which is
    what an operator reads first; the stack trace adds nothing for a bad file.
    """
