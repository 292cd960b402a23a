"""KV pool, decode backend and compiler figures for `/metrics`, read from live engine cores when scraped.

One collector per process, registered once on the global registry (which the engine process
exports, and the API process too when the engine runs on its thread), over a weak set of cores:
tests and embedded use create many cores in one process, and a core that is gone drops out.

A pool is sized at start-up (`pe_kv_cache_bytes`), but on a CPU its pages are taken as rows first
write them (`HugePageArena.zeros`), so the process's resident memory grows as rows reach fresh
blocks until the whole pool has been written once (the prefix cache keeps finished prompts' blocks
and hands out never-used ones first). That is memory committed on purpose and bounded by the pool,
so it is reported apart: `pe_kv_cache_resident_bytes` is the pool's pages in memory (`mincore`),
and resident memory less that figure is what must stay flat under load (`bench/soak.py`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import weakref
from collections.abc import Callable, Iterator
from typing import Protocol

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from service.model.backend import Backend
from service.model.paged_cache import PagedKVCache


class PoolOwner(Protocol):
    compile_seconds: float

    def kv_pools(self) -> dict[str, PagedKVCache]: ...

    def backends(self) -> dict[str, Backend]: ...


_CORES: weakref.WeakSet[PoolOwner] = weakref.WeakSet()


def track(core: PoolOwner) -> None:
    """Report `core`'s pools from now on (for as long as it lives)."""
    _collector()
    _CORES.add(core)


# Per model, one sample of its pool each: (family, name, help, what to read).
_POOL_FIGURES: tuple[
    tuple[type[GaugeMetricFamily | CounterMetricFamily], str, str, Callable[[PagedKVCache], float]], ...
] = (
    (
        GaugeMetricFamily,
        "pe_kv_cache_usage_perc",
        "Fraction of the model's KV cache blocks reserved by running requests (1 = full).",
        lambda pool: pool.usage,
    ),
    (
        GaugeMetricFamily,
        "pe_kv_cache_capacity_tokens",
        "Tokens the model's KV cache pool holds.",
        lambda pool: pool.total_blocks * pool.block_size,
    ),
    (GaugeMetricFamily, "pe_kv_cache_bytes", "Bytes of the model's KV cache pool.", lambda pool: pool.nbytes),
    (
        GaugeMetricFamily,
        "pe_kv_cache_resident_bytes",
        "Bytes of the model's KV cache pool in memory: on a CPU its pages are taken as rows first "
        "write them, up to pe_kv_cache_bytes; on a GPU, all of it from start-up.",
        lambda pool: resident_bytes(pool),
    ),
    (
        GaugeMetricFamily,
        "pe_kv_side_bytes",
        "Bytes running rows under an attention rule keep beside the model's KV cache pool, outside "
        "pe_kv_cache_bytes: their keys turned for the rule, and their windows copied where their "
        "blocks are not consecutive.",
        lambda pool: pool.side_bytes,
    ),
    (
        CounterMetricFamily,
        "pe_prefix_cache_queries",
        "Prompt tokens of generations admitted with a prefix to look up in the model's cache.",
        lambda pool: pool.queried_tokens,
    ),
    (
        CounterMetricFamily,
        "pe_prefix_cache_hits",
        "Of those, the tokens read from cached KV blocks.",
        lambda pool: pool.hit_tokens,
    ),
    (
        GaugeMetricFamily,
        "pe_prefix_cache_blocks",
        "KV blocks holding a cached prompt prefix (in use, or idle and evictable).",
        lambda pool: pool.cached_blocks,
    ),
)


class _PoolCollector(Collector):
    def collect(self) -> Iterator[Metric]:
        cores = list(_CORES)
        for family, name, description, read in _POOL_FIGURES:
            metric = family(name, description, labels=["model"])
            for core in cores:
                for model, pool in core.kv_pools().items():
                    metric.add_metric([model], read(pool))
            yield metric
        backend = GaugeMetricFamily(
            "pe_decode_backend",
            "1 for the backend that runs the model's decode passes (eager, compiled, cuda_graphs, c).",
            labels=["model", "backend"],
        )
        for core in cores:
            for model, chosen in core.backends().items():
                backend.add_metric([model, str(chosen)], 1.0)
        yield backend
        compile_time = GaugeMetricFamily(
            "pe_decode_compile_seconds", "Seconds spent compiling the decode pass at start-up."
        )
        compile_time.add_metric([], sum(core.compile_seconds for core in cores))
        yield compile_time


def resident_bytes(pool: PagedKVCache) -> int:
    """Bytes of the pool's key and value pages that are in memory. A CPU pool's memory is counted
    page by page with `mincore` (pages written, or read before any write); where that cannot be
    asked (another device, no `mincore`), the whole pool counts."""
    buffers = pool.keys + pool.values
    if not buffers or buffers[0].device.type != "cpu":
        return pool.nbytes
    page = mmap.PAGESIZE
    spans = sorted(
        (buffer.data_ptr() // page * page, -(-(buffer.data_ptr() + buffer.nbytes) // page) * page)
        for buffer in buffers
    )
    merged: list[list[int]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    resident = 0
    for start, end in merged:
        counted = _resident_pages(start, end - start)
        if counted is None:
            return pool.nbytes
        resident += counted * page
    return min(resident, pool.nbytes)


def _resident_pages(start: int, length: int) -> int | None:
    """Pages of the page-aligned span in memory, from `mincore`; None where it cannot be asked."""
    mincore = _mincore()
    if mincore is None:
        return None
    pages = length // mmap.PAGESIZE
    vector = (ctypes.c_ubyte * pages)()
    if mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vector) != 0:
        return None
    flags = bytes(vector)
    return pages - flags.count(0)  # the low bit says resident; the others are reserved, zero


@functools.cache
def _mincore() -> Callable[..., int] | None:
    name = ctypes.util.find_library("c")
    try:
        function: Callable[..., int] = ctypes.CDLL(name, use_errno=True).mincore
    except (OSError, AttributeError):
        return None
    return function


@functools.cache
def _collector() -> _PoolCollector:
    collector = _PoolCollector()
    REGISTRY.register(collector)
    return collector
