"""The right-padded KV cache: rows keep their own lengths through growth, joins and leaves."""

from __future__ import annotations

import torch

from service.model.config import ModelConfig
from service.model.kv_cache import KVCache
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


def test_select_and_concat_move_rows_with_their_lengths() -> None:
    joined = KVCache.concat([filled([2, 3], capacity=4), filled([6], capacity=8)])
    assert joined.lengths == [2, 3, 6] and joined.capacity == 8
    kept = joined.select([2, 0])
    assert kept.lengths == [6, 2]
    assert torch.equal(kept.values[0][0, 0, :6, 0], torch.arange(6, dtype=torch.float32))
    assert torch.equal(kept.row_tokens(1), torch.tensor([[0, 1]]))


def test_rows_leave_by_moving_the_last_rows_into_their_slots_and_join_into_free_slots() -> None:
    cache = filled([2, 3, 4, 5], capacity=8)
    slots = cache.keys[0].untyped_storage().data_ptr()
    order = cache.retain([False, True, False, True])  # rows 1 and 3 stay; row 3 moves into slot 0
    assert order == [3, 1] and cache.lengths == [5, 3]
    assert torch.equal(cache.keys[0][0, 0, :5, 0], 300 + torch.arange(5, dtype=torch.float32))
    assert torch.equal(cache.row_tokens(0), torch.arange(5)[None] + 300)
    poisoned = filled([1], capacity=8)
    poisoned.values[0][0, :, 1:] = float("nan")  # a leaving row's entries must not reach the next one
    cache.append(poisoned)
    cache.retain([True, True, False])
    cache.append(filled([2], capacity=4))  # into the slot the poisoned row left
    assert cache.lengths == [5, 3, 2]
    assert torch.isfinite(cache.values[0]).all()
    assert torch.equal(cache.keys[0][2, 0, :2, 0], torch.arange(2, dtype=torch.float32))
    assert cache.keys[0].untyped_storage().data_ptr() == slots  # no reallocation: the slots sufficed


@torch.inference_mode()
def test_rows_of_different_lengths_decode_like_separate_caches() -> None:
    torch.manual_seed(0)
    model = Transformer(CONFIG).eval()
    prompts = [torch.randint(0, 258, (1, length)) for length in (3, 9)]
    separate = [model.new_cache(1, 16) for _ in prompts]
    for prompt, cache in zip(prompts, separate, strict=True):
        model(prompt, cache=cache)
    batched = KVCache.concat([cache.select([0]) for cache in separate])
    step = torch.tensor([[7], [8]])
    together = model(step, cache=batched)[:, -1]
    for row, cache in enumerate(separate):
        alone = model(step[row : row + 1], cache=cache)[0, -1]
        assert torch.allclose(together[row], alone, atol=1e-5)
    assert batched.lengths == [4, 10]
