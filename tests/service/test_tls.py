"""TLS and mutual TLS on both protocols, through the SDK, with certificates made for the test.

Two live servers over one tiny model: one with `--tls-cert/--tls-key`, one that also requires
client certificates (`--tls-client-ca`). Through the SDK (sync and async, HTTP and gRPC) a client
trusting the test CA completes the handshake and gets answers; plain HTTP and a plaintext gRPC
channel on those ports are refused, as is a client that does not trust the CA; with mutual TLS a
client without a certificate is refused on both protocols and one with the CA's certificate served.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from pe_client import APIConnectionError, AsyncPEClient, PEClient
from pe_client.grpc import AsyncGrpcPEClient, GrpcPEClient
from pe_client.tls import TLS

from tests.live_server import OptionValue
from tests.service.api.conftest import BASE_OPTIONS, SERVER_ENV
from tests.tls import Certificates, TlsServer, make_certificates, tls_live_server

PROMPT = "def f():"
NEW_TOKENS = 4
OPTIONS: dict[str, OptionValue] = {**BASE_OPTIONS, "no_warmup": True}


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    return make_certificates(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def tls_only(tiny_zoo: list[Path], certificates: Certificates) -> Iterator[TlsServer]:
    with tls_live_server([tiny_zoo[0]], certificates, options=OPTIONS, env=SERVER_ENV) as server:
        yield server


@pytest.fixture(scope="module")
def mutual(tiny_zoo: list[Path], certificates: Certificates) -> Iterator[TlsServer]:
    with tls_live_server([tiny_zoo[0]], certificates, options=OPTIONS, env=SERVER_ENV, mutual=True) as server:
        yield server


def generated_over_every_client(server: TlsServer, tls: TLS) -> list[list[int]]:
    """The tokens of one greedy generation through each of the four SDK clients."""
    with PEClient(server.url, tls=tls) as http, GrpcPEClient(server.grpc_target, tls=tls) as rpc:
        answers = [
            http.generate(prompt=PROMPT, max_new_tokens=NEW_TOKENS, temperature=0.0).tokens,
            rpc.generate(prompt=PROMPT, max_new_tokens=NEW_TOKENS, temperature=0.0).tokens,
        ]

    async def asynchronously() -> list[list[int]]:
        async with (
            AsyncPEClient(server.url, tls=tls) as http,
            AsyncGrpcPEClient(server.grpc_target, tls=tls) as rpc,
        ):
            over_http = await http.generate(prompt=PROMPT, max_new_tokens=NEW_TOKENS, temperature=0.0)
            over_grpc = await rpc.generate(prompt=PROMPT, max_new_tokens=NEW_TOKENS, temperature=0.0)
            return [over_http.tokens, over_grpc.tokens]

    return answers + asyncio.run(asynchronously())


def refused_on_both(server: TlsServer, tls: TLS) -> None:
    with pytest.raises(APIConnectionError), PEClient(server.url, tls=tls, max_retries=0) as http:
        http.models()
    rpc = GrpcPEClient(server.grpc_target, tls=tls, max_retries=0, timeout=10.0)
    with pytest.raises(APIConnectionError), rpc:
        rpc.models()


def test_the_sdk_speaks_tls_to_both_protocols(tls_only: TlsServer, certificates: Certificates) -> None:
    answers = generated_over_every_client(tls_only, TLS(ca_file=certificates.ca))
    assert len(answers[0]) == NEW_TOKENS and all(answer == answers[0] for answer in answers)


def test_plaintext_and_untrusting_clients_are_refused(tls_only: TlsServer) -> None:
    with pytest.raises(httpx.TransportError):
        httpx.get(tls_only.url.replace("https://", "http://") + "/healthz", timeout=10.0)
    with grpc.insecure_channel(tls_only.grpc_target) as channel, pytest.raises(grpc.FutureTimeoutError):
        grpc.channel_ready_future(channel).result(timeout=3.0)
    # The system's trust store does not hold the test CA: the server's certificate is not verified.
    refused_on_both(tls_only, TLS())


def test_mutual_tls_refuses_a_client_without_a_certificate(
    mutual: TlsServer, certificates: Certificates
) -> None:
    refused_on_both(mutual, TLS(ca_file=certificates.ca))
    with_certificate = TLS(certificates.ca, certificates.client_cert, certificates.client_key)
    answers = generated_over_every_client(mutual, with_certificate)
    assert len(answers[0]) == NEW_TOKENS and all(answer == answers[0] for answer in answers)
