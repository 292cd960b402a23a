"""PECache: sharing, keying, growth, views, eviction, counters and metrics, on real tensors."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry

from pe_runtime import (
    PECache,
    RopeLayout,
    RopeScaling,
    alibi_slopes,
    rope_cos_sin,
    rope_inv_freq,
    sinusoidal_table,
)
from pe_runtime.t5 import t5_relative_position_bucket

YARN = RopeScaling(type="yarn", factor=4.0, original_max_position_embeddings=256)
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _cache(budget: int = 1 << 30) -> PECache:
    return PECache(budget, registry=None)


def _fetch(
    cache: PECache,
    *,
    head_dim: int = 16,
    base: float = 10000.0,
    scaling: RopeScaling | None = YARN,
    length: int = 100,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    layout: RopeLayout = "neox",
    seq_len: int | None = None,
) -> torch.Tensor:
    """The cos table for one key; defaults are the reference key the tests vary one field of."""
    tables = cache.rope(
        head_dim, base, scaling, length, device=device, dtype=dtype, layout=layout, seq_len=seq_len
    )
    return tables.cos


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def test_same_key_returns_the_same_storage_and_counts_a_hit() -> None:
    cache = _cache()
    first = cache.rope(16, 10000.0, YARN, 100, device="cpu", dtype=torch.float32)
    second = cache.rope(16, 10000.0, YARN, 100, device=torch.device("cpu"), dtype=torch.float32)
    assert _storage(first.cos) == _storage(second.cos) and _storage(first.sin) == _storage(second.sin)
    assert first.attention_factor == second.attention_factor == rope_inv_freq(16, 10000.0, YARN)[1]
    stats = cache.stats()
    assert stats.misses == {("rope", "cpu"): 1} and stats.hits == {("rope", "cpu"): 1}


def test_tables_equal_the_pure_functions() -> None:
    cache = _cache()
    tables = cache.rope(16, 10000.0, YARN, 100, device="cpu", dtype=torch.bfloat16, layout="gptj")
    inv_freq, attention_factor = rope_inv_freq(16, 10000.0, YARN)
    cos, sin = rope_cos_sin(inv_freq, attention_factor, 100, layout="gptj", dtype=torch.bfloat16)
    assert torch.equal(tables.cos, cos) and torch.equal(tables.sin, sin)
    assert tables.cos.shape == (100, 16) and tables.cos.dtype == torch.bfloat16


@pytest.mark.parametrize(
    "change",
    [
        {"dtype": torch.bfloat16},
        {"device": "meta"},
        {"head_dim": 32},
        {"base": 500000.0},
        {"layout": "gptj"},
        {"scaling": None},
        {"scaling": RopeScaling(type="yarn", factor=8.0, original_max_position_embeddings=256)},
        {"scaling": RopeScaling(type="yarn", factor=4.0, original_max_position_embeddings=512)},
        {"scaling": RopeScaling(type="yarn", factor=4.0, original_max_position_embeddings=256, beta_fast=16)},
        {"scaling": RopeScaling(type="yarn", factor=4.0, original_max_position_embeddings=256, beta_slow=2)},
        {
            "scaling": RopeScaling(
                type="yarn", factor=4.0, original_max_position_embeddings=256, truncate=False
            )
        },
        {"scaling": RopeScaling(type="yarn", factor=4.0, original_max_position_embeddings=256, mscale=0.5)},
        {
            "scaling": RopeScaling(
                type="yarn", factor=4.0, original_max_position_embeddings=256, attention_factor=2.0
            )
        },
        {
            "scaling": RopeScaling(
                type="yarn", factor=4.0, original_max_position_embeddings=256, mscale_all_dim=1
            )
        },
        {"scaling": RopeScaling(type="dynamic", factor=4.0, original_max_position_embeddings=256)},
        {"scaling": RopeScaling(type="linear", factor=4.0)},
        {"scaling": RopeScaling(type="ntk", factor=4.0)},
    ],
)
def test_any_difference_in_the_key_is_never_shared(change: dict[str, Any]) -> None:
    cache = _cache()
    base = _fetch(cache)
    other = _fetch(cache, **change)
    assert other.device.type == "meta" or _storage(other) != _storage(base)
    assert sum(cache.stats().misses.values()) == 2


def test_static_scalings_share_one_entry_across_sequence_lengths() -> None:
    cache = _cache()
    assert _storage(_fetch(cache, seq_len=10)) == _storage(_fetch(cache, seq_len=100_000))


def test_dynamic_keys_on_the_length_only_past_the_original() -> None:
    cache = _cache()
    dynamic = RopeScaling(type="dynamic", factor=4.0, original_max_position_embeddings=64)
    short = {_storage(_fetch(cache, scaling=dynamic, seq_len=n)) for n in (None, 10, 64)}
    long = {_storage(_fetch(cache, scaling=dynamic, seq_len=n)) for n in (65, 200)}
    assert len(short) == 1 and len(long) == 2 and not short & long


def test_bucketed_dynamic_shares_one_table_per_bucket() -> None:
    """Bucketed dynamic NTK: lengths 65..90 share the 91 bucket (original 64), 91 and 92 do not."""
    cache = _cache()
    dynamic = RopeScaling(type="dynamic", factor=4.0, original_max_position_embeddings=64)
    assert dynamic.dynamic_mode == "bucketed"
    first = {_storage(_fetch(cache, scaling=dynamic, seq_len=n)) for n in range(65, 91)}
    assert len(first) == 1
    assert _storage(_fetch(cache, scaling=dynamic, seq_len=92)) not in first


def test_length_dependent_tables_never_evict_static_ones() -> None:
    """Dynamic NTK in hf mode builds a table per length; they churn a budget of their own."""
    table_bytes = 2 * 128 * 16 * 4  # cos + sin [128, head_dim 16] float32: 100 positions grown to 128
    cache = PECache(4 * table_bytes, length_dependent_budget_bytes_per_device=2 * table_bytes, registry=None)
    static = _storage(_fetch(cache))
    hf_dynamic = RopeScaling(
        type="dynamic", factor=4.0, original_max_position_embeddings=64, dynamic_mode="hf"
    )
    for seq_len in range(65, 100):
        _fetch(cache, scaling=hf_dynamic, seq_len=seq_len)
    assert _storage(_fetch(cache)) == static
    stats = cache.stats()
    assert stats.bytes["cpu"] <= 3 * table_bytes
    assert stats.evictions["cpu"] == len(range(65, 100)) - 2


def test_longrope_keys_on_the_side_of_the_original_length() -> None:
    cache = _cache()
    longrope = RopeScaling(
        type="longrope",
        factor=4.0,
        original_max_position_embeddings=64,
        short_factor=(1.0,) * 8,
        long_factor=(2.0,) * 8,
    )
    short = {_storage(_fetch(cache, scaling=longrope, seq_len=n)) for n in (None, 64)}
    long = {_storage(_fetch(cache, scaling=longrope, seq_len=n)) for n in (65, 1000)}
    assert len(short) == 1 and len(long) == 1 and not short & long


def test_growth_to_the_next_power_of_two_and_views_for_shorter() -> None:
    cache = _cache()
    first = _fetch(cache, length=100)
    assert first.untyped_storage().nbytes() == 128 * 16 * 4
    grown = _fetch(cache, length=129)
    assert grown.untyped_storage().nbytes() == 256 * 16 * 4 and grown.shape == (129, 16)
    shorter = _fetch(cache, length=7)
    assert _storage(shorter) == _storage(grown) and shorter.shape == (7, 16)
    torch.testing.assert_close(shorter, grown[:7], rtol=0, atol=0)
    assert cache.stats().misses == {("rope", "cpu"): 2} and cache.stats().hits == {("rope", "cpu"): 1}
    assert cache.stats().bytes == {"cpu": 2 * 256 * 16 * 4}


def test_lru_eviction_under_a_small_budget() -> None:
    entry_bytes = 2 * 128 * 16 * 4  # cos + sin, 128 positions, 16 channels, float32
    cache = _cache(budget=2 * entry_bytes)
    scalings = [RopeScaling(type="linear", factor=f) for f in (2.0, 3.0, 4.0)]
    _fetch(cache, scaling=scalings[0])
    _fetch(cache, scaling=scalings[1])
    _fetch(cache, scaling=scalings[0])  # now the most recently used
    _fetch(cache, scaling=scalings[2])  # evicts scalings[1]
    stats = cache.stats()
    assert (
        stats.evictions == {"cpu": 1}
        and stats.entries == {"cpu": 2}
        and stats.bytes == {"cpu": 2 * entry_bytes}
    )
    _fetch(cache, scaling=scalings[0])
    assert cache.stats().hits == {("rope", "cpu"): 2}
    _fetch(cache, scaling=scalings[1])
    assert cache.stats().misses == {("rope", "cpu"): 4}


def test_an_entry_larger_than_the_budget_is_served_but_not_kept() -> None:
    cache = _cache(budget=1024)
    table = _fetch(cache, length=1000)
    assert table.shape == (1000, 16)
    assert cache.stats().bytes == {"cpu": 0} and cache.stats().entries == {"cpu": 0}


def test_devices_are_keyed_and_budgeted_separately() -> None:
    cache = _cache()
    on_cpu = _fetch(cache)
    on_meta = _fetch(cache, device="meta")
    assert on_meta.device.type == "meta" and on_meta.shape == on_cpu.shape
    stats = cache.stats()
    assert stats.misses == {("rope", "cpu"): 1, ("rope", "meta"): 1}
    assert stats.bytes == {"cpu": 2 * 128 * 16 * 4, "meta": 2 * 128 * 16 * 4}


def test_other_kinds_equal_the_pure_functions() -> None:
    cache = _cache()
    slopes = cache.alibi_slopes(12, device="cpu", dtype=torch.bfloat16)
    assert torch.equal(slopes, alibi_slopes(12).to(torch.bfloat16))
    assert _storage(cache.alibi_slopes(12, device="cpu", dtype=torch.bfloat16)) == _storage(slopes)
    table = cache.sinusoidal(50, 24, device="cpu", dtype=torch.float32)
    assert torch.equal(table, sinusoidal_table(50, 24))
    buckets = cache.t5_buckets(40, bidirectional=True, num_buckets=32, max_distance=128, device="cpu")
    relative = torch.arange(-39, 40)
    expected = t5_relative_position_bucket(relative, bidirectional=True, num_buckets=32, max_distance=128)
    assert torch.equal(buckets, expected)
    stats = cache.stats()
    assert stats.hits[("alibi_slopes", "cpu")] == 1
    assert stats.misses == {("alibi_slopes", "cpu"): 1, ("sinusoidal", "cpu"): 1, ("t5_buckets", "cpu"): 1}


def test_t5_bucket_views_index_by_key_minus_query() -> None:
    cache = _cache()
    cache.t5_buckets(100, bidirectional=False, num_buckets=32, max_distance=64, device="cpu")
    length = 9
    buckets = cache.t5_buckets(length, bidirectional=False, num_buckets=32, max_distance=64, device="cpu")
    assert buckets.shape == (2 * length - 1,)
    queries, keys = torch.arange(length)[:, None], torch.arange(length)[None, :]
    matrix = buckets[keys - queries + length - 1]
    expected = t5_relative_position_bucket(
        keys - queries, bidirectional=False, num_buckets=32, max_distance=64
    )
    assert torch.equal(matrix, expected)
    assert cache.stats().hits == {("t5_buckets", "cpu"): 1}


def test_prometheus_metrics_mirror_stats() -> None:
    registry = CollectorRegistry()
    cache = PECache(2 * 2 * 128 * 16 * 4, registry=registry)
    for factor in (2.0, 3.0, 4.0, 2.0):
        _fetch(cache, scaling=RopeScaling(type="linear", factor=factor))
    _fetch(cache, scaling=RopeScaling(type="linear", factor=4.0))
    cache.alibi_slopes(4, device="meta", dtype=torch.float32)

    def sample(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    assert sample("pe_cache_misses_total", kind="rope", device="cpu") == 4
    assert sample("pe_cache_hits_total", kind="rope", device="cpu") == 1
    assert sample("pe_cache_misses_total", kind="alibi_slopes", device="meta") == 1
    assert sample("pe_cache_evictions_total", device="cpu") == 2
    assert sample("pe_cache_bytes", device="cpu") == cache.stats().bytes["cpu"] == 2 * 2 * 128 * 16 * 4


def test_a_second_cache_on_the_same_registry_is_refused() -> None:
    registry = CollectorRegistry()
    PECache(registry=registry)
    with pytest.raises(ValueError, match="pe_cache"):
        PECache(registry=registry)


@pytest.mark.cuda
@requires_cuda
def test_cuda_entries_are_separate_from_cpu_and_cuda_aliases_share() -> None:
    cache = _cache()
    on_cpu = _fetch(cache)
    on_cuda = _fetch(cache, device="cuda")
    assert on_cuda.is_cuda
    torch.testing.assert_close(on_cuda.cpu(), on_cpu)
    index = torch.cuda.current_device()
    assert _storage(_fetch(cache, device=f"cuda:{index}")) == _storage(on_cuda)
    assert cache.stats().misses == {("rope", "cpu"): 1, ("rope", f"cuda:{index}"): 1}


@pytest.mark.cuda
@requires_cuda
def test_cuda_bfloat16_table_matches_the_cpu_one() -> None:
    cache = _cache()
    on_cpu = _fetch(cache, dtype=torch.bfloat16, length=4096)
    on_cuda = _fetch(cache, dtype=torch.bfloat16, length=4096, device="cuda")
    torch.testing.assert_close(on_cuda.cpu(), on_cpu, rtol=0, atol=2**-8)
