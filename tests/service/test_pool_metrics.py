"""`pe_kv_cache_resident_bytes`: a CPU pool's pages in memory, counted apart from the rest of the
process's memory. The pool is sized at start-up but takes its pages as rows first write them, so
this is what a flat-memory check subtracts (bench/soak.py)."""

from __future__ import annotations

import sys

import pytest
import torch

from service.engine.pool_metrics import resident_bytes
from service.model.config import ModelConfig
from service.model.paged_cache import PagedKVCache

CONFIG = ModelConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2)


def pool(budget_mib: int) -> PagedKVCache:
    return PagedKVCache.within(
        CONFIG, budget_mib << 20, min_tokens=64, device=torch.device("cpu"), dtype=torch.float32
    )


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore's page accounting is Linux's")
def test_a_pools_pages_count_once_rows_write_them_and_never_past_its_size() -> None:
    cache = pool(8)
    assert resident_bytes(cache) == 0  # sized, not yet written
    row = cache.allocate(100)
    for buffer in cache.keys + cache.values:
        buffer[:, row.blocks] = 1.0
    written = resident_bytes(cache)
    assert 0 < written <= cache.nbytes
    for buffer in cache.keys + cache.values:
        buffer.fill_(1.0)
    assert resident_bytes(cache) == cache.nbytes


def test_a_pool_that_is_not_in_this_processs_memory_counts_whole() -> None:
    cache = pool(1)
    cache.keys = [key.to("meta") for key in cache.keys]
    cache.values = [value.to("meta") for value in cache.values]
    assert resident_bytes(cache) == cache.nbytes
