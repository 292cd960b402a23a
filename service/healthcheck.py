"""`python3 -m service.healthcheck`: the container's health probe, over HTTPS when the server uses TLS.

The image's `HEALTHCHECK` and the compose file's `healthcheck` run it inside the container, beside
the server. It reads the server's settings the way the server does (the `PE_SERVE_*` variables,
through `Settings`), so it follows the port and the TLS files the server started with, and asks
`GET /readyz` on the loopback address: exit 0 on 200, 1 otherwise (Docker's "unhealthy"), with the
reason printed, where `docker inspect` shows it. A probe with a fixed `http://` URL reported a
TLS server unhealthy forever, since that server refuses plain HTTP at the handshake.

The probe does not verify the server's certificate, as the kubelet's HTTPS probes do not: it talks
to the loopback address of the container's own network namespace, where no one else sits between
it and the server, and it sends nothing secret (`/readyz` needs no API key). Verifying would fail
anyway on the usual certificate, which names the public host rather than 127.0.0.1 and may be
signed by a CA the image does not hold; an expired certificate is for monitoring to report, not
a reason to call the process unhealthy.

With mutual TLS (`PE_SERVE_TLS_CLIENT_CA`) the server refuses any handshake without a client
certificate signed by that CA, so the probe presents the one named by `PE_SERVE_HEALTHCHECK_CERT`
(and `PE_SERVE_HEALTHCHECK_KEY`, unless the key is in the same file); without it the probe reports
unhealthy and says what to set, rather than guessing with the server's own certificate.

Settings given as flags on the server's command line (`pe-serve --port 9000`) are not seen here:
in a container, give them as `PE_SERVE_*` variables.
"""

from __future__ import annotations

import argparse
import http.client
import os
import ssl
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from service.settings import Settings

CERT_ENV = "PE_SERVE_HEALTHCHECK_CERT"
KEY_ENV = "PE_SERVE_HEALTHCHECK_KEY"
PATH = "/readyz"
# Inside the image's HEALTHCHECK timeout (5 s), so that a slow answer reads as this probe's failure
# with its reason rather than as Docker killing it.
DEFAULT_TIMEOUT_S = 4.0
# A server bound to every interface is reached on the loopback address of the same family.
_LOOPBACK_FOR_WILDCARD = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}
_BODY_SHOWN = 200


class Unhealthy(Exception):
    """Why the server is not healthy, in one line."""


@dataclass(frozen=True)
class Target:
    """Where the server answers and, for TLS, how to shake hands with it."""

    host: str
    port: int
    tls: ssl.SSLContext | None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}{PATH}"


def target(settings: Settings, environ: Mapping[str, str]) -> Target:
    """The server's loopback address, over TLS when it has a certificate.

    Raises Unhealthy when the server requires client certificates and none is given for the probe,
    or the given one does not load.
    """
    host = _LOOPBACK_FOR_WILDCARD.get(settings.host, settings.host)
    if settings.tls_cert is None:
        return Target(host, settings.port, None)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    if settings.tls_client_ca is not None:
        cert = environ.get(CERT_ENV)
        if not cert:
            raise Unhealthy(
                "the server requires client certificates (PE_SERVE_TLS_CLIENT_CA): name one signed "
                f"by that CA, and its key, in {CERT_ENV} and {KEY_ENV}"
            )
        try:
            context.load_cert_chain(Path(cert), Path(environ[KEY_ENV]) if environ.get(KEY_ENV) else None)
        except (OSError, ssl.SSLError) as error:
            raise Unhealthy(f"cannot load the probe's client certificate {cert}: {error}") from None
    return Target(host, settings.port, context)


def probe(where: Target, timeout_s: float) -> None:
    """GET /readyz once; returns on 200, raises Unhealthy with the reason otherwise."""
    connection = (
        http.client.HTTPSConnection(where.host, where.port, timeout=timeout_s, context=where.tls)
        if where.tls is not None
        else http.client.HTTPConnection(where.host, where.port, timeout=timeout_s)
    )
    try:
        connection.request("GET", PATH)
        response = connection.getresponse()
        body = response.read(_BODY_SHOWN)
    except (OSError, http.client.HTTPException) as error:
        raise Unhealthy(f"{where.url}: {type(error).__name__}: {error}") from None
    finally:
        connection.close()
    if response.status != 200:
        raise Unhealthy(f"{where.url} answered {response.status}: {body.decode(errors='replace')}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m service.healthcheck",
        description="Exit 0 when the pe-serve configured by the PE_SERVE_* variables answers "
        "GET /readyz with 200 (over HTTPS when it has a TLS certificate), else 1.",
    )
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="S")
    options = parser.parse_args(argv)
    try:
        where = target(Settings(), os.environ)
        probe(where, options.timeout)
    except ValidationError as error:
        print(f"unhealthy: the server's settings do not load: {error}", file=sys.stderr)
        return 1
    except Unhealthy as error:
        print(f"unhealthy: {error}", file=sys.stderr)
        return 1
    print(f"healthy: {where.url} answered 200")
    return 0


if __name__ == "__main__":
    sys.exit(main())
