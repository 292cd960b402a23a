"""Key/value cache for a batch of sequences of different lengths.

Each row is right-padded: row `i` holds its tokens at positions `0 .. lengths[i]-1` and whatever
lies beyond is masked out by attention. Rows therefore keep their absolute positions, a row can
leave or join the running batch by a single copy (`select` / `concat`), and no step ever waits
for the longest sequence.

Keys are stored rotated, as computed. That is exact as long as a row's RoPE table stays the same,
which is why every row also records the table its entries were computed with (`table_keys`, the
length-dependent part of its scaling) and its token ids: when the table changes with the length
(dynamic NTK past the original context, LongRoPE crossing it), the entries of *every* layer are
stale (deeper layers' keys come from hidden states that attended with the old table), so the
model recomputes that row from its tokens. See `Transformer.forward`.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from service.model.config import ModelConfig


@dataclass
class KVCache:
    """Per-layer buffers `[B, n_kv_heads, capacity, head_dim]`, token ids `[B, capacity]`, lengths."""

    keys: list[Tensor]
    values: list[Tensor]
    tokens: Tensor
    lengths: list[int]
    table_keys: list[Hashable]
    # The slots of the pass in progress, computed once for all layers (None: rows of equal length).
    _pass_slots: tuple[Tensor, Tensor] | None = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def empty(
        cls, config: ModelConfig, batch_size: int, capacity: int, *, device: torch.device, dtype: torch.dtype
    ) -> KVCache:
        shape = (batch_size, config.n_kv_heads, capacity, config.head_dim)
        return cls(
            keys=[torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layers)],
            values=[torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layers)],
            tokens=torch.zeros(batch_size, capacity, dtype=torch.long, device=device),
            lengths=[0] * batch_size,
            table_keys=[None] * batch_size,
        )

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    @property
    def capacity(self) -> int:
        return self.tokens.shape[1]

    def reserve(self, new_tokens: int) -> None:
        """Make room for `new_tokens` more per row, doubling capacity so growth is amortised.

        Called once per pass, before the layers write: the write slots are computed here too.
        """
        uniform = len(set(self.lengths)) == 1
        self._pass_slots = None if uniform else self._slots(new_tokens, self.tokens.device)
        needed = max(self.lengths) + new_tokens
        if needed <= self.capacity:
            return
        capacity = max(needed, 2 * self.capacity)
        self.keys = [_grown(buffer, capacity, dim=2) for buffer in self.keys]
        self.values = [_grown(buffer, capacity, dim=2) for buffer in self.values]
        self.tokens = _grown(self.tokens, capacity, dim=1)

    def write(self, layer: int, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """Store `[B, n_kv_heads, T, head_dim]` after each row's tokens; return the key/value window.

        The pass must have called `reserve(T)` first.

        The window `[B, n_kv_heads, max(lengths) + T, head_dim]` is a view of the buffers; rows
        shorter than the longest carry padding there, which the attention mask excludes.
        """
        new_tokens = keys.shape[2]
        key_buffer, value_buffer = self.keys[layer], self.values[layer]
        if self._pass_slots is None:
            start = self.lengths[0]
            key_buffer[:, :, start : start + new_tokens] = keys
            value_buffer[:, :, start : start + new_tokens] = values
        else:
            rows, positions = self._pass_slots
            key_buffer[rows, :, positions] = keys.transpose(1, 2)
            value_buffer[rows, :, positions] = values.transpose(1, 2)
        window = max(self.lengths) + new_tokens
        return key_buffer[:, :, :window], value_buffer[:, :, :window]

    def advance(
        self, tokens: Tensor, table_keys: Sequence[Hashable], counts: Sequence[int] | None = None
    ) -> None:
        """Record the step's token ids `[B, T]` and tables once every layer has written its entries.

        `counts[i]` is how many of row i's tokens are real; the rest only padded the row to `T`.
        Their entries stay beyond the row's length, where attention never reads them before the
        row's next tokens overwrite them.
        """
        steps = counts if counts is not None else [tokens.shape[1]] * len(self.lengths)
        rows, positions = self._slots(tokens.shape[1], tokens.device)
        real = (
            torch.arange(tokens.shape[1], device=tokens.device)[None, :]
            < torch.tensor(list(steps), device=tokens.device)[:, None]
        )
        self.tokens[rows[real], positions[real]] = tokens[real]
        self.lengths = [length + step for length, step in zip(self.lengths, steps, strict=True)]
        self.table_keys = list(table_keys)

    def row_tokens(self, row: int) -> Tensor:
        """The token ids of one row `[1, lengths[row]]`."""
        return self.tokens[row : row + 1, : self.lengths[row]]

    def replace_row(self, row: int, source: KVCache) -> None:
        """Overwrite `row` with the single row of `source` (a recomputation of the same tokens)."""
        length = source.lengths[0]
        self.reserve(length - self.lengths[row])
        for buffer, new in zip(self.keys + self.values, source.keys + source.values, strict=True):
            buffer[row, :, :length] = new[0, :, :length]
        self.tokens[row, :length] = source.tokens[0, :length]
        self.lengths[row] = length
        self.table_keys[row] = source.table_keys[0]

    def select(self, rows: Sequence[int]) -> KVCache:
        """A cache holding only `rows`, in that order (a copy: the running batch shrinks)."""
        index = torch.tensor(list(rows), dtype=torch.long, device=self.tokens.device)
        return KVCache(
            keys=[buffer.index_select(0, index) for buffer in self.keys],
            values=[buffer.index_select(0, index) for buffer in self.values],
            tokens=self.tokens.index_select(0, index),
            lengths=[self.lengths[row] for row in rows],
            table_keys=[self.table_keys[row] for row in rows],
        )

    @classmethod
    def concat(cls, caches: Sequence[KVCache]) -> KVCache:
        """Stack caches row-wise (a copy: sequences join the running batch)."""
        capacity = max(cache.capacity for cache in caches)

        def stacked(buffers: Sequence[Tensor], dim: int) -> Tensor:
            return torch.cat([_grown(buffer, capacity, dim=dim) for buffer in buffers])

        n_layers = len(caches[0].keys)
        return cls(
            keys=[stacked([c.keys[layer] for c in caches], dim=2) for layer in range(n_layers)],
            values=[stacked([c.values[layer] for c in caches], dim=2) for layer in range(n_layers)],
            tokens=stacked([c.tokens for c in caches], dim=1),
            lengths=[length for cache in caches for length in cache.lengths],
            table_keys=[key for cache in caches for key in cache.table_keys],
        )

    def _slots(self, new_tokens: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """Row and position indices `[B, T]` of the slots the next `new_tokens` per row go to."""
        starts = torch.tensor(self.lengths, dtype=torch.long, device=device)
        positions = starts[:, None] + torch.arange(new_tokens, device=device)[None, :]
        rows = torch.arange(len(self.lengths), device=device)[:, None].expand_as(positions)
        return rows, positions


def _grown(buffer: Tensor, capacity: int, *, dim: int) -> Tensor:
    """`buffer` zero-padded along its position axis `dim` to `capacity`."""
    missing = capacity - buffer.shape[dim]
    if missing <= 0:
        return buffer
    shape = list(buffer.shape)
    shape[dim] = missing
    return torch.cat([buffer, buffer.new_zeros(shape)], dim=dim)
