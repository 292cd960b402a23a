"""The pure math of Shaw, Transformer-XL and CoPE, and their PECache kinds, on real tensors."""

from __future__ import annotations

import math

import pytest
import torch
from prometheus_client import CollectorRegistry

from pe_runtime import (
    PECache,
    PEConfigError,
    cope_logits,
    cope_positions,
    relative_shift,
    relative_sinusoid,
    shaw_key_logits,
    shaw_relative_index,
    shaw_value_term,
)


@pytest.mark.parametrize(("queries", "keys"), [(1, 1), (1, 9), (5, 5), (4, 11), (7, 7)])
def test_relative_shift_equals_explicit_i_minus_j_indexing(queries: int, keys: int) -> None:
    """Scores against distances Tk-1 .. 0, shifted, equal gathering distance i - j directly."""
    generator = torch.Generator().manual_seed(queries * 100 + keys)
    scores = torch.randn(2, 3, queries, keys, generator=generator)  # column m: distance keys - 1 - m
    shifted = relative_shift(scores)
    offset = keys - queries  # query t sits at position offset + t
    for t in range(queries):
        for j in range(offset + t + 1):  # visible keys only: the rest is the mask's
            distance = offset + t - j
            assert torch.equal(shifted[..., t, j], scores[..., t, keys - 1 - distance])


def test_relative_sinusoid_is_descending_sin_then_cos_and_interpolates() -> None:
    table = relative_sinusoid(6, 8)
    freqs = [10000.0 ** (-2 * m / 8) for m in range(4)]
    for row, distance in enumerate(range(5, -1, -1)):
        expected = [math.sin(distance * f) for f in freqs] + [math.cos(distance * f) for f in freqs]
        assert table[row].tolist() == pytest.approx(expected, abs=1e-6)
    stretched = relative_sinusoid(12, 8, factor=2.0)
    assert torch.allclose(stretched[1::2], table[:], atol=1e-6)  # distances 10, 8, .. 0 read as 5 .. 0
    with pytest.raises(PEConfigError):
        relative_sinusoid(4, 7)
    with pytest.raises(PEConfigError):
        relative_sinusoid(4, 8, factor=0.5)


def test_shaw_index_clips_and_keeps_only_the_causal_side() -> None:
    relative = torch.tensor([-9, -4, -3, -1, 0, 1, 5])
    assert shaw_relative_index(relative, max_distance=3).tolist() == [3, 3, 3, 1, 0, 0, 0]
    with pytest.raises(PEConfigError):
        shaw_relative_index(relative, max_distance=0)


def test_shaw_terms_equal_per_pair_embeddings() -> None:
    generator = torch.Generator().manual_seed(0)
    queries = torch.randn(1, 2, 4, 5, generator=generator)
    table = torch.randn(3, 5, generator=generator)
    probabilities = torch.softmax(torch.randn(1, 2, 4, 6, generator=generator), dim=-1)
    relative = torch.arange(6)[None, :] - torch.arange(2, 6)[:, None]
    index = shaw_relative_index(relative, max_distance=2)[None, None]  # [1, 1, 4, 6]
    per_pair = table[index[0, 0]]  # [4, 6, d]
    assert torch.allclose(
        shaw_key_logits(queries, table, index), torch.einsum("bhid,ijd->bhij", queries, per_pair)
    )
    expected = torch.einsum("bhij,ijd->bhid", probabilities, per_pair)
    assert torch.allclose(shaw_value_term(probabilities, table, index), expected, atol=1e-6)


def test_cope_positions_count_gates_from_the_key_to_the_query_and_clip() -> None:
    gates = torch.tensor([[0.5, 1.0, 0.25, 0.0], [1.0, 1.0, 1.0, 1.0]])
    assert cope_positions(gates, npos_max=10).tolist() == [[1.75, 1.25, 0.25, 0.0], [4.0, 3.0, 2.0, 1.0]]
    assert cope_positions(gates, npos_max=2).tolist() == [[1.75, 1.25, 0.25, 0.0], [2.0, 2.0, 2.0, 1.0]]


def test_cope_logits_interpolate_between_integer_positions() -> None:
    queries = torch.tensor([[[[1.0, 2.0]]]])  # [1, 1, 1, 2]
    table = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0]])  # q.e = 0, 1, 2
    positions = torch.tensor([[[[0.0, 0.5, 1.25, 2.0]]]])
    assert cope_logits(queries, table, positions).flatten().tolist() == [0.0, 0.5, 1.25, 2.0]


def test_new_kinds_are_cached_views_and_counted_in_metrics() -> None:
    registry = CollectorRegistry()
    cache = PECache(registry=registry)
    index = cache.shaw_index(10, max_distance=4, device="cpu")
    assert torch.equal(index, shaw_relative_index(torch.arange(-9, 10), max_distance=4))
    assert torch.equal(cache.shaw_index(7, max_distance=4, device="cpu"), index[3:-3])
    table = cache.xl_relative(10, 8, device="cpu", dtype=torch.float32, factor=2.0)
    assert torch.equal(table, relative_sinusoid(16, 8, factor=2.0)[-10:])
    assert torch.equal(cache.xl_relative(3, 8, device="cpu", dtype=torch.float32, factor=2.0), table[-3:])
    for kind in ("shaw_index", "xl_relative"):
        labels = {"kind": kind, "device": "cpu"}
        assert registry.get_sample_value("pe_cache_misses_total", labels) == 1
        assert registry.get_sample_value("pe_cache_hits_total", labels) == 1
