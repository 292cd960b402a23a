"""The model runner: runs one pass over rows of a model's KV pool, on the backend that takes it.

The scheduler (`service.engine.batch.ModelBatch`) decides which rows run, with which tokens, and
when; the runner only executes (vLLM keeps the same split between its scheduler and its model
runner). A pass goes to the fast decoder (`service.model.fast_decode`: the C pass or the compiled
step) when it covers the rows, else to the model's own layers; rows under an attention rule
(`pe_attention`, which the fast decoder refuses) run on the model's layers in a pass of their own,
beside the others'.

Failures stay with their row. A row's length advances only after a pass succeeded (what a failed
pass wrote lies past it, and is overwritten), so when a batched pass raises, every row is rerun
alone from the state it was in, and only the rows that still raise fail.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import Tensor

from pe_runtime import RopeScaling
from service.model.attention_rules import AttentionRule, rule_for_pass
from service.model.fast_decode import FastDecoder
from service.model.paged_cache import PagedKVCache, PagedRow, PagedRows
from service.model.refresh import recompute_row, stale_rows
from service.model.transformer import Stages, Transformer

logger = logging.getLogger("service.engine.runner")
_Value = TypeVar("_Value")


@dataclass(frozen=True)
class PassRows:
    """What one pass runs: rows of the pool and, for each, the tokens it feeds in (padded to one
    width; the first `counts[i]` are real), its scaling, its attention rule (None: standard) and
    the sequence length its table is read for."""

    rows: list[PagedRow]
    chunks: list[tuple[int, ...]]
    scalings: list[RopeScaling]
    rules: list[AttentionRule | None]
    table_lengths: list[int]
    counts: list[int]

    def __len__(self) -> int:
        return len(self.rows)

    def part(self, indices: Sequence[int]) -> PassRows:
        """The rows at `indices`, in that order."""

        def pick(values: Sequence[_Value]) -> list[_Value]:
            return [values[index] for index in indices]

        return PassRows(
            pick(self.rows),
            pick(self.chunks),
            pick(self.scalings),
            pick(self.rules),
            pick(self.table_lengths),
            pick(self.counts),
        )

    def as_run(self) -> PassRows:
        """The rows as the pass runs them: a rule that places every query of this pass as
        `standard` does (`rule_for_pass`: a text shorter than Self-Extend's window,
        DCA's first chunk, ...) is dropped, so that its row runs as a plain one, on the fast paths.
        Its earlier tokens sat lower still, so a recomputation of the row runs the same."""
        rules = [
            rule_for_pass(rule, row.length + row.dropped + count)
            for row, rule, count in zip(self.rows, self.rules, self.counts, strict=True)
        ]
        return self if rules == self.rules else dataclasses.replace(self, rules=rules)

    @property
    def any_rule(self) -> list[AttentionRule | None] | None:
        """The rules, or None when every row attends as trained (what the model takes)."""
        return self.rules if any(rule is not None for rule in self.rules) else None


@dataclass
class PassResult:
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


class ModelRunner:
    """Runs passes of one model over its pool; `fast` takes the passes it covers."""

    def __init__(self, model: Transformer, pool: PagedKVCache, fast: FastDecoder | None) -> None:
        self.model = model
        self.pool = pool
        self.fast = fast

    def run(self, rows: PassRows, view: PagedRows, *, decode: bool) -> PassResult:
        """One pass over `rows` (`view` is them behind the cache interface): one token per row
        when `decode`, else a prompt chunk. Rows with an attention rule the fast decoder does not
        take (`FastDecoder.decodes_under`) run on the model's own layers, which place each row's
        keys by its rule (`service.model.rule_attention`); the others where they would run alone,
        in a pass of their own beside them."""
        rows = rows.as_run()
        ruled = [row for row, rule in enumerate(rows.rules) if not self._fast_takes(rule, decode)]
        if self.fast is None or not ruled or len(ruled) == len(rows):
            return self._run(rows, view, decode=decode)
        plain = [row for row in range(len(rows)) if row not in ruled]
        results = []
        for indices in (plain, ruled):
            part = rows.part(indices)
            results.append(self._run(part, PagedRows(self.pool, part.rows), decode=decode))
        return _merged((plain, ruled), results)

    def stages(self, rows: PassRows, view: PagedRows) -> Stages[Tensor] | None:
        """A prompt chunk's pass a layer at a time on the model's own layers (logits [N, T, V] at
        the end), or None when a row's table changed since its entries were cached (its pass must
        recompute it first: `run`)."""
        if stale_rows(self.model, view, rows.scalings, rows.table_lengths):
            return None
        return self._stages(rows.as_run(), view)

    def run_alone(self, rows: PassRows, failed: dict[int, Exception] | None = None) -> PassResult:
        """Every row not in `failed` in a pass of its own; the rows that raise join `failed`."""
        failed = dict(failed or {})
        logits: dict[int, Tensor] = {}
        for row in range(len(rows)):
            if row in failed:
                continue
            alone = rows.part([row])
            try:
                logits[row] = self._forward(alone, PagedRows(self.pool, alone.rows))[0]
            except Exception as error:
                failed[row] = error
        if not logits:
            return self.nothing_ran(failed)
        return PassResult(list(logits), torch.stack(list(logits.values())), failed)

    def nothing_ran(self, failed: dict[int, Exception] | None = None) -> PassResult:
        empty = torch.empty(0, self.model.config.vocab_size, device=self._device)
        return PassResult([], empty, failed or {})

    def _run(self, rows: PassRows, view: PagedRows, *, decode: bool) -> PassResult:
        """One pass; if it raises, each row alone from its untouched state. The fast decoder
        takes it when it takes every row's rule (`_fast_takes`)."""
        failed = self._refresh(rows, view)
        takes = all(self._fast_takes(rule, decode) for rule in rows.rules)
        decoder = self.fast if takes and not failed else None
        try:
            if decode and decoder is not None and decoder.covers(view.lengths):
                logits = decoder.decode(view, [chunk[0] for chunk in rows.chunks], rows.scalings, rows.rules)
            elif not decode and decoder is not None and decoder.prefills(view.lengths, rows.counts):
                logits = decoder.prefill(view, rows.chunks, rows.counts, rows.scalings, rows.table_lengths)
            else:
                logits = self._forward(rows, view)
        except Exception:
            logger.exception("a batched pass failed; rerunning its rows one by one")
            return self.run_alone(rows, failed)
        ran = [row for row in range(len(rows)) if row not in failed]
        return PassResult(ran, logits if len(ran) == len(rows) else logits[ran], failed)

    def _fast_takes(self, rule: AttentionRule | None, decode: bool) -> bool:
        """Whether the fast decoder runs a row under `rule`: a row without one, and in a decode
        pass a rule it decodes (`FastDecoder.decodes_under`: a streaming row in C)."""
        return rule is None or (decode and self.fast is not None and self.fast.decodes_under(rule))

    def _refresh(self, rows: PassRows, view: PagedRows) -> dict[int, Exception]:
        """Recompute rows whose table changed; a row whose recomputation raises fails alone."""
        failed: dict[int, Exception] = {}
        for row in stale_rows(self.model, view, rows.scalings, rows.table_lengths):
            try:
                with torch.inference_mode():
                    recompute_row(
                        self.model, view, row, rows.scalings[row], rows.table_lengths[row], rows.rules[row]
                    )
            except Exception as error:
                failed[row] = error
        return failed

    def _forward(self, rows: PassRows, view: PagedRows) -> Tensor:
        """The model's own layers (its `forward`, whole): logits float32 [N, V] at each row's
        last real token."""
        with torch.inference_mode():
            logits: Tensor = self.model(self._tokens(rows.chunks), **self._pass_arguments(rows, view))[:, -1]
        return logits.float()

    def _stages(self, rows: PassRows, view: PagedRows) -> Stages[Tensor]:
        return self.model.forward_stages(self._tokens(rows.chunks), **self._pass_arguments(rows, view))

    @staticmethod
    def _pass_arguments(rows: PassRows, view: PagedRows) -> dict[str, Any]:
        """What the model's forward takes of the rows besides their tokens."""
        return {
            "scaling": rows.scalings,
            "cache": view,
            "table_lengths": rows.table_lengths,
            "counts": rows.counts,
            "attention": rows.any_rule,
        }

    @property
    def _device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def _tokens(self, chunks: Sequence[tuple[int, ...]]) -> Tensor:
        return torch.tensor([list(chunk) for chunk in chunks], dtype=torch.long, device=self._device)


def _merged(parts: Sequence[list[int]], results: Sequence[PassResult]) -> PassResult:
    """The results of passes over parts of the rows (row indices in `parts`) as one result."""
    pairs = list(zip(parts, results, strict=True))
    ran = [part[row] for part, result in pairs for row in result.rows]
    failed = {part[row]: error for part, result in pairs for row, error in result.failed.items()}
    return PassResult(ran, torch.cat([result.logits for result in results]), failed)
