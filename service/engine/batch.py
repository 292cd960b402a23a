"""One model's running sequences: those still reading their prompt, and those decoding.

Every sequence owns blocks of the model's KV pool (`service.model.paged_cache`) from admission to
exit, so rows moving between the groups, joining or leaving copy nothing. A decode pass runs every
decoding row in one forward pass, each row with its own RoPE scaling: through the compiled step
(`service.model.fast_decode`) when it applies, else the eager model. A prefill chunk advances every
prefilling row by one width of prompt tokens sized to the step's token budget (rows of different
prompt lengths and progress share the pass; a row with fewer tokens left is padded), so a long
prompt is read a slice per step between decode passes instead of stalling them. A row whose
prompt is complete moves to the decoding group with its first token's logits.

Failures stay with their row. A row's length advances only after a pass succeeded (what a failed
pass wrote lies past it, and is overwritten), so when a batched pass raises, every row is rerun
alone from the state it was in, and only the rows that still raise fail; rows that did nothing
wrong never write a token twice.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from pe_runtime import RopeScaling
from service.engine.budget import ChunkPlan, plan_chunk
from service.engine.sequence import RunningSequence
from service.engine.types import GenerationRequest
from service.model.attention_rules import AttentionRule, StreamingAttention
from service.model.backend import Backend
from service.model.fast_decode import FastDecoder
from service.model.paged_cache import PagedKVCache, PagedRow, PagedRows, prefix_keys
from service.model.refresh import recompute_row, stale_rows
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
class _PassResult:
    """Logits [N, V] of the N rows that ran (`rows`, in order), and the rows that failed."""

    rows: list[int]
    logits: Tensor
    failed: dict[int, Exception]

    def of(self, rows: list[int]) -> Tensor:
        """The logits of `rows`, a subsequence of `self.rows`: the whole tensor when they are all."""
        if rows == self.rows:
            return self.logits
        at = {row: index for index, row in enumerate(self.rows)}
        return self.logits[[at[row] for row in rows]]


@dataclass
class _SpreadChunk:
    """A prompt chunk whose pass runs a few layers per step (see `ModelBatch.prefill_chunk`)."""

    sequences: list[RunningSequence]
    rows: list[PagedRow]
    chunks: list[tuple[int, ...]]
    table_lengths: list[int]
    counts: list[int]
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

    def prefill_chunk(self, budget: int) -> tuple[StepOutcome, int]:
        """Advance every prefilling row by a chunk that fits `budget` units (`plan_chunk`).

        Rows take the same width; a row with fewer prompt tokens left is padded to it, so that one
        row close to the end of its prompt never slows the others down to its pace. When even the
        smallest chunk costs more than the budget (a few tokens deep in a long context still read
        every cached key), its pass is spread over steps, a few layers each, and the rows advance
        when the last layer is done; rows that join meanwhile wait for the next chunk. Returns the
        rows whose prompt is now complete, with their next-token logits (they move to the
        decoding group in `retain`, unless that first token finished them), the rows that
        failed, and what the step took from the budget.
        """
        if self._spread is not None:
            return self._continue_spread()
        group = self._prefilling
        past = max(sequence.prefilled for sequence in group.sequences)
        longest = max(sequence.prompt_remaining for sequence in group.sequences)
        plan = plan_chunk(budget, len(group), past, longest, self.model.config.n_layers)
        counts = [min(plan.width, sequence.prompt_remaining) for sequence in group.sequences]
        chunks = [
            sequence.next_prompt_chunk(count) + (_PAD,) * (plan.width - count)
            for sequence, count in zip(group.sequences, counts, strict=True)
        ]
        # Every chunk of a prompt reads the table for the whole prompt: no row changes table mid-prompt.
        lengths = [len(sequence.request.prompt_tokens) for sequence in group.sequences]
        sequences = list(group.sequences)
        scalings = [sequence.scaling for sequence in sequences]
        if plan.layers_per_step < plan.layers and not stale_rows(self.model, group.view, scalings, lengths):
            stages = self.model.forward_stages(
                self._tokens(chunks),
                scaling=scalings,
                cache=group.view,
                table_lengths=lengths,
                counts=counts,
                attention=_rules(sequences),
            )
            self._spread = _SpreadChunk(sequences, list(group.rows), chunks, lengths, counts, plan, stages)
            return self._continue_spread()
        result = self._run(group, chunks, lengths, counts)
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
            scalings = [sequence.scaling for sequence in spread.sequences]
            result = self._run_rows_alone(
                spread.rows,
                spread.chunks,
                scalings,
                _rules(spread.sequences),
                spread.table_lengths,
                spread.counts,
                {},
            )
            return self._prefilled(spread.sequences, spread.counts, result), spread.plan.cost_per_step
        if logits is None:
            return self._outcome([], self._nothing_ran(), []), spread.plan.cost_per_step
        self._spread = None
        last = logits[:, -1].float()  # [N, V] at each row's last real token
        result = _PassResult(list(range(len(spread.sequences))), last, {})
        return self._prefilled(spread.sequences, spread.counts, result), spread.plan.cost_per_step

    def _prefilled(
        self, sequences: list[RunningSequence], counts: list[int], result: _PassResult
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
        result = self._run(group, chunks, lengths, [1] * len(chunks), fast=True)
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

    def _outcome(self, sequences: list[RunningSequence], result: _PassResult, rows: list[int]) -> StepOutcome:
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

    @property
    def _device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def _tokens(self, chunks: Sequence[tuple[int, ...]]) -> Tensor:
        return torch.tensor([list(chunk) for chunk in chunks], dtype=torch.long, device=self._device)

    def _run(
        self,
        group: _Group,
        chunks: Sequence[tuple[int, ...]],
        table_lengths: list[int],
        counts: list[int],
        *,
        fast: bool = False,
    ) -> _PassResult:
        """The group's pass: rows with an attention rule run on the model's own layers, which place
        each row's keys by its rule (`service.model.rule_attention`); the others where they would
        run alone (the fast decoder, when there is one), in a pass of their own beside them."""
        ruled = [
            row for row, sequence in enumerate(group.sequences) if sequence.request.attention is not None
        ]
        if self.fast is None or not ruled or len(ruled) == len(group):
            return self._run_rows(group.view, group.sequences, chunks, table_lengths, counts, fast=fast)
        plain = [row for row in range(len(group)) if row not in ruled]
        results = []
        for part in (plain, ruled):
            view = PagedRows(self.pool, [group.rows[row] for row in part])
            sequences = [group.sequences[row] for row in part]
            part_chunks = [chunks[row] for row in part]
            part_lengths = [table_lengths[row] for row in part]
            part_counts = [counts[row] for row in part]
            results.append(self._run_rows(view, sequences, part_chunks, part_lengths, part_counts, fast=fast))
        return _merged((plain, ruled), results)

    def _run_rows(
        self,
        view: PagedRows,
        sequences: Sequence[RunningSequence],
        chunks: Sequence[tuple[int, ...]],
        table_lengths: list[int],
        counts: list[int],
        *,
        fast: bool,
    ) -> _PassResult:
        """One pass over `view`'s rows (`sequences`); if it raises, each row alone from its
        untouched state. The fast decoder takes it only when no row has an attention rule."""
        scalings = [sequence.scaling for sequence in sequences]
        rules = _rules(sequences)
        failed = self._refresh(view, scalings, rules, table_lengths)
        decoder = self.fast if rules is None and not failed else None
        try:
            if fast and decoder is not None and decoder.covers(view.lengths):
                logits = decoder.decode(view, [chunk[0] for chunk in chunks], scalings)
            elif not fast and decoder is not None and decoder.prefills(view.lengths, counts):
                logits = decoder.prefill(view, chunks, counts, scalings, table_lengths)
            else:
                logits = self._forward(view, chunks, scalings, rules, table_lengths, counts)
        except Exception:
            logger.exception("a batched pass failed; rerunning its rows one by one")
            return self._run_rows_alone(view.rows, chunks, scalings, rules, table_lengths, counts, failed)
        ran = [row for row in range(len(sequences)) if row not in failed]
        return _PassResult(ran, logits if len(ran) == len(sequences) else logits[ran], failed)

    def _run_rows_alone(
        self,
        rows: list[PagedRow],
        chunks: Sequence[tuple[int, ...]],
        scalings: list[RopeScaling],
        rules: list[AttentionRule | None] | None,
        table_lengths: list[int],
        counts: list[int],
        failed: dict[int, Exception],
    ) -> _PassResult:
        logits: dict[int, Tensor] = {}
        for row, paged in enumerate(rows):
            if row in failed:
                continue
            span = slice(row, row + 1)
            try:
                alone = PagedRows(self.pool, [paged])
                logits[row] = self._forward(
                    alone,
                    chunks[span],
                    scalings[span],
                    rules[span] if rules is not None else None,
                    table_lengths[span],
                    counts[span],
                )[0]
            except Exception as error:
                failed[row] = error
        if not logits:
            return self._nothing_ran(failed)
        return _PassResult(list(logits), torch.stack(list(logits.values())), failed)

    def _nothing_ran(self, failed: dict[int, Exception] | None = None) -> _PassResult:
        empty = torch.empty(0, self.model.config.vocab_size, device=self._device)
        return _PassResult([], empty, failed or {})

    def _refresh(
        self,
        rows: PagedRows,
        scalings: Sequence[RopeScaling],
        rules: Sequence[AttentionRule | None] | None,
        table_lengths: Sequence[int],
    ) -> dict[int, Exception]:
        """Recompute rows whose table changed; a row whose recomputation raises fails alone."""
        failed: dict[int, Exception] = {}
        for row in stale_rows(self.model, rows, scalings, table_lengths):
            try:
                with torch.inference_mode():
                    rule = rules[row] if rules is not None else None
                    recompute_row(self.model, rows, row, scalings[row], table_lengths[row], rule)
            except Exception as error:
                failed[row] = error
        return failed

    def _forward(
        self,
        rows: PagedRows,
        chunks: Sequence[tuple[int, ...]],
        scalings: Sequence[RopeScaling],
        rules: Sequence[AttentionRule | None] | None,
        table_lengths: Sequence[int],
        counts: Sequence[int],
    ) -> Tensor:
        with torch.inference_mode():
            logits: Tensor = self.model(
                self._tokens(chunks),
                scaling=list(scalings),
                cache=rows,
                table_lengths=list(table_lengths),
                counts=list(counts),
                attention=rules,
            )[:, -1]  # [N, V] at each row's last real token
        return logits.float()


def _merged(parts: Sequence[list[int]], results: Sequence[_PassResult]) -> _PassResult:
    """The results of passes over parts of a group (row indices in `parts`) as one result."""
    ran = [part[row] for part, result in zip(parts, results, strict=True) for row in result.rows]
    failed = {
        part[row]: error
        for part, result in zip(parts, results, strict=True)
        for row, error in result.failed.items()
    }
    return _PassResult(ran, torch.cat([result.logits for result in results]), failed)


def _rules(sequences: Sequence[RunningSequence]) -> list[AttentionRule | None] | None:
    """Each row's attention rule (`pe_attention`), or None when every row attends as trained."""
    rules = [sequence.request.attention for sequence in sequences]
    return rules if any(rule is not None for rule in rules) else None


def _reusable(request: GenerationRequest) -> int:
    """The prompt tokens a row may read from the cache: those before its last one, whose logits
    the row's own pass must give."""
    return max(0, len(request.prompt_tokens) - 1)
