"""Keeping cached entries true to a row's current RoPE table, the batch's decision to make.

Keys are cached rotated, and deeper layers' entries come from hidden states that attended with the
table of their time, so when a row's length-dependent table changes (bucketed dynamic NTK crossing
into the next bucket, LongRoPE crossing the original context) every layer's entries are stale.
Refreshing rebuilds the row from its token ids under the new table; afterwards incremental decoding
equals a fresh pass over the same tokens. Dynamic NTK in "hf" mode keeps stale entries on purpose.
"""

from __future__ import annotations

from collections.abc import Sequence

from pe_runtime import RopeScaling
from service.model.attention_rules import AttentionRule
from service.model.kv_cache import RowCache
from service.model.transformer import Transformer


def stale_rows(
    model: Transformer, cache: RowCache, scalings: Sequence[RopeScaling], table_lengths: Sequence[int]
) -> list[int]:
    """Rows whose cached entries were computed under another table than the one they now need."""
    positions = model.positions
    return [
        row
        for row, (past, before, scaling, length) in enumerate(
            zip(cache.lengths, cache.table_keys, scalings, table_lengths, strict=True)
        )
        if past > 0
        and not positions.keeps_cached_keys(scaling)
        and before != positions.table_key(scaling, length)
    ]


def recompute_row(
    model: Transformer,
    cache: RowCache,
    row: int,
    scaling: RopeScaling,
    table_length: int,
    attention: AttentionRule | None = None,
) -> None:
    """Rebuild one row's entries from its tokens under the table for `table_length`.

    The row is replaced only once the recomputation succeeded, so a failure leaves it as it was.
    """
    tokens = cache.row_tokens(row).clone()  # [1, L]
    fresh = model.new_cache(1, capacity=tokens.shape[1])
    model.final_hidden(
        tokens, scaling=scaling, cache=fresh, table_lengths=[table_length], attention=attention
    )
    cache.replace_row(row, fresh)
