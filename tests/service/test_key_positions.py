"""Positions as data: the pool records the position of every cached key, and every backend reads
the score bias at those positions, not at the key's block index.

A row's cached keys are moved to other positions by editing the pool (as a rule that groups or
shifts key positions will), and the eager pass, the torch step and the C pass must agree on the
result, which must differ from the unedited one.
"""

from __future__ import annotations

import pytest
import torch

from pe_runtime import RopeScaling
from service.model.backend import Backend
from service.model.fast_decode import FastDecoder
from service.model.kernels import batch_pass
from service.model.paged_cache import PagedKVCache, PagedRow, PagedRows
from tests.conftest import tiny_transformer
from tests.kernels import require_kernel
from tests.service.test_fast_decode import TOLERANCE, WIDE_HEAD, pool_for

PROMPT = 37
NONE = RopeScaling()


def cached_positions(pool: PagedKVCache, row: PagedRow) -> list[int]:
    positions = torch.arange(row.length)
    blocks = torch.tensor(row.blocks)[positions // pool.block_size]
    return pool.key_positions[blocks, positions % pool.block_size].tolist()


def prefilled(decoder: FastDecoder, prompt: list[int]) -> PagedRow:
    row = decoder.pool.allocate(len(prompt) + 2)
    with torch.inference_mode():
        decoder.model(torch.tensor([prompt]), scaling=[NONE], cache=PagedRows(decoder.pool, [row]))
    return row


def grouped(pool: PagedKVCache, row: PagedRow, group: int) -> None:
    """Every cached key of the row moved to position j // group (Self-Extend's grouping)."""
    positions = torch.arange(row.length)
    blocks = torch.tensor(row.blocks)[positions // pool.block_size]
    pool.key_positions[blocks, positions % pool.block_size] = positions // group


@pytest.mark.parametrize("pe", ["alibi", "t5_bias"])
def test_every_backend_reads_the_positions_the_pool_records(pe: str) -> None:
    require_kernel(batch_pass.available, "batch step")
    model = tiny_transformer(pe=pe, head_dim_override=WIDE_HEAD, t5_num_buckets=16, t5_max_distance=64)
    if model.positions.t5_table is not None:
        with torch.no_grad():
            model.positions.t5_table.weight.mul_(100.0)  # a bias that moves the scores, as ALiBi's does
    prompt = torch.randint(0, 256, (PROMPT,), generator=torch.Generator().manual_seed(2)).tolist()
    token = prompt[-1]
    results = {}
    for label, group in (("as written", 1), ("grouped", 3)):
        for backend in (Backend.EAGER, Backend.C, Backend.COMPILED):
            runs_on = Backend.C if backend is Backend.EAGER else backend  # its pool and prefill only
            decoder = FastDecoder(model, pool_for(model), runs_on, max_window=128, inductor=False)
            row = prefilled(decoder, prompt)
            assert cached_positions(decoder.pool, row) == list(range(PROMPT))
            grouped(decoder.pool, row, group)
            view = PagedRows(decoder.pool, [row])
            with torch.inference_mode():
                if backend is Backend.EAGER:
                    logits = model(torch.tensor([[token]]), scaling=[NONE], cache=view)[:, -1].float()
                else:
                    logits = decoder.decode(view, [token], [NONE])
            # The new key sits at its own index, whatever the others were moved to.
            assert cached_positions(decoder.pool, row)[-1] == PROMPT
            results[label, str(backend)] = logits
    for label in ("as written", "grouped"):
        eager = results[label, str(Backend.EAGER)]
        for backend in (Backend.C, Backend.COMPILED):
            assert float((results[label, str(backend)] - eager).abs().max()) < TOLERANCE, (label, backend)
    moved = results["grouped", str(Backend.EAGER)] - results["as written", str(Backend.EAGER)]
    assert float(moved.abs().max()) > 1e-3


def test_a_copied_prefix_head_keeps_its_positions() -> None:
    """A row reusing part of a cached block copies the block's positions with its entries."""
    model = tiny_transformer(pe="alibi")
    pool = pool_for(model)
    row = pool.allocate(32)
    lender = row.blocks[0]
    pool.key_positions[lender] = torch.arange(100, 100 + pool.block_size)
    row.prefix = [b"first", b"second"]
    pool.publish(row)
    pool.release(row)
    borrower = pool.allocate(32, prefix=[b"first"], limit=5)
    assert borrower.length == 5
    assert borrower.blocks[0] != lender
    assert pool.key_positions[borrower.blocks[0], :5].tolist() == list(range(100, 105))
