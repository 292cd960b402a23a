"""Prefix caching: a prompt reuses the KV blocks of an earlier prompt with the same model, scaling
and leading tokens, and answers as if it had computed them.

Every reuse is checked against an engine with the cache off: the same tokens, log-probabilities
within the engine's batch noise. Length-dependent tables (bucketed dynamic NTK) share only within
one table, and a row whose table will change while it runs shares nothing.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from pe_runtime import RopeScaling
from service.engine.core import DecodeSettings
from service.engine.engine import InferenceEngine, load_models
from service.engine.types import GenerationRequest, GenerationResult, SamplingParams
from service.model.paged_cache import PagedKVCache, prefix_keys
from tests.conftest import TinyCheckpointFactory, tiny_transformer

NATIVE = 16
TOLERANCE = 1e-4
# Bucketed (the default mode): the table follows the bucket of the row's length.
DYNAMIC = RopeScaling(type="dynamic", factor=2.0, original_max_position_embeddings=NATIVE)


@pytest.fixture(scope="module")
def rope_dir(make_tiny_checkpoint: TinyCheckpointFactory) -> Path:
    return make_tiny_checkpoint("rope", name="tiny-rope-prefix", native_context=NATIVE)


@pytest.fixture(scope="module")
def alibi_dir(make_tiny_checkpoint: TinyCheckpointFactory) -> Path:
    return make_tiny_checkpoint("alibi", name="tiny-alibi-prefix", native_context=NATIVE)


@contextmanager
def engine_for(
    directory: Path, *, prefix_cache: bool = True, kv_cache_bytes: int = 8 << 20
) -> Iterator[InferenceEngine]:
    decode = DecodeSettings(kv_cache_bytes=kv_cache_bytes, prefix_cache=prefix_cache)
    engine = InferenceEngine(load_models([directory], device="cpu", dtype="float32"), decode=decode)
    engine.start()
    try:
        yield engine
    finally:
        engine.shutdown()


def prompt(length: int, seed: int = 0) -> tuple[int, ...]:
    generator = torch.Generator().manual_seed(seed)
    return (256, *torch.randint(0, 256, (length - 1,), generator=generator).tolist())


def run(
    engine: InferenceEngine,
    model: str,
    prompts: Sequence[tuple[int, ...]],
    scaling: RopeScaling | None = None,
) -> list[GenerationResult]:
    """Each prompt in turn, to the end (so each finds what the ones before it published)."""
    results = []
    for index, tokens in enumerate(prompts):
        sampling = SamplingParams(max_new_tokens=6, temperature=0.0, logprobs=True, ignore_eos=True)
        final = list(engine.submit(GenerationRequest(f"p{index}", model, tokens, sampling, scaling)))[-1]
        assert isinstance(final, GenerationResult)
        results.append(final)
    return results


def assert_same_answers(ours: list[GenerationResult], reference: list[GenerationResult]) -> None:
    for cached, computed in zip(ours, reference, strict=True):
        assert cached.tokens == computed.tokens
        assert cached.logprobs is not None and computed.logprobs is not None
        assert max(abs(a - b) for a, b in zip(cached.logprobs, computed.logprobs, strict=True)) < TOLERANCE


@pytest.mark.parametrize(
    ("fixture", "model", "scaling"),
    [
        ("rope_dir", "tiny-rope-prefix", None),
        (
            "rope_dir",
            "tiny-rope-prefix",
            RopeScaling(type="yarn", factor=4.0, original_max_position_embeddings=NATIVE),
        ),
        ("alibi_dir", "tiny-alibi-prefix", None),
    ],
    ids=["rope", "rope-yarn", "alibi"],
)
def test_a_repeated_prompt_reads_its_prefix_from_the_cache(
    fixture: str, model: str, scaling: RopeScaling | None, request: pytest.FixtureRequest
) -> None:
    directory: Path = request.getfixturevalue(fixture)
    long = prompt(50)
    whole = prompt(48, seed=5)
    prompts = [long, long, (*long[:40], *prompt(20, seed=1)[1:]), whole, whole]
    with engine_for(directory) as engine:
        cached = run(engine, model, prompts, scaling)
    with engine_for(directory, prefix_cache=False) as engine:
        computed = run(engine, model, prompts, scaling)
    # 49 tokens before the last one: 3 whole blocks of 16; the third prompt shares 40 tokens: 2
    # blocks; a prompt of 3 whole blocks takes 2 and copies 15 tokens of the third.
    assert [result.cached_tokens for result in cached] == [0, 48, 32, 0, 47]
    assert [result.cached_tokens for result in computed] == [0] * 5
    assert_same_answers(cached, computed)


def test_another_scaling_or_model_default_shares_nothing(rope_dir: Path) -> None:
    long = prompt(50)
    with engine_for(rope_dir) as engine:
        first = run(engine, "tiny-rope-prefix", [long], RopeScaling(type="linear", factor=2.0))
        other = run(engine, "tiny-rope-prefix", [long], RopeScaling(type="linear", factor=4.0))
        default = run(engine, "tiny-rope-prefix", [long])
    assert [r.cached_tokens for r in (*first, *other, *default)] == [0, 0, 0]


def test_dynamic_ntk_shares_only_within_one_table(rope_dir: Path) -> None:
    """Bucketed dynamic NTK reads one table per length bucket: a prompt in another bucket computes
    its own entries, and a row that would cross a bucket while it runs neither reads nor publishes."""
    positions = tiny_transformer(native_context=NATIVE).positions
    key = positions.table_key
    base = prompt(70)
    same_bucket = (*base, *prompt(11, seed=2)[1:])  # 80 tokens
    next_bucket = (*base, *prompt(31, seed=3)[1:])  # 100 tokens
    assert key(DYNAMIC, 70) == key(DYNAMIC, 76) == key(DYNAMIC, 80) == key(DYNAMIC, 86)
    assert key(DYNAMIC, 100) != key(DYNAMIC, 70) and key(DYNAMIC, 100) == key(DYNAMIC, 106)
    crossing = prompt(88, seed=4)  # its 6 new tokens end at 94, past the bucket of 88
    assert key(DYNAMIC, 88) != key(DYNAMIC, 94)
    prompts = [base, same_bucket, next_bucket, crossing, crossing]
    with engine_for(rope_dir) as engine:
        cached = run(engine, "tiny-rope-prefix", prompts, DYNAMIC)
    with engine_for(rope_dir, prefix_cache=False) as engine:
        computed = run(engine, "tiny-rope-prefix", prompts, DYNAMIC)
    assert [result.cached_tokens for result in cached] == [0, 64, 0, 0, 0]
    assert_same_answers(cached, computed)


def test_a_row_reading_shared_blocks_is_unaffected_by_the_others_leaving(rope_dir: Path) -> None:
    """Two requests share a prefix while both run; the first one finishes and frees its blocks
    first, and the second still answers as if alone."""
    long = prompt(60)
    sampling = SamplingParams(max_new_tokens=30, temperature=0.0, logprobs=True, ignore_eos=True)
    with engine_for(rope_dir) as engine:
        first = engine.submit(GenerationRequest("a", "tiny-rope-prefix", long, sampling))
        stream = iter(first)
        next(stream)  # its prompt is done and published
        short = SamplingParams(max_new_tokens=2, temperature=0.0, logprobs=True, ignore_eos=True)
        second = list(engine.submit(GenerationRequest("b", "tiny-rope-prefix", long, short)))[-1]
        rest = list(stream)[-1]
        third = list(engine.submit(GenerationRequest("c", "tiny-rope-prefix", long, sampling)))[-1]
    assert isinstance(second, GenerationResult) and isinstance(rest, GenerationResult)
    assert isinstance(third, GenerationResult)
    assert second.cached_tokens == 48 and third.cached_tokens == 48
    assert rest.tokens[:2] == second.tokens and rest.tokens == third.tokens
    assert rest.logprobs is not None and third.logprobs is not None
    assert max(abs(a - b) for a, b in zip(rest.logprobs, third.logprobs, strict=True)) < TOLERANCE


def test_cached_blocks_are_evicted_oldest_first_inside_the_pool_bound() -> None:
    config = tiny_transformer(native_context=NATIVE).config
    pool = PagedKVCache(config, 7, device=torch.device("cpu"), dtype=torch.float32)  # 6 usable blocks
    first, second = prefix_keys("root", range(48)), prefix_keys("root", range(100, 148))
    row = pool.allocate(48, first)
    row.prefix = first
    blocks = list(row.blocks)
    assert row.length == 0 and pool.cached_blocks == 0
    pool.publish(row)
    pool.release(row)
    assert pool.cached_blocks == 3 and pool.free_blocks == 6 and pool.usage == 0.0
    again = pool.allocate(40, first[:2])  # 2 cached blocks and a fresh one
    assert again.length == 32 and again.blocks[:2] == blocks[:2]
    assert pool.fits(48) and not pool.fits(64)  # 2 never used and the idle third cached block
    other = pool.allocate(48, second)  # the 2 never-used blocks, then the idle one, evicted
    assert other.length == 0 and pool.cached_blocks == 2 and not pool.fits(1)
    pool.release(again)
    pool.release(other)
    assert pool.free_blocks == 6 and pool.cached_blocks == 2
    assert pool.allocate(48, first).length == 32  # the evicted tail is gone, its head is not


def test_a_limit_inside_a_cached_block_copies_its_head_and_keeps_the_block_cached() -> None:
    """A prompt of whole blocks asked again reads all but its last token: the block holding that
    token lends its head, copied into the row's own block, and stays cached even when the row's
    fresh blocks must evict idle ones."""
    config = tiny_transformer(native_context=NATIVE).config
    pool = PagedKVCache(config, 7, device=torch.device("cpu"), dtype=torch.float32)  # 6 usable blocks
    first, second = prefix_keys("root", range(48)), prefix_keys("root", range(100, 132))
    published = []
    for tokens, keys in ((48, first), (32, second)):
        row = pool.allocate(tokens, keys)
        row.prefix = keys
        published.append(list(row.blocks))
        for buffer in pool.keys + pool.values:
            buffer[:, row.blocks] = torch.randn_like(buffer[:, row.blocks])
        pool.publish(row)
        pool.release(row)
    (*shared, lender), _ = published
    # 1 block never used; idle, oldest first: the first prompt's tail (the lender), its head, the second's.
    assert pool.free_blocks == 6 and pool.cached_blocks == 5
    assert not pool.fits(96, first, limit=47)  # 4 fresh blocks would need the lender evicted
    row = pool.allocate(64, first, limit=47)  # 2 fresh: the unused block, then the oldest idle but the lender
    assert row.length == 47 and row.blocks[:2] == shared and lender not in row.blocks
    for buffer in pool.keys + pool.values:
        assert torch.equal(buffer[:, row.blocks[2], :15], buffer[:, lender, :15])
    pool.release(row)
    assert pool.allocate(48, first).length == 48  # the lender is still cached
