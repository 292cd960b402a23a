"""`PECache`: one per process, handing out PE tables keyed by (kind, device, dtype, parameters).

The engine asks for tables on every decode step from its worker thread, so a hit is a dict lookup
under a lock plus slicing: no tensor arithmetic, no allocation beyond the views. Entries grow to the
next power of two when a longer length is asked for (amortised growth), shorter lengths are views
of the same storage, and each device has its own byte budget with least-recently-used eviction.
Tables are built outside the lock so one slow build (a 64k table on CPU) does not stall hits on
other keys; two threads racing on the same key may both build, and the larger table wins.

Tables that depend on a sequence's length (dynamic NTK, LongRoPE past the original context) live
in a partition of their own with its own, smaller budget: a stream of requests at ever new lengths
churns only that partition and never evicts the static tables every other request reads.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Hashable, Iterator, Mapping
from dataclasses import dataclass
from typing import NamedTuple

import torch
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pe_runtime.absolute import sinusoidal_table
from pe_runtime.alibi import alibi_slopes
from pe_runtime.rope import RopeLayout, rope_cos_sin, rope_inv_freq, rope_seq_len_key
from pe_runtime.scaling import RopeScaling
from pe_runtime.shaw import shaw_relative_index
from pe_runtime.t5 import t5_relative_position_bucket
from pe_runtime.transformer_xl import relative_sinusoid

DEFAULT_BUDGET_BYTES_PER_DEVICE = 512 * 1024 * 1024
DEFAULT_LENGTH_DEPENDENT_BUDGET_BYTES_PER_DEVICE = 64 * 1024 * 1024

_UNSCALED = RopeScaling()


class RopeTables(NamedTuple):
    """cos and sin [length, rotary_dim] (views into the cached tables) and the factor already in them."""

    cos: torch.Tensor
    sin: torch.Tensor
    attention_factor: float


@dataclass(frozen=True)
class CacheStats:
    """A consistent snapshot of the counters; hits/misses are keyed by (kind, device)."""

    hits: Mapping[tuple[str, str], int]
    misses: Mapping[tuple[str, str], int]
    evictions: Mapping[str, int]
    bytes: Mapping[str, int]
    entries: Mapping[str, int]


@dataclass(frozen=True)
class _Entry:
    tensors: tuple[torch.Tensor, ...]
    capacity: int
    nbytes: int
    attention_factor: float = 1.0


_Builder = Callable[[int], _Entry]
_Key = tuple[str, str, Hashable]
_Partition = tuple[str, bool]  # (device label, length-dependent)


class PECache:
    """Thread-safe, per-device LRU cache of RoPE cos/sin tables, ALiBi slopes, sinusoidal tables,
    T5 buckets, Shaw's clipped-distance indices and Transformer-XL's relative sinusoids. Entries
    larger than the whole budget are handed out but not kept."""

    def __init__(
        self,
        budget_bytes_per_device: int = DEFAULT_BUDGET_BYTES_PER_DEVICE,
        *,
        length_dependent_budget_bytes_per_device: int = DEFAULT_LENGTH_DEPENDENT_BUDGET_BYTES_PER_DEVICE,
        registry: CollectorRegistry | None = REGISTRY,
    ) -> None:
        """`registry=None` keeps the counters private (readable through `stats()` only)."""
        for name, budget in (
            ("budget_bytes_per_device", budget_bytes_per_device),
            ("length_dependent_budget_bytes_per_device", length_dependent_budget_bytes_per_device),
        ):
            if budget < 0:
                raise ValueError(f"{name} must be >= 0, got {budget}")
        self.budget_bytes_per_device = budget_bytes_per_device
        self.length_dependent_budget_bytes_per_device = length_dependent_budget_bytes_per_device
        self._lock = threading.Lock()
        self._lru: defaultdict[_Partition, OrderedDict[_Key, _Entry]] = defaultdict(OrderedDict)
        self._bytes: defaultdict[_Partition, int] = defaultdict(int)
        self._hits: defaultdict[tuple[str, str], int] = defaultdict(int)
        self._misses: defaultdict[tuple[str, str], int] = defaultdict(int)
        self._evictions: defaultdict[str, int] = defaultdict(int)
        if registry is not None:
            registry.register(_CacheCollector(self))

    def rope(
        self,
        head_dim: int,
        base: float,
        scaling: RopeScaling | None,
        length: int,
        *,
        device: torch.device | str,
        dtype: torch.dtype,
        layout: RopeLayout = "neox",
        seq_len: int | None = None,
    ) -> RopeTables:
        """cos/sin for positions 0 .. length-1; see `rope_inv_freq` for head_dim, base and seq_len.

        seq_len enters the key only as far as the scaling depends on it, so static scalings share
        one entry across all sequence lengths.
        """
        scaling = scaling or _UNSCALED
        seq_len_key = rope_seq_len_key(scaling, seq_len)
        target = _canonical_device(device)

        def build(capacity: int) -> _Entry:
            inv_freq, attention_factor = rope_inv_freq(head_dim, base, scaling, seq_len_key)
            cos, sin = rope_cos_sin(
                inv_freq, attention_factor, capacity, layout=layout, dtype=dtype, device=target
            )
            return _entry((cos, sin), capacity, attention_factor)

        params = (head_dim, float(base), scaling, seq_len_key, layout, dtype)
        entry = self._fetch("rope", target, params, length, build, length_dependent=seq_len_key is not None)
        cos, sin = entry.tensors
        return RopeTables(cos[:length], sin[:length], entry.attention_factor)

    def alibi_slopes(
        self,
        num_heads: int,
        *,
        device: torch.device | str,
        dtype: torch.dtype,
        bias_max: float = 8.0,
        rule: str = "press",
    ) -> torch.Tensor:
        """ALiBi slopes [num_heads] on `device` in `dtype` (`bias_max`, `rule`: see `alibi_slopes`)."""
        target = _canonical_device(device)

        def build(capacity: int) -> _Entry:
            slopes = alibi_slopes(num_heads, bias_max=bias_max, rule=rule)
            return _entry((slopes.to(device=target, dtype=dtype),), capacity)

        params = (num_heads, float(bias_max), rule, dtype)
        return self._fetch("alibi_slopes", target, params, 1, build).tensors[0]

    def sinusoidal(
        self,
        length: int,
        dim: int,
        *,
        device: torch.device | str,
        dtype: torch.dtype,
        factor: float = 1.0,
    ) -> torch.Tensor:
        """The sinusoidal position table [length, dim], read at position / factor."""
        target = _canonical_device(device)

        def build(capacity: int) -> _Entry:
            table = sinusoidal_table(capacity, dim, factor=factor, device=target)
            return _entry((table.to(dtype),), capacity)

        params = (dim, float(factor), dtype)
        return self._fetch("sinusoidal", target, params, length, build).tensors[0][:length]

    def t5_buckets(
        self,
        length: int,
        *,
        bidirectional: bool,
        num_buckets: int,
        max_distance: int,
        device: torch.device | str,
    ) -> torch.Tensor:
        """T5 buckets for relative positions -(length-1) .. length-1, long [2*length - 1].

        The bucket of query q and key k is `buckets[k - q + length - 1]`.
        """
        target = _canonical_device(device)

        def build(capacity: int) -> _Entry:
            relative = torch.arange(1 - capacity, capacity, device=target)
            buckets = t5_relative_position_bucket(
                relative, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance
            )
            return _entry((buckets,), capacity)

        params = (bidirectional, num_buckets, max_distance)
        entry = self._fetch("t5_buckets", target, params, length, build)
        centre = entry.capacity - 1
        return entry.tensors[0][centre - (length - 1) : centre + length]

    def shaw_index(self, length: int, *, max_distance: int, device: torch.device | str) -> torch.Tensor:
        """Shaw table rows for relative positions -(length-1) .. length-1, long [2*length - 1].

        The row of query q and key k is `index[k - q + length - 1]` (the layout of `t5_buckets`).
        """
        target = _canonical_device(device)

        def build(capacity: int) -> _Entry:
            relative = torch.arange(1 - capacity, capacity, device=target)
            return _entry((shaw_relative_index(relative, max_distance=max_distance),), capacity)

        entry = self._fetch("shaw_index", target, (max_distance,), length, build)
        centre = entry.capacity - 1
        return entry.tensors[0][centre - (length - 1) : centre + length]

    def xl_relative(
        self, length: int, dim: int, *, device: torch.device | str, dtype: torch.dtype, factor: float = 1.0
    ) -> torch.Tensor:
        """Transformer-XL's R for distances length-1 .. 0, [length, dim], read at distance / factor.

        Stored descending, so a shorter length is the tail of a longer entry.
        """
        target = _canonical_device(device)

        def build(capacity: int) -> _Entry:
            table = relative_sinusoid(capacity, dim, factor=factor, device=target)
            return _entry((table.to(dtype),), capacity)

        entry = self._fetch("xl_relative", target, (dim, float(factor), dtype), length, build)
        return entry.tensors[0][entry.capacity - length :]

    def stats(self) -> CacheStats:
        with self._lock:
            size: defaultdict[str, int] = defaultdict(int)
            entries: defaultdict[str, int] = defaultdict(int)
            for (label, length_dependent), partition in self._lru.items():
                size[label] += self._bytes[label, length_dependent]
                entries[label] += len(partition)
            return CacheStats(
                hits=dict(self._hits),
                misses=dict(self._misses),
                evictions=dict(self._evictions),
                bytes=dict(size),
                entries=dict(entries),
            )

    def _fetch(
        self,
        kind: str,
        device: torch.device,
        params: Hashable,
        length: int,
        build: _Builder,
        *,
        length_dependent: bool = False,
    ) -> _Entry:
        """The entry for (kind, device, params) holding at least `length` positions, built if needed."""
        if length < 1:
            raise ValueError(f"length must be >= 1, got {length}")
        label = str(device)
        key: _Key = (kind, label, params)
        partition: _Partition = (label, length_dependent)
        with self._lock:
            entries = self._lru[partition]
            cached = entries.get(key)
            if cached is not None and cached.capacity >= length:
                entries.move_to_end(key)
                self._hits[kind, label] += 1
                return cached
            self._misses[kind, label] += 1
        built = build(_next_power_of_two(length))
        with self._lock:
            raced = entries.get(key)
            if raced is not None and raced.capacity >= built.capacity:
                entries.move_to_end(key)
                return raced
            self._store(partition, key, built)
        return built

    def _store(self, partition: _Partition, key: _Key, entry: _Entry) -> None:
        """Insert (replacing a smaller entry for the key) and evict from the cold end. Lock held."""
        label, length_dependent = partition
        budget = (
            self.length_dependent_budget_bytes_per_device
            if length_dependent
            else self.budget_bytes_per_device
        )
        entries = self._lru[partition]
        replaced = entries.pop(key, None)
        if replaced is not None:
            self._bytes[partition] -= replaced.nbytes
        if entry.nbytes > budget:
            return
        entries[key] = entry
        self._bytes[partition] += entry.nbytes
        while self._bytes[partition] > budget:
            _, evicted = entries.popitem(last=False)
            self._bytes[partition] -= evicted.nbytes
            self._evictions[label] += 1


class _CacheCollector(Collector):
    """Exports the cache's counters at scrape time, so hits never touch prometheus_client."""

    def __init__(self, cache: PECache) -> None:
        self._cache = cache

    def describe(self) -> Iterator[Metric]:
        """Declares the names so a second cache on the same registry is refused, not silently merged."""
        yield from _metric_families(CacheStats({}, {}, {}, {}, {}))

    def collect(self) -> Iterator[Metric]:
        yield from _metric_families(self._cache.stats())


def _metric_families(stats: CacheStats) -> Iterator[Metric]:
    hits = CounterMetricFamily(
        "pe_cache_hits", "PE table requests served from the cache.", labels=["kind", "device"]
    )
    misses = CounterMetricFamily(
        "pe_cache_misses", "PE table requests that built or grew a table.", labels=["kind", "device"]
    )
    for (kind, device), count in stats.hits.items():
        hits.add_metric([kind, device], count)
    for (kind, device), count in stats.misses.items():
        misses.add_metric([kind, device], count)
    evictions = CounterMetricFamily(
        "pe_cache_evictions", "Entries dropped to stay within the byte budget.", labels=["device"]
    )
    for device, count in stats.evictions.items():
        evictions.add_metric([device], count)
    size = GaugeMetricFamily("pe_cache_bytes", "Bytes held by cached PE tables.", labels=["device"])
    for device, count in stats.bytes.items():
        size.add_metric([device], count)
    yield from (hits, misses, evictions, size)


def _entry(tensors: tuple[torch.Tensor, ...], capacity: int, attention_factor: float = 1.0) -> _Entry:
    return _Entry(tensors, capacity, sum(tensor.nbytes for tensor in tensors), attention_factor)


def _next_power_of_two(length: int) -> int:
    return 1 << (length - 1).bit_length()


def _canonical_device(device: torch.device | str) -> torch.device:
    """'cuda' and 'cuda:0' must share entries when 0 is the current device."""
    if isinstance(device, torch.device) and (device.type != "cuda" or device.index is not None):
        return device  # already canonical: the common case on the hit path
    resolved = torch.device(device)
    if resolved.type == "cuda" and resolved.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return resolved
