"""The continuous-batching engine: batching never changes a request's result, and one request's
trouble (cancellation, a full queue, non-finite logits) never reaches the others."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from pe_runtime import RopeScaling
from service.engine.engine import InferenceEngine
from service.engine.errors import (
    ContextLengthError,
    EngineDrainingError,
    InvalidRequestError,
    ModelNotFoundError,
    QueueFullError,
    RequestCancelledError,
    RequestFailedError,
)
from service.engine.scoring import score_tokens
from service.engine.types import (
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    ScoreResult,
    ScoringRequest,
    TokenEvent,
)
from service.model.checkpoint import load_checkpoint, save_checkpoint
from tests.conftest import TINY_CONFIG, TinyCheckpointFactory, rope_scalings, tiny_transformer

NATIVE = 16
SCALINGS = rope_scalings(NATIVE, rotary_dim=TINY_CONFIG["d_model"] // TINY_CONFIG["n_heads"])
PROMPTS = [(256, *range(65, 65 + n)) for n in (4, 9, 13, 6, 11)]
MODEL = "tiny-rope-16"


@pytest.fixture(scope="module")
def rope_dir(make_tiny_checkpoint: TinyCheckpointFactory) -> Path:
    return make_tiny_checkpoint("rope", name=MODEL, native_context=NATIVE)


@contextmanager
def running_engine(dirs: list[Path], *, start: bool = True, **options: Any) -> Iterator[InferenceEngine]:
    engine = InferenceEngine.from_model_dirs(dirs, device="cpu", dtype="float32", **options)
    if start:
        engine.start()
    try:
        yield engine
    finally:
        engine.shutdown()


def generation(
    index: int, scaling: RopeScaling | None = None, model: str = MODEL, **sampling: Any
) -> GenerationRequest:
    params = {"max_new_tokens": 24, "temperature": 0.0, "logprobs": True} | sampling
    return GenerationRequest(
        request_id=f"r{index}",
        model=model,
        prompt_tokens=PROMPTS[index % len(PROMPTS)],
        sampling=SamplingParams(**params),
        scaling=scaling,
    )


def result_of(handle: Any) -> GenerationResult:
    final = list(handle)[-1]
    assert isinstance(final, GenerationResult)
    return final


def alone(engine: InferenceEngine, request: GenerationRequest) -> GenerationResult:
    return result_of(engine.submit(request))


def assert_same_generation(batched: GenerationResult, single: GenerationResult) -> None:
    assert batched.tokens == single.tokens
    assert batched.logprobs is not None and single.logprobs is not None
    assert max(abs(a - b) for a, b in zip(batched.logprobs, single.logprobs, strict=True)) <= 1e-4


def test_a_batch_of_mixed_scalings_gives_each_request_its_result_alone(rope_dir: Path) -> None:
    """Requests past the native context, each with another scaling, decoded in one batch.

    The last two share the first one's prompt, so the three are also prefilled together.
    """
    names = ["none", "linear", "dynamic", "yarn", "longrope", "ntk", "llama3"]
    requests = [generation(i if i < 5 else 0, SCALINGS[name]) for i, name in enumerate(names)]
    with running_engine([rope_dir], start=False) as engine:
        handles = [engine.submit(request) for request in requests]
        engine.start()  # everything queued is admitted together and shares every decode pass
        batched = [result_of(handle) for handle in handles]
        singles = [alone(engine, request) for request in requests]
    for name, batched_result, single in zip(names, batched, singles, strict=True):
        assert batched_result.pe.scaling == SCALINGS[name]
        assert_same_generation(batched_result, single)


def test_sampling_with_a_seed_is_the_same_alone_and_in_a_batch(rope_dir: Path) -> None:
    sampled: dict[str, Any] = {"temperature": 0.9, "top_k": 50, "top_p": 0.95, "seed": 1234}
    target = generation(0, SCALINGS["yarn"], **sampled)
    neighbours = [generation(i, SCALINGS["linear"], temperature=1.0, seed=i) for i in range(1, 4)]
    with running_engine([rope_dir], start=False) as engine:
        handles = [engine.submit(request) for request in [*neighbours, target]]
        engine.start()
        in_batch = [result_of(handle) for handle in handles][-1]
        single = alone(engine, target)
    assert in_batch.tokens == single.tokens


def test_cancelling_frees_the_request_and_leaves_the_others_intact(rope_dir: Path) -> None:
    with running_engine([rope_dir]) as engine:
        references = [alone(engine, generation(i)) for i in (1, 2)]
        long_running = engine.submit(generation(0, max_new_tokens=500))
        others = [engine.submit(generation(i)) for i in (1, 2)]
        events = iter(long_running)
        assert isinstance(next(events), TokenEvent)
        long_running.cancel()
        final = [event for event in events if isinstance(event, GenerationResult)][-1]
        results = [result_of(handle) for handle in others]
        assert engine.stats().running == 0
    assert final.finish_reason == "cancelled" and len(final.tokens) < 500
    for result, reference in zip(results, references, strict=True):
        assert_same_generation(result, reference)


def test_a_request_cancelled_while_queued_never_starts(rope_dir: Path) -> None:
    with running_engine([rope_dir], start=False) as engine:
        handle = engine.submit(ScoringRequest(request_id="s", model=MODEL, tokens=PROMPTS[0]))
        handle.cancel()
        engine.start()
        with pytest.raises(RequestCancelledError):
            list(handle)


def test_a_full_queue_refuses_at_once_and_queued_requests_still_run(rope_dir: Path) -> None:
    """One batch slot and two queue places: the fourth generation in flight is refused."""
    with running_engine([rope_dir], start=False, max_queue=2, max_batch_size=1) as engine:
        queued = [engine.submit(generation(i, max_new_tokens=3)) for i in range(3)]
        with pytest.raises(QueueFullError) as refused:
            engine.submit(generation(3))
        assert refused.value.retry_after_s >= 1.0
        assert engine.stats().queue_depth == 2
        scored = engine.submit(ScoringRequest("s", MODEL, PROMPTS[0]))  # scoring needs no batch slot
        engine.start()
        assert all(len(result_of(handle).tokens) == 3 for handle in queued)
        assert isinstance(list(scored)[-1], ScoreResult)


def test_non_finite_logits_fail_only_their_request(tmp_path: Path) -> None:
    """The EOS embedding is poisoned with NaN: only a prompt containing EOS can reach it."""
    model = tiny_transformer(native_context=NATIVE, tie_embeddings=False)  # the head stays finite
    with torch.no_grad():
        model.embed_tokens.weight[257] = float("nan")
    save_checkpoint(model, tmp_path / MODEL)
    with running_engine([tmp_path / MODEL]) as engine:
        references = [alone(engine, generation(i)) for i in (1, 2)]
        healthy = [engine.submit(generation(i)) for i in (1, 2)]
        next(iter(healthy[0]))  # the healthy requests are decoding when the poisoned one joins
        poisoned = engine.submit(
            GenerationRequest("bad", MODEL, (256, 65, 257, 66), SamplingParams(max_new_tokens=5))
        )
        with pytest.raises(RequestFailedError, match="non-finite"):
            list(poisoned)
        results = [result_of(handle) for handle in healthy]
        scored = engine.submit(ScoringRequest("bad-score", MODEL, (256, 257, 65)))
        with pytest.raises(RequestFailedError):
            list(scored)
        assert engine.healthy()
    # The first healthy request lost its first token to `next` above; compare the rest.
    assert results[0].tokens == references[0].tokens
    assert_same_generation(results[1], references[1])


def test_scoring_is_the_plain_function_and_agrees_with_generation_logprobs(rope_dir: Path) -> None:
    with running_engine([rope_dir]) as engine:
        generated = alone(engine, generation(0, SCALINGS["yarn"], max_new_tokens=30))
        tokens = PROMPTS[0] + generated.tokens
        handle = engine.submit(ScoringRequest("s", MODEL, tokens, scaling=SCALINGS["yarn"]))
        scored = list(handle)[-1]
    model = load_checkpoint(rope_dir, dtype=torch.float32)
    assert isinstance(scored, ScoreResult)
    reference = score_tokens(model, tokens, SCALINGS["yarn"])
    assert scored.token_logprobs[0] is None and reference[0] is None
    assert max(abs(a - b) for a, b in zip(scored.token_logprobs[1:], reference[1:], strict=True)) <= 1e-5  # type: ignore[operator]
    assert generated.logprobs is not None
    tail = scored.token_logprobs[len(PROMPTS[0]) :]
    assert max(abs(a - b) for a, b in zip(tail, generated.logprobs, strict=True) if a is not None) <= 1e-4


def test_scoring_in_chunks_equals_one_log_softmax_over_all_positions() -> None:
    model = tiny_transformer(native_context=NATIVE)
    tokens = torch.randint(0, 258, (700,), generator=torch.Generator().manual_seed(5))  # > one chunk
    with torch.inference_mode():
        logprobs = torch.log_softmax(model(tokens[None], scaling=SCALINGS["yarn"])[0, :-1], dim=-1)
    expected = logprobs.gather(1, tokens[1:, None])[:, 0]
    scored = score_tokens(model, tokens.tolist(), SCALINGS["yarn"])
    assert scored[0] is None and len(scored) == 700
    assert torch.allclose(torch.tensor(scored[1:]), expected, atol=1e-5)


def test_stop_strings_and_eos_end_a_generation(
    rope_dir: Path, make_tiny_checkpoint: TinyCheckpointFactory
) -> None:
    sampled: dict[str, Any] = {"max_new_tokens": 40, "temperature": 1.0, "seed": 3}
    with running_engine([rope_dir]) as engine:
        free = alone(engine, generation(3, **sampled))
        stop_char = next(c for c in free.text if c.isascii() and c.isprintable() and free.text.index(c) > 0)
        stopped = alone(engine, generation(3, **sampled, stop=(stop_char,)))
    assert stopped.finish_reason == "stop"
    assert stopped.text == free.text[: free.text.index(stop_char)]
    eos = free.tokens[2]
    eos_at_third = make_tiny_checkpoint("rope", name=MODEL, native_context=NATIVE, eos_id=eos)
    with running_engine([eos_at_third]) as engine:
        ended = alone(engine, generation(3, **sampled))
    assert ended.finish_reason == "eos"
    assert ended.tokens == free.tokens[: free.tokens.index(eos) + 1]


def test_resolve_pe_enforces_schemes_and_context_limits(make_tiny_checkpoint: TinyCheckpointFactory) -> None:
    dirs = [make_tiny_checkpoint(scheme, name=f"tiny-{scheme}") for scheme in ("rope", "learned", "alibi")]
    linear2 = RopeScaling(type="linear", factor=2.0)
    with running_engine(dirs, start=False, max_context=256) as engine:
        assert engine.resolve_pe("tiny-learned", None, 64).scaling == RopeScaling()
        assert engine.resolve_pe("tiny-learned", linear2, 128).scaling == linear2
        with pytest.raises(ContextLengthError):
            engine.resolve_pe("tiny-learned", None, 65)
        with pytest.raises(ContextLengthError):
            engine.resolve_pe("tiny-learned", linear2, 129)
        with pytest.raises(InvalidRequestError) as unsupported:
            engine.resolve_pe("tiny-alibi", linear2, 10)
        assert unsupported.value.param == "pe_scaling.type"
        with pytest.raises(ContextLengthError):
            engine.resolve_pe("tiny-rope", None, 257)
        assert engine.resolve_pe("tiny-alibi", None, 256).max_context == 256
        yarn = RopeScaling.from_hf({"rope_type": "yarn", "factor": 4.0}, max_position_embeddings=64)
        assert engine.resolve_pe("tiny-rope", yarn, 200).attention_factor > 1.0
        assert engine.models()[1].supported_scalings == ("none", "linear")


@pytest.mark.parametrize(
    ("field", "value"), [("max_new_tokens", 0), ("temperature", -0.1), ("top_k", -1), ("top_p", 0.0)]
)
def test_out_of_range_sampling_is_refused_at_submit(rope_dir: Path, field: str, value: float) -> None:
    with running_engine([rope_dir], start=False) as engine:
        with pytest.raises(InvalidRequestError) as refused:
            engine.submit(generation(0, None, MODEL, **{field: value}))
        assert refused.value.param == field
        with pytest.raises(InvalidRequestError) as bad_token:
            engine.submit(ScoringRequest("s", MODEL, (256, 300)))
        assert bad_token.value.param == "tokens.1"


def test_resolve_model_by_name_or_scheme(make_tiny_checkpoint: TinyCheckpointFactory) -> None:
    dirs = [make_tiny_checkpoint(scheme, name=f"tiny-{scheme}") for scheme in ("rope", "alibi")]
    with running_engine(dirs, start=False) as engine:
        assert engine.resolve_model(None, None).name == "tiny-rope"
        assert engine.resolve_model(None, "alibi").name == "tiny-alibi"
        assert engine.resolve_model("tiny-alibi", "alibi").name == "tiny-alibi"
        with pytest.raises(ModelNotFoundError):
            engine.resolve_model("missing", None)
        with pytest.raises(ModelNotFoundError):
            engine.resolve_model(None, "t5_bias")
        with pytest.raises(InvalidRequestError):
            engine.resolve_model("tiny-rope", "alibi")
        assert engine.tokenize("tiny-rope", "hi") == [256, 104, 105]
        assert engine.detokenize("tiny-rope", [256, 104, 105, 257]) == "hi"


def test_requests_for_different_models_run_side_by_side(make_tiny_checkpoint: TinyCheckpointFactory) -> None:
    schemes = ("t5_bias", "sinusoidal", "nope")
    dirs = [make_tiny_checkpoint(scheme, name=f"tiny-{scheme}") for scheme in schemes]
    requests = [generation(i, model=f"tiny-{scheme}") for i, scheme in enumerate(schemes)]
    with running_engine(dirs, start=False) as engine:
        handles = [engine.submit(request) for request in requests]
        engine.start()
        together = [result_of(handle) for handle in handles]
        singles = [alone(engine, request) for request in requests]
    for result, single in zip(together, singles, strict=True):
        assert_same_generation(result, single)


def test_learned_positions_run_past_their_table_with_linear_interpolation(
    make_tiny_checkpoint: TinyCheckpointFactory,
) -> None:
    directory = make_tiny_checkpoint("learned", name="tiny-learned-16", native_context=NATIVE)
    request = GenerationRequest(
        request_id="long",
        model="tiny-learned-16",
        prompt_tokens=(256, *range(65, 65 + 20)),
        sampling=SamplingParams(max_new_tokens=2 * NATIVE, temperature=0.0),
        scaling=RopeScaling(type="linear", factor=4.0),
    )
    with running_engine([directory]) as engine:
        with pytest.raises(ContextLengthError):
            engine.submit(
                GenerationRequest("short", "tiny-learned-16", request.prompt_tokens, request.sampling)
            )
        result = alone(engine, request)
    assert result.finish_reason == "length" and len(result.tokens) == 2 * NATIVE


def test_async_iteration_and_drain(rope_dir: Path) -> None:
    async def collect(handle: Any) -> list[Any]:
        return [event async for event in handle]

    with running_engine([rope_dir]) as engine:
        events = asyncio.run(collect(engine.submit(generation(0, max_new_tokens=5))))
        assert [type(event) for event in events] == [TokenEvent] * 5 + [GenerationResult]
        pending = engine.submit(generation(1, max_new_tokens=5))
        assert engine.drain(timeout_s=30.0)
        assert result_of(pending).finish_reason == "length"
        with pytest.raises(EngineDrainingError):
            engine.submit(generation(2))
        assert engine.stats().generated_tokens_total == 10


def test_shutdown_fails_what_is_still_queued(rope_dir: Path) -> None:
    with running_engine([rope_dir], start=False) as engine:
        queued = engine.submit(generation(0))
        engine.shutdown()
        with pytest.raises(EngineDrainingError):
            list(queued)
        assert engine.stats().queue_depth == 0
