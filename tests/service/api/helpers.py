"""Small HTTP helpers shared by the API tests: SSE parsing, metric scraping, polling."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import jsonschema

DONE = "[DONE]"
POLL_TIMEOUT_S = 60.0
# `assert_error_shape(..., param=ANY_PARAM)`: the field is named, but which one is not asserted.
ANY_PARAM = object()


def sse_data(response: httpx.Response) -> Iterator[Any]:
    """The `data:` payloads of an event stream as they arrive: JSON objects, and `[DONE]` as a string."""
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line.removeprefix("data: ")
            yield payload if payload == DONE else json.loads(payload)


def metric_value(client: httpx.Client, name: str, labels: str = "") -> float:
    """One sample from /metrics, e.g. `metric_value(client, "pe_serve_batch_size")`; 0 if absent."""
    text = client.get("/metrics").text
    pattern = re.compile(rf"^{re.escape(name)}{re.escape(labels)}\s+(\S+)$", re.MULTILINE)
    match = pattern.search(text)
    return float(match.group(1)) if match else 0.0


def metric_sum(client: httpx.Client, name: str, label_filter: str = "") -> float:
    """Sum of every sample of `name` whose label set contains `label_filter`."""
    total = 0.0
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + "{") and label_filter in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_for(condition: Callable[[], bool], what: str, timeout: float = POLL_TIMEOUT_S) -> None:
    """Poll until `condition()` holds; the timeout only bounds a hang, it is not a timing assertion."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def assert_error_shape(response: httpx.Response, status: int, param: object = ANY_PARAM) -> dict[str, Any]:
    """The SPEC's error body: `{"error": {"type", "message", "param"}}`, no stack trace; returns it."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"type", "message", "param"}, error
    assert isinstance(error["type"], str) and error["type"]
    assert isinstance(error["message"], str) and error["message"]
    assert "Traceback" not in response.text and ".py" not in response.text
    if param is not ANY_PARAM:
        assert error["param"] == param, error
    return dict(error)


def assert_stream_matches_openapi(client: httpx.Client, path: str, body: dict[str, Any]) -> None:
    """Stream `body` (with usage) from `path`: every JSON event must validate against the event
    schema `/openapi.json` documents for that route's 200 `text/event-stream`, then `[DONE]`."""
    openapi = client.get("/openapi.json").json()
    documented = openapi["paths"][path]["post"]["responses"]["200"]["content"]["text/event-stream"]["schema"]
    (json_data,) = [
        choice
        for choice in documented["properties"]["data"]["anyOf"]
        if choice.get("contentMediaType") == "application/json"
    ]
    schema = {**json_data["contentSchema"], "components": openapi["components"]}
    request = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", path, json=request) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) > 3
    for event in events[:-1]:
        jsonschema.validate(json.loads(event), schema)
