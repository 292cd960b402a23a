"""`/score` through the engine's runner: a row of the model's KV pool, chunks on the C pass where it
applies (the eager layers elsewhere), and what one full forward pass gives, for every scheme and
for documents of different scalings scored side by side.

Which pass ran is read where an operator reads it, `pe_scored_positions_total{model, path}` on the
process's registry; the pool's blocks through the core's own pools, step by step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
from prometheus_client import REGISTRY

from pe_runtime import RopeScaling
from service.engine.catalog import ModelCatalog
from service.engine.core import DecodeSettings, EngineCore, Job
from service.engine.engine import load_models
from service.engine.errors import EngineError, RequestCancelledError, RequestFailedError
from service.engine.models import ServedModel
from service.engine.types import (
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    ScoreResult,
    ScoringRequest,
)
from service.model.backend import Backend
from service.model.checkpoint import save_checkpoint
from service.model.config import SCHEMES
from service.model.kernels import batch_pass
from service.model.paged_cache import PagedKVCache
from service.model.transformer import Transformer
from tests.conftest import TINY_CONFIG, TinyCheckpointFactory, rope_scalings, tiny_transformer

NATIVE = 64
SCALINGS = rope_scalings(NATIVE, rotary_dim=TINY_CONFIG["d_model"] // TINY_CONFIG["n_heads"])
RELATIVE = ("shaw", "transformer_xl", "cope")  # eager models: the C pass has no such attention
needs_c = pytest.mark.skipif(not batch_pass.available(), reason="the C kernels are not built here")


def document(length: int, seed: int = 0) -> tuple[int, ...]:
    return tuple(torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist())


def full_pass(model: Transformer, tokens: Sequence[int], scaling: RopeScaling | None = None) -> torch.Tensor:
    """log p(t_i | t_<i) for i >= 1 from one forward pass over the whole document."""
    ids = torch.tensor([tokens])
    with torch.inference_mode():
        logprobs = torch.log_softmax(model(ids, scaling=scaling)[0, :-1].float(), dim=-1)
    return logprobs.gather(1, ids[0, 1:, None])[:, 0]


def scored_positions(model: str, path: str) -> float:
    value = REGISTRY.get_sample_value("pe_scored_positions_total", {"model": model, "path": path})
    return value if value is not None else 0.0


def run(
    core: EngineCore,
    models: list[ServedModel],
    jobs: Sequence[GenerationRequest | ScoringRequest],
    *,
    cancel_at: tuple[int, int] | None = None,
    each_step: Callable[[], object] | None = None,
    ended: dict[int, int] | None = None,
) -> dict[int, object]:
    """Every job's final item, all sent at once; `cancel_at` = (job, step) cancels that job then,
    `each_step()` is called after every step, and `ended` gets the step each job ended at."""
    catalog = ModelCatalog([served.spec for served in models])
    for key, job in enumerate(jobs):
        core.add(Job(key, job, catalog.validate(job), time.perf_counter()))
    finals: dict[int, object] = {}
    step = 0
    while core.has_work():
        if cancel_at is not None and step == cancel_at[1]:
            core.cancel(cancel_at[0])
        for key, item in core.step().events:
            if isinstance(item, GenerationResult | ScoreResult | EngineError):
                finals[key] = item
                if ended is not None:
                    ended[key] = step
        if each_step is not None:
            each_step()
        step += 1
    return finals


def assert_scores(final: object, expected: torch.Tensor, tolerance: float = 1e-5) -> None:
    assert isinstance(final, ScoreResult), final
    assert final.token_logprobs[0] is None
    ours = torch.tensor(final.token_logprobs[1:], dtype=torch.float32)
    assert (ours - expected).abs().max().item() <= tolerance


def pool_of(core: EngineCore, name: str) -> PagedKVCache:
    return core.kv_pools()[name]


@needs_c
def test_a_document_on_the_c_backend_runs_through_the_c_pass_and_gives_its_blocks_back(
    make_tiny_checkpoint: TinyCheckpointFactory,
) -> None:
    directory = make_tiny_checkpoint("rope", name="c-scored", native_context=NATIVE)
    models = load_models([directory], device="cpu", dtype="float32", max_context=256)
    core = EngineCore(models, step_token_budget=4)  # with no stream, 32 units a step: several chunks
    assert core.backends()["c-scored"] is Backend.C
    pool = pool_of(core, "c-scored")
    tokens = document(200)
    before = {path: scored_positions("c-scored", path) for path in ("c", "eager")}
    held: list[int] = []
    finals = run(
        core,
        models,
        [ScoringRequest("doc", "c-scored", tokens)],
        each_step=lambda: held.append(pool.total_blocks - pool.free_blocks),
    )
    assert_scores(finals[0], full_pass(models[0].model, tokens))
    assert scored_positions("c-scored", "c") - before["c"] == len(tokens) - 1
    assert scored_positions("c-scored", "eager") == before["eager"]
    assert max(held) == pool.blocks_for(len(tokens) - 1)  # its row, for every position it writes
    assert held[-1] == 0 and pool.free_blocks == pool.total_blocks


@needs_c
def test_documents_scored_at_once_run_whole_chunks_through_the_c_pass(
    make_tiny_checkpoint: TinyCheckpointFactory,
) -> None:
    """Each step's first document takes what its allowance buys; the units it leaves are no turn
    for the next one (`useful_chunk_cost`), which would read a few tokens on the eager pass spread
    over steps: every position of the three runs in C, and each equals its full pass."""
    directory = make_tiny_checkpoint("rope", name="c-together", native_context=NATIVE)
    models = load_models([directory], device="cpu", dtype="float32", max_context=256)
    core = EngineCore(models, step_token_budget=3)  # 24 units a step: a chunk may leave a few
    documents = [document(200, seed=seed) for seed in range(3)]
    before = {path: scored_positions("c-together", path) for path in ("c", "eager")}
    finals = run(
        core, models, [ScoringRequest(f"doc-{i}", "c-together", tokens) for i, tokens in enumerate(documents)]
    )
    for key, tokens in enumerate(documents):
        assert_scores(finals[key], full_pass(models[0].model, tokens))
    assert scored_positions("c-together", "eager") == before["eager"]
    assert scored_positions("c-together", "c") - before["c"] == sum(len(tokens) - 1 for tokens in documents)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_every_scheme_scores_in_chunks_what_one_full_pass_gives(
    make_tiny_checkpoint: TinyCheckpointFactory, scheme: str
) -> None:
    """Chunks of at most 16 units (no stream: 8 times the token budget); a learned table ends at
    the native context, so 60 tokens."""
    name = f"scored-{scheme}"
    directory = make_tiny_checkpoint(scheme, name=name, native_context=NATIVE)
    models = load_models([directory], device="cpu", dtype="float32", max_context=256)
    core = EngineCore(models, step_token_budget=2)
    tokens = document(60, seed=1)
    before = scored_positions(name, "c")
    finals = run(core, models, [ScoringRequest("doc", name, tokens)])
    assert_scores(finals[0], full_pass(models[0].model, tokens))
    on_c = scored_positions(name, "c") - before
    if scheme in RELATIVE or not batch_pass.available():
        assert on_c == 0
    else:
        assert on_c == len(tokens) - 1
    assert pool_of(core, name).free_blocks == pool_of(core, name).total_blocks


def test_documents_of_every_scaling_scored_side_by_side_match_their_full_passes(
    make_tiny_checkpoint: TinyCheckpointFactory,
) -> None:
    """One document per scaling type, 200 tokens (past the native 64: dynamic NTK and LongRoPE read
    the table for the whole length), all in flight at once beside a stream, in small chunks."""
    directory = make_tiny_checkpoint("rope", name="mixed", native_context=NATIVE)
    models = load_models([directory], device="cpu", dtype="float32", max_context=256)
    core = EngineCore(models, step_token_budget=24)
    stream = GenerationRequest(
        "gen", "mixed", document(5, seed=9), SamplingParams(max_new_tokens=40, temperature=0.0), stream=True
    )
    names = list(SCALINGS)
    jobs: list[GenerationRequest | ScoringRequest] = [stream] + [
        ScoringRequest(f"doc-{name}", "mixed", document(200, seed=i), SCALINGS[name])
        for i, name in enumerate(names)
    ]
    finals = run(core, models, jobs)
    assert isinstance(finals[0], GenerationResult) and len(finals[0].tokens) == 40
    for key, name in enumerate(names, 1):
        request = jobs[key]
        assert isinstance(request, ScoringRequest)
        assert_scores(finals[key], full_pass(models[0].model, request.tokens, SCALINGS[name]))


def test_a_document_waits_for_blocks_and_holds_back_later_jobs(
    make_tiny_checkpoint: TinyCheckpointFactory,
) -> None:
    """A pool of 256 tokens holds one 200-token document at a time: the second waits for the
    first's blocks rather than failing, and a generation that arrives after it waits behind it
    although its one block would fit beside the first."""
    directory = make_tiny_checkpoint("rope", name="small-pool", native_context=NATIVE)
    models = load_models([directory], device="cpu", dtype="float32", max_context=256)
    core = EngineCore(models, step_token_budget=2, decode=DecodeSettings(kv_cache_bytes=1))
    pool = pool_of(core, "small-pool")
    assert pool.total_blocks * pool.block_size == 256
    first, second = document(200, seed=2), document(200, seed=3)
    generation = GenerationRequest(
        "gen", "small-pool", (256, 1, 2), SamplingParams(max_new_tokens=4, temperature=0.0)
    )
    jobs: list[GenerationRequest | ScoringRequest] = [
        ScoringRequest("first", "small-pool", first),
        ScoringRequest("second", "small-pool", second),
        generation,
    ]
    held: list[int] = []
    ended: dict[int, int] = {}
    finals = run(
        core, models, jobs, each_step=lambda: held.append(pool.total_blocks - pool.free_blocks), ended=ended
    )
    model = models[0].model
    assert_scores(finals[0], full_pass(model, first))
    assert_scores(finals[1], full_pass(model, second))
    assert isinstance(finals[2], GenerationResult) and len(finals[2].tokens) == 4
    document_blocks = pool.blocks_for(len(first) - 1)
    assert held[: ended[0]] == [document_blocks] * ended[0]  # the first alone, the others waiting
    assert max(held) == document_blocks + 1  # then the second beside the generation's one block
    assert ended[0] < ended[2] < ended[1] and held[-1] == 0


def test_a_cancelled_document_gives_its_blocks_back(make_tiny_checkpoint: TinyCheckpointFactory) -> None:
    directory = make_tiny_checkpoint("rope", name="cancelled", native_context=NATIVE)
    models = load_models([directory], device="cpu", dtype="float32", max_context=256)
    core = EngineCore(models, step_token_budget=2)  # 16 units a step: a dozen chunks
    pool = pool_of(core, "cancelled")
    held: list[int] = []
    finals = run(
        core,
        models,
        [ScoringRequest("doc", "cancelled", document(200))],
        cancel_at=(0, 3),
        each_step=lambda: held.append(pool.total_blocks - pool.free_blocks),
    )
    assert isinstance(finals[0], RequestCancelledError)
    assert held[2] > 0 and pool.free_blocks == pool.total_blocks


def test_a_document_with_non_finite_logits_fails_and_gives_its_blocks_back(tmp_path: Path) -> None:
    model = tiny_transformer(native_context=NATIVE, tie_embeddings=False)  # the head stays finite
    with torch.no_grad():
        model.embed_tokens.weight[257] = float("nan")
    save_checkpoint(model, tmp_path / "poisoned")
    models = load_models([tmp_path / "poisoned"], device="cpu", dtype="float32", max_context=256)
    core = EngineCore(models)
    finals = run(core, models, [ScoringRequest("doc", "poisoned", (*document(40), 257, 65))])
    assert isinstance(finals[0], RequestFailedError)
    pool = pool_of(core, "poisoned")
    assert pool.free_blocks == pool.total_blocks


def test_top_logprobs_come_from_the_served_path(make_tiny_checkpoint: TinyCheckpointFactory) -> None:
    directory = make_tiny_checkpoint("rope", name="alternatives", native_context=NATIVE)
    models = load_models([directory], device="cpu", dtype="float32", max_context=256)
    tokens = document(80, seed=4)
    finals = run(
        EngineCore(models, step_token_budget=16),
        models,
        [ScoringRequest("doc", "alternatives", tokens, top_logprobs=3)],
    )
    final = finals[0]
    assert isinstance(final, ScoreResult) and final.top_logprobs is not None
    ids = torch.tensor([tokens])
    with torch.inference_mode():
        logprobs = torch.log_softmax(models[0].model(ids)[0, :-1], dim=-1)
    best = logprobs.topk(3, dim=-1)
    assert final.top_logprobs[0] is None
    for position, alternatives in enumerate(final.top_logprobs[1:]):
        assert alternatives is not None
        assert [top.token for top in alternatives] == best.indices[position].tolist()
        values = torch.tensor([top.logprob for top in alternatives])
        assert (values - best.values[position]).abs().max().item() <= 1e-5
