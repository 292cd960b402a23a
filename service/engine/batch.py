"""One model's running sequences: those still reading their prompt, and those decoding.

Each group shares one right-padded KV cache. A decode step runs every decoding row in one forward
pass, each row with its own RoPE scaling. A prefill chunk advances every prefilling row by one
width of prompt tokens sized to the step's token budget (rows of different prompt lengths and
progress share the pass; a row with fewer tokens left is padded), so a long prompt is read a slice
per step between decode steps instead of stalling them. A row whose prompt is complete moves to
the decoding group with its first token's logits.

Failures stay with their row. The model advances a cache only after a pass succeeded, so when a
batched pass raises, every row is rerun alone from the state it was in, and only the rows that
still raise fail; rows that did nothing wrong never write a token twice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from pe_runtime import RopeScaling
from service.engine.budget import chunk_cost, chunk_width
from service.engine.sequence import RunningSequence
from service.model.kv_cache import KVCache
from service.model.refresh import recompute_row, stale_rows
from service.model.transformer import Transformer

logger = logging.getLogger("service.engine.batch")

_PAD = 0  # fills a prompt chunk to the group's width; never kept (see `Transformer.forward`)


@dataclass
class StepOutcome:
    """Float32 logits [N, V] on CPU for the N rows that ran, and the rows that failed instead."""

    rows: list[RunningSequence]
    logits: Tensor
    failed: list[tuple[RunningSequence, Exception]] = field(default_factory=list)


@dataclass
class _PassResult:
    logits: dict[int, Tensor]  # row -> logits [V]
    failed: dict[int, Exception]


@dataclass
class _Group:
    """Sequences sharing one cache, row i of the cache belonging to sequences[i]."""

    sequences: list[RunningSequence] = field(default_factory=list)
    cache: KVCache | None = None

    def __len__(self) -> int:
        return len(self.sequences)

    def join(self, sequences: list[RunningSequence], cache: KVCache) -> None:
        if self.cache is None:
            self.cache = cache
        else:
            self.cache.append(cache)
        self.sequences += sequences

    def split(
        self, keep: Callable[[RunningSequence], bool], *, take: bool = False
    ) -> tuple[list[RunningSequence], KVCache | None]:
        """Remove the sequences `keep` rejects; return them, and with `take` a copy of their rows."""
        wanted = [keep(sequence) for sequence in self.sequences]
        if all(wanted) or self.cache is None:
            return [], None
        leaving = [row for row, stays in enumerate(wanted) if not stays]
        taken = self.cache.select(leaving) if take else None
        gone = [self.sequences[row] for row in leaving]
        if len(leaving) == len(self.sequences):
            self.sequences, self.cache = [], None
        else:
            order = self.cache.retain(wanted)
            self.sequences = [self.sequences[row] for row in order]
        return gone, taken


class ModelBatch:
    def __init__(self, model: Transformer) -> None:
        self.model = model
        self._prefilling = _Group()
        self._decoding = _Group()

    def __len__(self) -> int:
        return len(self._prefilling) + len(self._decoding)

    @property
    def decoding(self) -> int:
        return len(self._decoding)

    @property
    def prefilling(self) -> int:
        return len(self._prefilling)

    @property
    def sequences(self) -> list[RunningSequence]:
        return self._prefilling.sequences + self._decoding.sequences

    def add(self, sequences: list[RunningSequence]) -> None:
        """Start reading prompts; one cache for all of them, sized for the whole requests."""
        capacity = max(len(s.request.prompt_tokens) + s.request.sampling.max_new_tokens for s in sequences)
        self._prefilling.join(sequences, self.model.new_cache(len(sequences), capacity))

    def prefill_chunk(self, budget: int) -> tuple[StepOutcome, int]:
        """Advance every prefilling row by up to `budget` tokens in all.

        Rows take the same width; a row with fewer prompt tokens left is padded to it, so that one
        row close to the end of its prompt never slows the others down to its pace. Returns the
        rows whose prompt is now complete, with their next-token logits (they move to the decoding
        group in `retain`, unless that first token finished them), the rows that failed, and what
        the pass took from the budget.
        """
        group = self._prefilling
        past = max(sequence.prefilled for sequence in group.sequences)
        longest = max(sequence.prompt_remaining for sequence in group.sequences)
        width = min(longest, chunk_width(budget, len(group), past))
        counts = [min(width, sequence.prompt_remaining) for sequence in group.sequences]
        chunks = [
            sequence.next_prompt_chunk(count) + (_PAD,) * (width - count)
            for sequence, count in zip(group.sequences, counts, strict=True)
        ]
        # Every chunk of a prompt reads the table for the whole prompt: no row changes table mid-prompt.
        lengths = [len(sequence.request.prompt_tokens) for sequence in group.sequences]
        result = self._run(group, chunks, lengths, counts)
        for row in result.logits:
            group.sequences[row].prefilled += counts[row]
        ready = [row for row in result.logits if not group.sequences[row].prompt_remaining]
        return self._outcome(group, result, ready), chunk_cost(len(chunks), width, past)

    def decode(self) -> StepOutcome:
        """One token for every decoding row in one forward pass."""
        group = self._decoding
        assert group.cache is not None
        lengths = [past + 1 for past in group.cache.lengths]
        chunks = [(sequence.last_token,) for sequence in group.sequences]
        result = self._run(group, chunks, lengths, [1] * len(chunks))
        return self._outcome(group, result, list(result.logits))

    def _outcome(self, group: _Group, result: _PassResult, rows: list[int]) -> StepOutcome:
        vocab = self.model.config.vocab_size
        logits = torch.stack([result.logits[row] for row in rows]) if rows else torch.empty(0, vocab)
        failed = [(group.sequences[row], error) for row, error in result.failed.items()]
        return StepOutcome([group.sequences[row] for row in rows], logits, failed)

    def retain(self, keep: Callable[[RunningSequence], bool]) -> list[RunningSequence]:
        """Drop sequences for which `keep` is false (their cache rows too); return the dropped ones.

        Then rows whose prompt is complete move to the decoding group: only those still running,
        so a request done at its first token never costs the decoding rows a copy.
        """
        dropped: list[RunningSequence] = []
        for group in (self._prefilling, self._decoding):
            gone, _ = group.split(keep)
            dropped += gone
        moving, cache = self._prefilling.split(lambda sequence: sequence.prompt_remaining > 0, take=True)
        if moving and cache is not None:
            self._decoding.join(moving, cache)
        return dropped

    @property
    def _device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def _run(
        self, group: _Group, chunks: Sequence[tuple[int, ...]], table_lengths: list[int], counts: list[int]
    ) -> _PassResult:
        """One pass over the group; if it raises, each row alone from its untouched cache row."""
        assert group.cache is not None
        scalings = [sequence.scaling for sequence in group.sequences]
        failed = self._refresh(group.cache, scalings, table_lengths)
        try:
            logits = self._forward(group.cache, chunks, scalings, table_lengths, counts)
        except Exception:
            logger.exception("a batched pass failed; rerunning its rows one by one")
            return self._run_rows_alone(group, chunks, scalings, table_lengths, counts, failed)
        return _PassResult({row: logits[row] for row in range(len(group)) if row not in failed}, failed)

    def _run_rows_alone(
        self,
        group: _Group,
        chunks: Sequence[tuple[int, ...]],
        scalings: list[RopeScaling],
        table_lengths: list[int],
        counts: list[int],
        failed: dict[int, Exception],
    ) -> _PassResult:
        assert group.cache is not None
        logits: dict[int, Tensor] = {}
        caches: list[KVCache] = []
        for row in range(len(group)):
            cache = group.cache.select([row])
            caches.append(cache)
            if row in failed:
                continue
            span = slice(row, row + 1)
            try:
                logits[row] = self._forward(
                    cache, chunks[span], scalings[span], table_lengths[span], counts[span]
                )[0]
            except Exception as error:
                failed[row] = error
        group.cache = KVCache.concat(caches)
        return _PassResult(logits, failed)

    def _refresh(
        self, cache: KVCache, scalings: Sequence[RopeScaling], table_lengths: Sequence[int]
    ) -> dict[int, Exception]:
        """Recompute rows whose table changed; a row whose recomputation raises fails alone."""
        failed: dict[int, Exception] = {}
        for row in stale_rows(self.model, cache, scalings, table_lengths):
            try:
                with torch.inference_mode():
                    recompute_row(self.model, cache, row, scalings[row], table_lengths[row])
            except Exception as error:
                failed[row] = error
        return failed

    def _forward(
        self,
        cache: KVCache,
        chunks: Sequence[tuple[int, ...]],
        scalings: Sequence[RopeScaling],
        table_lengths: Sequence[int],
        counts: Sequence[int],
    ) -> Tensor:
        tokens = torch.tensor([list(chunk) for chunk in chunks], dtype=torch.long, device=self._device)
        with torch.inference_mode():
            logits: Tensor = self.model(
                tokens,
                scaling=list(scalings),
                cache=cache,
                table_lengths=list(table_lengths),
                counts=list(counts),
            )[:, -1]  # [N, V] at each row's last real token
        return logits.float().cpu()
