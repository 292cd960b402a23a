"""Turning one row of logits into the next token, reproducibly per request.

Each request owns a `torch.Generator`, so the random numbers it draws depend only on its seed and
how many tokens it has drawn, never on which other requests share its batch. Log-probabilities
are taken from the raw distribution (before temperature, top-k and top-p), so they are comparable
with what `/score` reports for the same tokens.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import torch
from torch import Tensor

from service.engine.types import SamplingParams


class Sampler:
    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.generator = torch.Generator(device="cpu")
        self.generator.manual_seed(params.seed if params.seed is not None else secrets.randbits(63))

    @property
    def greedy(self) -> bool:
        return self.params.temperature == 0.0

    def sample(self, logits: Tensor) -> tuple[int, float]:
        """logits: float32 [vocab] on CPU -> (token, its raw log-probability)."""
        return sample_rows([self], logits[None])[0]

    def draw(self, logits: Tensor) -> int:
        """A random token from float32 logits [vocab] after temperature, top-k and top-p."""
        filtered = _top_p(
            _top_k(_tempered(logits, self.params.temperature), self.params.top_k), self.params.top_p
        )
        return int(torch.multinomial(torch.softmax(filtered, dim=-1), 1, generator=self.generator))


def _tempered(logits: Tensor, temperature: float) -> Tensor:
    """logits / temperature, finite for any temperature > 0 however small.

    Shifting by the maximum first makes every entry <= 0, so a tiny temperature sends the others
    to -inf (the greedy limit) instead of overflowing; the floor keeps a temperature that rounds
    to zero in float32 from turning the maximum into 0 / 0.
    """
    shifted = logits - logits.max()
    return shifted / max(temperature, torch.finfo(logits.dtype).tiny)


def sample_rows(samplers: Sequence[Sampler], logits: Tensor) -> list[tuple[int, float]]:
    """One (token, raw log-probability) per row of float32 logits [B, vocab] on CPU.

    Softmax and argmax run once for the whole batch; only rows that sample pay a per-row draw.
    """
    raw_logprobs = torch.log_softmax(logits, dim=-1)  # [B, V]
    best = torch.argmax(logits, dim=-1).tolist()
    tokens = [
        best[row] if sampler.greedy else sampler.draw(logits[row]) for row, sampler in enumerate(samplers)
    ]
    chosen = raw_logprobs.gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()  # [B]
    return list(zip(tokens, chosen, strict=True))


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
    cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
    # A token is dropped when the tokens before it already reach p; the most likely always stays.
    dropped_sorted = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= p
    dropped_sorted[0] = False  # p may round to 0 in float32
    dropped = torch.zeros_like(dropped_sorted).scatter(0, order, dropped_sorted)
    return logits.masked_fill(dropped, float("-inf"))
