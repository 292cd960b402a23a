"""Who may call, and under which request id: the rules both transports apply at their edge."""

from __future__ import annotations

import hmac
import re
from collections.abc import Collection

# A request id a client may choose: it ends up in logs and headers, so only a sane token.
CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


def bearer_authorized(authorization: str, keys: Collection[bytes]) -> bool:
    """Whether an `Authorization` value is `Bearer <one of keys>`, compared in constant time."""
    scheme, _, offered = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return False
    candidate = offered.strip().encode()
    # Compare against every key, without short-circuit, so timing reveals nothing.
    matches = [hmac.compare_digest(candidate, key) for key in keys]
    return any(matches)
