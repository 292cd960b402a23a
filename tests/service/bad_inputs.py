"""The battery of bad requests, one table for both protocols.

Each case is an HTTP request with its expected status and field; every case HTTP answers with 422
or 404 also carries its gRPC twin (see `BadRequest`), so tests/service/api/test_bad_requests.py
and tests/service/grpc/test_bad_requests.py cannot drift apart.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from pe_client.grpc._codec import request_message

from service.grpc_api import pe_serve_pb2 as pb
from tests.service import wire
from tests.service.api.conftest import MAX_CONTEXT, NATIVE_CONTEXT, ROTARY_FREQUENCIES
from tests.service.api.helpers import ANY_PARAM

GOOD: dict[str, Any] = {"prompt": "def f():", "max_new_tokens": 2}
GOOD_WIRE = pb.GenerateRequest(prompt="def f():", max_new_tokens=2).SerializeToString()
JSON_HEADERS = {"Content-Type": "application/json"}
CHUNK_BYTES = 64 * 1024
GRPC_TWIN_STATUSES = frozenset({404, 422})
# `grpc_param` default: the twin names the same field as the HTTP case.
SAME_PARAM = object()

ONE_MIB = 1 << 20


@dataclass(frozen=True)
class BadRequest:
    """One case: a body merged into GOOD (or raw bytes), where it goes, and the expected answer.

    Its gRPC twin (cases answered with 422 or 404) is, by default, the same payload as a protobuf
    message; `grpc_body` replaces the payload when the JSON is raw text (NaN, say), `grpc_wire`
    gives the message's bytes when no message object can carry the mistake (a string where an
    integer goes is a wrong wire type), and `grpc_param` the field named when the wire names it
    otherwise (an unknown field has a number, not a name). `no_grpc_twin` says why a case has
    none: what it gets wrong exists only in HTTP.
    """

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
    grpc_body: dict[str, Any] | None = None
    grpc_wire: bytes | None = None
    grpc_param: object = SAME_PARAM
    no_grpc_twin: str = ""

    def payload(self) -> dict[str, Any]:
        return {key: value for key, value in {**GOOD, **self.changes}.items() if key not in self.drop}

    def body(self) -> bytes:
        if self.raw is not None:
            return self.raw
        return json.dumps(self.payload()).encode()

    @property
    def has_grpc_twin(self) -> bool:
        return self.status in GRPC_TWIN_STATUSES and not self.no_grpc_twin

    def grpc_method(self) -> str:
        return "Score" if self.path == "/score" else "Generate"

    def grpc_request(self) -> bytes:
        """The twin's serialized request; raises TypeError/ValueError if a message cannot carry it."""
        if self.grpc_wire is not None:
            return self.grpc_wire
        message_type = pb.ScoreRequest if self.path == "/score" else pb.GenerateRequest
        body = self.grpc_body if self.grpc_body is not None else self.payload()
        return request_message(message_type, body).SerializeToString()

    def expected_grpc_param(self) -> object:
        return self.param if self.grpc_param is SAME_PARAM else self.grpc_param

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
    BadRequest(
        "max_new_tokens as string",
        422,
        "max_new_tokens",
        {"max_new_tokens": "8"},
        grpc_wire=GOOD_WIRE + wire.length_delimited(6, b"8"),
    ),
    BadRequest(
        "max_new_tokens as float",
        422,
        "max_new_tokens",
        {"max_new_tokens": 1.5},
        grpc_wire=GOOD_WIRE + wire.double(6, 1.5),
    ),
    BadRequest(
        "temperature as string",
        422,
        "temperature",
        {"temperature": "hot"},
        grpc_wire=GOOD_WIRE + wire.length_delimited(7, b"hot"),
    ),
    BadRequest("top_k as float", 422, "top_k", {"top_k": 2.5}, grpc_wire=GOOD_WIRE + wire.double(8, 2.5)),
    BadRequest(
        "stream as string", 422, "stream", {"stream": "yes"}, no_grpc_twin="gRPC's Generate always streams"
    ),
    BadRequest(
        "logprobs as integer",
        422,
        "logprobs",
        {"logprobs": 1},
        grpc_wire=GOOD_WIRE + wire.length_delimited(12, b"1"),
    ),
    BadRequest(
        "prompt as number", 422, "prompt", {"prompt": 123}, grpc_wire=GOOD_WIRE + wire.varint_field(1, 123)
    ),
    BadRequest(
        "tokens as strings",
        422,
        "tokens.0",
        {"tokens": ["a"]},
        drop=("prompt",),
        grpc_wire=wire.fixed32(2, 97),
        grpc_param="tokens",
    ),
    BadRequest(
        "stop as string", 422, "stop", {"stop": "\n"}, grpc_wire=GOOD_WIRE + wire.varint_field(11, 10)
    ),
    BadRequest("model as number", 422, "model", {"model": 5}, grpc_wire=GOOD_WIRE + wire.varint_field(3, 5)),
    BadRequest(
        "pe_scaling as string",
        422,
        "pe_scaling",
        {"pe_scaling": "yarn"},
        grpc_wire=GOOD_WIRE + wire.varint_field(5, 1),
    ),
    # Out of range and non-finite numbers.
    BadRequest("max_new_tokens zero", 422, "max_new_tokens", {"max_new_tokens": 0}),
    BadRequest("max_new_tokens negative", 422, "max_new_tokens", {"max_new_tokens": -1}),
    BadRequest("max_new_tokens over max_context", 422, "max_new_tokens", {"max_new_tokens": MAX_CONTEXT + 1}),
    BadRequest("temperature negative", 422, "temperature", {"temperature": -0.1}),
    BadRequest(
        "temperature NaN",
        422,
        "temperature",
        raw=raw_json('{"prompt": "a", "temperature": NaN}'),
        grpc_body={"prompt": "a", "temperature": math.nan},
    ),
    BadRequest(
        "temperature Infinity",
        422,
        "temperature",
        raw=raw_json('{"prompt": "a", "temperature": Infinity}'),
        grpc_body={"prompt": "a", "temperature": math.inf},
    ),
    BadRequest("top_p zero", 422, "top_p", {"top_p": 0.0}),
    BadRequest("top_p above one", 422, "top_p", {"top_p": 1.5}),
    BadRequest("top_k negative", 422, "top_k", {"top_k": -1}),
    BadRequest("seed negative", 422, "seed", {"seed": -1}),
    BadRequest(
        "seed 2**63", 422, "seed", {"seed": 2**63}, grpc_wire=GOOD_WIRE + wire.varint_field(10, 2**63)
    ),
    BadRequest("nine stop strings", 422, "stop", {"stop": [str(i) for i in range(9)]}),
    BadRequest("stop string too long", 422, "stop.0", {"stop": ["x" * 65]}),
    BadRequest("empty stop string", 422, "stop.0", {"stop": [""]}),
    BadRequest("factor below one", 422, "pe_scaling.factor", scaling(type="linear", factor=0.5)),
    BadRequest(
        "factor NaN",
        422,
        "pe_scaling.factor",
        raw=raw_json('{"prompt": "a", "pe_scaling": {"type": "ntk", "factor": NaN}}'),
        grpc_body={"prompt": "a", "pe_scaling": {"type": "ntk", "factor": math.nan}},
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
    BadRequest(
        "unknown field",
        422,
        "foo",
        {"foo": 1},
        grpc_wire=GOOD_WIRE + wire.varint_field(99, 1),
        grpc_param="99",
    ),
    BadRequest(
        "unknown scaling field",
        422,
        "pe_scaling.beta",
        scaling(type="linear", factor=2.0, beta=1),
        grpc_wire=GOOD_WIRE + wire.scaling(2, wire.double(1, 2.0) + wire.varint_field(9, 1)),
        grpc_param="pe_scaling.9",
    ),
    BadRequest(
        "field of another scaling type",
        422,
        "pe_scaling.beta_fast",
        scaling(type="ntk", factor=2.0, beta_fast=32.0),
        grpc_wire=GOOD_WIRE + wire.scaling(3, wire.double(1, 2.0) + wire.double(3, 32.0)),
        grpc_param="pe_scaling.3",
    ),
    BadRequest(
        "unknown scaling type",
        422,
        "pe_scaling.type",
        scaling(type="warp", factor=2.0),
        grpc_wire=GOOD_WIRE + wire.scaling(8, wire.double(1, 2.0)),
    ),
    BadRequest(
        "scaling without type",
        422,
        "pe_scaling.type",
        scaling(factor=2.0),
        grpc_body={**GOOD, "pe_scaling": pb.PEScaling()},
    ),
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
    BadRequest(
        "empty tokens",
        422,
        "tokens",
        {"tokens": []},
        drop=("prompt",),
        grpc_param="prompt",  # an empty repeated field is an absent one: neither prompt nor tokens
    ),
    BadRequest("token id out of vocabulary", 422, "tokens.1", {"tokens": [1, 258]}, drop=("prompt",)),
    BadRequest("negative token id", 422, "tokens.0", {"tokens": [-1]}, drop=("prompt",)),
    BadRequest(
        "lone surrogate in prompt",
        422,
        "prompt",
        raw=raw_json('{"prompt": "\\ud800"}'),
        grpc_wire=wire.length_delimited(1, b"\xed\xa0\x80"),
        grpc_param=None,  # the message does not parse (proto3 strings are UTF-8)
    ),
    # Bodies that are not a JSON object.
    BadRequest(
        "invalid UTF-8 bytes",
        422,
        None,
        raw=b'{"prompt": "\xff\xfe"}',
        grpc_wire=wire.length_delimited(1, b"\xff\xfe"),
    ),
    BadRequest("malformed JSON", 422, None, raw=b'{"prompt": "a",', grpc_wire=GOOD_WIRE[:-1]),
    BadRequest("JSON array", 422, ANY_PARAM, raw=b'["a"]', grpc_wire=b"\xff"),
    BadRequest("empty body", 422, ANY_PARAM, raw=b"", grpc_wire=b""),
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
    # The sampling controls, each out of range.
    BadRequest("min_p above 1", 422, "min_p", {"min_p": 1.5}),
    BadRequest("negative min_p", 422, "min_p", {"min_p": -0.1}),
    BadRequest("repetition_penalty 0", 422, "repetition_penalty", {"repetition_penalty": 0}),
    BadRequest("presence_penalty above 2", 422, "presence_penalty", {"presence_penalty": 2.5}),
    BadRequest("frequency_penalty below -2", 422, "frequency_penalty", {"frequency_penalty": -3}),
    BadRequest(
        "ignore_eos not a bool",
        422,
        "ignore_eos",
        {"ignore_eos": "yes"},
        grpc_wire=GOOD_WIRE + wire.length_delimited(18, b"yes"),
    ),
    BadRequest("negative min_tokens", 422, "min_tokens", {"min_tokens": -1}),
    BadRequest("min_tokens over max_new_tokens", 422, "min_tokens", {"min_tokens": 3}),
    BadRequest("stop token id out of vocabulary", 422, "stop_token_ids.0", {"stop_token_ids": [300]}),
    BadRequest("negative stop token id", 422, "stop_token_ids.0", {"stop_token_ids": [-1]}),
    BadRequest("top_logprobs above 20", 422, "top_logprobs", {"top_logprobs": 21}),
    # Scoring and routing.
    BadRequest(
        "score one token", 422, "tokens", {"tokens": [5]}, drop=("prompt", "max_new_tokens"), path="/score"
    ),
    BadRequest(
        "score top_logprobs above 20",
        422,
        "top_logprobs",
        {"tokens": [5, 6], "top_logprobs": 21},
        drop=("prompt", "max_new_tokens"),
        path="/score",
    ),
    BadRequest(
        "score with generation field",
        422,
        "max_new_tokens",
        path="/score",
        grpc_wire=GOOD_WIRE,  # max_new_tokens (6) is no field of ScoreRequest
        grpc_param="6",
    ),
    BadRequest(
        "score with bad factor",
        422,
        "pe_scaling.factor",
        scaling(type="linear", factor="x"),
        drop=("max_new_tokens",),
        path="/score",
        grpc_wire=wire.length_delimited(1, b"a") + wire.scaling(2, wire.length_delimited(1, b"x")),
    ),
    BadRequest("GET on /generate", 405, None, method="GET"),
    BadRequest(
        "unknown path",
        404,
        None,
        path="/generate/v2",
        no_grpc_twin="HTTP routing; gRPC answers an unknown method with UNIMPLEMENTED",
    ),
]
