"""Eight threads hammering one PECache with mixed keys: every table correct, counters consistent."""

from __future__ import annotations

import random
import threading
from collections import Counter
from dataclasses import dataclass

import pytest
import torch

from pe_runtime import PECache, RopeLayout, RopeScaling, rope_cos_sin, rope_inv_freq, sinusoidal_table
from pe_runtime.t5 import t5_relative_position_bucket

THREADS = 8
CALLS_PER_THREAD = 150
MAX_LENGTH = 700
HEAD_DIM = 32
SINUSOIDAL_DIM = 24


@dataclass(frozen=True)
class Request:
    """One cache entry's identity; which fields matter depends on `kind`."""

    kind: str
    device: str
    dtype: torch.dtype = torch.float32
    scaling: RopeScaling | None = None
    layout: RopeLayout = "neox"
    bidirectional: bool = True

    def fetch(self, cache: PECache, length: int) -> torch.Tensor:
        if self.kind == "rope":
            return cache.rope(
                HEAD_DIM,
                10000.0,
                self.scaling,
                length,
                device=self.device,
                dtype=self.dtype,
                layout=self.layout,
            ).sin
        if self.kind == "sinusoidal":
            return cache.sinusoidal(length, SINUSOIDAL_DIM, device=self.device, dtype=self.dtype)
        return cache.t5_buckets(
            length, bidirectional=self.bidirectional, num_buckets=32, max_distance=128, device=self.device
        )

    def expected(self, length: int) -> torch.Tensor:
        if self.kind == "rope":
            inv_freq, factor = rope_inv_freq(HEAD_DIM, 10000.0, self.scaling)
            return rope_cos_sin(inv_freq, factor, length, layout=self.layout, dtype=self.dtype)[1]
        if self.kind == "sinusoidal":
            return sinusoidal_table(length, SINUSOIDAL_DIM).to(self.dtype)
        relative = torch.arange(1 - length, length)
        return t5_relative_position_bucket(
            relative, bidirectional=self.bidirectional, num_buckets=32, max_distance=128
        )

    def entry_bytes(self, capacity: int) -> int:
        if self.kind == "rope":
            return 2 * capacity * HEAD_DIM * self.dtype.itemsize
        if self.kind == "sinusoidal":
            return capacity * SINUSOIDAL_DIM * self.dtype.itemsize
        return (2 * capacity - 1) * torch.int64.itemsize


def _requests() -> list[Request]:
    scalings = (
        None,
        RopeScaling(type="linear", factor=2.0),
        RopeScaling(type="yarn", factor=4.0, original_max_position_embeddings=128),
        RopeScaling(type="llama3", factor=8.0, original_max_position_embeddings=128),
    )
    layouts: tuple[RopeLayout, ...] = ("neox", "gptj")
    rope = [
        Request("rope", device, dtype, scaling, layout)
        for scaling in scalings
        for dtype in (torch.float32, torch.bfloat16)
        for layout in layouts
        for device in ("cpu", "meta")
    ]
    others = [Request("sinusoidal", device, torch.float16) for device in ("cpu", "meta")]
    others += [Request("t5_buckets", "cpu", bidirectional=bidirectional) for bidirectional in (True, False)]
    return rope + others


def _hammer(cache: PECache, requests: list[Request]) -> tuple[Counter[tuple[str, str]], dict[Request, int]]:
    """Runs the threads; returns the calls made per (kind, device) and the longest length per request."""
    references = {request: request.expected(MAX_LENGTH) for request in requests if request.device == "cpu"}
    calls: Counter[tuple[str, str]] = Counter()
    longest: dict[Request, int] = {}
    failures: list[str] = []
    record = threading.Lock()
    start = threading.Barrier(THREADS)

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        start.wait()
        for _ in range(CALLS_PER_THREAD):
            request, length = rng.choice(requests), rng.randint(1, MAX_LENGTH)
            table = request.fetch(cache, length)
            reference = references.get(request)
            expected_shape = (2 * length - 1,) if request.kind == "t5_buckets" else (length, table.shape[-1])
            if table.shape != expected_shape or (reference is not None and not _is_prefix(table, reference)):
                failures.append(f"{request} length {length}")
            with record:
                calls[request.kind, request.device] += 1
                longest[request] = max(longest.get(request, 0), length)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures[:5]
    return calls, longest


def _is_prefix(table: torch.Tensor, reference: torch.Tensor) -> bool:
    """t5 views are centred slices of the longest table; the others are leading rows."""
    if table.dim() == 1:
        centre = (reference.shape[0] - 1) // 2
        half = (table.shape[0] - 1) // 2
        return torch.equal(table, reference[centre - half : centre + half + 1])
    return torch.equal(table, reference[: table.shape[0]])


def _capacity(length: int) -> int:
    return 1 << (length - 1).bit_length()


@pytest.mark.timeout(120)
def test_threads_get_correct_tables_and_consistent_counters() -> None:
    cache = PECache(1 << 30, registry=None)
    requests = _requests()
    calls, longest = _hammer(cache, requests)
    stats = cache.stats()
    assert Counter(stats.hits) + Counter(stats.misses) == calls
    assert stats.evictions == {}
    expected_bytes: Counter[str] = Counter()
    for request, length in longest.items():
        expected_bytes[request.device] += request.entry_bytes(_capacity(length))
    assert stats.bytes == dict(expected_bytes)
    assert stats.entries == dict(Counter(request.device for request in longest))


@pytest.mark.timeout(120)
def test_threads_under_eviction_pressure_stay_within_budget() -> None:
    budget = 600_000
    cache = PECache(budget, registry=None)
    calls, _ = _hammer(cache, _requests())
    stats = cache.stats()
    assert Counter(stats.hits) + Counter(stats.misses) == calls
    assert stats.evictions.get("cpu", 0) > 0
    assert all(0 <= held <= budget for held in stats.bytes.values())
