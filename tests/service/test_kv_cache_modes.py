"""A KV cache grown during a forward pass (inference mode) is still a cache that can be written
afterwards, outside inference mode (a recomputed row replacing its entries, a tool editing it).

Found by the soak: a cache resized inside a forward pass became an inference tensor, and the next
in-place write outside inference mode raised, killing the engine process.
"""

from __future__ import annotations

import torch

from service.model.config import ModelConfig
from service.model.kv_cache import KVCache

CONFIG = ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, native_context=16)


def test_a_cache_grown_in_inference_mode_takes_writes_outside_it() -> None:
    cache = KVCache.empty(CONFIG, batch_size=2, capacity=4, device=torch.device("cpu"), dtype=torch.float32)
    with torch.inference_mode():
        cache.reserve(16)  # what a forward pass does before its layers write
    assert cache.capacity >= 16
    source = KVCache.empty(CONFIG, batch_size=1, capacity=16, device=torch.device("cpu"), dtype=torch.float32)
    source.lengths = [16]
    cache.replace_row(1, source)
    assert cache.lengths == [0, 16]
    assert not cache.keys[0].is_inference()
