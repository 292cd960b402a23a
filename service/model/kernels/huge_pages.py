"""Memory for the C step's packed weights, backed by 2 MiB pages where Linux gives them.

A decode pass streams every weight once per step (SmolLM2 in float32: 540 MB). In 4 KiB pages
that is a TLB miss every 64 cache lines, and each page walk holds up the prefetches that keep the
products fed: at 16 rows a product over weights read from memory ran at 130 GFLOP/s, and at
180 GFLOP/s over the same weights in 2 MiB pages (a /tmp probe over 24 copies of SmolLM2's
gate/up panels, two threads). Debian's default for transparent huge pages is `madvise`: memory is
backed by 2 MiB pages only where a process asks, before its pages are touched. The arena asks.

Tensors are copied into anonymous mappings of at least `REGION_BYTES`, one after another, so that
a model's panels share pages instead of each rounding up to its own. Where the system has no
transparent huge pages (another OS, a kernel without them, `never`), the mapping is plain memory
and nothing else changes.
"""

from __future__ import annotations

import contextlib
import math
import mmap

import torch
from torch import Tensor

HUGE_PAGE = 2 << 20
REGION_BYTES = 64 << 20  # a region's size at least: a tensor larger than that gets its own
ALIGNMENT = 64  # each tensor starts on a cache line


class HugePageArena:
    """Places copies of tensors in memory that asks for 2 MiB pages. A placed tensor keeps its
    mapping alive (`torch.frombuffer` holds it), whatever becomes of the arena."""

    def __init__(self, region_bytes: int = REGION_BYTES) -> None:
        self._region_bytes = region_bytes
        self._memory: Tensor | None = None  # the current region's usable bytes
        self._used = 0

    def place(self, tensor: Tensor) -> Tensor:
        """A contiguous copy of the CPU tensor `tensor`, in the arena."""
        placed = self.zeros(tuple(tensor.shape), tensor.dtype)
        placed.copy_(tensor)
        return placed

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        """A tensor of zeros in the arena. The mapping is zero until written and takes memory page
        by page as it is first written, so a large pool costs what its rows have used."""
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if self._memory is None or self._used + nbytes > self._memory.numel():
            self._open_region(max(self._region_bytes, nbytes))
        assert self._memory is not None
        tensor = self._memory[self._used : self._used + nbytes].view(dtype).view(shape)
        self._used += -(-nbytes // ALIGNMENT) * ALIGNMENT
        return tensor

    def _open_region(self, size: int) -> None:
        # One huge page more than asked: the usable bytes start on a 2 MiB boundary. Bytes never
        # touched (before that boundary, past the last tensor) cost no memory.
        region = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        advice = getattr(mmap, "MADV_HUGEPAGE", None)
        if advice is not None:
            with contextlib.suppress(OSError):  # no transparent huge pages here: plain pages
                region.madvise(advice)
        memory = torch.frombuffer(region, dtype=torch.uint8)
        start = -memory.data_ptr() % HUGE_PAGE
        self._memory, self._used = memory[start : start + size], 0
