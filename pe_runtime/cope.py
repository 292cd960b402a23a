"""CoPE, contextual position encoding (Golovneva et al. 2024): positions counted by gates.

Query i opens a gate `g_ij = sigmoid(q_i . k_j)` on each visible key; the position of key j
seen from i is the number of open gates between them, `p_ij = sum_{t = j .. i} g_it`, clipped
to `npos_max`. Positions are fractional, so the learned embeddings `e[0 .. npos_max]` are read
by linear interpolation, and `q_i . e[p_ij]` is added to the attention logit.

As in the authors' reference code, `q . k` is the scaled attention logit (the gate is its
sigmoid) and the position term `q . e` is added unscaled.
"""

from __future__ import annotations

import torch


def cope_positions(gates: torch.Tensor, *, npos_max: int) -> torch.Tensor:
    """Positions [..., Tq, Tk] from gates [..., Tq, Tk] that are already zero on hidden keys.

    A reversed cumulative sum over the keys: p_ij adds the gates of keys j .. i (those past i are
    zero), then the clip to `npos_max`.
    """
    return gates.flip(-1).cumsum(-1).flip(-1).clamp(max=npos_max)


def cope_logits(queries: torch.Tensor, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The `q_i . e[p_ij]` term, interpolated: queries [B, H, Tq, d], table [npos_max + 1, d].

    `q . e[n]` is computed once per integer position n, then each pair blends its floor and ceil:
    `(p - floor p) q.e[ceil p] + (1 - (p - floor p)) q.e[floor p]`.
    """
    per_position = queries @ table.to(queries.dtype).T  # [B, H, Tq, npos_max + 1]
    floor = positions.floor()
    weight = (positions - floor).to(queries.dtype)
    below = per_position.gather(-1, floor.long())
    above = per_position.gather(-1, positions.ceil().long())
    return weight * above + (1 - weight) * below
