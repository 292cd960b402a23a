"""The SDK against a real pe-serve process: results, streams, early close, and every error a server sends.

Every test runs once per protocol (see conftest.py): the HTTP and gRPC clients must behave alike.
"""

from __future__ import annotations

import asyncio
import math
import signal
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
from pe_client import (
    APIConnectionError,
    APITimeoutError,
    AuthenticationError,
    GenerateParams,
    GenerateRequest,
    LinearScaling,
    NotFoundError,
    PayloadTooLargeError,
    PEClient,
    PEScaling,
    RateLimitError,
    ServiceUnavailableError,
    StreamEnd,
    StreamToken,
    UnprocessableEntityError,
    YarnScaling,
)
from pe_client.grpc import GrpcPEClient
from pe_client.types import Scheme

from tests.clients.conftest import (
    API_KEY,
    NATIVE_CONTEXT,
    SERVER_ENV,
    SERVER_OPTIONS,
    AsyncClient,
    ClientFactory,
    SyncClient,
    address,
)
from tests.live_server import LiveServer, free_port, start_server
from tests.service.api.helpers import metric_value, wait_for

PAST_NATIVE = "0123456789" * 8  # 80 bytes + BOS: past the tiny models' 64-token native context
# Greedy and far longer than any test waits for: runs until the client goes away.
ENDLESS = GenerateParams(prompt="a", max_new_tokens=4000, temperature=0.0)


def greedy(*, pe: Scheme | None = None, pe_scaling: PEScaling | None = None) -> GenerateParams:
    """A short deterministic generation past the native context, so scalings matter."""
    params = GenerateParams(prompt=PAST_NATIVE, max_new_tokens=12, temperature=0.0)
    if pe is not None:
        params["pe"] = pe
    if pe_scaling is not None:
        params["pe_scaling"] = pe_scaling
    return params


def running_requests(metrics_http: httpx.Client) -> float:
    return metric_value(metrics_http, "pe_serve_batch_size")


def server_is_idle(metrics_http: httpx.Client) -> bool:
    """Nothing running and nothing queued: a cancelled queued request may be admitted (and only then
    found cancelled) after the running one has left, so an empty batch alone is not enough."""
    return running_requests(metrics_http) == 0 and metric_value(metrics_http, "pe_serve_queue_depth") == 0


def test_models_lists_the_resident_models(client: SyncClient) -> None:
    models = client.models()
    assert [(model.name, model.scheme) for model in models] == [
        ("tiny-rope", "rope"),
        ("tiny-alibi", "alibi"),
    ]
    rope = models[0]
    assert rope.native_context == NATIVE_CONTEXT
    assert {"none", "linear", "ntk", "yarn"} <= set(rope.supported_scalings)
    assert rope.device == "cpu" and rope.dtype == "float32" and rope.parameters > 0


def test_generate_reports_the_scaling_it_ran_with(client: SyncClient) -> None:
    result = client.generate(**greedy(pe="rope", pe_scaling=YarnScaling(factor=4.0)))
    assert result.model == "tiny-rope"
    assert result.finish_reason == "length"
    assert len(result.tokens) == result.usage.completion_tokens == greedy()["max_new_tokens"]
    assert result.pe.scheme == "rope"
    assert result.pe.scaling is not None and result.pe.scaling["type"] == "yarn"
    assert result.pe.scaling["original_max_position_embeddings"] == NATIVE_CONTEXT
    assert result.pe.attention_factor > 1.0  # YaRN's mscale for factor 4


def test_keywords_dicts_and_request_objects_are_the_same_request(client: SyncClient) -> None:
    by_typed_scaling = client.generate(**greedy(pe_scaling=LinearScaling(factor=2.0)))
    with_dict_scaling = greedy()
    with_dict_scaling["pe_scaling"] = {"type": "linear", "factor": 2.0}
    by_dict = client.generate(**with_dict_scaling)
    by_request = client.generate(GenerateRequest.model_validate(greedy(pe_scaling=LinearScaling(factor=2.0))))
    assert by_dict.tokens == by_typed_scaling.tokens == by_request.tokens


def test_stream_yields_the_same_tokens_as_generate(client: SyncClient) -> None:
    whole = client.generate(**greedy(pe_scaling=YarnScaling(factor=4.0)))
    with client.generate_stream(**greedy(pe_scaling=YarnScaling(factor=4.0))) as stream:
        events = list(stream)
    tokens = [event.token for event in events if isinstance(event, StreamToken)]
    assert tokens == whole.tokens
    assert stream.text == whole.text
    assert isinstance(events[-1], StreamEnd) and events[-1] is stream.final
    assert stream.final.usage == whole.usage
    assert stream.final.pe.scaling == whole.pe.scaling


def test_sampling_controls_and_top_logprobs_go_through_the_sdk(client: SyncClient) -> None:
    controls: GenerateParams = {
        "prompt": "ab",
        "max_new_tokens": 6,
        "temperature": 0.0,
        "repetition_penalty": 2.0,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.5,
        "min_p": 0.05,
        "min_tokens": 6,
        "ignore_eos": True,
        "stop_token_ids": [257],
        "top_logprobs": 3,
        "logprobs": True,
    }
    result = client.generate(**controls)
    assert result.top_logprobs is not None and [len(entry) for entry in result.top_logprobs] == [3] * 6
    streamed = [event for event in client.generate_stream(**controls) if isinstance(event, StreamToken)]
    assert [event.top_logprobs for event in streamed] == result.top_logprobs
    plain: GenerateParams = {"prompt": "ab", "max_new_tokens": 2}
    assert client.generate(**plain).top_logprobs is None
    assert all(
        event.top_logprobs is None
        for event in client.generate_stream(**plain)
        if isinstance(event, StreamToken)
    )
    with pytest.raises(UnprocessableEntityError) as raised:
        client.generate(prompt="ab", min_p=2.0)
    assert raised.value.param == "min_p"


def test_async_client_generates_and_streams(async_client: AsyncClient, client: SyncClient) -> None:
    async def run() -> tuple[list[int], list[int]]:
        async with async_client:
            result = await async_client.generate(**greedy())
            streamed: list[int] = []
            async with async_client.generate_stream(**greedy()) as stream:
                streamed.extend([event.token async for event in stream if isinstance(event, StreamToken)])
            return result.tokens, streamed

    generated, streamed = asyncio.run(run())
    assert generated == streamed == client.generate(**greedy()).tokens


def test_leaving_a_stream_early_cancels_the_generation(
    client: SyncClient, metrics_http: httpx.Client
) -> None:
    with client.generate_stream(**ENDLESS) as stream:
        first = next(iter(stream))
        assert isinstance(first, StreamToken)
        wait_for(lambda: running_requests(metrics_http) == 1, "the stream to run")
    wait_for(lambda: running_requests(metrics_http) == 0, "the server to cancel the abandoned stream")
    assert client.generate(prompt="a", max_new_tokens=1).usage.completion_tokens == 1


def test_score_matches_its_own_perplexity(client: SyncClient) -> None:
    scored = client.score(prompt=PAST_NATIVE, pe_scaling=YarnScaling(factor=4.0))
    assert scored.num_tokens == len(scored.tokens) == len(scored.token_logprobs)
    assert scored.token_logprobs[0] is None
    assert all(logprob is not None and logprob <= 0.0 for logprob in scored.token_logprobs[1:])
    assert scored.perplexity == pytest.approx(math.exp(-scored.total_logprob / (scored.num_tokens - 1)))


def test_score_of_tokens_is_as_given(client: SyncClient) -> None:
    scored = client.score(tokens=[104, 105, 106], model="tiny-alibi")
    assert scored.tokens == [104, 105, 106] and scored.model == "tiny-alibi"


def test_score_reports_the_alternatives_asked_for(client: SyncClient) -> None:
    """A greedy continuation's tokens are the most likely at their positions, so each is its
    position's first alternative, with the log-probability the score gives it."""
    prompt = [104, 105, 106, 107]
    generated = client.generate(tokens=prompt, max_new_tokens=6, temperature=0.0, ignore_eos=True)
    tokens = prompt + generated.tokens
    scored = client.score(tokens=tokens, top_logprobs=3)
    assert scored.top_logprobs is not None and len(scored.top_logprobs) == len(tokens)
    assert scored.top_logprobs[0] is None
    for position in range(1, len(tokens)):
        alternatives, logprob = scored.top_logprobs[position], scored.token_logprobs[position]
        assert alternatives is not None and logprob is not None and len(alternatives) == 3
        values = [alternative.logprob for alternative in alternatives]
        assert values == sorted(values, reverse=True) and logprob <= values[0] + 1e-5
        if position >= len(prompt):
            assert alternatives[0].token == tokens[position]
            assert alternatives[0].logprob == pytest.approx(logprob, abs=1e-4)
    assert client.score(tokens=tokens).top_logprobs is None


def test_health_is_live_and_ready(client: SyncClient) -> None:
    health = client.health()
    assert health.live and health.ready


@pytest.mark.parametrize("api_key", ["", "wrong-key"])
def test_a_missing_or_wrong_key_is_an_authentication_error(
    make_client: ClientFactory, server: LiveServer, api_key: str
) -> None:
    with (
        make_client(server, api_key=api_key) as anonymous,
        pytest.raises(AuthenticationError) as caught,
    ):
        anonymous.models()
    assert caught.value.status_code == 401 and caught.value.type


def test_unknown_model_is_not_found(client: SyncClient) -> None:
    with pytest.raises(NotFoundError) as caught:
        client.generate(prompt="a", model="no-such-model")
    assert caught.value.status_code == 404


@pytest.mark.parametrize(
    ("params", "param"),
    [
        (GenerateParams(prompt="a", pe_scaling=LinearScaling(factor=0.5)), "pe_scaling.factor"),
        (GenerateParams(prompt="a", pe="alibi", pe_scaling=YarnScaling(factor=4.0)), "pe_scaling"),
        (GenerateParams(prompt="a", max_new_tokens=5000), "max_new_tokens"),
        (GenerateParams(tokens=[1, 2], prompt="a"), None),
    ],
)
def test_invalid_requests_are_unprocessable_and_name_the_field(
    client: SyncClient, params: GenerateParams, param: str | None
) -> None:
    with pytest.raises(UnprocessableEntityError) as caught:
        client.generate(**params)
    assert caught.value.status_code == 422
    if param is not None:
        assert caught.value.param is not None and caught.value.param.startswith(param)


def test_oversized_body_is_payload_too_large(client: SyncClient) -> None:
    with pytest.raises(PayloadTooLargeError):
        client.score(prompt="a" * (1 << 20))


@pytest.fixture
def full_server(client: SyncClient, metrics_http: httpx.Client) -> Iterator[ExitStack]:
    """The one batch slot and the one queue place taken by endless streams; close the stack to free them."""
    with ExitStack() as streams:
        streams.enter_context(client.generate_stream(**ENDLESS))
        wait_for(lambda: running_requests(metrics_http) == 1, "the first stream to run")
        streams.enter_context(client.generate_stream(**ENDLESS))
        wait_for(lambda: metric_value(metrics_http, "pe_serve_queue_depth") == 1, "the second to queue")
        yield streams
    wait_for(lambda: server_is_idle(metrics_http), "the streams to be cancelled")


def test_full_queue_is_a_rate_limit_error_with_retry_after(
    make_client: ClientFactory, server: LiveServer, full_server: ExitStack
) -> None:
    impatient = make_client(server, api_key=API_KEY, max_retries=0)
    with impatient, pytest.raises(RateLimitError) as caught:
        impatient.generate(prompt="a", max_new_tokens=1)
    assert float(caught.value.headers["retry-after"]) >= 1


def test_full_queue_is_retried_after_the_servers_retry_after(
    make_client: ClientFactory, server: LiveServer, full_server: ExitStack, metrics_http: httpx.Client
) -> None:
    """The injected sleep frees the server instead of waiting, so the retry finds room."""
    waits: list[float] = []

    def free_the_queue(delay: float) -> None:
        waits.append(delay)
        full_server.close()
        wait_for(lambda: server_is_idle(metrics_http), "the streams to be cancelled")

    with make_client(server, api_key=API_KEY, max_retries=5, sleep=free_the_queue) as patient:
        result = patient.generate(prompt="a", max_new_tokens=1)
    assert result.usage.completion_tokens == 1
    assert waits and waits[0] >= 1 and waits[0] == int(waits[0])  # Retry-After's whole seconds


def test_unreachable_server_is_a_connection_error(protocol: str) -> None:
    nowhere_at = address(protocol, free_port())
    client_class = GrpcPEClient if protocol == "grpc" else PEClient
    with (
        client_class(nowhere_at, max_retries=0) as nowhere,
        pytest.raises(APIConnectionError),
    ):
        nowhere.models()


def test_slow_answer_is_a_timeout_error(make_client: ClientFactory, server: LiveServer) -> None:
    hasty = make_client(server, api_key=API_KEY, timeout=0.05, max_retries=0)
    with hasty, pytest.raises(APITimeoutError):
        hasty.generate(**ENDLESS)


def test_draining_server_is_unavailable(make_client: ClientFactory, sdk_models: list[Path]) -> None:
    options = {**SERVER_OPTIONS, "max_queue": 4}
    draining = start_server(sdk_models[:1], options=options, env=SERVER_ENV)
    try:
        sdk = make_client(draining, api_key=API_KEY, max_retries=0)
        with sdk, sdk.generate_stream(**ENDLESS) as stream:
            next(iter(stream))
            draining.send_signal(signal.SIGTERM)
            wait_for(lambda: not sdk.health().ready, "readiness to drop")
            assert sdk.health().live
            with pytest.raises(ServiceUnavailableError) as caught:
                sdk.generate(prompt="a", max_new_tokens=1)
        assert caught.value.status_code == 503
    finally:
        draining.stop()
        draining.log_path.unlink(missing_ok=True)
