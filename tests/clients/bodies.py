"""Canned server bodies for the transport-level tests, shaped as the SPEC fixes them."""

from __future__ import annotations

import json

import httpx

PE_BLOCK = {
    "scheme": "rope",
    "scaling": None,
    "attention_factor": 1.0,
    "native_context": 256,
    "max_context": 1024,
}
TIMING = {"queue_ms": 0.1, "prefill_ms": 1.0, "decode_ms": 2.0}

GENERATION = {
    "id": "gen-1",
    "model": "zoo-rope",
    "text": "hi",
    "tokens": [104, 105],
    "logprobs": None,
    "finish_reason": "length",
    "usage": {"prompt_tokens": 3, "completion_tokens": 2},
    "pe": PE_BLOCK,
    "timing": TIMING,
}

STREAM_END = {key: GENERATION[key] for key in ("id", "model", "finish_reason", "usage", "pe", "timing")}

SCORE = {
    "model": "zoo-rope",
    "tokens": [1, 2],
    "token_logprobs": [None, -0.5],
    "total_logprob": -0.5,
    "perplexity": 1.6487,
    "num_tokens": 2,
}


def token_event(token: int) -> str:
    return json.dumps({"token": token, "text": chr(token)})


def sse(*payloads: str) -> httpx.Response:
    """An event-stream response with one `data:` event per payload."""
    content = "".join(f"data: {payload}\n\n" for payload in payloads).encode()
    return httpx.Response(200, content=content, headers={"content-type": "text/event-stream"})
