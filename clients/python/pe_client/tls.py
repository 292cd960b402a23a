"""TLS for the SDK's connections: which server certificates to trust, and the client's own (mTLS).

Give any client `tls=TLS(...)`: `PEClient` and `AsyncPEClient` verify the server with
`ssl_context()` (an `https://` base URL), the gRPC clients open a secure channel with the same
files (`pe_client.grpc`). Without `tls` an `https://` URL is verified against the system's trust
store, and the gRPC clients connect in plain text.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from pathlib import Path

PathLike = str | os.PathLike[str]


@dataclass(frozen=True)
class TLS:
    """`ca_file`: PEM certificates to trust (None: the system's store). `cert_file` and `key_file`:
    the client certificate and its key, for a server that requires one (`--tls-client-ca`)."""

    ca_file: PathLike | None = None
    cert_file: PathLike | None = None
    key_file: PathLike | None = None

    def __post_init__(self) -> None:
        if self.key_file is not None and self.cert_file is None:
            raise ValueError("TLS: key_file needs cert_file")

    def ssl_context(self) -> ssl.SSLContext:
        """A verifying client context: hostname checked, our certificate offered when we have one."""
        context = ssl.create_default_context(cafile=self.ca_file)
        if self.cert_file is not None:
            context.load_cert_chain(self.cert_file, self.key_file)
        return context

    def pem(self) -> tuple[bytes | None, bytes | None, bytes | None]:
        """(trusted CAs, client key, client certificate chain) as bytes, as gRPC takes them."""
        return (
            _read(self.ca_file),
            _read(self.key_file if self.key_file is not None else self.cert_file),
            _read(self.cert_file),
        )


def verify(tls: TLS | None) -> ssl.SSLContext | bool:
    """httpx's `verify`: our context, or its own default (the system's store) without `tls`."""
    return tls.ssl_context() if tls is not None else True


def _read(path: PathLike | None) -> bytes | None:
    return Path(path).read_bytes() if path is not None else None
