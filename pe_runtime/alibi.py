"""ALiBi (Press et al. 2022): a per-head linear penalty on distance instead of position embeddings."""

from __future__ import annotations

import math

import torch

from pe_runtime.errors import PEConfigError


def _geometric_slopes(count: int) -> list[float]:
    """The paper's slopes for a power-of-two head count: 2^(-8k/count), k = 1 .. count."""
    return [2.0 ** (-8.0 * k / count) for k in range(1, count + 1)]


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """Per-head slopes, float32 [num_heads], for any head count.

    For a non-power of two the paper takes all slopes of the nearest lower power of two, then every
    other slope of the next power: the extra heads interleave between the existing ones instead of
    crowding at the steep end.
    """
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        raise PEConfigError(f"num_heads must be a positive integer, got {num_heads!r}", field="num_heads")
    lower = 2 ** math.floor(math.log2(num_heads))
    slopes = _geometric_slopes(lower) + _geometric_slopes(2 * lower)[0::2][: num_heads - lower]
    return torch.tensor(slopes, dtype=torch.float32)


def alibi_bias(slopes: torch.Tensor, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
    """Causal ALiBi bias slope * (k - q), float32 [num_heads, len_q, len_k], added to attention logits.

    Positions are absolute, so a decode step passes its one query position against the cached keys.
    Keys after the query get a positive value here: masking them is the causal mask's job.
    """
    # distance: [len_q, len_k]
    distance = k_positions.to(torch.float32)[None, :] - q_positions.to(torch.float32)[:, None]
    return slopes.to(device=distance.device, dtype=torch.float32)[:, None, None] * distance
