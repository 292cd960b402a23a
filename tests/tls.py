"""TLS for tests: a throwaway certificate authority, and a live server that speaks TLS.

`make_certificates(directory)` writes a CA, a server certificate for 127.0.0.1 and localhost, and
a client certificate, each signed by the CA (P-256 keys, valid for a day), with the extensions
strict verifiers ask for (Python's `VERIFY_X509_STRICT`, gRPC's BoringSSL), using the `openssl`
command line. `tls_live_server(...)` is `tests.live_server.live_server` over TLS: the server gets
`--tls-cert/--tls-key` (and `--tls-client-ca` with `mutual=True`) and is ready once `/readyz`
answers 200 over HTTPS to a client trusting the CA (presenting the client certificate).
"""

from __future__ import annotations

import contextlib
import ssl
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.live_server import READY_TIMEOUT_S, OptionValue, launch_server

_KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
_LEAF_EXTENSIONS = (
    "basicConstraints=critical,CA:FALSE\n"
    "keyUsage=critical,digitalSignature\n"
    "subjectKeyIdentifier=hash\n"
    "authorityKeyIdentifier=keyid,issuer\n"
)


@dataclass(frozen=True)
class Certificates:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _openssl(*arguments: str) -> None:
    subprocess.run(["openssl", *arguments], check=True, capture_output=True)


def _leaf(directory: Path, name: str, ca: Path, ca_key: Path, extensions: str) -> tuple[Path, Path]:
    cert, key, request, ext = (directory / f"{name}{suffix}" for suffix in (".pem", ".key", ".csr", ".ext"))
    ext.write_text(_LEAF_EXTENSIONS + extensions)
    _openssl("req", *_KEY, "-subj", f"/CN={name}", "-keyout", str(key), "-out", str(request))
    _openssl(
        "x509", "-req", "-in", str(request), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial",
        "-days", "1", "-extfile", str(ext), "-out", str(cert),
    )  # fmt: skip
    return cert, key


def make_certificates(directory: Path) -> Certificates:
    ca, ca_key = directory / "ca.pem", directory / "ca.key"
    _openssl(
        "req", "-x509", *_KEY, "-days", "1", "-subj", "/CN=pe-serve test CA",
        "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        "-keyout", str(ca_key), "-out", str(ca),
    )  # fmt: skip
    server = _leaf(
        directory,
        "server",
        ca,
        ca_key,
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n",
    )
    client = _leaf(directory, "client", ca, ca_key, "extendedKeyUsage=clientAuth\n")
    return Certificates(ca, *server, *client)


@dataclass(frozen=True)
class TlsServer:
    url: str  # https://127.0.0.1:<port>
    grpc_target: str

    def client_context(self, certificates: Certificates) -> ssl.SSLContext:
        """Trusts the test CA and presents the client certificate."""
        context = ssl.create_default_context(cafile=certificates.ca)
        context.load_cert_chain(certificates.client_cert, certificates.client_key)
        return context


@contextlib.contextmanager
def tls_live_server(
    model_dirs: Sequence[Path | str],
    certificates: Certificates,
    *,
    options: Mapping[str, OptionValue],
    env: Mapping[str, str] | None = None,
    mutual: bool = False,
) -> Iterator[TlsServer]:
    """A ready server on HTTPS and gRPC over TLS for the duration of the block; stopped afterwards."""
    flags: dict[str, OptionValue] = {
        **options,
        "tls_cert": str(certificates.server_cert),
        "tls_key": str(certificates.server_key),
    }
    if mutual:
        flags["tls_client_ca"] = str(certificates.ca)
    server = launch_server(model_dirs, options=flags, env=env)
    assert server.grpc_target is not None
    running = TlsServer(url=server.base_url.replace("http://", "https://"), grpc_target=server.grpc_target)
    try:
        with httpx.Client(verify=running.client_context(certificates), timeout=2.0) as client:
            deadline = time.monotonic() + READY_TIMEOUT_S
            while not _ready(client, running.url + "/readyz"):
                if server.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"pe-serve over TLS did not become ready:\n{server.logs()}")
                time.sleep(0.1)
        yield running
    finally:
        server.stop()
        server.log_path.unlink(missing_ok=True)


def _ready(client: httpx.Client, url: str) -> bool:
    with contextlib.suppress(httpx.TransportError):
        return client.get(url).status_code == 200
    return False
