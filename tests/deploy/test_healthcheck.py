"""The container health probe (`service/healthcheck.py`) against live servers on loopback ports.

The command is the one the Dockerfile's `HEALTHCHECK` runs (the compose file must run the same),
in a fresh process with the image's host setting (`0.0.0.0`) and the test server's port: it
answers healthy for a plain server, for a TLS server once `PE_SERVE_TLS_CERT`/`KEY` are set as
the server's are (and unhealthy without them, as the old plain-HTTP probe was), for a mutual-TLS
server when given a client certificate signed by the server's client CA (and unhealthy without
one, or with one from another CA); unhealthy when nothing listens and when `/readyz` is not 200.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from service.healthcheck import CERT_ENV, KEY_ENV
from service.settings import Settings
from tests.live_server import OptionValue, free_port, live_server
from tests.tls import Certificates, make_certificates, tls_live_server

REPO_ROOT = Path(__file__).resolve().parents[2]
OPTIONS: dict[str, OptionValue] = {"device": "cpu", "dtype": "float32", "max_context": 512, "no_warmup": True}
SERVER_ENV = {"OMP_NUM_THREADS": "1"}
PROBE_TIMEOUT_S = 30.0


def dockerfile_probe() -> list[str]:
    """The exec-form CMD of the Dockerfile's HEALTHCHECK."""
    text = (REPO_ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    match = re.search(r"^HEALTHCHECK\b.*?\bCMD (\[.*\])$", text, re.MULTILINE)
    assert match is not None, "no exec-form HEALTHCHECK in the Dockerfile"
    command: list[str] = json.loads(match.group(1))
    return command


def compose_probes() -> dict[str, list[str]]:
    """Each compose service's healthcheck command, without its `CMD` marker."""
    services = yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())["services"]
    probes: dict[str, list[str]] = {}
    for name, service in services.items():
        if "healthcheck" in service:
            marker, *command = service["healthcheck"]["test"]
            assert marker == "CMD", f"{name}: the healthcheck must be exec form"
            probes[name] = command
    return probes


def run_probe(port: int, extra_env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The HEALTHCHECK command in a new process, as the image would run it, against `port`."""
    interpreter, *arguments = dockerfile_probe()
    assert interpreter == "python3"
    environment = {key: value for key, value in os.environ.items() if not key.startswith("PE_SERVE_")}
    environment.update({"PE_SERVE_HOST": "0.0.0.0", "PE_SERVE_PORT": str(port), **(extra_env or {})})
    return subprocess.run(
        [sys.executable, *arguments],
        cwd=REPO_ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=PROBE_TIMEOUT_S,
    )


def tls_env(certificates: Certificates) -> dict[str, str]:
    """The server's certificate and key, as the probe finds them in the container's environment."""
    return {
        "PE_SERVE_TLS_CERT": str(certificates.server_cert),
        "PE_SERVE_TLS_KEY": str(certificates.server_key),
    }


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    return make_certificates(tmp_path_factory.mktemp("tls"))


def test_the_image_and_the_compose_file_run_the_same_probe() -> None:
    assert dockerfile_probe() == ["python3", "-m", "service.healthcheck"]
    probes = compose_probes()
    assert set(probes) == {"pe-serve", "pe-serve-cpu"}
    assert all(command == dockerfile_probe() for command in probes.values())


def test_a_plain_server_is_healthy(tiny_checkpoints: dict[str, Path]) -> None:
    with live_server([tiny_checkpoints["rope"]], options=OPTIONS, env=SERVER_ENV) as server:
        port = port_of(server.base_url)
        probed = run_probe(port)
    assert probed.returncode == 0, probed.stderr
    assert f"healthy: http://127.0.0.1:{port}/readyz answered 200" in probed.stdout


def test_a_tls_server_is_healthy_when_the_probe_reads_its_settings(
    tiny_checkpoints: dict[str, Path], certificates: Certificates
) -> None:
    with tls_live_server([tiny_checkpoints["rope"]], certificates, options=OPTIONS, env=SERVER_ENV) as server:
        port = port_of(server.url)
        over_tls = run_probe(port, tls_env(certificates))
        over_plain_http = run_probe(port)
    assert over_tls.returncode == 0, over_tls.stderr
    assert f"https://127.0.0.1:{port}/readyz answered 200" in over_tls.stdout
    # What the fixed http:// probe did: a TLS server refuses plain HTTP, so it never turned healthy.
    assert over_plain_http.returncode == 1 and "unhealthy" in over_plain_http.stderr


@pytest.fixture(scope="module")
def mutual_tls_port(tiny_checkpoints: dict[str, Path], certificates: Certificates) -> Iterator[int]:
    with tls_live_server(
        [tiny_checkpoints["rope"]], certificates, options=OPTIONS, env=SERVER_ENV, mutual=True
    ) as server:
        yield port_of(server.url)


def test_a_mutual_tls_server_is_healthy_to_a_probe_with_a_client_certificate(
    mutual_tls_port: int, certificates: Certificates, tmp_path: Path
) -> None:
    mutual = {**tls_env(certificates), "PE_SERVE_TLS_CLIENT_CA": str(certificates.ca)}
    own = {CERT_ENV: str(certificates.client_cert), KEY_ENV: str(certificates.client_key)}
    foreign = make_certificates(tmp_path)
    from_another_ca = {CERT_ENV: str(foreign.client_cert), KEY_ENV: str(foreign.client_key)}
    with_certificate = run_probe(mutual_tls_port, {**mutual, **own})
    without_certificate = run_probe(mutual_tls_port, mutual)
    other_ca = run_probe(mutual_tls_port, {**mutual, **from_another_ca})
    assert with_certificate.returncode == 0, with_certificate.stderr
    assert without_certificate.returncode == 1 and CERT_ENV in without_certificate.stderr
    assert other_ca.returncode == 1 and "unhealthy" in other_ca.stderr


def compose_tls_environments(mounted_at: Path) -> dict[str, dict[str, str]]:
    """Per service, the variables deploy/compose-tls.yml and compose-mtls.yml add, their files
    under `mounted_at` instead of the directory the override mounts."""
    tls, mutual = (
        yaml.safe_load((REPO_ROOT / "deploy" / name).read_text())["services"]
        for name in ("compose-tls.yml", "compose-mtls.yml")
    )
    environments = {}
    for name, service in tls.items():
        (volume,) = service["volumes"]
        _, mount, _ = volume.rsplit(":", 2)  # ${PE_SERVE_TLS_DIR:-./tls}:MOUNT:ro
        environment = {**service["environment"], **mutual[name]["environment"]}
        assert all(value.startswith(f"{mount}/") for value in environment.values()), environment
        environments[name] = {
            key: value.replace(mount, str(mounted_at), 1) for key, value in environment.items()
        }
    return environments


def test_the_compose_tls_overrides_make_the_probe_healthy_over_mutual_tls(
    mutual_tls_port: int, certificates: Certificates, tmp_path: Path
) -> None:
    """The certificates laid out under the names the overrides give them, as the smoke test does."""
    for source, name in (
        (certificates.server_cert, "tls.crt"),
        (certificates.server_key, "tls.key"),
        (certificates.ca, "ca.crt"),
        (certificates.client_cert, "probe.crt"),
        (certificates.client_key, "probe.key"),
    ):
        shutil.copy(source, tmp_path / name)
    environments = compose_tls_environments(tmp_path)
    assert set(environments) == set(compose_probes())
    server_variables = {f"PE_SERVE_{field.upper()}" for field in Settings.model_fields}
    for environment in environments.values():
        # A misspelt server variable would be ignored by the server, and TLS silently off.
        assert set(environment) - server_variables == {CERT_ENV, KEY_ENV}
        probed = run_probe(mutual_tls_port, environment)
        assert probed.returncode == 0, probed.stderr


def test_nothing_listening_is_unhealthy() -> None:
    probed = run_probe(free_port())
    assert probed.returncode == 1
    assert "ConnectionRefusedError" in probed.stderr


class _NotReady(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b'{"status": "loading"}'
        self.send_response(503 if self.path == "/readyz" else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        """Silent: the test reads the probe's output, not the stub's."""


@pytest.fixture
def not_ready_server() -> Iterator[int]:
    """A stand-in answering /readyz with 503, as pe-serve does while it loads or drains."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _NotReady)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_a_server_not_ready_is_unhealthy(not_ready_server: int) -> None:
    probed = run_probe(not_ready_server)
    assert probed.returncode == 1
    assert "answered 503" in probed.stderr and "loading" in probed.stderr
