"""Prometheus metrics with the SPEC's names.

Request counts, latencies and time to first token are observed by the HTTP layer on its own
registry (one per app, so several apps can live in one process). Queue depth, batch size and
generated tokens are read from `Engine.stats()` at scrape time rather than mirrored, so they can
never drift from the engine. The process-wide registry (process metrics; `pe_runtime`'s cache
counters when the engine runs in this process) follows ours, then, when the engine runs in its own
process, that process's registry (`pe_cache_*` and `pe_engine_process_*`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from service.engine.types import EngineStats

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4

# Latency buckets from 5 ms to 2 min: small CPU models answer in milliseconds, long generations
# on big checkpoints take minutes.
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

_NO_ENGINE_STATS = EngineStats(queue_depth=0, running=0, batch_size=0, generated_tokens_total=0)


class _EngineCollector:
    """Engine-owned numbers, sampled at scrape time; zeros until the engine is up."""

    def __init__(self, read_stats: Callable[[], EngineStats | None]) -> None:
        self._read_stats = read_stats

    def collect(self) -> Iterable[Metric]:
        stats = self._read_stats() or _NO_ENGINE_STATS
        yield CounterMetricFamily(
            "pe_serve_generated_tokens", "Tokens generated since start.", value=stats.generated_tokens_total
        )
        yield GaugeMetricFamily(
            "pe_serve_queue_depth",
            "Generations waiting to start (for a batch slot or KV-cache blocks).",
            stats.queue_depth,
        )
        yield GaugeMetricFamily("pe_serve_batch_size", "Sequences in the running batch.", stats.running)


class ServiceMetrics:
    """The HTTP layer's instruments, and the rendering of everything `/metrics` exposes."""

    def __init__(
        self, read_stats: Callable[[], EngineStats | None], read_engine_metrics: Callable[[], bytes]
    ) -> None:
        self._read_engine_metrics = read_engine_metrics
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "pe_serve_requests",
            "Requests answered, by protocol (http, grpc), endpoint (path or gRPC method) and status.",
            ["endpoint", "status", "protocol"],
            registry=self.registry,
        )
        self.request_duration = Histogram(
            "pe_serve_request_duration_seconds",
            "Time from request start to the last byte of the response.",
            ["endpoint", "protocol"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.time_to_first_token = Histogram(
            "pe_serve_time_to_first_token_seconds",
            "Time from request start to the first generated token.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_EngineCollector(read_stats))

    def observe_request(
        self, endpoint: str, status: int | str, seconds: float, protocol: str = "http"
    ) -> None:
        """`status` is the HTTP status code, or the gRPC status code's name (`OK`, `NOT_FOUND`, ...)."""
        self.requests.labels(endpoint=endpoint, status=str(status), protocol=protocol).inc()
        self.request_duration.labels(endpoint=endpoint, protocol=protocol).observe(seconds)

    def render(self) -> bytes:
        """Ours, this process's global registry, then the engine process's (may block briefly)."""
        return generate_latest(self.registry) + generate_latest(REGISTRY) + self._read_engine_metrics()
