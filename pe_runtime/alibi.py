"""ALiBi (Press et al. 2022): a per-head linear penalty on distance instead of position embeddings."""

from __future__ import annotations

import math

import torch

from pe_runtime.errors import PEConfigError


def _geometric_slopes(count: int, bias_max: float = 8.0) -> list[float]:
    """The paper's slopes for a power-of-two head count: 2^(-bias_max * k / count), k = 1 .. count."""
    return [2.0 ** (-bias_max * k / count) for k in range(1, count + 1)]


def alibi_slopes(num_heads: int, *, bias_max: float = 8.0, rule: str = "press") -> torch.Tensor:
    """Per-head slopes, float32 [num_heads], for any head count.

    For a non-power of two, `rule="press"` (the paper, and BLOOM) takes all slopes of the nearest
    lower power of two, then every other slope of the next power: the extra heads interleave
    between the existing ones instead of crowding at the steep end. `rule="mpt"` is MPT's: the next
    power's slopes, the even-numbered ones first, cut to `num_heads`. Both agree for a power of two.
    `bias_max` is the exponent of the steepest slope (MPT's `alibi_bias_max`; 8 in the paper).
    """
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        raise PEConfigError(f"num_heads must be a positive integer, got {num_heads!r}", field="num_heads")
    if not bias_max > 0:
        raise PEConfigError(f"bias_max must be positive, got {bias_max!r}", field="bias_max")
    if rule == "press":
        lower = 2 ** math.floor(math.log2(num_heads))
        extra = _geometric_slopes(2 * lower, bias_max)[0::2][: num_heads - lower]
        slopes = _geometric_slopes(lower, bias_max) + extra
    elif rule == "mpt":
        upper = _geometric_slopes(2 ** math.ceil(math.log2(num_heads)), bias_max)
        slopes = (upper if len(upper) == num_heads else upper[1::2] + upper[0::2])[:num_heads]
    else:
        raise PEConfigError(f"unknown ALiBi slope rule {rule!r}", field="rule")
    return torch.tensor(slopes, dtype=torch.float32)


def alibi_bias(slopes: torch.Tensor, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
    """Causal ALiBi bias slope * (k - q), float32 [num_heads, len_q, len_k], added to attention logits.

    Positions are absolute, so a decode step passes its one query position against the cached keys.
    Keys after the query get a positive value here: masking them is the causal mask's job.
    Leading batch dimensions broadcast: positions [..., len_q] and [..., len_k] give
    [num_heads, ..., len_q, len_k] (rows whose cached keys sit at positions of their own).
    """
    # distance: [..., len_q, len_k]
    distance = k_positions.to(torch.float32)[..., None, :] - q_positions.to(torch.float32)[..., :, None]
    slopes = slopes.to(device=distance.device, dtype=torch.float32)
    return slopes.view(-1, *([1] * distance.dim())) * distance
