"""The arena that holds the C step's packed weights: exact copies, cache-line aligned, packed one
after another into shared regions, and backed by 2 MiB pages where the system offers them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from service.model.kernels.huge_pages import ALIGNMENT, HUGE_PAGE, HugePageArena

THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_page_bytes(address: int) -> int:
    """The bytes of this process's mapping holding `address` that sit in transparent huge pages."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    inside = False
    for line in lines:
        span = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if span:
            inside = int(span.group(1), 16) <= address < int(span.group(2), 16)
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return 0


def test_placed_tensors_are_aligned_copies_that_share_a_region() -> None:
    arena = HugePageArena(region_bytes=4 << 20)
    tensors = [torch.randn(100, 7), torch.randint(-128, 127, (33, 5), dtype=torch.int8), torch.randn(3)]
    placed = [arena.place(tensor) for tensor in tensors]
    for original, copy in zip(tensors, placed, strict=True):
        assert torch.equal(original, copy) and copy.dtype == original.dtype and copy.is_contiguous()
        assert copy.data_ptr() % ALIGNMENT == 0 and copy.data_ptr() != original.data_ptr()
    # One after another in one region: the second starts where the first ends, rounded to a line.
    assert placed[1].data_ptr() - placed[0].data_ptr() == -(-100 * 7 * 4 // ALIGNMENT) * ALIGNMENT
    assert placed[0].data_ptr() % HUGE_PAGE == 0  # a region's first tensor opens a huge page


def test_a_tensor_past_the_region_s_end_opens_a_region_of_its_own_size() -> None:
    arena = HugePageArena(region_bytes=1 << 20)
    first = arena.place(torch.ones(200_000))  # 800 kB: fits
    second = arena.place(torch.full((100_000,), 2.0))  # would pass the region's end
    large = arena.place(torch.full((1_000_000,), 3.0))  # larger than a region
    assert second.data_ptr() % HUGE_PAGE == 0 and large.data_ptr() % HUGE_PAGE == 0
    assert {second.data_ptr(), large.data_ptr()}.isdisjoint({first.data_ptr()})
    assert [float(tensor.sum()) for tensor in (first, second, large)] == [200_000, 200_000, 3_000_000]


def test_zeros_are_fresh_zeros_one_after_another() -> None:
    arena = HugePageArena()
    pool = arena.zeros((4, 1 << 20), torch.float32)  # 16 MiB
    assert pool.shape == (4, 1 << 20) and not pool.any()
    pool[2, :10] = 1.0
    assert float(pool.sum()) == 10.0
    follower = arena.zeros((3,), torch.int64)  # the next one starts past the first, on a line
    assert follower.data_ptr() - pool.data_ptr() == 16 << 20 and not follower.any()


def test_placed_tensors_outlive_the_arena() -> None:
    placed = HugePageArena().place(torch.arange(1000.0))
    torch.ones(10_000_000).sum()  # other allocations come and go
    assert torch.equal(placed, torch.arange(1000.0))


@pytest.mark.skipif(
    not THP_SETTING.exists() or "[never]" in THP_SETTING.read_text(),
    reason="this system has no transparent huge pages",
)
def test_the_region_is_backed_by_huge_pages() -> None:
    placed = HugePageArena().place(torch.randn(3 * HUGE_PAGE // 4))  # three huge pages of floats
    assert huge_page_bytes(placed.data_ptr()) >= 2 * HUGE_PAGE
