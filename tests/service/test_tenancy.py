"""Tenants kept apart: a request belongs to the key that made it, and each key has its own limits.

One live server with three keys (two from `--api-key-file`, one from `--api-key`), one sequence
at a time (`--max-batch-size 1`, so a second request waits in the queue behind a long one) and
per-key limits of 2 requests and 500 tokens. The matrix: a request made by key A over HTTP or
gRPC; key B's lookup (`GET /requests/{id}`), cancel (`POST /requests/{id}/cancel`) and gRPC `Abort`
all answer NOT_FOUND as for an id nobody uses, while A's lookup finds it and A's cancel or Abort
stops it.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from service.grpc_api import pe_serve_pb2 as pb
from tests.live_server import LiveServer, live_server
from tests.service.api.conftest import BASE_OPTIONS, SERVER_ENV, model_name
from tests.service.grpc.helpers import assert_status, raw_call, request_bytes, stream

KEY_A, KEY_B, KEY_C = "tenant-a-key", "tenant-b-key", "tenant-c-key"
MAX_CONCURRENT = 2
MAX_TOKENS = 500
# Seconds of work on a model the C step cannot run, stopped by each test long before it ends.
LONG: dict[str, Any] = {"model": model_name("shaw"), "prompt": "a", "max_new_tokens": 400, "temperature": 0.0}
SHORT: dict[str, Any] = {"prompt": "a", "max_new_tokens": 16, "temperature": 0.0}
GRPC_GENERATE = "/pe_serve.v1.PEServe/Generate"


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def grpc_auth(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


@pytest.fixture(scope="module")
def server(tiny_zoo: list[Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    key_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    key_file.write_text(f"# tenants\n{KEY_A}\n\n  {KEY_B}  \n# the end\n")
    options = {
        **BASE_OPTIONS,
        "api_key": KEY_C,
        "api_key_file": str(key_file),
        "max_batch_size": 1,
        "max_concurrent_per_key": MAX_CONCURRENT,
        "max_queued_tokens_per_key": MAX_TOKENS,
        "no_warmup": True,
    }
    with live_server(tiny_zoo, options=options, env=SERVER_ENV) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60.0) as http:
        yield http


@pytest.fixture(scope="module")
def channel(server: LiveServer) -> Iterator[grpc.Channel]:
    assert server.grpc_target is not None
    with grpc.insecure_channel(server.grpc_target) as opened:
        yield opened


def lookup(client: httpx.Client, key: str, request_id: str) -> httpx.Response:
    return client.get(f"/requests/{request_id}", headers=auth(key))


def cancel(client: httpx.Client, key: str, request_id: str) -> httpx.Response:
    return client.post(f"/requests/{request_id}/cancel", headers=auth(key))


def abort(channel: grpc.Channel, key: str, request_id: str) -> grpc.StatusCode:
    try:
        raw_call(channel, "Abort")(
            pb.AbortRequest(request_id=request_id).SerializeToString(), metadata=grpc_auth(key), timeout=10
        )
    except grpc.RpcError as error:
        return error.code()
    return grpc.StatusCode.OK


@contextlib.contextmanager
def http_stream(
    client: httpx.Client, key: str, request_id: str, body: dict[str, Any]
) -> Iterator[Callable[[], str]]:
    """A streamed /generate accepted by the server; yields a reader of how its stream ended."""
    headers = {**auth(key), "X-Request-ID": request_id}
    with client.stream("POST", "/generate", json={**body, "stream": True}, headers=headers) as response:
        assert response.status_code == 200, response.read()
        lines = (line for line in response.iter_lines() if line.startswith("data: "))

        def ending() -> str:
            last = ""
            for line in lines:
                last = line.removeprefix("data: ")
            if last == "[DONE]":
                return "done"
            error: str = json.loads(last)["error"]["type"]
            return error

        yield ending


@contextlib.contextmanager
def grpc_stream(
    channel: grpc.Channel, key: str, request_id: str, body: dict[str, Any]
) -> Iterator[Callable[[], str]]:
    """A streamed gRPC Generate accepted by the server; yields a reader of how its stream ended."""
    call: Any = stream(channel, {**body, "request_id": request_id}, metadata=grpc_auth(key), timeout=60)
    call.initial_metadata()  # sent once the request is accepted

    def ending() -> str:
        try:
            for _ in call:
                pass
        except grpc.RpcError as error:
            return str(error.code().name)
        return "done"

    try:
        yield ending
    finally:
        call.cancel()


def opened(
    made_over: str, client: httpx.Client, channel: grpc.Channel
) -> Callable[[str, str, dict[str, Any]], contextlib.AbstractContextManager[Callable[[], str]]]:
    if made_over == "http":
        return lambda key, request_id, body: http_stream(client, key, request_id, body)
    return lambda key, request_id, body: grpc_stream(channel, key, request_id, body)


@pytest.mark.parametrize("made_over", ["http", "grpc"])
@pytest.mark.parametrize("owner_stops_with", ["cancel", "abort"])
def test_only_the_owner_can_look_up_cancel_or_abort_a_request(
    client: httpx.Client, channel: grpc.Channel, made_over: str, owner_stops_with: str
) -> None:
    request_id = f"tenancy-{made_over}-{owner_stops_with}"
    with opened(made_over, client, channel)(KEY_A, request_id, LONG) as ending:
        owned = lookup(client, KEY_A, request_id)
        assert owned.status_code == 200, owned.text
        assert owned.json()["endpoint"] == ("/generate" if made_over == "http" else GRPC_GENERATE)
        assert owned.json()["models"] == [LONG["model"]] and not owned.json()["cancelled"]
        # Key B, and key C from the other source of keys: refused as if the id were free.
        for other in (KEY_B, KEY_C):
            for refused in (lookup(client, other, request_id), cancel(client, other, request_id)):
                assert refused.status_code == 404, refused.text
                assert refused.json()["error"]["type"] == "request_not_found"
            assert abort(channel, other, request_id) is grpc.StatusCode.NOT_FOUND
        # Untouched by all that: still A's, still running.
        assert lookup(client, KEY_A, request_id).json()["cancelled"] is False
        if owner_stops_with == "cancel":
            stopped = cancel(client, KEY_A, request_id)
            assert stopped.status_code == 200 and stopped.json()["cancelled"] is True
        else:
            assert abort(channel, KEY_A, request_id) is grpc.StatusCode.OK
        assert ending() == ("request_cancelled" if made_over == "http" else "CANCELLED")
    assert lookup(client, KEY_A, request_id).status_code == 404


def test_two_keys_may_use_one_request_id(client: httpx.Client, channel: grpc.Channel) -> None:
    """An id names a request within its key's own: B reusing A's id neither conflicts nor reaches A's."""
    with (
        http_stream(client, KEY_A, "shared-id", LONG) as a_ends,
        grpc_stream(channel, KEY_B, "shared-id", SHORT) as b_ends,
    ):
        assert lookup(client, KEY_B, "shared-id").json()["endpoint"] == GRPC_GENERATE
        assert cancel(client, KEY_B, "shared-id").status_code == 200
        assert b_ends() == "CANCELLED"
        assert lookup(client, KEY_A, "shared-id").json()["endpoint"] == "/generate"
        assert cancel(client, KEY_A, "shared-id").status_code == 200
        assert a_ends() == "request_cancelled"


def test_a_key_over_its_concurrency_limit_gets_429_on_every_protocol(
    client: httpx.Client, channel: grpc.Channel
) -> None:
    # A's first request runs, its second waits behind it (one sequence at a time): two unfinished.
    with (
        http_stream(client, KEY_A, "limit-1", LONG) as first,
        http_stream(client, KEY_A, "limit-2", SHORT) as second,
    ):
        refused = client.post("/generate", json=SHORT, headers=auth(KEY_A))
        assert refused.status_code == 429 and refused.headers["Retry-After"] == "1"
        assert refused.json()["error"]["type"] == "key_concurrency_limit"
        openai = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 4}, headers=auth(KEY_A))
        assert openai.status_code == 429 and openai.headers["Retry-After"] == "1"
        assert openai.json()["error"]["type"] == "rate_limit_error"
        assert openai.json()["error"]["code"] == "key_concurrency_limit"
        with pytest.raises(grpc.RpcError) as caught:
            raw_call(channel, "Score")(
                request_bytes("Score", {"prompt": "a b"}), metadata=grpc_auth(KEY_A), timeout=10
            )
        metadata = assert_status(caught.value, grpc.StatusCode.RESOURCE_EXHAUSTED)
        assert metadata["retry-after"] == "1" and metadata["pe-serve-error-type"] == "key_concurrency_limit"
        # Another key is not held back by A's limit: its request is queued (200, stream open).
        with http_stream(client, KEY_B, "limit-b", SHORT) as other:
            assert cancel(client, KEY_B, "limit-b").status_code == 200
            assert other() == "request_cancelled"
        assert cancel(client, KEY_A, "limit-2").status_code == 200
        assert cancel(client, KEY_A, "limit-1").status_code == 200
        assert (first(), second()) == ("request_cancelled", "request_cancelled")
    assert client.post("/generate", json=SHORT, headers=auth(KEY_A)).status_code == 200


def test_a_key_over_its_token_limit_gets_429_and_a_request_over_it_alone_422(
    client: httpx.Client, channel: grpc.Channel
) -> None:
    alone = client.post("/generate", json={**SHORT, "max_new_tokens": MAX_TOKENS}, headers=auth(KEY_B))
    assert alone.status_code == 422, alone.text
    with grpc_stream(channel, KEY_B, "tokens-1", LONG) as first:
        # ~402 tokens held; 100 more pass 500.
        more = {**SHORT, "max_new_tokens": 100}
        refused = client.post("/generate", json=more, headers=auth(KEY_B))
        assert refused.status_code == 429 and refused.headers["Retry-After"] == "1"
        assert refused.json()["error"]["type"] == "key_token_limit"
        with pytest.raises(grpc.RpcError) as caught:
            list(stream(channel, more, metadata=grpc_auth(KEY_B), timeout=10))
        metadata = assert_status(caught.value, grpc.StatusCode.RESOURCE_EXHAUSTED)
        assert metadata["retry-after"] == "1" and metadata["pe-serve-error-type"] == "key_token_limit"
        # Within the limit, B's smaller request is taken (queued behind the first).
        with http_stream(client, KEY_B, "tokens-2", SHORT) as small:
            assert cancel(client, KEY_B, "tokens-2").status_code == 200
            assert small() == "request_cancelled"
        assert abort(channel, KEY_B, "tokens-1") is grpc.StatusCode.OK
        assert first() == "CANCELLED"


def test_keys_from_the_file_stay_out_of_the_process_list(server: LiveServer, client: httpx.Client) -> None:
    command_line = Path(f"/proc/{server.process.pid}/cmdline").read_bytes()
    assert b"--api-key-file" in command_line
    assert KEY_A.encode() not in command_line and KEY_B.encode() not in command_line
    for key in (KEY_A, KEY_B, KEY_C):
        assert client.get("/models", headers=auth(key)).status_code == 200
    assert client.get("/models", headers=auth("# tenants")).status_code == 401
