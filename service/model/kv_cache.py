"""Key/value cache for a batch of sequences of different lengths, in slots that rows join and leave.

Each row is right-padded: row `i` holds its tokens at positions `0 .. lengths[i]-1` and whatever
lies beyond is masked out by attention. Rows therefore keep their absolute positions and no step
ever waits for the longest sequence.

The buffers have more slots than rows: the active rows are the first `batch_size` slots, which is
what the model reads (`keys`, `values` and `tokens` are views of them). A row joins by a copy of
its own entries into a free slot (`append`), and leaves by having the last active row moved into
its slot (`retain`): what a join or a leave costs is the rows that move, not the whole batch.

Keys are stored rotated, as computed. That is exact as long as a row's RoPE table stays the same,
which is why every row also records the table its entries were computed with (`table_keys`, the
length-dependent part of its scaling) and its token ids: when the table changes with the length
(bucketed dynamic NTK, LongRoPE crossing the original context), the entries of *every* layer are
stale (deeper layers' keys come from hidden states that attended with the old table), and the
engine recomputes that row from its tokens (`service.model.refresh`).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Protocol

import torch
from torch import Tensor

from service.model.config import ModelConfig


class RowCache(Protocol):
    """What `Transformer.forward` needs of a cache: rows with lengths, written a pass at a time.

    `KVCache` (contiguous rows, for scoring and tests) and `PagedRows` (rows of a block pool, for
    serving) both provide it.
    """

    @property
    def lengths(self) -> list[int]: ...

    @property
    def table_keys(self) -> list[Hashable]: ...

    def reserve(self, new_tokens: int) -> None: ...

    def write(self, layer: int, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]: ...

    def advance(
        self, tokens: Tensor, table_keys: Sequence[Hashable], counts: Sequence[int] | None = None
    ) -> None: ...

    def row_tokens(self, row: int) -> Tensor: ...

    def replace_row(self, row: int, source: KVCache) -> None: ...


class KVCache:
    """Per-layer slot buffers `[slots, n_kv_heads, capacity, head_dim]`, token ids, row lengths."""

    def __init__(
        self,
        keys: list[Tensor],
        values: list[Tensor],
        tokens: Tensor,
        lengths: list[int],
        table_keys: list[Hashable],
    ) -> None:
        self._keys = keys
        self._values = values
        self._tokens = tokens
        self.lengths = lengths
        self.table_keys = table_keys
        # The write slots of the pass in progress, computed once for all layers (None: rows of
        # equal length, written with one slice).
        self._pass_slots: tuple[Tensor, Tensor] | None = None

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
        return self._tokens.shape[1]

    @property
    def keys(self) -> list[Tensor]:
        """Per layer, the active rows' keys `[batch_size, n_kv_heads, capacity, head_dim]` (views)."""
        return [buffer[: self.batch_size] for buffer in self._keys]

    @property
    def values(self) -> list[Tensor]:
        return [buffer[: self.batch_size] for buffer in self._values]

    @property
    def tokens(self) -> Tensor:
        """The active rows' token ids `[batch_size, capacity]` (a view)."""
        return self._tokens[: self.batch_size]

    def reserve(self, new_tokens: int) -> None:
        """Make room for `new_tokens` more per row, doubling capacity so growth is amortised.

        Called once per pass, before the layers write: the write slots are computed here too.
        """
        uniform = len(set(self.lengths)) == 1
        self._pass_slots = None if uniform else self._slots(new_tokens, self._tokens.device)
        needed = max(self.lengths) + new_tokens
        if needed > self.capacity:
            self._resize(self._tokens.shape[0], max(needed, 2 * self.capacity))

    def write(self, layer: int, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """Store `[B, n_kv_heads, T, head_dim]` after each row's tokens; return the key/value window.

        The pass must have called `reserve(T)` first. The window `[B, n_kv_heads, max(lengths) + T,
        head_dim]` is a view of the buffers; rows shorter than the longest carry padding there,
        which the attention mask excludes.
        """
        new_tokens = keys.shape[2]
        rows = self.batch_size
        key_buffer, value_buffer = self._keys[layer][:rows], self._values[layer][:rows]
        if self._pass_slots is None:
            start = self.lengths[0]
            key_buffer[:, :, start : start + new_tokens] = keys
            value_buffer[:, :, start : start + new_tokens] = values
        else:
            slot_rows, positions = self._pass_slots
            key_buffer[slot_rows, :, positions] = keys.transpose(1, 2)
            value_buffer[slot_rows, :, positions] = values.transpose(1, 2)
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
        return self._tokens[row : row + 1, : self.lengths[row]]

    def replace_row(self, row: int, source: KVCache) -> None:
        """Overwrite `row` with the single row of `source` (a recomputation of the same tokens)."""
        length = source.lengths[0]
        if length > self.capacity:
            self._resize(self._tokens.shape[0], length)
        for buffer, new in zip(self._keys + self._values, source._keys + source._values, strict=True):
            buffer[row, :, :length] = new[0, :, :length]
        self._tokens[row, :length] = source._tokens[0, :length]
        self.lengths[row] = length
        self.table_keys[row] = source.table_keys[0]

    def select(self, rows: Sequence[int]) -> KVCache:
        """A new cache holding only `rows`, in that order (a copy of those rows alone)."""
        index = torch.tensor(list(rows), dtype=torch.long, device=self._tokens.device)
        return KVCache(
            keys=[buffer.index_select(0, index) for buffer in self._keys],
            values=[buffer.index_select(0, index) for buffer in self._values],
            tokens=self._tokens.index_select(0, index),
            lengths=[self.lengths[row] for row in rows],
            table_keys=[self.table_keys[row] for row in rows],
        )

    def append(self, other: KVCache) -> None:
        """Add `other`'s rows after ours, copying only them (slots double when they run out)."""
        start, count = self.batch_size, other.batch_size
        if start + count > self._tokens.shape[0] or other.capacity > self.capacity:
            self._resize(max(start + count, 2 * self._tokens.shape[0]), max(self.capacity, other.capacity))
        span = other.capacity
        buffers = zip(self._keys + self._values, other._keys + other._values, strict=True)
        for buffer, source in buffers:
            buffer[start : start + count, :, :span] = source[:count]
            buffer[start : start + count, :, span:] = 0  # a former occupant's entries, masked but not gone
        self._tokens[start : start + count, :span] = other._tokens[:count]
        self.lengths = self.lengths + list(other.lengths)
        self.table_keys = self.table_keys + list(other.table_keys)

    def retain(self, keep: Sequence[bool]) -> list[int]:
        """Keep the rows where `keep` holds, moving the last kept rows into the freed slots.

        Returns, for each row of the result, its index before: the caller reorders whatever it
        keeps per row the same way.
        """
        kept = [row for row, wanted in enumerate(keep) if wanted]
        holes = [row for row in range(len(kept)) if not keep[row]]
        movers = [row for row in kept if row >= len(kept)]
        order = list(range(len(kept)))
        for hole, mover in zip(holes, movers, strict=True):
            for buffer in self._keys + self._values:
                buffer[hole] = buffer[mover]
            self._tokens[hole] = self._tokens[mover]
            order[hole] = mover
        self.lengths = [self.lengths[row] for row in order]
        self.table_keys = [self.table_keys[row] for row in order]
        return order

    @classmethod
    def concat(cls, caches: Sequence[KVCache]) -> KVCache:
        """The rows of every cache, in order, in one new cache."""
        joined = caches[0].select(range(caches[0].batch_size))
        for cache in caches[1:]:
            joined.append(cache)
        return joined

    @torch.inference_mode(False)
    def _resize(self, slots: int, capacity: int) -> None:
        """New buffers of `slots` x `capacity`, the active rows copied in, the rest zero.

        Normal tensors even when a forward pass (inference mode) grows the cache: the buffers
        outlive the pass, and rows are moved in them outside it when others leave the batch.
        """
        rows, length = self.batch_size, self.capacity

        def resized(buffer: Tensor) -> Tensor:
            grown = buffer.new_zeros((slots, *buffer.shape[1:2], capacity, *buffer.shape[3:]))
            grown[:rows, :, :length] = buffer[:rows]
            return grown

        self._keys = [resized(buffer) for buffer in self._keys]
        self._values = [resized(buffer) for buffer in self._values]
        tokens = self._tokens.new_zeros((slots, capacity))
        tokens[:rows, :length] = self._tokens[:rows]
        self._tokens = tokens

    def _slots(self, new_tokens: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """Row and position indices `[B, T]` of the slots the next `new_tokens` per row go to."""
        starts = torch.tensor(self.lengths, dtype=torch.long, device=device)
        positions = starts[:, None] + torch.arange(new_tokens, device=device)[None, :]
        rows = torch.arange(len(self.lengths), device=device)[:, None].expand_as(positions)
        return rows, positions
