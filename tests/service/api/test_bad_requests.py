"""A battery of bad requests: each gets the right 4xx in the SPEC's error shape, and the server lives on."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from tests.service.api.conftest import MAX_CONTEXT, NATIVE_CONTEXT, ROTARY_FREQUENCIES
from tests.service.api.helpers import ANY_PARAM, assert_error_shape

ONE_MIB = 1 << 20
GOOD: dict[str, Any] = {"prompt": "def f():", "max_new_tokens": 2}
JSON_HEADERS = {"Content-Type": "application/json"}
CHUNK_BYTES = 64 * 1024


@dataclass(frozen=True)
class BadRequest:
    """One case: a body merged into GOOD (or raw bytes), where it goes, and the expected answer."""

    name: str
    status: int
    param: object = ANY_PARAM
    changes: dict[str, Any] = field(default_factory=dict)
    drop: tuple[str, ...] = ()
    raw: bytes | None = None
    headers: dict[str, str] = field(default_factory=lambda: dict(JSON_HEADERS))
    method: str = "POST"
    path: str = "/generate"
    chunked: bool = False

    def body(self) -> bytes:
        if self.raw is not None:
            return self.raw
        payload = {key: value for key, value in {**GOOD, **self.changes}.items() if key not in self.drop}
        return json.dumps(payload).encode()

    def send(self, client: httpx.Client) -> httpx.Response:
        """An iterator body makes httpx send `Transfer-Encoding: chunked` with no Content-Length."""
        data = self.body()
        content: bytes | Iterator[bytes] = data
        if self.chunked:
            content = (data[start : start + CHUNK_BYTES] for start in range(0, len(data), CHUNK_BYTES))
        return client.request(self.method, self.path, content=content, headers=self.headers)


def scaling(**fields: Any) -> dict[str, Any]:
    return {"pe_scaling": fields}


def raw_json(text: str) -> bytes:
    return text.encode()


HUGE_PROMPT = json.dumps({"prompt": "a" * (ONE_MIB + 10)}).encode()

CASES = [
    # Wrong types (strict JSON types: no "8" for 8, no 1.5 for an integer, no 1 for a boolean).
    BadRequest("max_new_tokens as string", 422, "max_new_tokens", {"max_new_tokens": "8"}),
    BadRequest("max_new_tokens as float", 422, "max_new_tokens", {"max_new_tokens": 1.5}),
    BadRequest("temperature as string", 422, "temperature", {"temperature": "hot"}),
    BadRequest("top_k as float", 422, "top_k", {"top_k": 2.5}),
    BadRequest("stream as string", 422, "stream", {"stream": "yes"}),
    BadRequest("logprobs as integer", 422, "logprobs", {"logprobs": 1}),
    BadRequest("prompt as number", 422, "prompt", {"prompt": 123}),
    BadRequest("tokens as strings", 422, "tokens.0", {"tokens": ["a"]}, drop=("prompt",)),
    BadRequest("stop as string", 422, "stop", {"stop": "\n"}),
    BadRequest("model as number", 422, "model", {"model": 5}),
    BadRequest("pe_scaling as string", 422, "pe_scaling", {"pe_scaling": "yarn"}),
    # Out of range and non-finite numbers.
    BadRequest("max_new_tokens zero", 422, "max_new_tokens", {"max_new_tokens": 0}),
    BadRequest("max_new_tokens negative", 422, "max_new_tokens", {"max_new_tokens": -1}),
    BadRequest("max_new_tokens over max_context", 422, "max_new_tokens", {"max_new_tokens": MAX_CONTEXT + 1}),
    BadRequest("temperature negative", 422, "temperature", {"temperature": -0.1}),
    BadRequest("temperature NaN", 422, "temperature", raw=raw_json('{"prompt": "a", "temperature": NaN}')),
    BadRequest(
        "temperature Infinity", 422, "temperature", raw=raw_json('{"prompt": "a", "temperature": Infinity}')
    ),
    BadRequest("top_p zero", 422, "top_p", {"top_p": 0.0}),
    BadRequest("top_p above one", 422, "top_p", {"top_p": 1.5}),
    BadRequest("top_k negative", 422, "top_k", {"top_k": -1}),
    BadRequest("seed negative", 422, "seed", {"seed": -1}),
    BadRequest("seed 2**63", 422, "seed", {"seed": 2**63}),
    BadRequest("nine stop strings", 422, "stop", {"stop": [str(i) for i in range(9)]}),
    BadRequest("stop string too long", 422, "stop.0", {"stop": ["x" * 65]}),
    BadRequest("empty stop string", 422, "stop.0", {"stop": [""]}),
    BadRequest("factor below one", 422, "pe_scaling.factor", scaling(type="linear", factor=0.5)),
    BadRequest(
        "factor NaN",
        422,
        "pe_scaling.factor",
        raw=raw_json('{"prompt": "a", "pe_scaling": {"type": "ntk", "factor": NaN}}'),
    ),
    BadRequest("factor missing", 422, "pe_scaling.factor", scaling(type="yarn")),
    BadRequest(
        "beta_fast <= beta_slow",
        422,
        "pe_scaling.beta_fast",
        scaling(type="yarn", factor=2.0, beta_fast=1.0, beta_slow=2.0),
    ),
    BadRequest(
        "high_freq <= low_freq",
        422,
        "pe_scaling.high_freq_factor",
        scaling(type="llama3", factor=8.0, low_freq_factor=4.0, high_freq_factor=1.0),
    ),
    BadRequest(
        "longrope lists differ",
        422,
        "pe_scaling.long_factor",
        scaling(type="longrope", short_factor=[1.0] * 8, long_factor=[1.0] * 4),
    ),
    # Fields in range whose derived quantities are not (found by fuzzing: a 500 before).
    BadRequest(
        "yarn subnormal beta_slow",
        422,
        "pe_scaling.beta_slow",
        scaling(type="yarn", factor=1.0, beta_slow=5e-324),
    ),
    BadRequest(
        "score yarn subnormal beta_slow",
        422,
        "pe_scaling.beta_slow",
        scaling(type="yarn", factor=1.0, beta_slow=5e-324),
        drop=("max_new_tokens",),
        path="/score",
    ),
    BadRequest(
        "yarn subnormal attention_factor",
        422,
        "pe_scaling.attention_factor",
        scaling(type="yarn", factor=2.0, attention_factor=5e-324),
    ),
    BadRequest(
        "longrope subnormal short factors",
        422,
        "pe_scaling.short_factor",
        scaling(
            type="longrope",
            short_factor=[5e-324] * ROTARY_FREQUENCIES,
            long_factor=[1.0] * ROTARY_FREQUENCIES,
        ),
    ),
    BadRequest(
        "longrope attention factor at original length 1",
        422,
        "pe_scaling.original_max_position_embeddings",
        scaling(
            type="longrope",
            factor=2.0,
            original_max_position_embeddings=1,
            short_factor=[1.0] * ROTARY_FREQUENCIES,
            long_factor=[1.0] * ROTARY_FREQUENCIES,
        ),
    ),
    BadRequest(
        "longrope wrong list length",
        422,
        ANY_PARAM,
        scaling(type="longrope", short_factor=[1.0] * 3, long_factor=[1.0] * 3),
    ),
    # Unknown names.
    BadRequest("unknown field", 422, "foo", {"foo": 1}),
    BadRequest("unknown scaling field", 422, "pe_scaling.beta", scaling(type="linear", factor=2.0, beta=1)),
    BadRequest(
        "field of another scaling type",
        422,
        "pe_scaling.beta_fast",
        scaling(type="ntk", factor=2.0, beta_fast=32.0),
    ),
    BadRequest("unknown scaling type", 422, "pe_scaling.type", scaling(type="warp", factor=2.0)),
    BadRequest("scaling without type", 422, "pe_scaling.type", scaling(factor=2.0)),
    BadRequest("unknown scheme", 422, "pe", {"pe": "fourier"}),
    BadRequest("unknown model", 404, "model", {"model": "no-such-model"}),
    BadRequest("model and pe disagree", 422, ANY_PARAM, {"model": "tiny-rope", "pe": "alibi"}),
    BadRequest(
        "scaling on a scheme without RoPE",
        422,
        "pe_scaling.type",
        {"pe": "alibi", **scaling(type="yarn", factor=4.0)},
    ),
    # Prompt and tokens.
    BadRequest("empty prompt", 422, "prompt", {"prompt": ""}),
    BadRequest("prompt over max_context", 422, "prompt", {"prompt": "a" * (MAX_CONTEXT + 1)}),
    BadRequest(
        "tokens over max_context", 422, "tokens", {"tokens": [5] * (MAX_CONTEXT + 1)}, drop=("prompt",)
    ),
    BadRequest(
        "score prompt over max_context",
        422,
        "prompt",
        {"prompt": "a" * (ONE_MIB - 100)},
        drop=("max_new_tokens",),
        path="/score",
    ),
    BadRequest(
        "prompt + max_new_tokens over max_context",
        422,
        ANY_PARAM,
        {"prompt": "a" * 400, "max_new_tokens": 200},
    ),
    BadRequest(
        "learned positions past the table",
        422,
        ANY_PARAM,
        {"pe": "learned", "prompt": "a" * (NATIVE_CONTEXT + 8)},
    ),
    BadRequest("both prompt and tokens", 422, "prompt", {"tokens": [1, 2]}),
    BadRequest("neither prompt nor tokens", 422, "prompt", drop=("prompt",)),
    BadRequest("empty tokens", 422, "tokens", {"tokens": []}, drop=("prompt",)),
    BadRequest("token id out of vocabulary", 422, "tokens.1", {"tokens": [1, 258]}, drop=("prompt",)),
    BadRequest("negative token id", 422, "tokens.0", {"tokens": [-1]}, drop=("prompt",)),
    BadRequest("lone surrogate in prompt", 422, "prompt", raw=raw_json('{"prompt": "\\ud800"}')),
    # Bodies that are not a JSON object.
    BadRequest("invalid UTF-8 bytes", 422, None, raw=b'{"prompt": "\xff\xfe"}'),
    BadRequest("malformed JSON", 422, None, raw=b'{"prompt": "a",'),
    BadRequest("JSON array", 422, ANY_PARAM, raw=b'["a"]'),
    BadRequest("empty body", 422, ANY_PARAM, raw=b""),
    BadRequest("text/plain content type", 415, None, headers={"Content-Type": "text/plain"}),
    BadRequest(
        "form content type",
        415,
        None,
        raw=b"prompt=a",
        headers={"Content-Type": "application/x-www-form-urlencoded"},
    ),
    BadRequest("no content type", 415, None, headers={}),
    BadRequest("huge body", 413, None, raw=HUGE_PROMPT),
    BadRequest("huge chunked body", 413, None, raw=HUGE_PROMPT, chunked=True),
    # Scoring and routing.
    BadRequest(
        "score one token", 422, "tokens", {"tokens": [5]}, drop=("prompt", "max_new_tokens"), path="/score"
    ),
    BadRequest("score with generation field", 422, "max_new_tokens", path="/score"),
    BadRequest(
        "score with bad factor",
        422,
        "pe_scaling.factor",
        scaling(type="linear", factor="x"),
        drop=("max_new_tokens",),
        path="/score",
    ),
    BadRequest("GET on /generate", 405, None, method="GET"),
    BadRequest("unknown path", 404, None, path="/generate/v2"),
]


def test_the_battery_is_large_enough() -> None:
    assert len(CASES) >= 40
    assert len({case.name for case in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_bad_request_gets_the_right_status_and_error_shape(client: httpx.Client, case: BadRequest) -> None:
    assert_error_shape(case.send(client), case.status, case.param)


def test_server_stays_healthy_after_the_battery(client: httpx.Client) -> None:
    for case in CASES:
        case.send(client)
    assert client.get("/healthz").status_code == 200
    assert client.get("/readyz").status_code == 200
    response = client.post("/generate", json=GOOD)
    assert response.status_code == 200, response.text
    assert 'status="500"' not in client.get("/metrics").text
