"""One model's scheduler: its running sequences, those still reading their prompt and those
decoding, and what each step runs of them.

Every sequence owns blocks of the model's KV pool (`service.model.paged_cache`) from admission to
exit, so rows moving between the groups, joining or leaving copy nothing. A decode pass runs every
decoding row, each row with its own RoPE scaling and attention rule. A prefill chunk advances the
prefilling rows with the least prompt left, as many as the step's token budget gives a useful
width, by one width of prompt tokens (rows of different prompt lengths and progress share the
pass; a row with fewer tokens left is padded; the others wait their turn), so a long prompt is read
a slice per step between decode passes instead of stalling them, and a short one is not held
behind it. A row whose prompt is complete moves to the decoding group with its first token's logits.

The passes themselves are the runner's (`service.engine.runner.ModelRunner`): which backend
takes them, and how a failed pass is rerun row by row so that failures stay with their row.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from pe_runtime import RopeScaling
from service.engine.budget import MAX_PASSED_OVER, ChunkPlan, plan_chunk, rows_per_chunk, useful_chunk_cost
from service.engine.runner import ModelRunner, PassResult, PassRows
from service.engine.sequence import RunningSequence
from service.engine.types import GenerationRequest
from service.model.attention_rules import StreamingAttention
from service.model.backend import Backend
from service.model.fast_decode import FastDecoder
from service.model.paged_cache import PagedKVCache, PagedRow, PagedRows, prefix_keys
from service.model.transformer import Stages, Transformer, run_layers

logger = logging.getLogger("service.engine.batch")

_PAD = 0  # fills a prompt chunk to the group's width; never kept (see `Transformer.forward`)


@dataclass
class StepOutcome:
    """Float32 logits [N, V] on the model's device for the N rows that ran, and the rows that failed."""

    rows: list[RunningSequence]
    logits: Tensor
    failed: list[tuple[RunningSequence, Exception]] = field(default_factory=list)


@dataclass
class _SpreadChunk:
    """A prompt chunk whose pass runs a few layers per step (see `ModelBatch.prefill_chunk`)."""

    sequences: list[RunningSequence]
    rows: PassRows
    plan: ChunkPlan
    stages: Stages[Tensor]


class _Group:
    """Sequences that run their passes together, row i being sequences[i]."""

    def __init__(self, pool: PagedKVCache) -> None:
        self.pool = pool
        self.sequences: list[RunningSequence] = []
        self.rows: list[PagedRow] = []
        self._view: PagedRows | None = None

    def __len__(self) -> int:
        return len(self.sequences)

    @property
    def view(self) -> PagedRows:
        """The rows behind the cache interface; rebuilt only when sequences join or leave."""
        if self._view is None:
            self._view = PagedRows(self.pool, self.rows)
        return self._view

    def rebuild(self) -> None:
        """Rows changed blocks (a streaming row slid its window): the view is built anew."""
        self._view = None

    def join(self, sequence: RunningSequence, row: PagedRow) -> None:
        self.sequences.append(sequence)
        self.rows.append(row)
        self._view = None

    def split(self, keep: Callable[[RunningSequence], bool]) -> list[tuple[RunningSequence, PagedRow]]:
        """Remove the sequences `keep` rejects and return them with their rows."""
        pairs = list(zip(self.sequences, self.rows, strict=True))
        kept = [keep(sequence) for sequence in self.sequences]
        if all(kept):
            return []
        self.sequences = [sequence for (sequence, _), stays in zip(pairs, kept, strict=True) if stays]
        self.rows = [row for (_, row), stays in zip(pairs, kept, strict=True) if stays]
        self._view = None
        return [pair for pair, stays in zip(pairs, kept, strict=True) if not stays]


class ModelBatch:
    def __init__(
        self,
        model: Transformer,
        pool: PagedKVCache,
        fast: FastDecoder | None = None,
        backend: Backend = Backend.EAGER,
        *,
        prefix_cache: bool = True,
    ) -> None:
        """`fast` runs the passes it covers on `backend`; everything else runs the model eagerly.
        With `prefix_cache`, prompts reuse the pool's cached blocks of earlier prompts."""
        self.model = model
        self.pool = pool
        self.fast = fast
        self.runner = ModelRunner(model, pool, fast)
        self.backend = backend
        self.prefix_cache = prefix_cache
        self._prefilling = _Group(pool)
        self._decoding = _Group(pool)
        self._spread: _SpreadChunk | None = None

    def __len__(self) -> int:
        return len(self._prefilling) + len(self._decoding)

    @property
    def decoding(self) -> int:
        return len(self._decoding)

    @property
    def streaming(self) -> bool:
        """Whether a decoding row streams its tokens (its client sees every gap between them)."""
        return any(sequence.request.stream for sequence in self._decoding.sequences)

    @property
    def prefilling(self) -> int:
        return len(self._prefilling)

    @property
    def sequences(self) -> list[RunningSequence]:
        return self._prefilling.sequences + self._decoding.sequences

    def fits(self, request: GenerationRequest, scaling: RopeScaling) -> bool:
        """Whether the pool has blocks for the whole request now (prompt and every new token)."""
        return self.pool.fits(self._reach(request), self._prefix(request, scaling), _reusable(request))

    def add(self, sequence: RunningSequence) -> None:
        """Start reading its prompt, in blocks reserved for the whole request (`fits` first),
        from the end of the prefix the pool has cached (`sequence.cached_tokens`)."""
        request = sequence.request
        prefix = self._prefix(request, sequence.scaling)
        row = self.pool.allocate(self._reach(request), prefix, _reusable(request))
        row.prefix = prefix
        if row.length:
            prompt = len(request.prompt_tokens)
            row.tokens = list(request.prompt_tokens[: row.length])
            row.table_key = self.model.positions.table_key(sequence.scaling, prompt)
            sequence.prefilled = sequence.cached_tokens = row.length
        if prefix:
            self.pool.queried_tokens += len(request.prompt_tokens)
            self.pool.hit_tokens += row.length
        self._prefilling.join(sequence, row)

    def _prefix(self, request: GenerationRequest, scaling: RopeScaling) -> list[bytes]:
        """The keys of the prompt's whole blocks, or none where its blocks must stay its own.

        The root names the scaling with every parameter, the table the prompt is read with and
        the attention rule (`pe_attention`), if any.
        A row whose table changes before it ends (bucketed dynamic NTK crossing a bucket,
        LongRoPE crossing the original length) is recomputed in place then, so it neither
        shares nor publishes; dynamic NTK in "hf" mode keeps its entries and may share, as
        its prompt's table is in the root.
        """
        if not self.prefix_cache or isinstance(request.attention, StreamingAttention):
            return []  # a streaming row gives its blocks back as its window moves on
        positions = self.model.positions
        prompt = len(request.prompt_tokens)
        table = positions.table_key(scaling, prompt)
        changes = table != positions.table_key(scaling, self._reach(request))
        if changes and not positions.keeps_cached_keys(scaling):
            return []
        # Past the first layer every entry depends on how attention placed the keys before it.
        root = (scaling, table) if request.attention is None else (scaling, table, request.attention)
        return prefix_keys(root, request.prompt_tokens, self.pool.block_size)

    def useful_chunk_cost(self) -> int:
        """The fewest units worth a turn after another chunk of the step (`useful_chunk_cost`) for
        the row that goes next; 0 while a spread chunk's layers are pending (they run on any)."""
        if self._spread is not None:
            return 0
        first = min(self._prefilling.sequences, key=_chunk_order)
        return useful_chunk_cost(first.prefilled, first.prompt_remaining)

    def prefill_chunk(self, budget: int) -> tuple[StepOutcome, int]:
        """Advance prefilling rows by a chunk that fits `budget` units (`plan_chunk`).

        The rows are those with the least prompt left (the oldest first among equals), as many as
        the budget gives a useful width (`rows_per_chunk`); the others wait, though a row that
        `MAX_PASSED_OVER` chunks went past goes first. Rows take the same
        width; a row with fewer prompt tokens left is padded to it, so that one row close to the
        end of its prompt never slows the others down to its pace. When even the smallest chunk
        costs more than the budget (a few tokens deep in a long context still read every cached
        key), its pass is spread over steps, a few layers each, and the rows advance when the last
        layer is done; rows that join meanwhile wait for the next chunk. Returns the rows whose
        prompt is now complete, with their next-token logits (they move to the decoding group in
        `retain`, unless that first token finished them), the rows that failed, and what the step
        took from the budget.
        """
        if self._spread is not None:
            return self._continue_spread()
        group = self._prefilling
        order = sorted(range(len(group)), key=lambda row: _chunk_order(group.sequences[row]))
        taken = order[: rows_per_chunk(budget, [group.sequences[row].prefilled for row in order])]
        for row, sequence in enumerate(group.sequences):
            sequence.passed_over = 0 if row in taken else sequence.passed_over + 1
        sequences, rows = [group.sequences[row] for row in taken], [group.rows[row] for row in taken]
        view = group.view if taken == list(range(len(group))) else PagedRows(self.pool, rows)
        past = max(sequence.prefilled for sequence in sequences)
        longest = max(sequence.prompt_remaining for sequence in sequences)
        plan = plan_chunk(budget, len(taken), past, longest, self.model.config.n_layers)
        counts = [min(plan.width, sequence.prompt_remaining) for sequence in sequences]
        chunks = [
            sequence.next_prompt_chunk(count) + (_PAD,) * (plan.width - count)
            for sequence, count in zip(sequences, counts, strict=True)
        ]
        # Every chunk of a prompt reads the table for the whole prompt: no row changes table mid-prompt.
        lengths = [len(sequence.request.prompt_tokens) for sequence in sequences]
        passed = _pass_rows(sequences, rows, chunks, lengths, counts)
        if plan.layers_per_step < plan.layers:
            stages = self.runner.stages(passed, view)
            if stages is not None:
                self._spread = _SpreadChunk(sequences, passed, plan, stages)
                return self._continue_spread()
        result = self.runner.run(passed, view, decode=False)
        return self._prefilled(sequences, counts, result), plan.cost

    def _continue_spread(self) -> tuple[StepOutcome, int]:
        """The next layers of the spread chunk; a pass that raises is rerun row by row, whole."""
        spread = self._spread
        assert spread is not None
        try:
            with torch.inference_mode():
                logits = run_layers(spread.stages, spread.plan.layers_per_step)
        except Exception:
            logger.exception("a spread prompt chunk failed; rerunning its rows one by one")
            self._spread = None
            result = self.runner.run_alone(spread.rows)
            return self._prefilled(spread.sequences, spread.rows.counts, result), spread.plan.cost_per_step
        if logits is None:
            return self._outcome([], self.runner.nothing_ran(), []), spread.plan.cost_per_step
        self._spread = None
        last = logits[:, -1].float()  # [N, V] at each row's last real token
        result = PassResult(list(range(len(spread.sequences))), last, {})
        return self._prefilled(spread.sequences, spread.rows.counts, result), spread.plan.cost_per_step

    def _prefilled(
        self, sequences: list[RunningSequence], counts: list[int], result: PassResult
    ) -> StepOutcome:
        for row in result.rows:
            sequences[row].prefilled += counts[row]
        ready = [row for row in result.rows if not sequences[row].prompt_remaining]
        return self._outcome(sequences, result, ready)

    def decode(self) -> StepOutcome:
        """One token for every decoding row in one forward pass."""
        group = self._decoding
        self._slide(group)
        lengths = [past + 1 for past in group.view.lengths]
        chunks = [(sequence.last_token,) for sequence in group.sequences]
        result = self.runner.run(
            _pass_rows(group.sequences, group.rows, chunks, lengths, [1] * len(chunks)),
            group.view,
            decode=True,
        )
        return self._outcome(group.sequences, result, result.rows)

    def _slide(self, group: _Group) -> None:
        """Streaming rows give back the blocks that left their window before their next token
        (`PagedKVCache.slide`), so that each holds a bounded number however long it generates."""
        moved = False
        for sequence, row in zip(group.sequences, group.rows, strict=True):
            rule = sequence.request.attention
            if isinstance(rule, StreamingAttention):
                moved |= self.pool.slide(row, head=rule.sink_tokens, window=rule.window, room=1)
        if moved:
            group.rebuild()

    def _reach(self, request: GenerationRequest) -> int:
        """The most positions a request's row holds at once: its prompt and every token it may
        generate; under streaming attention, at most its prompt or its sinks and window (with a
        block of slack each and one for the next token), whichever is more."""
        reach = len(request.prompt_tokens) + request.sampling.max_new_tokens
        rule = request.attention
        if not isinstance(rule, StreamingAttention):
            return reach
        size = self.pool.block_size
        held = (math.ceil(rule.sink_tokens / size) + math.ceil(rule.window / size) + 2) * size
        return min(reach, max(len(request.prompt_tokens) + 1, held))

    def _outcome(self, sequences: list[RunningSequence], result: PassResult, rows: list[int]) -> StepOutcome:
        logits = result.of(rows)
        failed = [(sequences[row], error) for row, error in result.failed.items()]
        return StepOutcome([sequences[row] for row in rows], logits, failed)

    def retain(self, keep: Callable[[RunningSequence], bool]) -> list[RunningSequence]:
        """Drop sequences for which `keep` is false and free their blocks; return the dropped ones.

        Then rows whose prompt is complete move to the decoding group (their blocks stay theirs).
        A spread chunk with a dropped row is abandoned before its blocks go back to the pool; its
        other rows read that chunk again (nothing of it was kept).
        """
        if self._spread is not None and not all(map(keep, self._spread.sequences)):
            self._spread.stages.close()
            self._spread = None
        dropped: list[RunningSequence] = []
        for group in (self._prefilling, self._decoding):
            for sequence, row in group.split(keep):
                if sequence.prompt_remaining == 0:
                    self.pool.publish(row)
                self.pool.release(row)
                dropped.append(sequence)
        for sequence, row in self._prefilling.split(lambda sequence: sequence.prompt_remaining > 0):
            self.pool.publish(row)
            self._decoding.join(sequence, row)
        return dropped


def _pass_rows(
    sequences: Sequence[RunningSequence],
    rows: Sequence[PagedRow],
    chunks: Sequence[tuple[int, ...]],
    table_lengths: list[int],
    counts: list[int],
) -> PassRows:
    """Rows as a pass runs them, each with its sequence's scaling and rule."""
    return PassRows(
        list(rows),
        list(chunks),
        [sequence.scaling for sequence in sequences],
        [sequence.request.attention for sequence in sequences],
        table_lengths,
        counts,
    )


def _chunk_order(sequence: RunningSequence) -> tuple[bool, int]:
    """Where a prompt row stands for the next chunk: the rows passed over too often first, oldest
    first; then the least prompt left (the sort is stable: the oldest first among equals)."""
    if sequence.passed_over >= MAX_PASSED_OVER:
        return (False, 0)
    return (True, sequence.prompt_remaining)


def _reusable(request: GenerationRequest) -> int:
    """The prompt tokens a row may read from the cache: those before its last one, whose logits
    the row's own pass must give."""
    return max(0, len(request.prompt_tokens) - 1)
