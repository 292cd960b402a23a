"""An in-process stand-in for the server, for lab tests that need to see every body sent.

Byte-level like the zoo (token = byte, BOS 256), so a prompt's token ids decode back to its text;
with `chat=True` it has a chat template, rendered as `<user>...<assistant>`, which the zoo cannot
show. `/generate` answers with `answer(prompt_text)`. Every request is kept in `sent`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from pe_client import AsyncPEClient

from tests.clients.bodies import GENERATION

BOS = 256
MODEL = "fake-rope"


@dataclass
class FakeLabServer:
    max_context: int = 4096
    chat: bool = False
    answer: Callable[[str], str] = lambda _: ""
    sent: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def client(self) -> AsyncPEClient:
        """An async client whose requests this fake answers (enter it in the test's event loop)."""
        return AsyncPEClient(
            "http://fake", http_client=httpx.AsyncClient(transport=httpx.MockTransport(self))
        )

    def bodies(self, path: str) -> list[dict[str, Any]]:
        return [body for sent_path, body in self.sent if sent_path == path]

    def render(self, body: dict[str, Any]) -> str:
        """The text a /tokenize body stands for: its prompt, or its one message in the template."""
        if "messages" in body:
            return f"<user>{body['messages'][0]['content']}<assistant>"
        prompt: str = body["prompt"]
        return prompt

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else {}
        self.sent.append((request.url.path, body))
        if request.url.path == "/models":
            return httpx.Response(200, json={"models": [self._card()]})
        if request.url.path == "/tokenizer_info":
            return httpx.Response(
                200,
                json={
                    "model": MODEL,
                    "bos_token_id": BOS,
                    "eos_token_id": BOS + 1,
                    "chat_template": "{{ messages }}" if self.chat else None,
                    "model_max_length": self.max_context,
                },
            )
        if request.url.path == "/tokenize":
            return httpx.Response(200, json={"tokens": [BOS, *self.render(body).encode()]})
        if request.url.path == "/generate":
            prompt = bytes(token for token in body["tokens"] if token < BOS).decode()
            return httpx.Response(200, json={**GENERATION, "model": MODEL, "text": self.answer(prompt)})
        return httpx.Response(
            404, json={"error": {"type": "not_found", "message": "no route", "param": None}}
        )

    def _card(self) -> dict[str, Any]:
        return {
            "name": MODEL,
            "scheme": "rope",
            "native_context": 256,
            "max_context": self.max_context,
            "supported_scalings": ["none", "linear", "ntk", "dynamic", "yarn", "llama3", "longrope"],
            "supported_attention": ["standard", "self_extend", "rerope", "leaky_rerope", "dca", "streaming"],
            "parameters": 1000,
            "device": "cpu",
            "dtype": "float32",
            "backend": "eager",
            "weights": "float",
        }
