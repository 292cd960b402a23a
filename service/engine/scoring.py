"""Scoring: the log-probability of every token given its prefix, read in chunks through a KV cache.

This is the code path behind `/score`. The engine advances a `ChunkedScorer` by a slice of its
tokens per step, between decode passes, so a long document never stalls running streams;
`score_tokens` runs one to the end, which is what the extrapolation benchmark measures. With a
length-dependent scaling (dynamic NTK, LongRoPE) every position uses the table for the whole
sequence, as one full forward pass would: every chunk is told the total length.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from pe_runtime import RopeScaling
from service.engine.budget import ChunkPlan, chunk_cost, plan_chunk
from service.engine.errors import RequestFailedError
from service.engine.sampler import top_alternatives
from service.engine.types import TopLogprobs
from service.model.kv_cache import KVCache
from service.model.transformer import Stages, Transformer, run_layers

# Positions projected to the vocabulary at once: bounds the [N, V] float32 logits to a few hundred
# MiB even for 150k-token vocabularies, whatever the chunk length.
_PROJECTION_CHUNK = 512


class ChunkedScorer:
    """One scoring job in progress; its cache is allocated when it first runs."""

    def __init__(
        self,
        model: Transformer,
        tokens: Sequence[int],
        scaling: RopeScaling | None = None,
        *,
        top_logprobs: int = 0,
    ) -> None:
        self.model = model
        self.scaling = scaling
        self.top_logprobs = top_logprobs
        self._tokens = list(tokens)
        self._logprobs: list[float | None] = [None]
        self._alternatives: list[TopLogprobs | None] = [None]
        self._cache: KVCache | None = None
        # The chunk in progress when its pass is spread over steps: its ids, plan and stages.
        self._spread: tuple[Tensor, ChunkPlan, Stages[Tensor]] | None = None

    @property
    def remaining(self) -> int:
        """Positions still to run; the last token is only ever a target."""
        return len(self._tokens) - len(self._logprobs)

    def advance(self, budget: int) -> int:
        """Run the next chunk that fits `budget` (`service.engine.budget.plan_chunk`), or the next
        layers of a chunk spread over steps; returns what this call took from the budget.

        Raises RequestFailedError on non-finite logits.
        """
        model = self.model
        device = model.embed_tokens.weight.device
        if self._cache is None:
            self._cache = model.new_cache(1, len(self._tokens))
        if self._spread is None:
            start = len(self._logprobs) - 1
            plan = plan_chunk(budget, 1, start, self.remaining, model.config.n_layers)
            ids = torch.tensor(self._tokens[start : start + plan.width + 1], dtype=torch.long, device=device)
            stages = model.final_hidden_stages(
                ids[None, : plan.width],
                scaling=self.scaling,
                cache=self._cache,
                table_lengths=[len(self._tokens)],
            )
            self._spread = (ids, plan, stages)
        ids, plan, stages = self._spread
        with torch.inference_mode():
            final = run_layers(stages, plan.layers_per_step)
            if final is None:
                return plan.cost_per_step
            self._spread = None
            hidden = final[0]  # [width, D]
            for at in range(0, plan.width, _PROJECTION_CHUNK):
                logprobs = _chunk_logprobs(model, hidden[at : at + _PROJECTION_CHUNK])
                targets = ids[at + 1 : at + 1 + _PROJECTION_CHUNK]
                self._logprobs += logprobs.gather(1, targets[:, None])[:, 0].cpu().tolist()
                if self.top_logprobs:
                    self._alternatives += top_alternatives(logprobs.cpu(), self.top_logprobs)
        if not self.remaining:
            self._cache = None  # done: the memory goes back at once, not when the job is dropped
        return plan.cost_per_step

    def result(self) -> list[float | None]:
        return list(self._logprobs)

    def alternatives(self) -> list[TopLogprobs | None] | None:
        """The most likely tokens at every position (first None), if they were asked for."""
        return list(self._alternatives) if self.top_logprobs else None


def score_tokens(
    model: Transformer, tokens: Sequence[int], scaling: RopeScaling | None = None
) -> list[float | None]:
    """`[None, log p(t1 | t0), log p(t2 | t0 t1), ...]`; `scaling=None` is the model's default."""
    scorer = ChunkedScorer(model, tokens, scaling)
    while scorer.remaining:
        scorer.advance(chunk_cost(1, scorer.remaining, 0))  # a budget that fits all in one pass
    return scorer.result()


def _chunk_logprobs(model: Transformer, hidden: Tensor) -> Tensor:
    """Log-probabilities [N, V] for hidden states [N, D]; raises on non-finite logits."""
    logits = model.lm_head(hidden).float()  # [N, V]
    if not bool(torch.isfinite(logits).all()):
        raise RequestFailedError("the model produced non-finite logits for this input")
    return torch.log_softmax(logits, dim=-1)
