"""Transformer-XL relative attention (Dai et al. 2019): sinusoidal R_{i-j} and the relative shift.

The logit of query i and key j is `(q_i + u) . k_j + (q_i + v) . W_R R_{i-j}` (terms a + c and
b + d of the paper). The position terms are computed against the distances `Tk - 1 .. 0` once per
query, a [Tq, Tk] product, and `relative_shift` moves each query's row so that column j holds
distance i - j: no [Tq, Tk, d] tensor of per-pair encodings is ever built.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from pe_runtime.errors import PEConfigError


def relative_sinusoid(
    length: int,
    dim: int,
    *,
    factor: float = 1.0,
    base: float = 10000.0,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """R for the distances `length - 1, ..., 1, 0` (descending, as the shift needs), float32 [length, dim].

    The paper's layout: sines in the first half of the channels, cosines in the second. `factor`
    > 1 reads distance / factor (linear interpolation of relative positions), exactly.
    """
    if dim < 2 or dim % 2:
        raise PEConfigError(f"dim must be a positive even integer, got {dim!r}", field="dim")
    if not math.isfinite(factor) or factor < 1.0:
        raise PEConfigError(f"factor must be a finite number >= 1, got {factor!r}", field="factor")
    inv_freq = torch.exp(
        torch.arange(0, dim, 2, dtype=torch.float32, device=device) * (-math.log(base) / dim)
    )
    distances = torch.arange(length - 1, -1, -1, dtype=torch.float32, device=device) / factor
    angles = torch.outer(distances, inv_freq)
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


def relative_shift(scores: torch.Tensor) -> torch.Tensor:
    """[..., Tq, Tk] scores against distances `Tk - 1 .. 0` -> [..., Tq, Tk] scores against `i - j`.

    Query t is taken to sit at position `Tk - Tq + t` (the last query is the last key). One zero
    column padded on the left and a reshape to [Tk + 1, Tq] slide row t left by `Tq - 1 - t`, so
    column j ends up holding distance `Tk - Tq + t - j`. Columns with j past the query hold
    other rows' values: the causal mask must hide them.
    """
    *lead, queries, keys = scores.shape
    padded = F.pad(scores, (1, 0))  # [..., Tq, Tk + 1]
    return padded.reshape(*lead, keys + 1, queries)[..., 1:, :].reshape(*lead, queries, keys)
