"""Attention behind one interface: a layer hands over its queries, keys and values, and the cache
it runs over decides how they meet.

`Attention.forward` (transformer.py) computes the projections, norms and rotations once, for
every path, then calls `attend`. What differs is where keys live:

- no cache (training, a fresh full pass): the pass's own keys;
- a `RowCache` (`KVCache`, `PagedRows`): the new keys are written after each row's entries and
  attention reads the windows the cache returns;
- a `PagedStep` (the torch decode step, compiled or captured as CUDA graphs): one query per row,
  attending over its blocks of the pool (`reference_paged_decode_attention`).

Over a window, attention is SDPA with the pass's mask and score bias, the relative schemes'
explicit attention (Shaw, Transformer-XL, CoPE), or, for rows with a `pe_attention` rule, the
rule's branches over the positions the cache records (`rule_attention`). The C pass
(`kernels/batch_pass.c`) is the same computation over the same pool, run as one call, for rows
without a rule.
"""

from __future__ import annotations

from typing import NamedTuple

import torch.nn.functional as F
from torch import Tensor

from pe_runtime import RopeLayout
from service.model.kernels.paged_attention import reference_paged_decode_attention
from service.model.kv_cache import RowCache
from service.model.positional import PositionalInputs
from service.model.relative_attention import RelativeAttention
from service.model.rule_attention import Windows, attend_rows


class PagedStep(NamedTuple):
    """One query per row over the pool's blocks: what the torch decode step attends with."""

    key_pages: list[Tensor]  # per layer [Hkv, NB, BS, hd]
    value_pages: list[Tensor]
    window_blocks: Tensor  # [B, nb]
    positions: Tensor  # [B] each row's new position: its write slot and causal limit
    bias: Tensor | None  # [B, H, W] float32, the scheme's bias on the scores

    def attend(self, layer: int, queries: Tensor, keys: Tensor, values: Tensor) -> Tensor:
        """[B, H, 1, hd] queries and [B, Hkv, 1, hd] new entries -> attended [B, H, 1, hd]."""
        scale = queries.shape[-1] ** -0.5
        attended = reference_paged_decode_attention(
            queries[:, :, 0],
            keys[:, :, 0],
            values[:, :, 0],
            self.key_pages[layer],
            self.value_pages[layer],
            self.window_blocks,
            self.positions,
            self.bias,
            scale,
        )  # [B, H, hd] float32
        return attended[:, :, None].to(queries.dtype)


def attend(
    cache: RowCache | PagedStep | None,
    layer: int,
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    positions: PositionalInputs,
    relative: RelativeAttention | None,
    layout: RopeLayout = "neox",
) -> Tensor:
    """Queries [B, H, Tq, hd] against the pass's keys and values [B, Hkv, Tq, hd] and whatever
    `cache` holds before them: attended [B, H, Tq, hd]. Writes the new entries into the cache."""
    if isinstance(cache, PagedStep):
        return cache.attend(layer, queries, keys, values)
    key_windows: Windows = keys
    value_windows: Windows = values
    if cache is not None:
        key_windows, value_windows = cache.write(layer, keys, values)
    if positions.rules is not None:
        return attend_rows(
            positions.rules,
            layer,
            queries,
            key_windows,
            value_windows,
            positions.attn_mask,
            positions.causal,
            layout,
        )
    # Without a rule the windows are the pass's, [B, Hkv, Tk, hd] each.
    assert isinstance(key_windows, Tensor) and isinstance(value_windows, Tensor)
    keys, values = key_windows, value_windows
    if relative is not None:
        attended: Tensor = relative(queries, keys, values, positions.relative)
        return attended
    return F.scaled_dot_product_attention(
        queries,
        keys,
        values,
        attn_mask=positions.attn_mask,
        is_causal=positions.causal,
        enable_gqa=keys.shape[1] != queries.shape[1],
    )
