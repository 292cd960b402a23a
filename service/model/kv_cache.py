"""The cache interface of `Transformer.forward`, and a contiguous cache of right-padded rows.

`RowCache` is what a forward pass needs of a cache: rows with lengths, written a pass at a time.
Serving uses the paged pool (`service.model.paged_cache`); `KVCache` here keeps each row in one
contiguous buffer, for a document being scored and for tests and tools.

Each row is right-padded: row `i` holds its tokens at positions `0 .. lengths[i]-1` and whatever
lies beyond is masked out by attention. Rows therefore keep their absolute positions and no step
ever waits for the longest sequence.

Keys are stored rotated, as computed. That is exact as long as a row's RoPE table stays the same,
which is why every row also records the table its entries were computed with (`table_keys`, the
length-dependent part of its scaling) and its token ids: when the table changes with the length
(bucketed dynamic NTK, LongRoPE crossing the original context), the entries of *every* layer are
stale (deeper layers' keys come from hidden states that attended with the old table), and the
batch recomputes that row from its tokens (`service.model.refresh`).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Protocol

import torch
from torch import Tensor

from service.model.attention_rules import AttentionRule
from service.model.config import ModelConfig
from service.model.rule_attention import TurnedKeys, Windows


class RowCache(Protocol):
    """What `Transformer.forward` needs of a cache: rows with lengths, written a pass at a time.

    `KVCache` (contiguous rows, for scoring and tests) and `PagedRows` (rows of a block pool, for
    serving) both provide it.
    """

    @property
    def lengths(self) -> list[int]: ...

    @property
    def table_keys(self) -> list[Hashable]: ...

    @property
    def text_offsets(self) -> list[int]: ...

    def turned_keys(self, rules: Sequence[AttentionRule | None]) -> list[TurnedKeys | None]: ...

    def reserve(self, new_tokens: int) -> None: ...

    def key_positions(self) -> Tensor: ...

    def write(self, layer: int, keys: Tensor, values: Tensor) -> tuple[Windows, Windows]: ...

    def advance(
        self, tokens: Tensor, table_keys: Sequence[Hashable], counts: Sequence[int] | None = None
    ) -> None: ...

    def row_tokens(self, row: int) -> Tensor: ...

    def replace_row(self, row: int, source: KVCache) -> None: ...


class KVCache:
    """Per-layer buffers `[rows, n_kv_heads, capacity, head_dim]`, token ids, row lengths."""

    def __init__(
        self,
        keys: list[Tensor],
        values: list[Tensor],
        tokens: Tensor,
        lengths: list[int],
        table_keys: list[Hashable],
    ) -> None:
        self.keys = keys
        self.values = values
        self.tokens = tokens
        self.lengths = lengths
        self.table_keys = table_keys
        # The write positions of the pass in progress, computed once for all layers (None: rows of
        # equal length, written with one slice).
        self._pass_slots: tuple[Tensor, Tensor] | None = None
        self._window = 0  # the pass's key window, max(lengths) + T

    @property
    def text_offsets(self) -> list[int]:
        """Contiguous rows hold their whole text: every entry sits at its index."""
        return [0] * len(self.lengths)

    def turned_keys(self, rules: Sequence[AttentionRule | None]) -> list[TurnedKeys | None]:
        """None: a contiguous cache lives for one computation, its rule rows turn their windows."""
        return [None] * len(self.lengths)

    @classmethod
    def empty(
        cls, config: ModelConfig, batch_size: int, capacity: int, *, device: torch.device, dtype: torch.dtype
    ) -> KVCache:
        """Buffers for `batch_size` rows of up to `capacity` tokens.

        Rows of different lengths put padding inside each other's windows, and padding must be
        finite (a zero-weighted NaN is still NaN), so several rows start zeroed. A single row's
        window only ever covers what it wrote, so its buffers stay unwritten: zeroing a 4,000-token
        document's cache took about 20 ms in one step, a stall for every running stream.
        """
        shape = (batch_size, config.n_kv_heads, capacity, config.head_dim)
        allocate = torch.zeros if batch_size > 1 else torch.empty
        return cls(
            keys=[allocate(shape, device=device, dtype=dtype) for _ in range(config.n_layers)],
            values=[allocate(shape, device=device, dtype=dtype) for _ in range(config.n_layers)],
            tokens=torch.zeros(batch_size, capacity, dtype=torch.long, device=device),
            lengths=[0] * batch_size,
            table_keys=[None] * batch_size,
        )

    @property
    def capacity(self) -> int:
        return self.tokens.shape[1]

    def reserve(self, new_tokens: int) -> None:
        """Make room for `new_tokens` more per row, doubling capacity so growth is amortised.

        Called once per pass, before the layers write: the write positions are computed here too.
        """
        uniform = len(set(self.lengths)) == 1
        self._pass_slots = None if uniform else self._slots(new_tokens, self.tokens.device)
        needed = self._window = max(self.lengths) + new_tokens
        if needed > self.capacity:
            self._grow(max(needed, 2 * self.capacity))

    def key_positions(self) -> Tensor:
        """The position of each key of the pass's window `[1, max(lengths) + T]` (after `reserve`):
        a contiguous row holds its tokens in order, each key at its index."""
        assert self._window > 0, "reserve() first"
        return torch.arange(self._window, device=self.tokens.device)[None]

    def write(self, layer: int, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """Store `[B, n_kv_heads, T, head_dim]` after each row's tokens; return the key/value window.

        The pass must have called `reserve(T)` first. The window `[B, n_kv_heads, max(lengths) + T,
        head_dim]` is a view of the buffers; rows shorter than the longest carry padding there,
        which the attention mask excludes.
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
        if length > self.capacity:
            self._grow(length)
        for buffer, new in zip(self.keys + self.values, source.keys + source.values, strict=True):
            buffer[row, :, :length] = new[0, :, :length]
        self.tokens[row, :length] = source.tokens[0, :length]
        self.lengths[row] = length
        self.table_keys[row] = source.table_keys[0]

    @torch.inference_mode(False)
    def _grow(self, capacity: int) -> None:
        """New buffers of `capacity` positions with every entry copied in, the rest zero.

        Normal tensors even when a forward pass (inference mode) grows the cache: the buffers
        outlive the pass, and whoever holds the cache may write them outside inference mode.
        """
        length = self.capacity

        def grown(buffer: Tensor) -> Tensor:
            bigger = buffer.new_zeros((*buffer.shape[:2], capacity, *buffer.shape[3:]))
            bigger[:, :, :length] = buffer
            return bigger

        self.keys = [grown(buffer) for buffer in self.keys]
        self.values = [grown(buffer) for buffer in self.values]
        tokens = self.tokens.new_zeros((self.tokens.shape[0], capacity))
        tokens[:, :length] = self.tokens
        self.tokens = tokens

    def _slots(self, new_tokens: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """Row and position indices `[B, T]` where the next `new_tokens` per row go."""
        starts = torch.tensor(self.lengths, dtype=torch.long, device=device)
        positions = starts[:, None] + torch.arange(new_tokens, device=device)[None, :]
        rows = torch.arange(len(self.lengths), device=device)[:, None].expand_as(positions)
        return rows, positions
