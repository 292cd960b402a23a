"""Scoring: the log-probability of every token given its prefix, read in chunks over a row of blocks.

This is the code path behind `/score`. A document holds a row of its model's KV block pool
(`service.model.paged_cache`) while it is scored, as a generation does, so its memory is inside
the pool's bound and a document waits for blocks when the pool is full. The engine advances a
`ChunkedScorer` by a slice of its tokens per step, between decode passes, so a long document
never stalls running streams; `score_tokens` runs one to the end on the eager pass, which is what
the extrapolation benchmark measures and what the tests compare the served path against.

Each chunk runs where a prompt chunk of the same row would: through the C pass when the model's
fast decoder takes it (`FastDecoder.prefills`), every token of the chunk a row of the pass, which
returns every token's final residual (`FastDecoder.prefill_hidden`); else on the model's own layers
(`Transformer.final_hidden_stages` over the row), spread a few layers per step when even the
smallest chunk costs more than the step allows (as prompt chunks are: the C pass runs every layer
in one call). Either way the positions then go through the final norm and the head
`_PROJECTION_CHUNK` at a time. With a length-dependent scaling (dynamic NTK, LongRoPE) every
position uses the table for the whole sequence, as one full forward pass would: every chunk is
told the total length.

Scoring neither reads nor publishes the prefix cache: every position's log-probabilities need its
hidden state, which the cache does not keep, so cached keys and values of a prefix would save no
work.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

from pe_runtime import RopeScaling
from service.engine.budget import ChunkPlan, chunk_cost, plan_chunk, useful_chunk_cost
from service.engine.errors import RequestFailedError
from service.engine.sampler import top_alternatives
from service.engine.types import TopLogprobs
from service.model.attention_rules import AttentionRule, rule_for_pass
from service.model.fast_decode import FastDecoder
from service.model.paged_cache import PagedKVCache, PagedRows
from service.model.transformer import Stages, Transformer, run_layers

# Positions projected to the vocabulary at once: bounds the [N, V] float32 logits to a few hundred
# MiB even for 150k-token vocabularies, whatever the chunk length.
_PROJECTION_CHUNK = 512

ScorePath = Literal["c", "eager"]
SCORE_PATHS: tuple[ScorePath, ...] = ("c", "eager")


def cached_positions(tokens: Sequence[int]) -> int:
    """The positions a document writes to its row: all but the last token, which is only a target."""
    return len(tokens) - 1


class ChunkedScorer:
    """One document being scored over `rows`, a single row of a block pool with room for
    `cached_positions(tokens)`; `fast` runs the chunks it takes (`FastDecoder.prefills`)."""

    def __init__(
        self,
        model: Transformer,
        tokens: Sequence[int],
        rows: PagedRows,
        scaling: RopeScaling | None = None,
        *,
        fast: FastDecoder | None = None,
        top_logprobs: int = 0,
        attention: AttentionRule | None = None,
    ) -> None:
        self.model = model
        self.rows = rows
        self.scaling = scaling if scaling is not None else model.positions.default_scaling
        self.attention = attention
        self.fast = fast
        self.top_logprobs = top_logprobs
        self.positions_by_path: dict[ScorePath, int] = dict.fromkeys(SCORE_PATHS, 0)
        self._tokens = list(tokens)
        self._logprobs: list[float | None] = [None]
        self._alternatives: list[TopLogprobs | None] = [None]
        # An eager chunk in progress when its pass is spread over steps: its targets, plan and stages.
        self._spread: tuple[Tensor, ChunkPlan, Stages[Tensor]] | None = None

    @property
    def remaining(self) -> int:
        """Positions still to run; the last token is only ever a target."""
        return len(self._tokens) - len(self._logprobs)

    def useful_chunk_cost(self) -> int:
        """The fewest units worth a turn after another chunk of the step (`useful_chunk_cost`); 0
        while a spread chunk's layers are pending (they run on any)."""
        if self._spread is not None:
            return 0
        return useful_chunk_cost(len(self._logprobs) - 1, self.remaining)

    def advance(self, budget: int) -> int:
        """Run the next chunk that fits `budget` (`service.engine.budget.plan_chunk`), or the next
        layers of a chunk spread over steps; returns what this call took from the budget.

        Raises RequestFailedError on non-finite logits.
        """
        if self._spread is None:
            start = len(self._logprobs) - 1
            plan = plan_chunk(budget, 1, start, self.remaining, self.model.config.n_layers)
            chunk = self._tokens[start : start + plan.width]
            targets = torch.tensor(self._tokens[start + 1 : start + plan.width + 1], device=self._device)
            whole = plan.layers_per_step == plan.layers
            # The C pass runs no attention rule, but a rule places the queries below its
            # `standard_below` as standard does: such a chunk runs as a plain one.
            plain = rule_for_pass(self.attention, start + plan.width) is None
            if (
                whole
                and plain
                and self.fast is not None
                and self.fast.prefills(self.rows.lengths, [plan.width])
            ):
                residuals = self.fast.prefill_hidden(
                    self.rows, [chunk], [plan.width], [self.scaling], [len(self._tokens)]
                )
                with torch.inference_mode():
                    self._score(self.model.norm(residuals), targets, "c")
                return plan.cost
            stages = self.model.final_hidden_stages(
                torch.tensor([chunk], device=self._device),
                scaling=self.scaling,
                cache=self.rows,
                table_lengths=[len(self._tokens)],
                attention=self.attention,
            )
            self._spread = (targets, plan, stages)
        targets, plan, stages = self._spread
        with torch.inference_mode():
            final = run_layers(stages, plan.layers_per_step)
            if final is not None:
                self._spread = None
                self._score(final[0], targets, "eager")
        return plan.cost_per_step

    def close(self) -> None:
        """Drop a spread chunk's pass before the row's blocks go back to the pool."""
        if self._spread is not None:
            self._spread[2].close()
            self._spread = None

    def result(self) -> list[float | None]:
        return list(self._logprobs)

    def alternatives(self) -> list[TopLogprobs | None] | None:
        """The most likely tokens at every position (first None), if they were asked for."""
        return list(self._alternatives) if self.top_logprobs else None

    @property
    def _device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def _score(self, hidden: Tensor, targets: Tensor, path: ScorePath) -> None:
        """Record the log-probabilities of `targets` [N] after normed hidden states [N, D]."""
        for at in range(0, len(targets), _PROJECTION_CHUNK):
            logprobs = _chunk_logprobs(self.model, hidden[at : at + _PROJECTION_CHUNK])
            picked = targets[at : at + _PROJECTION_CHUNK, None]
            self._logprobs += logprobs.gather(1, picked)[:, 0].cpu().tolist()
            if self.top_logprobs:
                self._alternatives += top_alternatives(logprobs.cpu(), self.top_logprobs)
        self.positions_by_path[path] += len(targets)


def score_tokens(
    model: Transformer,
    tokens: Sequence[int],
    scaling: RopeScaling | None = None,
    attention: AttentionRule | None = None,
) -> list[float | None]:
    """`[None, log p(t1 | t0), log p(t2 | t0 t1), ...]` on the eager pass, in one chunk, over a pool
    of its own; `scaling=None` is the model's default, `attention=None` standard attention."""
    weight = model.embed_tokens.weight
    positions = cached_positions(tokens)
    pool = PagedKVCache.within(
        model.config, 0, min_tokens=positions, device=weight.device, dtype=weight.dtype
    )
    rows = PagedRows(pool, [pool.allocate(positions)])
    scorer = ChunkedScorer(model, tokens, rows, scaling, attention=attention)
    while scorer.remaining:
        scorer.advance(chunk_cost(1, scorer.remaining, 0))  # a budget that fits all in one pass
    return scorer.result()


def _chunk_logprobs(model: Transformer, hidden: Tensor) -> Tensor:
    """Log-probabilities [N, V] for hidden states [N, D]; raises on non-finite logits."""
    logits = model.lm_head(hidden).float()  # [N, V]
    if not bool(torch.isfinite(logits).all()):
        raise RequestFailedError("the model produced non-finite logits for this input")
    return torch.log_softmax(logits, dim=-1)
