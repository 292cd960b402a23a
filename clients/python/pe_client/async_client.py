"""The asyncio client: the same methods as `PEClient`, awaitable."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Self, Unpack
from urllib.parse import quote

import httpx

from pe_client._base import (
    DEFAULT_MAX_RETRIES,
    DEFAULT_TIMEOUT,
    BaseClient,
    build_body,
    connection_error,
    resumed_body,
    status_error,
)
from pe_client.errors import APIConnectionError, APIError
from pe_client.streaming import AsyncStream
from pe_client.tls import TLS, verify
from pe_client.types import (
    ChatMessage,
    GenerateParams,
    GenerateRequest,
    GenerateResponse,
    Health,
    ModelInfo,
    ModelList,
    ScoreParams,
    ScoreRequest,
    ScoreResponse,
    TokenizerInfo,
)


class AsyncPEClient(BaseClient):
    """Non-blocking client for pe-serve; see `PEClient` for the arguments."""

    def __init__(
        self,
        base_url: str | None = None,
        *,
        api_key: str | None = None,
        timeout: float | httpx.Timeout = DEFAULT_TIMEOUT,
        max_retries: int = DEFAULT_MAX_RETRIES,
        http_client: httpx.AsyncClient | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        tls: TLS | None = None,
    ) -> None:
        super().__init__(base_url=base_url, api_key=api_key, timeout=timeout, max_retries=max_retries)
        self._owns_http = http_client is None
        self._http = http_client if http_client is not None else httpx.AsyncClient(verify=verify(tls))
        self._sleep = sleep

    async def generate(
        self, request: GenerateRequest | None = None, /, **params: Unpack[GenerateParams]
    ) -> GenerateResponse:
        """Generate a completion and wait for all of it."""
        body = build_body(GenerateRequest, request, params, stream=False)
        return GenerateResponse.model_validate((await self._post("/generate", body)).json())

    def generate_stream(
        self, request: GenerateRequest | None = None, /, **params: Unpack[GenerateParams]
    ) -> AsyncStream:
        """Stream a completion; the request is sent when the stream is entered or iterated, and
        resumed if it is cut (see `PEClient.generate_stream`)."""
        body = build_body(GenerateRequest, request, params, stream=True)
        headers = self._headers()  # one request id for the call, resumes included
        return AsyncStream(
            lambda held: self._send(
                self._build_request(self._http, "POST", "/generate", resumed_body(body, held), headers),
                stream=True,
            ),
            self.retry_policy,
            self._sleep,
        )

    async def score(
        self, request: ScoreRequest | None = None, /, **params: Unpack[ScoreParams]
    ) -> ScoreResponse:
        """Log-probability of every token of a text given its prefix, and the perplexity."""
        body = build_body(ScoreRequest, request, params)
        return ScoreResponse.model_validate((await self._post("/score", body)).json())

    async def tokenize(
        self,
        prompt: str | None = None,
        *,
        messages: list[ChatMessage] | None = None,
        model: str | None = None,
    ) -> list[int]:
        """The token ids the server runs for `prompt` (BOS first, as for generation) or for `messages`
        rendered by the model's chat template with the assistant's turn opened."""
        body: dict[str, object] = {"model": model, "prompt": prompt}
        if messages is not None:
            body["messages"] = [message.model_dump() for message in messages]
        response = await self._post(
            "/tokenize", {key: value for key, value in body.items() if value is not None}
        )
        tokens: list[int] = response.json()["tokens"]
        return tokens

    async def tokenizer_info(self, model: str | None = None) -> TokenizerInfo:
        """A model's special tokens and chat template (the default model when none is named)."""
        path = "/tokenizer_info" if model is None else f"/tokenizer_info?model={quote(model)}"
        return TokenizerInfo.model_validate(
            (await self._send(self._build_request(self._http, "GET", path))).json()
        )

    async def models(self) -> list[ModelInfo]:
        """The resident models, in load order."""
        response = await self._send(self._build_request(self._http, "GET", "/models"))
        return ModelList.model_validate(response.json()).models

    async def health(self) -> Health:
        """Liveness and readiness right now: one attempt each, no retries (a probe must not wait)."""
        return Health(live=await self._probe("/healthz"), ready=await self._probe("/readyz"))

    async def close(self) -> None:
        if self._owns_http:
            await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def _post(self, path: str, body: object) -> httpx.Response:
        return await self._send(self._build_request(self._http, "POST", path, body))

    async def _probe(self, path: str) -> bool:
        response = await self._send_once(self._build_request(self._http, "GET", path), stream=False)
        if response.status_code in (200, 503):
            return response.status_code == 200
        raise status_error(response)

    async def _send_once(self, request: httpx.Request, *, stream: bool) -> httpx.Response:
        try:
            return await self._http.send(request, stream=stream)
        except httpx.TransportError as exc:
            raise connection_error(exc, request) from exc

    async def _send(self, request: httpx.Request, *, stream: bool = False) -> httpx.Response:
        """Send under the retry policy; a successful response, or the last attempt's error."""
        retries_taken = 0
        while True:
            error: APIError
            try:
                response = await self._send_once(request, stream=stream)
            except APIConnectionError as exc:
                error = exc
            else:
                if response.is_success:
                    return response
                await response.aread()
                error = status_error(response)
            await self._sleep(self.retry_policy.delay_or_raise(retries_taken, error))
            retries_taken += 1
