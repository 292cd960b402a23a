"""The decode pass as CUDA graphs: one per batch bucket and window bucket, replayed every step.

A zoo model's step is a few hundred small kernels, and on a GPU their launches, not their work,
set its time; a graph replays them all in one launch. A graph reads and writes the addresses it
was captured with, so each window bucket keeps static input buffers sized for the largest batch,
and its graphs read prefixes of them:

- tokens and positions are copied in every step (one host-to-device copy of both);
- the window's blocks are copied in every step (a device copy, the padding rows zeroed);
- the positional stacks, row-to-table index and bias tables only when `FastDecoder` hands in a
  different `PassTables` (it rebuilds them only when rows join, leave or change table).

A batch runs in the graph of the smallest bucket that holds it. The rows past it feed token 0 at
position 0 through the scratch block, which no row reads, and their logits are dropped. All graphs
share one memory pool (they run one at a time, on one stream), captured from the largest batch
down as vLLM does; a graph's output can be overwritten by the next replay, so what `__call__`
returns is a copy.

`capture=False` runs the step on the same buffers without a graph: how the CPU tests check the
padding and the buffers' refreshes, which are the same code either way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from service.model.paged_cache import SCRATCH_BLOCK
from service.model.positional import PassInputs, PassTables

PassOnInputs = Callable[[PassInputs], Tensor]

WARM_UP_RUNS = 2  # before a capture: compiling and lazy initialisation must not be captured


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, ... up to `max_batch`, which is itself a bucket: a padded row costs a full row."""
    sizes, size = [], 1
    while size < max_batch:
        sizes.append(size)
        size *= 2
    return [*sizes, max_batch]


@dataclass
class _Replay:
    """One bucket's step over its views of the buffers: a captured graph, or (uncaptured) a call."""

    step: PassOnInputs
    inputs: PassInputs
    graph: torch.cuda.CUDAGraph | None = None
    logits: Tensor | None = None  # the graph's output, rewritten by every replay

    def run(self) -> Tensor:
        if self.graph is None or self.logits is None:
            return self.step(self.inputs)
        self.graph.replay()
        return self.logits


@dataclass
class _WindowBuffers:
    """The static inputs of one window bucket's graphs, sized for the largest bucket."""

    ids: Tensor  # [2, max_batch] tokens, then positions
    window_blocks: Tensor  # [max_batch, blocks]
    tables: PassTables  # stacks [max_tables, W, ...], index [max_batch], bias tables as the step's
    loaded: PassTables | None = None  # what the tables hold now (kept alive: compared by identity)
    graphs: dict[int, _Replay] = field(default_factory=dict)  # by batch bucket

    def inputs(self, batch: int) -> PassInputs:
        """Views of the first `batch` rows: every graph of the window reads the same memory."""
        index = self.tables.table_index
        return PassInputs(
            self.ids[0, :batch],
            self.ids[1, :batch],
            self.window_blocks[:batch],
            index[:batch] if index is not None else None,
            *self.tables[1:],
        )


class GraphedPass:
    """`step` over static buffers, captured per (batch bucket, window) on first use."""

    def __init__(self, step: PassOnInputs, max_batch: int, *, capture: bool) -> None:
        self.step = step
        self.buckets = batch_buckets(max_batch)
        self.capture = capture
        self._windows: dict[int, _WindowBuffers] = {}
        self._first_graph: torch.cuda.CUDAGraph | None = None  # whose memory pool all graphs share

    def bucket_for(self, batch: int) -> int:
        for size in self.buckets:
            if size >= batch:
                return size
        raise ValueError(f"a batch of {batch} rows is past the largest graph ({self.buckets[-1]})")

    def __call__(
        self, tokens: list[int], positions: list[int], window_blocks: Tensor, tables: PassTables
    ) -> Tensor:
        """Logits float32 [B, V] for B rows: the step of their bucket's graph, replayed."""
        batch = len(tokens)
        bucket = self.bucket_for(batch)
        buffers = self._buffers(window_blocks, tables)
        padding = bucket - batch
        buffers.ids[:, :bucket].copy_(torch.tensor([tokens + [0] * padding, positions + [0] * padding]))
        buffers.window_blocks[:batch].copy_(window_blocks)
        buffers.window_blocks[batch:bucket].fill_(SCRATCH_BLOCK)
        if buffers.loaded is not tables:
            _load_tables(buffers.tables, tables)
            buffers.loaded = tables
        replay = buffers.graphs.get(bucket) or self._capture(buffers, bucket)
        return replay.run()[:batch].clone()

    def captured(self) -> list[tuple[int, int]]:
        """(window blocks, batch bucket) of every graph there is."""
        return sorted(
            (buffers.window_blocks.shape[1], bucket)
            for buffers in self._windows.values()
            for bucket in buffers.graphs
        )

    def _buffers(self, window_blocks: Tensor, tables: PassTables) -> _WindowBuffers:
        count = window_blocks.shape[1]
        buffers = self._windows.get(count)
        if buffers is None:
            rows = self.buckets[-1]
            device = window_blocks.device
            buffers = _WindowBuffers(
                ids=torch.zeros(2, rows, dtype=torch.long, device=device),
                window_blocks=torch.full((rows, count), SCRATCH_BLOCK, dtype=torch.long, device=device),
                tables=_static_tables(tables, rows),
            )
            self._windows[count] = buffers
        return buffers

    def _capture(self, buffers: _WindowBuffers, bucket: int) -> _Replay:
        """The bucket's graph over the buffers as they are (the step's inputs are valid by then)."""
        replay = _Replay(self.step, buffers.inputs(bucket))
        if self.capture:
            for _ in range(WARM_UP_RUNS):
                replay.run()
            torch.cuda.synchronize(buffers.ids.device)
            replay.graph = torch.cuda.CUDAGraph()
            first = self._first_graph
            with torch.cuda.graph(replay.graph, pool=first.pool() if first is not None else None):
                replay.logits = self.step(replay.inputs)
            self._first_graph = first or replay.graph
        buffers.graphs[bucket] = replay
        return replay


def _static_tables(tables: PassTables, rows: int) -> PassTables:
    """Buffers shaped like `tables`, with room for a table per row (at least the two stacks that
    `FastDecoder` always hands in) and an index entry per row."""
    stack_rows = max(rows, 2)

    def stack(table: Tensor | None) -> Tensor | None:
        return None if table is None else table.new_zeros(stack_rows, *table.shape[1:])

    index = tables.table_index
    return PassTables(
        table_index=None if index is None else index.new_zeros(rows),
        rope_cos=stack(tables.rope_cos),
        rope_sin=stack(tables.rope_sin),
        absolute=stack(tables.absolute),
        alibi_slopes=None if tables.alibi_slopes is None else tables.alibi_slopes.clone(),
        t5_buckets=None if tables.t5_buckets is None else tables.t5_buckets.clone(),
    )


def _load_tables(static: PassTables, tables: PassTables) -> None:
    """Copy `tables` into the buffers; index entries past the batch point at table 0."""
    for buffer, table in zip(static, tables, strict=True):
        if buffer is None or table is None:
            if (buffer is None) != (table is None):
                raise ValueError("the step's tables changed kind within a window")
            continue
        buffer[: len(table)].copy_(table)
        if buffer is static.table_index:
            buffer[len(table) :].zero_()
