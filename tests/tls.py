"""A throwaway certificate authority for TLS tests, made with the `openssl` command line.

`make_certificates(directory)` writes a CA, a server certificate for 127.0.0.1 and localhost, and
a client certificate, each signed by the CA (P-256 keys, valid for a day), with the extensions
strict verifiers ask for (Python's `VERIFY_X509_STRICT`, gRPC's BoringSSL).
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

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
