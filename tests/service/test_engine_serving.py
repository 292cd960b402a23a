"""The serving path: chunked prefill and scoring, contained failures, and the engine in its own process.

Every property is checked against the same requests run another way (alone, in one pass, in this
process), since those are the guarantees chunking and the process boundary must not change.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from pe_runtime import RopeScaling
from service.engine.catalog import ModelCatalog
from service.engine.client import EngineClient
from service.engine.config import EngineConfig
from service.engine.core import EngineCore, Job
from service.engine.engine import InferenceEngine, load_models
from service.engine.errors import EngineError, InvalidRequestError, QueueFullError, RequestFailedError
from service.engine.frontend import EngineFrontend
from service.engine.models import ServedModel
from service.engine.scoring import score_tokens
from service.engine.types import (
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    ScoreResult,
    ScoringRequest,
)
from service.model.checkpoint import load_checkpoint
from service.model.fast_decode import FastDecoder
from service.model.paged_cache import PagedRows
from tests.conftest import TINY_CONFIG, TinyCheckpointFactory, rope_scalings

NATIVE = 16
SCALINGS = rope_scalings(NATIVE, rotary_dim=TINY_CONFIG["d_model"] // TINY_CONFIG["n_heads"])
MODEL = "tiny-rope-serving"
LONG_PROMPTS = [(256, *((7 * i + n) % 256 for i in range(n))) for n in (4, 37, 90, 150)]
MIXED = ["none", "yarn", "dynamic", "longrope"]


@pytest.fixture(scope="module")
def rope_dir(make_tiny_checkpoint: TinyCheckpointFactory) -> Path:
    return make_tiny_checkpoint("rope", name=MODEL, native_context=NATIVE)


def request(
    index: int, prompt: Sequence[int], scaling: RopeScaling | None = None, new_tokens: int = 20
) -> GenerationRequest:
    sampling = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, logprobs=True)
    return GenerationRequest(f"r{index}", MODEL, tuple(prompt), sampling, scaling)


@contextmanager
def engine_over(models: list[ServedModel], **options: Any) -> Iterator[InferenceEngine]:
    engine = InferenceEngine(models, **options)
    engine.start()
    try:
        yield engine
    finally:
        engine.shutdown()


def cpu_models(directory: Path) -> list[ServedModel]:
    return load_models([directory], device="cpu", dtype="float32")


def outcomes(
    engine: EngineFrontend, requests: Sequence[GenerationRequest]
) -> list[GenerationResult | EngineError]:
    """Submit everything at once (so it shares steps), then read each request's final item."""
    handles = [engine.submit(item) for item in requests]
    results: list[GenerationResult | EngineError] = []
    for handle in handles:
        try:
            final = list(handle)[-1]
        except EngineError as error:
            results.append(error)
            continue
        assert isinstance(final, GenerationResult)
        results.append(final)
    return results


def assert_same(first: GenerationResult | EngineError, second: GenerationResult | EngineError) -> None:
    assert isinstance(first, GenerationResult) and isinstance(second, GenerationResult)
    assert first.tokens == second.tokens
    assert first.logprobs is not None and second.logprobs is not None
    assert max(abs(a - b) for a, b in zip(first.logprobs, second.logprobs, strict=True)) <= 1e-4


def test_long_prompts_read_in_chunks_together_generate_what_each_does_alone(rope_dir: Path) -> None:
    """Prompts of 5 to 151 tokens under a 16-token budget: they share chunks, every row its own scaling."""
    models = cpu_models(rope_dir)
    requests = [
        request(i, p, SCALINGS[name]) for i, (p, name) in enumerate(zip(LONG_PROMPTS, MIXED, strict=True))
    ]
    with engine_over(models, step_token_budget=16, max_batch_size=8) as chunked:
        together = outcomes(chunked, requests)
    with engine_over(models, step_token_budget=4096) as whole:
        alone = [outcomes(whole, [item])[0] for item in requests]
    for first, second in zip(together, alone, strict=True):
        assert_same(first, second)


@pytest.mark.parametrize("scheme", ["learned", "sinusoidal", "alibi", "t5_bias", "nope"])
def test_every_scheme_reads_padded_prompt_chunks_exactly(
    make_tiny_checkpoint: TinyCheckpointFactory, scheme: str
) -> None:
    """The short row is padded to the long row's width; a learned table ends at position 15."""
    directory = make_tiny_checkpoint(scheme, name=MODEL, native_context=NATIVE)
    prompts = [LONG_PROMPTS[0][:3], LONG_PROMPTS[2][:13]]
    requests = [request(i, prompt, new_tokens=3) for i, prompt in enumerate(prompts)]
    models = cpu_models(directory)
    with engine_over(models, step_token_budget=8) as chunked:
        together = outcomes(chunked, requests)
    with engine_over(models, step_token_budget=4096) as whole:
        alone = [outcomes(whole, [item])[0] for item in requests]
    for first, second in zip(together, alone, strict=True):
        assert_same(first, second)


@pytest.mark.parametrize("scaling", ["yarn", "dynamic", "longrope"])
def test_scoring_in_chunks_equals_one_pass(rope_dir: Path, scaling: str) -> None:
    tokens = tuple(torch.randint(0, 258, (200,), generator=torch.Generator().manual_seed(3)).tolist())
    with engine_over(cpu_models(rope_dir), step_token_budget=16) as engine:
        final = list(engine.submit(ScoringRequest("s", MODEL, tokens, SCALINGS[scaling])))[-1]
    assert isinstance(final, ScoreResult)
    reference = score_tokens(load_checkpoint(rope_dir, dtype=torch.float32), tokens, SCALINGS[scaling])
    assert final.token_logprobs[0] is None and reference[0] is None
    differences = [abs(a - b) for a, b in zip(final.token_logprobs[1:], reference[1:], strict=True)]  # type: ignore[operator]
    assert max(differences) <= 1e-5


def plant_fault(
    model: torch.nn.Module, when: Callable[[Sequence[int]], bool], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Make every pass over rows of cached lengths `when` accepts raise, as a kernel failure would:
    the model's own forward and the fast decode pass alike (the C step, a CPU's default)."""
    original = model.forward

    def faulty(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("cache") is not None and when(kwargs["cache"].lengths):
            raise RuntimeError("planted fault")
        return original(*args, **kwargs)

    model.forward = faulty  # type: ignore[method-assign]
    fast_decode = FastDecoder.decode

    def faulty_fast_decode(self: FastDecoder, rows: PagedRows, *args: Any) -> torch.Tensor:
        if when(rows.lengths):
            raise RuntimeError("planted fault")
        return fast_decode(self, rows, *args)

    monkeypatch.setattr(FastDecoder, "decode", faulty_fast_decode)


def test_a_fault_in_a_batched_step_fails_its_row_and_the_others_match_their_solo_runs(
    rope_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fault fires in the 4th decode pass of the shortest row, batched or alone: that row fails.

    The other rows were in the batched step that raised; they are rerun from their untouched cache
    rows, so they go on exactly as they would have alone (no token written twice).
    """
    prompts = [LONG_PROMPTS[0], LONG_PROMPTS[1], LONG_PROMPTS[2]]
    faulty_length = len(prompts[0]) + 3  # only the shortest row ever has this length
    requests = [
        request(i, p, SCALINGS[name]) for i, (p, name) in enumerate(zip(prompts, MIXED[:3], strict=True))
    ]
    models = cpu_models(rope_dir)
    plant_fault(models[0].model, lambda lengths: faulty_length in lengths, monkeypatch)
    with engine_over(models, step_token_budget=4096) as engine:
        together = outcomes(engine, requests)
    monkeypatch.undo()
    with engine_over(cpu_models(rope_dir)) as clean:
        alone = [outcomes(clean, [item])[0] for item in requests]
    assert isinstance(together[0], RequestFailedError)
    assert "planted fault" in together[0].message
    for first, second in zip(together[1:], alone[1:], strict=True):
        assert_same(first, second)


@contextmanager
def engine_process(directory: Path, **options: Any) -> Iterator[EngineClient]:
    config = EngineConfig(model_dirs=(directory,), device="cpu", dtype="float32", torch_threads=1, **options)
    client = EngineClient(config, max_queue=0)
    try:
        yield client
    finally:
        client.shutdown()


def test_the_engine_process_generates_and_scores_what_the_in_process_engine_does(rope_dir: Path) -> None:
    requests = [
        request(i, p, SCALINGS[name]) for i, (p, name) in enumerate(zip(LONG_PROMPTS, MIXED, strict=True))
    ]
    score = ScoringRequest("s", MODEL, LONG_PROMPTS[3], SCALINGS["yarn"])
    with engine_process(rope_dir, step_token_budget=32) as remote:
        across = outcomes(remote, requests)
        remote_score = list(remote.submit(score))[-1]
        stats = remote.stats()
        metrics = remote.metrics_text().decode()
    with engine_over(cpu_models(rope_dir), step_token_budget=32) as local:
        here = outcomes(local, requests)
        local_score = list(local.submit(score))[-1]
    for first, second in zip(across, here, strict=True):
        assert_same(first, second)
    assert isinstance(remote_score, ScoreResult) and isinstance(local_score, ScoreResult)
    assert remote_score.token_logprobs == local_score.token_logprobs
    assert stats.generated_tokens_total == sum(
        len(r.tokens) for r in across if isinstance(r, GenerationResult)
    )
    assert stats.queue_depth == 0 and stats.running == 0
    assert "pe_cache_hits_total" in metrics and "pe_engine_process_resident_memory_bytes" in metrics


def test_requests_are_validated_before_they_cross_and_cancels_cross_after(rope_dir: Path) -> None:
    with engine_process(rope_dir) as remote:
        with pytest.raises(InvalidRequestError) as bad_token:
            remote.submit(request(0, (256, 999)))
        assert bad_token.value.param == "tokens.1"
        handle = remote.submit(request(1, LONG_PROMPTS[1], new_tokens=2000 - len(LONG_PROMPTS[1])))
        events = iter(handle)
        next(events)  # the first token: the request is running in the engine process
        handle.cancel()
        final = list(events)[-1]
    assert isinstance(final, GenerationResult)
    assert final.finish_reason == "cancelled"
    assert len(final.tokens) < 2000 - len(LONG_PROMPTS[1])


def test_engine_errors_keep_their_fields_through_pickling() -> None:
    error = pickle.loads(pickle.dumps(QueueFullError("full", retry_after_s=7.0)))
    assert isinstance(error, QueueFullError) and error.retry_after_s == 7.0 and error.message == "full"
    invalid = pickle.loads(pickle.dumps(InvalidRequestError("bad", param="pe_scaling.factor")))
    assert invalid.param == "pe_scaling.factor" and str(invalid) == "bad"


def test_a_long_document_is_scored_between_decode_steps_and_blocks_no_model(
    make_tiny_checkpoint: TinyCheckpointFactory,
) -> None:
    """Step by step on the core itself: another model's generation finishes while a 2,000-token
    document on the first model is still being read, a budget-sized chunk per step."""
    reader = make_tiny_checkpoint("rope", name="reader", native_context=NATIVE)
    writer = make_tiny_checkpoint("alibi", name="writer", native_context=NATIVE)
    models = load_models([reader, writer], device="cpu", dtype="float32")
    specs = ModelCatalog([served.spec for served in models])
    core = EngineCore(models, step_token_budget=64)
    document = ScoringRequest("doc", "reader", tuple(i % 256 for i in range(2000)))
    generation = GenerationRequest(
        "gen", "writer", LONG_PROMPTS[0], SamplingParams(max_new_tokens=8, temperature=0.0)
    )
    jobs: list[GenerationRequest | ScoringRequest] = [document, generation]
    for key, job in enumerate(jobs):
        core.add(Job(key, job, specs.validate(job), 0.0))
    finished: list[int] = []
    while len(finished) < 2:
        events = core.step().events
        finished += [key for key, item in events if isinstance(item, GenerationResult | ScoreResult)]
    assert finished == [1, 0]  # the 8 tokens came out while the document was still being read
