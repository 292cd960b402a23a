"""API keys, the bounded queue (429 + Retry-After), and disconnects freeing batch slots."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import openai
import pytest

from service.api.routes import playground
from tests.live_server import LiveServer, live_server
from tests.service.api.conftest import BASE_OPTIONS, SERVER_ENV
from tests.service.api.helpers import assert_error_shape, metric_value, sse_data, wait_for

API_KEY = "s3cret-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
LONG_CONTEXT = 8192
# Greedy and long: runs until cancelled, so the tests decide when a batch slot frees up.
ENDLESS = {"prompt": "a", "max_new_tokens": LONG_CONTEXT - 16, "temperature": 0}
SHORT = {"prompt": "a", "max_new_tokens": 2}


@pytest.fixture(scope="module")
def guarded_server(tiny_zoo: list[Path]) -> Iterator[LiveServer]:
    """One model, one batch slot, one queue place, and an API key."""
    options = {
        **BASE_OPTIONS,
        "max_context": LONG_CONTEXT,
        "max_batch_size": 1,
        "max_queue": 1,
        "api_key": API_KEY,
    }
    with live_server(tiny_zoo[:1], options=options, env=SERVER_ENV) as running:
        yield running


@pytest.fixture
def authed(guarded_server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=guarded_server.base_url, headers=AUTH, timeout=60.0) as http:
        yield http


def batch_size(client: httpx.Client) -> float:
    return metric_value(client, "pe_serve_batch_size")


def queue_depth(client: httpx.Client) -> float:
    return metric_value(client, "pe_serve_queue_depth")


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/generate", SHORT),
        ("POST", "/score", {"prompt": "ab"}),
        ("POST", "/inspect", {"length": 4}),
        ("GET", "/models", None),
        ("POST", "/tokenize", {"prompt": "ab"}),
        ("POST", "/detokenize", {"tokens": [97]}),
        ("GET", "/tokenizer_info", None),
    ],
)
@pytest.mark.parametrize("authorization", [None, "Bearer wrong-key", f"Basic {API_KEY}", "Bearer"])
def test_inference_routes_need_the_key(
    guarded_server: LiveServer, method: str, path: str, body: object, authorization: str | None
) -> None:
    headers = {"Authorization": authorization} if authorization else {}
    response = httpx.request(method, guarded_server.url(path), json=body, headers=headers)
    assert_error_shape(response, 401, None)
    assert response.headers["WWW-Authenticate"].startswith("Bearer")


def test_the_right_key_opens_every_route(authed: httpx.Client) -> None:
    assert authed.get("/models").status_code == 200
    assert authed.post("/generate", json=SHORT).status_code == 200
    assert authed.post("/score", json={"prompt": "ab"}).status_code == 200
    assert authed.post("/inspect", json={"length": 4}).status_code == 200


@pytest.mark.parametrize("path", ["/healthz", "/readyz", "/metrics"])
def test_operational_routes_stay_open(guarded_server: LiveServer, path: str) -> None:
    assert httpx.get(guarded_server.url(path)).status_code == 200


def test_the_playground_page_and_its_assets_stay_open(
    guarded_server: LiveServer, authed: httpx.Client
) -> None:
    """A browser cannot send the key with a page load: the page asks for it and sends it itself.

    Only the files that exist are open, so the key still guards every other path.
    """
    paths = playground.public_paths()
    assert "/playground/static/js/main.js" in paths
    for path in paths:
        assert httpx.get(guarded_server.url(path)).status_code == 200, path
    missing = "/playground/static/missing.js"
    assert_error_shape(httpx.get(guarded_server.url(missing)), 401, None)
    assert_error_shape(authed.get(missing), 404, None)


def test_full_queue_answers_429_with_retry_after(authed: httpx.Client) -> None:
    with authed.stream("POST", "/generate", json={**ENDLESS, "stream": True}) as running:
        events = sse_data(running)  # kept referenced: dropping the iterator would close the stream
        assert "token" in next(events)
        with ThreadPoolExecutor(max_workers=1) as pool:
            queued = pool.submit(authed.post, "/generate", json=SHORT)
            wait_for(lambda: queue_depth(authed) == 1, "the second request to queue")
            rejected = authed.post("/generate", json=SHORT)
            assert_error_shape(rejected, 429)
            assert int(rejected.headers["Retry-After"]) >= 1
            running.close()
            assert queued.result().status_code == 200


def test_disconnect_mid_stream_frees_the_slot(authed: httpx.Client) -> None:
    wait_for(lambda: batch_size(authed) == 0, "an idle batch")
    with authed.stream("POST", "/generate", json={**ENDLESS, "stream": True}) as running:
        events = sse_data(running)
        first, second = next(events), next(events)
        assert {"token", "text"} <= set(first) and {"token", "text"} <= set(second)
        assert batch_size(authed) == 1
    wait_for(lambda: batch_size(authed) == 0, "the cancelled stream to leave the batch")
    assert authed.post("/generate", json=SHORT).status_code == 200


def test_disconnect_while_waiting_for_json_frees_the_slot(
    authed: httpx.Client, guarded_server: LiveServer
) -> None:
    wait_for(lambda: batch_size(authed) == 0, "an idle batch")
    address = urlsplit(guarded_server.base_url)
    payload = json.dumps(ENDLESS).encode()
    head = (
        f"POST /generate HTTP/1.1\r\nHost: {address.netloc}\r\nAuthorization: Bearer {API_KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    ).encode()
    with socket.create_connection((address.hostname, address.port)) as raw:
        raw.sendall(head + payload)
        wait_for(lambda: batch_size(authed) == 1, "the request to join the batch")
    wait_for(lambda: batch_size(authed) == 0, "the abandoned request to leave the batch")


def openai_client(server: LiveServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url("/v1"), api_key=key, max_retries=0, timeout=60.0)


def test_openai_routes_need_the_key(guarded_server: LiveServer) -> None:
    with openai_client(guarded_server, "wrong-key") as client:
        with pytest.raises(openai.AuthenticationError) as raised:
            client.models.list()
        assert raised.value.status_code == 401
        with pytest.raises(openai.AuthenticationError):
            client.completions.create(model="tiny-rope", prompt="a", max_tokens=2)
    with openai_client(guarded_server, API_KEY) as client:
        assert [model.id for model in client.models.list()] == ["tiny-rope"]
        assert client.completions.create(model="tiny-rope", prompt="a", max_tokens=2).choices


def test_closing_an_openai_stream_frees_the_slot(authed: httpx.Client, guarded_server: LiveServer) -> None:
    wait_for(lambda: batch_size(authed) == 0, "an idle batch")
    with openai_client(guarded_server, API_KEY) as client:
        stream = client.completions.create(
            model="tiny-rope", prompt="a", max_tokens=LONG_CONTEXT - 16, temperature=0, stream=True
        )
        chunks = iter(stream)
        next(chunks), next(chunks)
        assert batch_size(authed) == 1
        stream.close()
    wait_for(lambda: batch_size(authed) == 0, "the cancelled stream to leave the batch")
    assert authed.post("/generate", json=SHORT).status_code == 200
