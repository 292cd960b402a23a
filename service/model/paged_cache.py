"""A model's key/value memory as a pool of fixed-size blocks, and the rows of a batch that use it.

Each running sequence owns a list of blocks, allocated once when it is admitted (enough for its
prompt and `max_new_tokens`), and written in place by index until it leaves: rows joining or
leaving a batch copy nothing, and memory in use follows the tokens the sequences can reach, not
the longest context the model allows. The pool is sized once, from a byte budget, so its memory
is bounded and known at start-up (`kv_cache_usage` reports how much of it is reserved).

Prefix caching (vLLM's automatic prefix caching, llama.cpp's prompt cache): a block that holds
a whole block of a finished prompt is published under a chain key (`prefix_keys`: the key of
everything before it, its tokens, and a root naming the row's scaling and table), and a later
request whose prompt starts with the same blocks under the same root reuses them instead of
computing them again. Blocks are reference-counted; a published block nobody uses stays cached
and is evicted least recently used first, inside the same pool bound, only when a fresh block is
needed. Shared blocks are only read: a row writes past its length. A row reuses at most the
tokens before its prompt's last one, whose logits its own pass must give; where that limit ends
inside a cached block (a prompt of whole blocks, asked again), the row copies the block's head
into a block of its own rather than computing a whole block again (llama.cpp's prompt cache
likewise recomputes one token, not 16).

Block 0 is never handed out. Writes that belong to nobody (positions past a row's reservation
when a prefill chunk pads a short row to the group's width, padding rows of a fixed-shape decode
step) land there, and nothing reads it as a real entry: every read is masked by the row's length.

`PagedRows` gives a group of rows the cache interface `Transformer.forward` uses (`reserve`,
`write`, `advance`, `lengths`), so the eager path reads windows gathered from the blocks, while
the fast passes (`attention.PagedStep`, the C pass) index the blocks themselves.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from service.model.attention_rules import AttentionRule
from service.model.config import ModelConfig
from service.model.kernels.huge_pages import HugePageArena
from service.model.kv_cache import KVCache
from service.model.rule_attention import TurnedKeys, Windows, grown_capacity

BLOCK_SIZE = 16
SCRATCH_BLOCK = 0  # what padded block tables name; 0, so that zero padding names it too


@dataclass(eq=False)
class PagedRow:
    """One sequence's place in the pool: its blocks, cached length, table and token ids."""

    blocks: list[int]
    length: int = 0
    table_key: Hashable = None
    tokens: list[int] = field(default_factory=list)  # the ids behind its entries, to recompute them
    prefix: list[bytes] = field(default_factory=list)  # the keys its prompt's whole blocks publish
    # Tokens of its text whose blocks it gave back (`PagedKVCache.slide`): slots past its head
    # hold text index slot + dropped.
    dropped: int = 0
    turned: TurnedKeys | None = None  # its keys turned for its attention rule, made on first use
    copy: WindowCopy | None = None  # its window kept contiguous under a rule, where its blocks are not a run

    @property
    def side_bytes(self) -> int:
        """What its copies beside the pool hold (`turned`, `copy`)."""
        return sum(kept.nbytes for kept in (self.turned, self.copy) if kept is not None)


class WindowCopy:
    """A rule row's key and value windows kept contiguous across its passes, per layer.

    A row under an attention rule runs on the model's own layers, which read its window as one
    tensor; on blocks that do not follow each other (a prompt that reused cached blocks, a free list
    in pieces) that took a gather of every cached entry in every layer, a third of a decode step at
    8k. The copy takes only what each pass adds: the entries the row has committed stay as copied
    (a failed pass's slots past them are copied again), and a row that gave back blocks
    (`PagedKVCache.slide`, its slots moved) or was recomputed (`PagedRows.replace_row`) is copied
    afresh. Like its turned keys, it lives beside the pool, outside its bound: such a row holds its
    entries twice. It grows as `TurnedKeys` does, up to the row's reservation."""

    def __init__(self) -> None:
        self._kept: dict[int, tuple[Tensor, Tensor, int]] = {}  # layer: keys, values, slots copied
        self._dropped = 0

    @property
    def nbytes(self) -> int:
        return sum(
            keys.numel() * keys.element_size() + values.numel() * values.element_size()
            for keys, values, _ in list(self._kept.values())
        )

    def windows(
        self, layer: int, pages: tuple[Tensor, Tensor], row: PagedRow, block_size: int, window: int
    ) -> tuple[Tensor, Tensor]:
        """The row's first `window` slots of `pages` (keys, values `[Hkv, blocks, size, hd]`) as
        `[Hkv, window, hd]` each, copying from the pool only the blocks not yet copied. Slots past
        the row's blocks (a padded chunk at the end of its reservation) hold nothing it reads."""
        if row.dropped != self._dropped:
            self._kept.clear()
            self._dropped = row.dropped
        keys, values, copied = self._kept.get(layer, (None, None, 0))
        first_block = min(copied, row.length) // block_size
        first = first_block * block_size
        if keys is None or values is None or keys.shape[1] < window:
            held = keys.shape[1] if keys is not None else 0
            capacity = grown_capacity(window, held, len(row.blocks) * block_size)
            grown = [page.new_empty((page.shape[0], capacity, page.shape[-1])) for page in pages]
            if keys is not None and values is not None:
                grown[0][:, :first], grown[1][:, :first] = keys[:, :first], values[:, :first]
            keys, values = grown
        held = min(window, len(row.blocks) * block_size)
        blocks = torch.tensor(row.blocks[first_block : math.ceil(held / block_size)], device=keys.device)
        for buffer, page in zip((keys, values), pages, strict=True):
            buffer[:, first:held] = page.index_select(1, blocks).flatten(1, 2)[:, : held - first]
        self._kept[layer] = (keys, values, held)
        return keys[:, :window], values[:, :window]


class PagedKVCache:
    """Per layer, key and value blocks `[n_kv_heads, num_blocks, block_size, head_dim]`.

    Heads outermost: gathering a row's blocks then gives, per head, its window `[W, head_dim]` in
    one contiguous piece, which is what attention kernels read fastest.
    """

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        *,
        block_size: int = BLOCK_SIZE,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        if num_blocks < 2:
            raise ValueError("a paged cache needs at least one block besides the scratch block")
        shape = (config.n_kv_heads, num_blocks, block_size, config.head_dim)
        self.block_size = block_size
        # On a CPU, pages of 2 MiB where the system has them (attention reads a row's blocks
        # scattered over the pool: SmolLM2 at 16 rows of 2,000 tokens stepped in 90-94 ms against
        # 104-105), taken as rows first write them.
        arena = HugePageArena() if torch.device(device).type == "cpu" else None

        def zeros() -> Tensor:
            if arena is not None:
                return arena.zeros(shape, dtype)
            return torch.zeros(shape, device=device, dtype=dtype)

        self.keys = [zeros() for _ in range(config.n_layers)]
        self.values = [zeros() for _ in range(config.n_layers)]
        # The position of every cached key, by block and offset: what positional rules read (the
        # score biases today), so that a key's position is data, not its block index. A pass
        # records its new keys' positions before its layers run (`PagedRows.place`).
        self.key_positions = torch.zeros((num_blocks, block_size), dtype=torch.long, device=device)
        self._free = list(range(num_blocks - 1, SCRATCH_BLOCK, -1))
        self._references = [0] * num_blocks
        self._rows: set[PagedRow] = set()  # rows holding blocks, for what they hold beside the pool
        self._key_of: dict[int, bytes] = {}  # published blocks and their prefix keys
        self._published: dict[bytes, int] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # published, unused: oldest first
        self.queried_tokens = 0  # prompt tokens of the requests admitted with a prefix to look up
        self.hit_tokens = 0  # of those, the tokens read from cached blocks

    @classmethod
    def within(
        cls,
        config: ModelConfig,
        budget_bytes: int,
        *,
        min_tokens: int,
        max_tokens: int | None = None,
        block_size: int = BLOCK_SIZE,
        device: torch.device,
        dtype: torch.dtype,
    ) -> PagedKVCache:
        """The largest pool that fits `budget_bytes`, within `min_tokens` and `max_tokens`.

        `min_tokens` is the longest request the model accepts: a budget below it would leave
        such a request waiting forever, so the floor wins and the budget is exceeded instead.
        `max_tokens` is the most the batch can ever hold (its rows times the longest request):
        memory past it would never be used.
        """
        per_block = bytes_per_token(config, dtype) * block_size
        blocks = budget_bytes // per_block
        if max_tokens is not None:
            blocks = min(blocks, math.ceil(max_tokens / block_size))
        blocks = max(blocks, math.ceil(min_tokens / block_size)) + 1
        return cls(config, blocks, block_size=block_size, device=device, dtype=dtype)

    @property
    def total_blocks(self) -> int:
        """Blocks that can be handed out (the scratch block is not one)."""
        return self.keys[0].shape[1] - 1

    @property
    def free_blocks(self) -> int:
        """Blocks a new sequence can take: never used, or cached by nobody running (evictable)."""
        return len(self._free) + len(self._idle)

    @property
    def cached_blocks(self) -> int:
        """Blocks holding a published prompt prefix, in use or not."""
        return len(self._published)

    @property
    def usage(self) -> float:
        """The fraction of blocks reserved by running sequences, 0 to 1."""
        return 1.0 - self.free_blocks / self.total_blocks

    @property
    def nbytes(self) -> int:
        return sum(buffer.numel() * buffer.element_size() for buffer in self.keys + self.values)

    @property
    def side_bytes(self) -> int:
        """What the rows now holding blocks keep beside the pool, outside `nbytes`: rows under an
        attention rule, their keys turned for it and their windows copied (`PagedRow.side_bytes`).
        Read by `/metrics`, on another thread when the engine runs on one: each collection is
        copied (`list`, one step under the interpreter lock) before it is walked."""
        return sum(row.side_bytes for row in list(self._rows))

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)

    def fits(self, tokens: int, prefix: Sequence[bytes] = (), limit: int | None = None) -> bool:
        """Whether a sequence of `tokens` can be admitted now, reusing what it can of `prefix`'s
        first `limit` tokens (all of its blocks by default)."""
        shared, head = self._reusable(prefix, limit)
        held = [block for block in shared + _lender(head) if self._references[block] == 0]
        return self.blocks_for(tokens) - len(shared) <= self.free_blocks - len(held)

    def allocate(self, tokens: int, prefix: Sequence[bytes] = (), limit: int | None = None) -> PagedRow:
        """Blocks for `tokens`: first the cached blocks of `prefix`, then fresh ones, evicting idle
        cached blocks when none is free. The row reads at most `limit` tokens from the cache (its
        `length` says how many); a cached block that `limit` ends inside lends its head, copied."""
        if not self.fits(tokens, prefix, limit):
            raise MemoryError(f"{tokens} tokens need {self.blocks_for(tokens)} KV blocks; too few are free")
        shared, head = self._reusable(prefix, limit)
        for block in shared + _lender(head):  # the lender too, so that no fresh block evicts it
            self._idle.pop(block, None)
            self._references[block] += 1
        fresh = [self._take() for _ in range(self.blocks_for(tokens) - len(shared))]
        length = len(shared) * self.block_size
        if head:
            block, count = head
            for buffer in self.keys + self.values:
                buffer[:, fresh[0], :count] = buffer[:, block, :count]
            self.key_positions[fresh[0], :count] = self.key_positions[block, :count]
            self._unreference(block)
            length += count
        row = PagedRow(shared + fresh, length=length)
        self._rows.add(row)
        return row

    def publish(self, row: PagedRow) -> None:
        """Offer the row's whole prompt blocks (`row.prefix`, once written) to later requests; a
        key another block already holds keeps that block."""
        for block, key in zip(row.blocks, row.prefix, strict=False):
            if block not in self._key_of and key not in self._published:
                self._key_of[block] = key
                self._published[key] = block

    def slide(self, row: PagedRow, *, head: int, window: int, room: int) -> bool:
        """Give back the row's blocks that lie wholly between its first `head` slots and its last
        `window` entries, so that a row attending to sinks and a window (StreamingLLM) holds a
        bounded number of blocks however long its text grows; keep room for `room` more entries,
        reusing a dropped block at the tail before taking a free one. The remaining entries keep
        the positions recorded for them (`key_positions`) and move down to fill the gap (their
        count is added to `row.dropped`). Returns whether the row's blocks changed."""
        size = self.block_size
        before = list(row.blocks)
        first = math.ceil(head / size)  # blocks holding the head stay where they are
        last = max(first, (row.length - window) // size)  # blocks wholly before the window
        released = row.blocks[first:last]
        del row.blocks[first:last]
        row.length -= len(released) * size
        row.dropped += len(released) * size
        while len(row.blocks) * size < row.length + room:
            row.blocks.append(released.pop() if released else self._take())
        for block in released:
            self._unreference(block)
        return row.blocks != before

    def release(self, row: PagedRow) -> None:
        """Give the row's blocks back, and its copies with them; published blocks stay cached until
        evicted, the tail first."""
        for block in reversed(row.blocks):
            self._unreference(block)
        row.blocks = []
        row.turned = row.copy = None
        self._rows.discard(row)

    def _unreference(self, block: int) -> None:
        self._references[block] -= 1
        if self._references[block] > 0:
            return
        if block in self._key_of:
            self._idle[block] = None
        else:
            self._free.append(block)

    def _reusable(
        self, prefix: Sequence[bytes], limit: int | None
    ) -> tuple[list[int], tuple[int, int] | None]:
        """The cached blocks wholly before `limit`, and (block, count) where `limit` ends `count`
        tokens into a further cached block."""
        cached = self._cached(prefix)
        if limit is None:
            return cached, None
        whole, count = divmod(limit, self.block_size)
        if count and len(cached) > whole:
            return cached[:whole], (cached[whole], count)
        return cached[:whole], None

    def _cached(self, prefix: Sequence[bytes]) -> list[int]:
        """The published blocks of `prefix`'s leading keys, up to the first one not cached."""
        blocks = []
        for key in prefix:
            block = self._published.get(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def _take(self) -> int:
        if self._free:
            block = self._free.pop()
        else:
            block, _ = self._idle.popitem(last=False)
            del self._published[self._key_of.pop(block)]
        self._references[block] = 1
        return block


def _lender(head: tuple[int, int] | None) -> list[int]:
    """The block that lends its head to a row, as a list of none or one."""
    return [head[0]] if head else []


def _run_start(blocks: Sequence[int]) -> int | None:
    """The first of `blocks` when they follow each other in the pool, else None."""
    consecutive = bool(blocks) and list(blocks) == list(range(blocks[0], blocks[0] + len(blocks)))
    return blocks[0] if consecutive else None


def prefix_keys(root: Hashable, tokens: Sequence[int], block_size: int = BLOCK_SIZE) -> list[bytes]:
    """The chain keys of the whole blocks of `tokens`: block i's key covers `root` (what else the
    entries depend on: the scaling and its table) and every token up to the end of block i."""
    keys: list[bytes] = []
    key = hashlib.sha256(repr(root).encode()).digest()
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = b"".join(token.to_bytes(4, "little") for token in tokens[start : start + block_size])
        key = hashlib.sha256(key + block).digest()
        keys.append(key)
    return keys


def bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """Keys and values of one token in every layer."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * config.n_layers * config.n_kv_heads * config.head_dim * element


class PagedRows:
    """Rows of the pool in batch order, behind the cache interface of `Transformer.forward`."""

    def __init__(self, pool: PagedKVCache, rows: Sequence[PagedRow]) -> None:
        self.pool = pool
        self.rows = list(rows)
        device = pool.keys[0].device
        widest = max(len(row.blocks) for row in self.rows)
        # [B, widest]; short rows padded with the scratch block.
        self.block_table = torch.tensor(
            [row.blocks + [SCRATCH_BLOCK] * (widest - len(row.blocks)) for row in self.rows],
            dtype=torch.long,
            device=device,
        )
        self._write: tuple[Tensor, Tensor] | None = None
        self._window = 0
        # A row whose blocks follow each other in the pool (the usual case: the free list hands out
        # runs) has its window as a view of the pool, with nothing to gather: a lone row's always,
        # a rule row's in any pass (`_run_holds`). Each row's first block, else None.
        self._run_starts = [_run_start(row.blocks) for row in self.rows]

    @property
    def lengths(self) -> list[int]:
        return [row.length for row in self.rows]

    @property
    def table_keys(self) -> list[Hashable]:
        return [row.table_key for row in self.rows]

    @property
    def text_offsets(self) -> list[int]:
        """How far each row's next entries sit in its text past their slot (`PagedRow.dropped`)."""
        return [row.dropped for row in self.rows]

    def turned_keys(self, rules: Sequence[AttentionRule | None]) -> list[TurnedKeys | None]:
        """The keys of each row under a rule that moves pairs, turned for it and kept with the row
        across its passes (None for the other rows)."""
        for row, rule in zip(self.rows, rules, strict=True):
            if row.turned is None and rule is not None and rule.moves_pairs:
                row.turned = TurnedKeys(limit=len(row.blocks) * self.pool.block_size)
        return [row.turned for row in self.rows]

    def reserve(self, new_tokens: int) -> None:
        """Work out, once per pass, where the next `new_tokens` of every row go, and record their
        positions in the pool."""
        self._write = self.place(new_tokens)
        self._window = max(self.lengths) + new_tokens

    def place(self, new_tokens: int) -> tuple[Tensor, Tensor]:
        """Record the positions of every row's next `new_tokens` keys in the pool (each at its
        index in the row's text) before a pass writes them; their blocks and offsets `[B, T]`.
        Slots past a row's reservation are the scratch block's, which nobody reads."""
        device = self.block_table.device
        starts = torch.tensor(self.lengths, dtype=torch.long, device=device)
        slots = starts[:, None] + torch.arange(new_tokens, device=device)[None, :]  # [B, T]
        blocks, offsets = self.slots(slots)
        self.pool.key_positions[blocks, offsets] = (
            slots + torch.tensor(self.text_offsets, device=device)[:, None]
        )
        return blocks, offsets

    def key_positions(self) -> Tensor:
        """The positions the pool records for each row's window of the pass `[B, max(lengths) + T]`
        (after `reserve`); slots past a row's own entries hold whatever they held, masked."""
        size = self.pool.block_size
        table = self.window_blocks(math.ceil(self._window / size))
        return self.pool.key_positions[table].flatten(1)[:, : self._window]

    def recorded_positions(self, row: int) -> Tensor:
        """The positions the pool records for one row's entries `[length]`, in slot order."""
        entry = self.rows[row]
        blocks = torch.tensor(entry.blocks, dtype=torch.long, device=self.block_table.device)
        return self.pool.key_positions[blocks].flatten()[: entry.length]

    def slots(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Block and offset of each row's `positions` [B, T]; past its blocks, the scratch block."""
        size = self.pool.block_size
        index = positions // size
        widest = self.block_table.shape[1]
        blocks = self.block_table.gather(1, index.clamp(max=widest - 1))
        return torch.where(index < widest, blocks, SCRATCH_BLOCK), positions % size

    def write(self, layer: int, keys: Tensor, values: Tensor) -> tuple[Windows, Windows]:
        """Store `[B, n_kv_heads, T, head_dim]` after each row's entries; return the windows.

        When every row is under a rule, each row's own window `[n_kv_heads, length + T, head_dim]`
        (a list): a rule attends row by row (`rule_attention.attend_rows`), so no row pays for a
        gather of every row's entries to the longest row's width in every layer.
        Otherwise the windows `[B, n_kv_heads, max(lengths) + T, head_dim]` are gathered from the
        blocks (a copy; for a lone row on consecutive blocks, a view of the pool): rows shorter than
        the longest carry other entries there, which the mask hides.
        """
        assert self._write is not None, "reserve() first"
        pages = self.pool.keys[layer], self.pool.values[layer]
        if self._window_is_run:
            start = self.rows[0].length
            for pool_pages, new in zip(pages, (keys, values), strict=True):
                self._run(pool_pages, 0)[:, start : self._window] = new[0]  # [Hkv, T, hd]
        else:
            blocks, offsets = self._write
            for pool_pages, new in zip(pages, (keys, values), strict=True):
                pool_pages[:, blocks, offsets] = new.transpose(0, 1)  # [Hkv, B, T, hd]
        if all(row.turned is not None for row in self.rows):
            windows = [
                self._row_window(layer, pages, index, row.length + keys.shape[2])
                for index, row in enumerate(self.rows)
            ]
            return [keys for keys, _ in windows], [values for _, values in windows]
        return self._gather(pages[0]), self._gather(pages[1])

    def _row_window(
        self, layer: int, pages: tuple[Tensor, Tensor], index: int, window: int
    ) -> tuple[Tensor, Tensor]:
        """Row `index`'s first `window` slots `[Hkv, window, hd]`: a view of the pool where its
        blocks follow each other and hold the window, else its `WindowCopy`."""
        row = self.rows[index]
        if self._run_holds(index, window):
            return self._run(pages[0], index)[:, :window], self._run(pages[1], index)[:, :window]
        if row.copy is None:
            row.copy = WindowCopy()
        return row.copy.windows(layer, pages, row, self.pool.block_size, window)

    def window_blocks(self, count: int) -> Tensor:
        """Each row's first `count` blocks `[B, count]`, contiguous, scratch-filled past its own.

        A window can reach past every row's blocks (a padded prefill chunk of a row near the end
        of its reservation, a decode window rounded up to its bucket): the scratch block fills it.
        """
        table = F.pad(self.block_table, (0, max(0, count - self.block_table.shape[1])))[:, :count]
        # A fresh tensor of canonical strides: the compiled step guards on them, and a one-row
        # slice counts as contiguous while keeping the wider table's stride.
        return table.new_empty(table.shape).copy_(table)

    def _gather(self, pages: Tensor) -> Tensor:
        if self._window_is_run:
            return self._run(pages, 0)[None, :, : self._window]  # [1, Hkv, W, hd]
        size = self.pool.block_size
        table = self.window_blocks(math.ceil(self._window / size))
        batch, count = table.shape
        # index_select copies whole blocks; advanced indexing with a 2-d index is several times slower
        gathered = pages.index_select(1, table.flatten())  # [Hkv, B * count, size, hd]
        window = gathered.view(pages.shape[0], batch, count * size, -1).transpose(0, 1)  # [B, Hkv, W, hd]
        return window[:, :, : self._window]

    @property
    def _window_is_run(self) -> bool:
        """Whether the pass's window lies within a lone row's consecutive blocks (a view, no gather)."""
        return len(self.rows) == 1 and self._run_holds(0, self._window)

    def _run_holds(self, index: int, window: int) -> bool:
        """Whether row `index`'s blocks follow each other in the pool and hold `window` slots."""
        blocks = len(self.rows[index].blocks)
        return self._run_starts[index] is not None and window <= blocks * self.pool.block_size

    def _run(self, pages: Tensor, index: int) -> Tensor:
        """Row `index`'s consecutive blocks as one view `[Hkv, blocks * block_size, hd]` of `pages`."""
        start = self._run_starts[index]
        assert start is not None
        return pages[:, start : start + len(self.rows[index].blocks)].flatten(1, 2)

    def advance(
        self, tokens: Tensor, table_keys: Sequence[Hashable], counts: Sequence[int] | None = None
    ) -> None:
        """Record the pass's token ids `[B, T]` (the first `counts[i]` of row i are real)."""
        steps = counts if counts is not None else [tokens.shape[1]] * len(self.rows)
        for row, ids, step, key in zip(self.rows, tokens.tolist(), steps, table_keys, strict=True):
            row.tokens.extend(ids[:step])
            row.length += step
            row.table_key = key

    def row_tokens(self, row: int) -> Tensor:
        """The token ids of one row `[1, length]`."""
        return torch.tensor([self.rows[row].tokens], dtype=torch.long, device=self.block_table.device)

    def replace_row(self, row: int, source: KVCache) -> None:
        """Overwrite `row` with the single row of `source` (a recomputation of the same tokens)."""
        length = source.lengths[0]
        positions = torch.arange(length, device=self.block_table.device)
        size = self.pool.block_size
        blocks, offsets = self.block_table[row, positions // size], positions % size
        for pages, new in zip(self.pool.keys + self.pool.values, source.keys + source.values, strict=True):
            pages[:, blocks, offsets] = new[0, :, :length]  # [Hkv, L, hd]
        self.pool.key_positions[blocks, offsets] = positions
        target = self.rows[row]
        target.length = length
        target.table_key = source.table_keys[0]
        target.copy = None  # every entry changed
