"""A KV cache grown during a forward pass (inference mode) is still a cache whose rows can move
afterwards, outside inference mode, when other rows leave the batch.

Found by the soak: a prefill chunk padded past the cache's capacity resized it inside the forward
pass, a row left the prefill group at the end of the step, the row moved into its slot, and the
in-place copy into an inference tensor killed the engine process (and every request in flight).
"""

from __future__ import annotations

import torch

from service.model.config import ModelConfig
from service.model.kv_cache import KVCache

CONFIG = ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, native_context=16)


def test_rows_move_after_the_cache_grew_in_inference_mode() -> None:
    cache = KVCache.empty(CONFIG, batch_size=2, capacity=4, device=torch.device("cpu"), dtype=torch.float32)
    with torch.inference_mode():
        cache.reserve(16)  # what a forward pass does before its layers write
    assert cache.capacity >= 16
    order = cache.retain([False, True])  # outside inference mode, as the engine step does
    assert order == [1]
    assert cache.batch_size == 1
