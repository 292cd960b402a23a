"""Position ids for the training-side extension methods: which RoPE position each token sits at.

A plain batch puts its T tokens at 0..T-1. The two samplers here put them elsewhere, always in
increasing order along the row (the model reads text left to right, and RoPE's relative angles only
mean "earlier" when positions grow with the text), always inside a fixed range, and always drawn
from the caller's seeded generator so a run repeats exactly.
"""

from __future__ import annotations

import itertools

import torch


def pose_positions(
    batch_size: int, length: int, target: int, generator: torch.Generator, *, chunks: int = 2
) -> torch.Tensor:
    """PoSE position ids (Zhu et al. 2023, "PoSE: Efficient Context Window Extension of LLMs via
    Positional Skip-wise Training"), `[batch_size, length]`, each row inside `[0, target)`.

    As in the paper, a row's `length` tokens are cut into `chunks` pieces of random lengths (at
    least one token each), and piece i is shifted by a skip bias u_i drawn uniformly from
    [u_{i-1}, target - length] with u_{-1} = 0, so positions increase along the row and the
    largest distance between two tokens can reach `target - 1` although only `length` tokens are
    ever in memory. The paper's default is two chunks.

    Where it differs from the seed: the seed "dropped" positions by slicing the input, which
    shortens the text and never shows the model a distance longer than the window. Here the text
    stays one contiguous window (the paper's text-skip v_i = 0 variant) and only the positions skip.
    """
    if not 1 <= chunks <= length <= target:
        raise ValueError(f"need 1 <= chunks ({chunks}) <= length ({length}) <= target ({target})")
    rows = []
    slack = target - length
    for _ in range(batch_size):
        cuts = torch.randperm(length - 1, generator=generator)[: chunks - 1].add(1).sort().values
        bounds = [0, *cuts.tolist(), length]
        bias = 0
        pieces = []
        for start, end in itertools.pairwise(bounds):
            bias = int(torch.randint(bias, slack + 1, (), generator=generator))
            pieces.append(torch.arange(start, end) + bias)
        rows.append(torch.cat(pieces))
    return torch.stack(rows)


def randomized_positions(
    batch_size: int, length: int, max_position: int, generator: torch.Generator
) -> torch.Tensor:
    """Randomized positions (Ruoss et al. 2023, "Randomized Positional Encodings Boost Length
    Generalization of Transformers"), `[batch_size, length]`: per row, an ordered uniformly random
    subset of `length` distinct positions from `[0, max_position)`.

    Training on such subsets exposes every position, and every distance, up to `max_position` while
    the window stays `length` tokens long; `max_position` is meant to be the longest length the model
    will be asked to read.

    Where it differs from the seed: the seed applied `randperm` to the positions themselves, a
    random permutation that destroys their order (a token could sit "before" the one it follows).
    The paper samples a subset and sorts it; here the subset is the first `length` entries of a
    random permutation of the whole range, sorted.
    """
    if not 1 <= length <= max_position:
        raise ValueError(f"need 1 <= length ({length}) <= max_position ({max_position})")
    rows = [
        torch.randperm(max_position, generator=generator)[:length].sort().values for _ in range(batch_size)
    ]
    return torch.stack(rows)
