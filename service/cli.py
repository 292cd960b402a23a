"""`pe-serve` / `python -m service`: parse flags, build the app, run uvicorn with a draining stop.

SIGTERM (or Ctrl-C) does not stop the server at once: `/readyz` turns 503 and the gRPC health
service NOT_SERVING, new requests get 503 (UNAVAILABLE over gRPC), running ones on either protocol
finish (up to `--drain-timeout-s` seconds), and only then does uvicorn shut down and
the process exit 0. A second signal stops it immediately.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import ssl
import sys
from collections.abc import Sequence
from types import FrameType
from typing import Any, get_args

import uvicorn
from pydantic import ValidationError

from service.api.connections import KEEP_ALIVE_TIMEOUT_S, guarded_protocol
from service.logs import logging_config
from service.requests.model_names import ModelAliases, ModelNameError
from service.requests.state import Phase, ServiceState
from service.server import create_server
from service.settings import Device, DType, EngineMode, LogLevel, Settings, Weights

# Seconds uvicorn waits for open connections once the drain is over; responses are complete by then.
CONNECTION_GRACE_S = 5


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first stop signal drains the service instead of stopping at once."""

    def __init__(self, config: uvicorn.Config, state: ServiceState) -> None:
        super().__init__(config)
        self.state = state
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task[bool] | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not recorded in `_captured_signals`: uvicorn would re-raise it after shutdown and the
        # process would die by the signal instead of exiting 0.
        if self._drain is not None or self._loop is None:
            self.force_exit = self.should_exit
            self.should_exit = True
            return
        self._loop.call_soon_threadsafe(self._begin_drain)

    def _begin_drain(self) -> None:
        if self._drain is None:
            self._drain = asyncio.ensure_future(self.state.drain())

    async def on_tick(self, counter: int) -> bool:
        self.state.check_engine()
        stop = self.state.drained.is_set() or self.state.phase is Phase.FAILED
        return await super().on_tick(counter) or stop


def build_parser() -> argparse.ArgumentParser:
    """Flags default to 'not given' so that `PE_SERVE_*` variables and defaults fill the rest."""
    parser = argparse.ArgumentParser(
        prog="pe-serve",
        description="Serve transformers whose positional encoding and RoPE scaling are chosen per request.",
        argument_default=argparse.SUPPRESS,
        epilog="Every flag can also be set as PE_SERVE_<NAME> in the environment (e.g. PE_SERVE_MAX_QUEUE).",
    )
    parser.add_argument("--host", help="interface to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port to bind (default 8000)")
    parser.add_argument("--grpc-port", type=int, help="port of the gRPC API (default 50051; 0 disables it)")
    parser.add_argument(
        "--model-dir",
        nargs="+",
        action="extend",
        metavar="DIR",
        help="checkpoint directory (ours or Hugging Face Llama-family); repeatable; default: the bundled zoo",
    )
    parser.add_argument(
        "--alias",
        action="append",
        metavar="NAME=TARGET",
        help="a fixed model name: TARGET is a model and its SPECs, MODEL@SPEC[@SPEC] (e.g. "
        "long=zoo-rope@yarn:factor=4,original_max_position_embeddings=256); listed by /v1/models; "
        "repeatable",
    )
    parser.add_argument("--device", choices=get_args(Device), help="default auto (cuda when available)")
    parser.add_argument(
        "--dtype", choices=get_args(DType), help="default auto (bfloat16 on cuda, float32 on cpu)"
    )
    parser.add_argument(
        "--weights",
        choices=get_args(Weights),
        help="linear weights kept packed at run time: int8 (a scale per 32 inputs, as GGUF Q8_0), int4 "
        "(a scale and a minimum per 32 inputs, as GGUF Q4_1; CPU only); /models says which (default float)",
    )
    parser.add_argument(
        "--max-context", type=int, metavar="N", help="longest prompt + generation (default 4096)"
    )
    parser.add_argument(
        "--max-stream-tokens",
        type=int,
        metavar="N",
        help="most tokens a generation under pe_attention streaming may make, past max_context "
        "(default 65536)",
    )
    parser.add_argument(
        "--max-batch-size", type=int, metavar="N", help="sequences per forward pass (default 16)"
    )
    parser.add_argument(
        "--max-queue", type=int, metavar="N", help="waiting requests before 429 (default 64; 0: unbounded)"
    )
    parser.add_argument(
        "--engine-mode",
        choices=get_args(EngineMode),
        help="process (default): the engine in its own process; thread: in this process",
    )
    parser.add_argument(
        "--step-token-budget",
        type=int,
        metavar="N",
        help="most prompt/scoring tokens per engine step besides decoding (default 192)",
    )
    parser.add_argument(
        "--prefill-slowdown",
        type=float,
        metavar="X",
        help="chunks of a step take at most X times its decode pass (default 2; 0: token budget only)",
    )
    parser.add_argument(
        "--torch-threads",
        type=int,
        metavar="N",
        help="torch threads of the engine (default 0: every core)",
    )
    parser.add_argument(
        "--kv-cache-mb",
        type=int,
        metavar="MIB",
        help="KV cache pool per model in MiB (default 128, or 4 max_context requests where that is more)",
    )
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        help="open the fast step backends: 'c' (one C call per pass, a CPU in float32 with one "
        "torch thread), else 'compiled' (torch.compile at start-up) or 'cuda_graphs' on a GPU; the "
        "start-up log and /models say which runs (default: off, every model 'eager')",
    )
    parser.add_argument(
        "--prefix-cache",
        action=argparse.BooleanOptionalAction,
        help="reuse the KV blocks of earlier prompts with the same model, scaling and token prefix "
        "(default: on)",
    )
    parser.add_argument(
        "--compile-max-window",
        type=int,
        metavar="N",
        help="longest context the compiled steps cover (the C step has no bound); longer ones run "
        "eager (default 512)",
    )
    parser.add_argument(
        "--api-key", metavar="KEY", help="require 'Authorization: Bearer KEY' (comma-separate several)"
    )
    parser.add_argument(
        "--api-key-file",
        metavar="FILE",
        help="bearer keys, one a line (# comments, blank lines skipped): out of the process list; "
        "adds to --api-key",
    )
    parser.add_argument(
        "--max-concurrent-per-key",
        type=int,
        metavar="N",
        help="requests one key may have running or queued, else 429 (default 0: no limit)",
    )
    parser.add_argument(
        "--max-queued-tokens-per-key",
        type=int,
        metavar="N",
        help="prompt + max new tokens one key may have unfinished, else 429 (default 0: no limit)",
    )
    parser.add_argument(
        "--tls-cert", metavar="FILE", help="PEM certificate chain: serve HTTP and gRPC over TLS"
    )
    parser.add_argument("--tls-key", metavar="FILE", help="PEM private key of --tls-cert")
    parser.add_argument(
        "--tls-client-ca", metavar="FILE", help="PEM CA bundle: require client certificates it signed (mTLS)"
    )
    parser.add_argument("--max-body-bytes", type=int, metavar="N", help="request body limit (default 1 MiB)")
    parser.add_argument(
        "--header-timeout-s",
        type=float,
        metavar="S",
        help="time a client has to send a request's headers, else 408 and close (default 10)",
    )
    parser.add_argument(
        "--max-header-bytes", type=int, metavar="N", help="request header limit, else 431 (default 32 KiB)"
    )
    parser.add_argument(
        "--max-connections",
        type=int,
        metavar="N",
        help="open connections at once; one more gets 503 and is closed (default 1000)",
    )
    parser.add_argument(
        "--drain-timeout-s",
        "--drain-timeout",
        dest="drain_timeout_s",
        type=float,
        metavar="S",
        help="grace time on SIGTERM (default 30)",
    )
    parser.add_argument("--log-level", choices=get_args(LogLevel), help="default info")
    parser.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the warm-up prefill")
    return parser


def load_settings(argv: Sequence[str] | None = None) -> Settings:
    parser = build_parser()
    flags: dict[str, Any] = vars(parser.parse_args(argv))
    try:
        settings = Settings(**flags)
    except ValidationError as error:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())
        parser.error(problems)
    try:  # what can be judged before the models load; the rest once they are (`check_aliases`)
        ModelAliases.from_flags(settings.alias)
    except ModelNameError as error:
        parser.error(str(error))
    return settings


def tls_options(settings: Settings) -> dict[str, Any]:
    """uvicorn's TLS arguments: none without a certificate; client certificates required with a CA."""
    if settings.tls_cert is None:
        return {}
    options: dict[str, Any] = {"ssl_certfile": settings.tls_cert, "ssl_keyfile": settings.tls_key}
    if settings.tls_client_ca is not None:
        options.update(ssl_ca_certs=str(settings.tls_client_ca), ssl_cert_reqs=ssl.CERT_REQUIRED)
    return options


def main(argv: Sequence[str] | None = None) -> None:
    settings = load_settings(argv)
    app = create_server(settings)
    state: ServiceState = app.state.service
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        **tls_options(settings),
        log_config=logging_config(settings.log_level),
        access_log=False,
        timeout_graceful_shutdown=CONNECTION_GRACE_S,
        timeout_keep_alive=KEEP_ALIVE_TIMEOUT_S,
        server_header=False,
        http=guarded_protocol(
            header_timeout_s=settings.header_timeout_s,
            max_header_bytes=settings.max_header_bytes,
            max_connections=settings.max_connections,
        ),
    )
    DrainingServer(config, state).run()
    sys.exit(1 if state.phase is Phase.FAILED else 0)
