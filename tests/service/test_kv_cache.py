"""The KV caches: contiguous rows keep their own lengths through growth; pool rows batch like them."""

from __future__ import annotations

import torch

from service.model.config import ModelConfig
from service.model.kv_cache import KVCache
from service.model.paged_cache import PagedKVCache, PagedRow, PagedRows
from service.model.transformer import Transformer
from tests.conftest import TINY_CONFIG

CONFIG = ModelConfig.from_dict(TINY_CONFIG)


def filled(lengths: list[int], capacity: int) -> KVCache:
    """A cache whose entries encode (row, position) so copies can be checked exactly."""
    cache = KVCache.empty(CONFIG, len(lengths), capacity, device=torch.device("cpu"), dtype=torch.float32)
    for row, length in enumerate(lengths):
        for buffer in cache.keys + cache.values:
            buffer[row, :, :length] = (100 * row + torch.arange(length, dtype=torch.float32))[None, :, None]
        cache.tokens[row, :length] = torch.arange(length) + 100 * row
    cache.lengths = list(lengths)
    return cache


def test_write_appends_after_each_rows_own_length_and_returns_the_window() -> None:
    cache = filled([2, 5], capacity=8)
    new = torch.full((2, CONFIG.n_kv_heads, 1, CONFIG.head_dim), -1.0)
    cache.reserve(1)  # every pass reserves its tokens before the layers write them
    keys, values = cache.write(0, new, new)
    assert keys.shape[2] == values.shape[2] == 6
    assert keys[0, 0, 2, 0] == -1 and values[1, 0, 5, 0] == -1
    assert keys[1, 0, 2, 0] == 102  # the longer row is untouched before its end


def test_growth_keeps_every_entry() -> None:
    cache = filled([3, 1], capacity=4)
    cache.reserve(5)
    assert cache.capacity >= 8
    assert torch.equal(cache.keys[1][0, 0, :3, 0], torch.tensor([0.0, 1.0, 2.0]))
    assert torch.equal(cache.row_tokens(0), torch.tensor([[0, 1, 2]]))


@torch.inference_mode()
def test_rows_of_different_lengths_decode_like_separate_caches() -> None:
    torch.manual_seed(0)
    model = Transformer(CONFIG).eval()
    prompts = [torch.randint(0, 258, (1, length)) for length in (3, 9)]
    separate = [model.new_cache(1, 16) for _ in prompts]
    pool = PagedKVCache(CONFIG, 8, device=torch.device("cpu"), dtype=torch.float32)
    slots = [pool.allocate(16) for _ in prompts]
    for prompt, cache, slot in zip(prompts, separate, slots, strict=True):
        model(prompt, cache=cache)
        model(prompt, cache=PagedRows(pool, [slot]))  # each row alone in the pool, then together
    batched = PagedRows(pool, slots)
    step = torch.tensor([[7], [8]])
    together = model(step, cache=batched)[:, -1]
    for row, cache in enumerate(separate):
        alone = model(step[row : row + 1], cache=cache)[0, -1]
        assert torch.allclose(together[row], alone, atol=1e-5)
    assert batched.lengths == [4, 10]


def test_a_padded_chunk_reaching_past_every_rows_blocks_still_gets_its_whole_window() -> None:
    """Row 0 is near the end of its one-block reservation, row 1 has a long chunk to read: the
    window (10 cached + 12 new) is wider than any row's blocks, and the scratch block fills it."""
    pool = PagedKVCache(CONFIG, 4, device=torch.device("cpu"), dtype=torch.float32)
    rows = PagedRows(pool, [pool.allocate(12), pool.allocate(14)])
    rows.rows[0].length = 10
    rows.reserve(12)
    new = torch.ones((2, CONFIG.n_kv_heads, 12, CONFIG.head_dim))
    keys, values = rows.write(0, new, new)
    assert isinstance(keys, torch.Tensor) and isinstance(values, torch.Tensor)  # no rule: the pass's windows
    assert keys.shape[2] == values.shape[2] == 22
    assert torch.equal(keys[1, :, :12], new[1])  # row 1's own entries, in its own block


@torch.inference_mode()
def test_a_lone_row_on_consecutive_blocks_reads_a_view_and_computes_what_scattered_blocks_do() -> None:
    """Two copies of one sequence, one on a run of blocks (read in place), one on blocks out of
    order (gathered): prompt chunks and decode passes give the same logits, and the run's window
    is the pool's own memory."""
    torch.manual_seed(0)
    model = Transformer(CONFIG).eval()
    pool = PagedKVCache(CONFIG, 12, device=torch.device("cpu"), dtype=torch.float32)
    consecutive = PagedRows(pool, [pool.allocate(40)])
    assert consecutive.rows[0].blocks == [1, 2, 3]
    scattered = PagedRows(pool, [PagedRow([9, 6, 11])])  # blocks the pool has not handed out
    tokens = torch.randint(0, 258, (1, 37))
    for chunk in (tokens[:, :20], tokens[:, 20:35], tokens[:, 35:36], tokens[:, 36:]):
        on_run, gathered = model(chunk, cache=consecutive), model(chunk, cache=scattered)
        assert torch.allclose(on_run, gathered, atol=1e-6)
    assert torch.equal(pool.keys[0][:, 1:3], pool.keys[0][:, [9, 6]])  # the same entries, in place
    consecutive.reserve(1)
    new = torch.zeros(1, CONFIG.n_kv_heads, 1, CONFIG.head_dim)
    keys, _ = consecutive.write(0, new, new)
    assert isinstance(keys, torch.Tensor)
    assert keys.untyped_storage().data_ptr() == pool.keys[0].untyped_storage().data_ptr()
