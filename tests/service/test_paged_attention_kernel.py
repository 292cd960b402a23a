"""The C decode-attention kernel against its torch reference.

Rows sit at positions that end a block, start one, fill a window, or hold a single key; heads of
8 take the scalar path, 32 and 64 the vector path (and 48 its generic width); groups of two query
heads per key/value head check grouped-query indexing. Both sides write the new key and value
into their own copy of the pool, which must come out equal.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch

from service.model.kernels import paged_attention
from service.model.kernels.paged_attention import paged_decode_attention, reference_paged_decode_attention
from tests.kernels import require_kernel, torch_threads


@pytest.fixture(autouse=True)
def _kernel() -> None:
    require_kernel(paged_attention.available, "paged attention")


BLOCK = 16
POOL_BLOCKS = 40
WINDOW_BLOCKS = 4
POSITIONS = (0, 15, 16, 37, WINDOW_BLOCKS * BLOCK - 1)


class Inputs(NamedTuple):
    queries: torch.Tensor
    new_keys: torch.Tensor
    new_values: torch.Tensor
    key_pages: torch.Tensor
    value_pages: torch.Tensor
    window_blocks: torch.Tensor
    positions: torch.Tensor


def case(head_dim: int, group: int, *, bias: bool, seed: int = 0) -> tuple[Inputs, torch.Tensor | None]:
    """Inputs of one step: queries, new keys and values, pools, blocks, positions; and a bias."""
    generator = torch.Generator().manual_seed(seed)
    kv_heads, batch = 2, len(POSITIONS)
    heads = kv_heads * group

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    pools = [normal(kv_heads, POOL_BLOCKS, BLOCK, head_dim) for _ in range(2)]
    shuffled = torch.randperm(POOL_BLOCKS - 1, generator=generator) + 1  # never the scratch block
    blocks = shuffled[: batch * WINDOW_BLOCKS].view(batch, -1)
    queries, keys, values = (normal(batch, n, head_dim) for n in (heads, kv_heads, kv_heads))
    inputs = Inputs(queries, keys, values, pools[0], pools[1], blocks, torch.tensor(POSITIONS))
    scores_bias = normal(batch, heads, WINDOW_BLOCKS * BLOCK) if bias else None
    return inputs, scores_bias


def copied(inputs: Inputs) -> Inputs:
    return Inputs(*(t.clone() for t in inputs))


def both(inputs: Inputs, bias: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """Kernel output and pools, then the reference's, each on its own copy of the pools."""
    ours, theirs = copied(inputs), copied(inputs)
    scale = inputs.queries.shape[-1] ** -0.5
    out = paged_decode_attention(*ours, bias, scale)
    expected = reference_paged_decode_attention(*theirs, bias, scale)
    return out, ours.key_pages, ours.value_pages, expected, theirs.key_pages, theirs.value_pages


@pytest.mark.parametrize("threads", [1, 2], ids=["1-thread", "2-threads"])
@pytest.mark.parametrize("bias", [False, True], ids=["causal", "biased"])
@pytest.mark.parametrize("group", [1, 2])
@pytest.mark.parametrize("head_dim", [8, 32, 48, 64])
def test_the_kernel_equals_the_torch_reference(head_dim: int, group: int, bias: bool, threads: int) -> None:
    """Every (row, head) pair attends on its own, so threads share them with the same result."""
    tensors, scores_bias = case(head_dim, group, bias=bias)
    with torch_threads(threads):
        out, keys, values, expected, expected_keys, expected_values = both(tensors, scores_bias)
    assert out.shape == expected.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(keys, expected_keys) and torch.equal(values, expected_values)


def test_strided_rows_of_a_fused_projection_are_read_in_place() -> None:
    """Queries, keys and values arrive as slices of one [B, (H + 2 Hkv) * hd] product."""
    inputs, _ = case(32, 1, bias=False)
    fused = torch.cat([t.flatten(1) for t in inputs[:3]], dim=1)
    width = inputs.queries.shape[1] * 32
    views = [fused[:, :width], fused[:, width : 2 * width], fused[:, 2 * width :]]
    queries, keys, values = (view.view(len(POSITIONS), -1, 32) for view in views)
    assert not values.is_contiguous()
    out, *_ = both(inputs._replace(queries=queries, new_keys=keys, new_values=values), None)
    expected, *_ = both(inputs, None)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


@pytest.mark.parametrize(
    ("spoil", "message"),
    [
        (lambda i: i._replace(window_blocks=i.window_blocks.clone().fill_(POOL_BLOCKS)), "block id"),
        (lambda i: i._replace(window_blocks=i.window_blocks.clone().fill_(-1)), "block id"),
        (lambda i: i._replace(positions=i.positions.clone().fill_(WINDOW_BLOCKS * BLOCK)), "position"),
        (lambda i: i._replace(positions=i.positions[:-1]), "window_blocks"),
    ],
    ids=["block-past-the-pool", "negative-block", "position-past-the-window", "rows-disagree"],
)
def test_indices_out_of_bounds_are_refused_before_the_kernel_runs(
    spoil: Callable[[Inputs], Inputs], message: str
) -> None:
    """The kernel trusts its indices; the binding checks them, so a bad one is a Python error."""
    inputs, _ = case(32, 1, bias=False)
    pools = inputs.key_pages.clone(), inputs.value_pages.clone()
    with pytest.raises(ValueError, match=message):
        paged_decode_attention(*spoil(inputs), None, 1.0)
    assert torch.equal(pools[0], inputs.key_pages) and torch.equal(pools[1], inputs.value_pages)


@pytest.mark.parametrize("head_dim", [8, 64], ids=["scalar", "vector"])
def test_masked_slots_read_as_a_minus_infinity_bias(head_dim: int) -> None:
    """A row's masked slots [first, last) (a streaming row's entries between its sinks and its
    window) weigh nothing, as under a bias of −inf there; ranges inside a block, across blocks and
    empty ones."""
    inputs, _ = case(head_dim, 2, bias=False)
    masked = torch.tensor([[0, 0], [3, 9], [4, 16], [2, 30], [10, 63]])  # per row of POSITIONS
    heads, window = inputs.queries.shape[1], WINDOW_BLOCKS * BLOCK
    slots = torch.arange(window)
    hidden = (slots[None] >= masked[:, :1]) & (slots[None] < masked[:, 1:])  # [B, W]
    bias = torch.zeros(len(POSITIONS), heads, window).masked_fill(hidden[:, None], float("-inf"))
    scale = head_dim**-0.5
    out = paged_decode_attention(*copied(inputs), None, scale, masked)
    expected = reference_paged_decode_attention(*copied(inputs), bias, scale)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    unmasked = paged_decode_attention(*copied(inputs), None, scale)
    assert (out - unmasked).abs().max() > 1e-3, "the masks must change what the rows read"


def test_a_mask_over_a_rows_own_newest_key_is_refused() -> None:
    inputs, _ = case(32, 1, bias=False)
    masked = torch.zeros(len(POSITIONS), 2, dtype=torch.long)
    masked[2] = torch.tensor([0, POSITIONS[2] + 1])
    with pytest.raises(ValueError, match="own newest key"):
        paged_decode_attention(*copied(inputs), None, 1.0, masked)
