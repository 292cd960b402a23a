"""The one error type of pe_runtime.

Callers (the HTTP layer above all) turn it into a 422 that names the offending field, so the field is
carried as data rather than buried in the message.
"""

from __future__ import annotations


class PEConfigError(ValueError):
    """A positional-encoding configuration that cannot be honoured; `field` names the bad key."""

    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
