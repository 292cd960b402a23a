"""Who may call, and under which request id: the rules both transports apply at their edge."""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Collection

# A request id a client may choose: it ends up in logs and headers, so only a sane token.
CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")

# The one caller of a server without keys: every request belongs to it, as before keys existed.
ANONYMOUS = "anonymous"


def caller_name(key: bytes) -> str:
    """The name a key's requests are owned under: a short digest, so the key itself is kept nowhere."""
    return "key-" + hashlib.sha256(key).hexdigest()[:16]


def bearer_caller(authorization: str, keys: Collection[bytes]) -> str | None:
    """The caller an `Authorization: Bearer <key>` value names; None unless the key is one of `keys`.

    Every key is compared, in constant time and without short-circuit, so timing reveals nothing.
    """
    scheme, _, offered = authorization.partition(" ")
    candidate = offered.strip().encode()
    matches = [hmac.compare_digest(candidate, key) for key in keys]
    if scheme.lower() != "bearer" or not any(matches):
        return None
    return caller_name(candidate)
