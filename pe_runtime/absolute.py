"""Absolute position embeddings: the fixed sinusoidal table and stretching a learned table."""

from __future__ import annotations

import math

import torch

from pe_runtime.errors import PEConfigError


def sinusoidal_table(
    length: int,
    dim: int,
    *,
    base: float = 10000.0,
    factor: float = 1.0,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Vaswani et al.'s table, float32 [length, dim]: sin in even channels, cos in odd ones.

    `factor` > 1 is position interpolation done exactly: row p holds the encoding of position
    p / factor, which a fixed sinusoid can evaluate directly instead of blending table rows.
    """
    if dim < 1:
        raise PEConfigError(f"dim must be a positive integer, got {dim!r}", field="dim")
    _check_factor(factor)
    channel_pairs = torch.arange(0, dim, 2, dtype=torch.float32, device=device)  # [ceil(dim / 2)]
    inv_freq = torch.exp(channel_pairs * (-math.log(base) / dim))
    positions = torch.arange(length, dtype=torch.float32, device=device) / factor  # [length]
    angles = torch.outer(positions, inv_freq)
    table = torch.empty(length, dim, dtype=torch.float32, device=device)
    table[:, 0::2] = angles.sin()
    table[:, 1::2] = angles.cos()[:, : dim // 2]
    return table


def interpolate_learned(table: torch.Tensor, factor: float) -> torch.Tensor:
    """Position interpolation for a learned table [length, dim] -> [floor(length * factor), dim].

    Row p of the result is the original table read at position p / factor, linearly interpolated,
    so a model with learned positions can run `factor` times past its trained length.
    """
    _check_factor(factor)
    length = table.shape[0]
    source = torch.arange(int(length * factor), dtype=torch.float32, device=table.device) / factor
    below = source.floor().to(torch.long).clamp(max=length - 1)
    above = (below + 1).clamp(max=length - 1)
    weight = (source - below.to(torch.float32))[:, None]  # [new_length, 1]
    rows = table.to(torch.float32)
    return (rows[below] * (1 - weight) + rows[above] * weight).to(table.dtype)


def _check_factor(factor: float) -> None:
    if not math.isfinite(factor) or factor < 1.0:
        raise PEConfigError(f"factor must be a finite number >= 1, got {factor!r}", field="factor")
