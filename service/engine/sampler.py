"""Turning rows of logits into next tokens, reproducibly per request and independently per row.

Each token's random draw is seeded from the request's seed and the token's index in its generation
(`draw_seed`), so it depends neither on which other requests share the batch nor on the path the
generation took: a stream resumed after a cut at token k draws tokens k+1.. exactly as the uncut
stream did, on this replica or another, where a generator seeded once and advanced by each draw
would need its state carried across the cut. Log-probabilities and top alternatives are taken
from the raw distribution (before penalties, temperature, top-k, top-p and min-p), so they are
comparable with what `/score` reports for the same tokens.

A step's rows may each ask for different controls. Every control is a row-wise operation on the
batch's logits: rows that use one are gathered into one tensor operation, rows that do not are
left untouched, so a row's settings can never move another row's token or log-probabilities.
The order is the usual one (transformers, vLLM): penalties, then the masks that keep EOS and stop
tokens from ending a generation too early, then, for sampling rows, temperature, top-k, top-p and
min-p before the draw.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable, Collection, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from service.engine.types import SamplingParams, TopLogprob, TopLogprobs
from service.model.kernels.logit_rows import LogitRows, logit_rows


class Pick(NamedTuple):
    """One row's outcome: the token, its raw log-probability, and the asked-for alternatives."""

    token: int
    logprob: float
    top_logprobs: TopLogprobs | None


class Sampler:
    """One request's sampling state: its generator and the tokens its penalties look at.

    `resumed`: how many of the prompt's last tokens the generation itself produced before its
    stream was cut (`service.engine.types.Resumed`); they count as output for the OpenAI
    penalties and for the index of each later draw. `params` then counts what is left
    (`min_tokens`), as `generated` does.
    """

    def __init__(
        self,
        params: SamplingParams,
        *,
        prompt: Sequence[int] = (),
        eos_ids: Collection[int] = (),
        resumed: int = 0,
    ) -> None:
        self.params = params
        self.eos_ids = tuple(sorted(eos_ids))
        self.seed = params.seed if params.seed is not None else secrets.randbits(63)
        self._generator: torch.Generator | None = None
        self.generated = 0
        self._prompt = tuple(prompt)
        self._earlier = self._prompt[len(self._prompt) - resumed :]
        self._seen: Tensor | None = None  # bool [V]: prompt and output tokens (repetition penalty)
        self._counts: Tensor | None = None  # float [V]: output token counts (OpenAI penalties)

    @property
    def greedy(self) -> bool:
        return self.params.temperature == 0.0

    @property
    def penalizes_repetition(self) -> bool:
        return self.params.repetition_penalty != 1.0

    @property
    def penalizes_output(self) -> bool:
        return self.params.presence_penalty != 0.0 or self.params.frequency_penalty != 0.0

    def blocked_tokens(self) -> tuple[int, ...]:
        """Tokens that may not be drawn now: those that would end the generation before min_tokens."""
        if self.generated >= self.params.min_tokens:
            return ()
        enders = self.params.stop_token_ids
        return enders if self.params.ignore_eos else (*enders, *self.eos_ids)

    def generator(self, device: torch.device) -> torch.Generator:
        """The generator of the next draw, on the device its logits live on, seeded for that draw's
        index in the generation (made at the first draw, seeded again at each)."""
        if self._generator is None:
            self._generator = torch.Generator(device=device)
        self._generator.manual_seed(draw_seed(self.seed, len(self._earlier) + self.generated))
        return self._generator

    def seen(self, vocab: int, device: torch.device) -> Tensor:
        if self._seen is None:
            self._seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            self._seen[[token for token in self._prompt if token < vocab]] = True
        return self._seen

    def counts(self, vocab: int, device: torch.device) -> Tensor:
        if self._counts is None:
            earlier = torch.tensor([token for token in self._earlier if token < vocab], dtype=torch.long)
            self._counts = torch.bincount(earlier, minlength=vocab).to(device=device, dtype=torch.float32)
        return self._counts

    def record(self, token: int) -> None:
        """Note a generated token for the penalties and min_tokens."""
        self.generated += 1
        if self._seen is not None:
            self._seen[token] = True
        if self._counts is not None:
            self._counts[token] += 1.0

    def sample(self, logits: Tensor) -> tuple[int, float]:
        """logits: float32 [vocab] -> (token, its raw log-probability)."""
        (pick,) = sample_rows([self], logits[None])
        if pick is None:
            raise ValueError("these sampling controls leave no token to draw")
        return pick.token, pick.logprob

    def draw(self, logits: Tensor) -> int:
        """A random token from float32 logits [vocab] after temperature, top-k, top-p and min-p."""
        params = self.params
        filtered = _min_p(
            _top_p(_top_k(_tempered(logits, params.temperature), params.top_k), params.top_p), params.min_p
        )
        probabilities = torch.softmax(filtered, dim=-1)
        return int(torch.multinomial(probabilities, 1, generator=self.generator(logits.device)))


_MASK64 = (1 << 64) - 1


def draw_seed(seed: int, index: int) -> int:
    """The seed of draw `index` (0-based) of a request seeded `seed`: SplitMix64 of the pair, so that
    neighbouring indices and seeds give unrelated streams."""
    mixed = (seed + (index + 1) * 0x9E3779B97F4A7C15) & _MASK64
    mixed = ((mixed ^ (mixed >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    mixed = ((mixed ^ (mixed >> 27)) * 0x94D049BB133111EB) & _MASK64
    return mixed ^ (mixed >> 31)


def sample_rows(
    samplers: Sequence[Sampler], logits: Tensor, summary: LogitRows | None = None
) -> list[Pick | None]:
    """One pick per row of finite float32 logits [B, vocab]; each sampler records its token.
    `summary`: `logit_rows(logits)`, where the caller has it already.

    Everything runs where the logits are (the model's device): the rows' argmax and log-sum-exp
    in one pass (`logit_rows`), top-k alternatives once for the whole batch, a per-row draw only
    for rows that sample, penalties and masks only for rows that use them. What comes back to the
    host is B token ids and log-probabilities (and the asked-for alternatives), never a row of
    logits.

    None for a row whose controls leave no token to draw (every token masked to -inf): checked for
    all rows before any draw, so the others' random streams are the same as without that row.
    """
    summary = summary if summary is not None else logit_rows(logits)
    adjusted = adjusted_logits(samplers, logits)
    if adjusted is logits:  # finite rows: each has a token to draw
        drawable, best = [1] * len(samplers), summary.argmaxes
    else:
        best_values, best_tokens = torch.max(adjusted, dim=-1)
        drawable, best = torch.stack([torch.isfinite(best_values).long(), best_tokens]).tolist()  # one sync
    rows = [row for row in range(len(samplers)) if drawable[row]]
    tokens = [best[row] if samplers[row].greedy else samplers[row].draw(adjusted[row]) for row in rows]
    every = len(rows) == len(samplers)
    kept = logits if every else logits[rows]
    index = torch.tensor(tokens, dtype=torch.long, device=logits.device)[:, None]
    # A log-probability is the logit less its row's log-sum-exp: one reading of the logits, where
    # a whole log_softmax also wrote [B, V] (at 16 rows of a 49k vocabulary, a step's 0.3 ms).
    normalizer = summary.log_sums if every else summary.of(rows).log_sums
    chosen = (kept.gather(1, index)[:, 0] - normalizer).tolist()
    alternatives = _top_logprobs(kept, normalizer, [samplers[row].params.top_logprobs for row in rows])
    picks: list[Pick | None] = [None] * len(samplers)
    for row, token, logprob, top in zip(rows, tokens, chosen, alternatives, strict=True):
        samplers[row].record(token)
        picks[row] = Pick(token, logprob, top)
    return picks


def top_alternatives(logprobs: Tensor, count: int) -> list[TopLogprobs]:
    """The `count` most likely tokens of every row of log-probabilities [N, V], most likely first."""
    if count <= 0:
        return [() for _ in range(logprobs.shape[0])]
    values, indices = torch.topk(logprobs, min(count, logprobs.shape[-1]), dim=-1)
    return [
        tuple(TopLogprob(token=token, logprob=value) for token, value in zip(ids, row, strict=True))
        for ids, row in zip(indices.tolist(), values.tolist(), strict=True)
    ]


def _top_logprobs(logits: Tensor, normalizer: Tensor, counts: list[int]) -> list[TopLogprobs | None]:
    """Each row's alternatives (None where none were asked for), from one top-k over the batch of
    logits less their rows' log-sum-exp (`normalizer` [B])."""
    widest = max(counts, default=0)
    if widest == 0:
        return [None] * len(counts)
    rows = top_alternatives(logits - normalizer[:, None], widest)
    return [row[:count] if count else None for row, count in zip(rows, counts, strict=True)]


def adjusted_logits(samplers: Sequence[Sampler], logits: Tensor) -> Tensor:
    """The logits tokens are chosen from: `logits` itself when no row adjusts anything."""
    steps: list[tuple[Callable[[Sampler], bool], Callable[[Tensor, Sequence[Sampler]], Tensor]]] = [
        (lambda sampler: sampler.penalizes_repetition, _repetition_penalty),
        (lambda sampler: sampler.penalizes_output, _output_penalties),
        (lambda sampler: bool(sampler.blocked_tokens()), _blocked),
    ]
    adjusted = logits
    for applies, apply in steps:
        rows = [row for row, sampler in enumerate(samplers) if applies(sampler)]
        if not rows:
            continue
        if adjusted is logits:
            adjusted = logits.clone()
        chosen = [samplers[row] for row in rows]
        adjusted[rows] = apply(adjusted[rows], chosen)
    return adjusted


def _repetition_penalty(logits: Tensor, samplers: Sequence[Sampler]) -> Tensor:
    """transformers' rule: a seen token's logit is divided by the penalty if positive, else multiplied."""
    vocab, device = logits.shape[-1], logits.device
    seen = torch.stack([sampler.seen(vocab, device) for sampler in samplers])
    penalty = torch.tensor([sampler.params.repetition_penalty for sampler in samplers], device=device)[
        :, None
    ]
    # A penalty near zero (any positive float is allowed) divides a positive logit past the largest
    # float; saturating there keeps the limit (the seen token wins) instead of an inf that turns
    # into NaN once the sampler subtracts the maximum.
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    penalized = penalized.clamp(max=torch.finfo(logits.dtype).max)
    return torch.where(seen, penalized, logits)


def _output_penalties(logits: Tensor, samplers: Sequence[Sampler]) -> Tensor:
    """OpenAI's rule: logit - count * frequency_penalty - (count > 0) * presence_penalty."""
    vocab, device = logits.shape[-1], logits.device
    counts = torch.stack([sampler.counts(vocab, device) for sampler in samplers])
    frequency = torch.tensor([sampler.params.frequency_penalty for sampler in samplers], device=device)[
        :, None
    ]
    presence = torch.tensor([sampler.params.presence_penalty for sampler in samplers], device=device)[:, None]
    return logits - counts * frequency - (counts > 0).float() * presence


def _blocked(logits: Tensor, samplers: Sequence[Sampler]) -> Tensor:
    vocab = logits.shape[-1]
    mask = torch.zeros_like(logits, dtype=torch.bool)
    for row, sampler in enumerate(samplers):
        mask[row, [token for token in sampler.blocked_tokens() if token < vocab]] = True
    return logits.masked_fill(mask, float("-inf"))


def _tempered(logits: Tensor, temperature: float) -> Tensor:
    """logits / temperature, finite for any temperature > 0 however small.

    Shifting by the maximum first makes every entry <= 0, so a tiny temperature sends the others
    to -inf (the greedy limit) instead of overflowing; the floor keeps a temperature that rounds
    to zero in float32 from turning the maximum into 0 / 0.
    """
    shifted = logits - logits.max()
    return shifted / max(temperature, torch.finfo(logits.dtype).tiny)


def _top_k(logits: Tensor, k: int) -> Tensor:
    """Keep the k largest logits (ties at the k-th value kept too); 0 disables."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    threshold = torch.topk(logits, k).values[-1]
    return logits.masked_fill(logits < threshold, float("-inf"))


def _top_p(logits: Tensor, p: float) -> Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches p; 1 disables."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True)
    probabilities = torch.softmax(sorted_logits, dim=-1)
    # A token is dropped when the tokens before it already reach p; the most likely always stays.
    dropped_sorted = (probabilities.cumsum(dim=-1) - probabilities) >= p
    dropped_sorted[0] = False  # p may round to 0 in float32
    dropped = torch.zeros_like(dropped_sorted).scatter(0, order, dropped_sorted)
    return logits.masked_fill(dropped, float("-inf"))


def _min_p(logits: Tensor, min_p: float) -> Tensor:
    """Keep tokens at least `min_p` times as likely as the most likely one; 0 disables.

    In log space: logit >= max_logit + log(min_p), which keeps the most likely token always.
    """
    if min_p <= 0.0:
        return logits
    threshold = logits.max() + math.log(min_p)
    return logits.masked_fill(logits < threshold, float("-inf"))
