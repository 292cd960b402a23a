"""Shaw, Uszkoreit and Vaswani (2018): learned embeddings of the clipped relative distance.

Every (query i, key j) pair reads one row of two learned tables, `a^K` (added to the key in the
logit) and `a^V` (added to the value in the output), chosen by `clip(j - i, -k, k)`. A causal
model only ever sees `j <= i`, so the tables here hold the `k + 1` rows for distances `-k .. 0`,
indexed by the distance `min(i - j, k)` (keys after the query, masked anyway, read row 0).
"""

from __future__ import annotations

import torch

from pe_runtime.errors import PEConfigError


def shaw_relative_index(relative_position: torch.Tensor, *, max_distance: int) -> torch.Tensor:
    """Table row (long, same shape) for each relative position `j - i`: `-clip(j - i, -k, 0)`."""
    if isinstance(max_distance, bool) or not isinstance(max_distance, int) or max_distance < 1:
        raise PEConfigError(
            f"max_distance must be a positive integer, got {max_distance!r}", field="max_distance"
        )
    return (-relative_position.to(torch.long)).clamp(min=0, max=max_distance)


def shaw_key_logits(queries: torch.Tensor, table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The `q_i . a^K_ij` term: queries [B, H, Tq, d], table [k + 1, d], index [B|1, 1|H, Tq, Tk].

    Each query meets only `k + 1` distinct embeddings, so it is projected on those once and the
    result gathered per key, instead of materialising a [Tq, Tk, d] tensor of embeddings.
    """
    per_distance = queries @ table.to(queries.dtype).T  # [B, H, Tq, k + 1]
    batch, heads, length, _ = per_distance.shape
    return per_distance.gather(-1, index.expand(batch, heads, length, index.shape[-1]))


def shaw_value_term(probabilities: torch.Tensor, table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The `sum_j alpha_ij a^V_ij` term: probabilities [B, H, Tq, Tk] -> [B, H, Tq, d].

    The attention mass on each distance is summed first (a scatter over `k + 1` bins), then mixes
    the table's rows: the same sum, without a [Tq, Tk, d] tensor.
    """
    batch, heads, length, keys = probabilities.shape
    bins = probabilities.new_zeros(batch, heads, length, table.shape[0])
    bins.scatter_add_(-1, index.expand(batch, heads, length, keys), probabilities)
    return bins @ table.to(probabilities.dtype)
