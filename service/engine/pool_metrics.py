"""KV pool, decode backend and compiler figures for `/metrics`, read from live engine cores when scraped.

One collector per process, registered once on the global registry (which the engine process
exports, and the API process too when the engine runs on its thread), over a weak set of cores:
tests and embedded use create many cores in one process, and a core that is gone drops out.
"""

from __future__ import annotations

import functools
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


@functools.cache
def _collector() -> _PoolCollector:
    collector = _PoolCollector()
    REGISTRY.register(collector)
    return collector
