"""Key/value cache for a batch of sequences of different lengths.

Each row is right-padded: row `i` holds its tokens at positions `0 .. lengths[i]-1` and whatever
lies beyond is masked out by attention. Rows therefore keep their absolute positions, a row can
leave or join the running batch by a single copy (`select` / `concat`), and no step ever waits
for the longest sequence.

Keys are stored *before* the rotary rotation. The model rotates the whole key window with the
table for each row's current length at every step, which is what keeps incremental decoding equal
to a full recompute even when the table itself changes with the length (dynamic NTK, LongRoPE):
there is no stale rotation in the cache to be wrong.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from service.model.config import ModelConfig


@dataclass
class KVCache:
    """Per-layer buffers `[B, n_kv_heads, capacity, head_dim]` plus each row's filled length."""

    keys: list[Tensor]
    values: list[Tensor]
    lengths: list[int]

    @classmethod
    def empty(
        cls, config: ModelConfig, batch_size: int, capacity: int, *, device: torch.device, dtype: torch.dtype
    ) -> KVCache:
        shape = (batch_size, config.n_kv_heads, capacity, config.head_dim)
        return cls(
            keys=[torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layers)],
            values=[torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layers)],
            lengths=[0] * batch_size,
        )

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    def reserve(self, new_tokens: int) -> None:
        """Make room for `new_tokens` more per row, doubling capacity so growth is amortised."""
        needed = max(self.lengths) + new_tokens
        if needed <= self.capacity:
            return
        capacity = max(needed, 2 * self.capacity)
        self.keys = [_grown(buffer, capacity) for buffer in self.keys]
        self.values = [_grown(buffer, capacity) for buffer in self.values]

    def write(self, layer: int, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """Store `[B, n_kv_heads, T, head_dim]` after each row's tokens; return the key/value window.

        The window `[B, n_kv_heads, max(lengths) + T, head_dim]` is a view of the buffers; rows
        shorter than the longest carry padding there, which the attention mask excludes.
        """
        new_tokens = keys.shape[2]
        key_buffer, value_buffer = self.keys[layer], self.values[layer]
        if len(set(self.lengths)) == 1:
            start = self.lengths[0]
            key_buffer[:, :, start : start + new_tokens] = keys
            value_buffer[:, :, start : start + new_tokens] = values
        else:
            rows, positions = self._scatter_index(new_tokens, keys.device)
            key_buffer[rows, :, positions] = keys.transpose(1, 2)
            value_buffer[rows, :, positions] = values.transpose(1, 2)
        window = max(self.lengths) + new_tokens
        return key_buffer[:, :, :window], value_buffer[:, :, :window]

    def advance(self, new_tokens: int) -> None:
        """Count the tokens every layer has just written (called once per forward, after the last)."""
        self.lengths = [length + new_tokens for length in self.lengths]

    def select(self, rows: Sequence[int]) -> KVCache:
        """A cache holding only `rows`, in that order (a copy: the running batch shrinks)."""
        index = torch.tensor(list(rows), dtype=torch.long, device=self.keys[0].device)
        return KVCache(
            keys=[buffer.index_select(0, index) for buffer in self.keys],
            values=[buffer.index_select(0, index) for buffer in self.values],
            lengths=[self.lengths[row] for row in rows],
        )

    @classmethod
    def concat(cls, caches: Sequence[KVCache]) -> KVCache:
        """Stack caches row-wise (a copy: sequences join the running batch)."""
        capacity = max(cache.capacity for cache in caches)
        n_layers = len(caches[0].keys)
        return cls(
            keys=[torch.cat([_grown(c.keys[layer], capacity) for c in caches]) for layer in range(n_layers)],
            values=[
                torch.cat([_grown(c.values[layer], capacity) for c in caches]) for layer in range(n_layers)
            ],
            lengths=[length for cache in caches for length in cache.lengths],
        )

    def _scatter_index(self, new_tokens: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """Row and position indices `[B, T]` of the slots the next `new_tokens` per row go to."""
        starts = torch.tensor(self.lengths, dtype=torch.long, device=device)
        positions = starts[:, None] + torch.arange(new_tokens, device=device)[None, :]
        rows = torch.arange(len(self.lengths), device=device)[:, None].expand_as(positions)
        return rows, positions


def _grown(buffer: Tensor, capacity: int) -> Tensor:
    """`buffer` with its position axis (dim 2) zero-padded to `capacity`."""
    missing = capacity - buffer.shape[2]
    if missing <= 0:
        return buffer
    padding = buffer.new_zeros(buffer.shape[0], buffer.shape[1], missing, buffer.shape[3])
    return torch.cat([buffer, padding], dim=2)
