"""Prometheus metrics of both sides, each in its own registry.

The per-step cost splits into two service-level indicators with different owners (the reference audit's
advice): the **round trip** on the network (request sent -> reply received, minus the time the server
reports for handling it: placement, routing and the provider own its regressions) and the **fixed
overhead** (local compute + cloud compute + serialization: the code and the hardware own those). They
are separate histograms so that a dashboard never mixes them.

The local side (the api server's `/metrics`) observes whole generations from their step records. The
cloud side (`serve --metrics-port N`) cannot see the network round trip, so it reports its own share of
the fixed overhead (time from receiving a step to having its reply ready), plus sessions and KV memory
read from the session table at scrape time. This module knows nothing about HTTP routing; it only
builds registries and renders them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .allocator import heap

# Seconds; dense around WAN round trips (10-150 ms) where the SLOs live.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0)
ACCEPTED_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32)
RATE_BUCKETS = (1, 2, 5, 10, 15, 20, 30, 50, 75, 100, 200, 500)

# allocator.heap()'s keys -> (metric name, help)
HEAP_GAUGES = {
    "in_use_bytes": ("splitinfer_heap_in_use_bytes", "Bytes malloc has handed out (glibc; 0 elsewhere)."),
    "free_bytes": ("splitinfer_heap_free_bytes", "Bytes malloc holds free (glibc; 0 elsewhere)."),
    "python_blocks": ("splitinfer_python_blocks", "Object blocks CPython has allocated."),
}

__all__ = ["CONTENT_TYPE_LATEST", "HEAP_GAUGES", "LocalMetrics", "CloudMetrics", "render"]


def render(registry: CollectorRegistry) -> bytes:
    """The text exposition format of a registry (what a scrape returns)."""
    return generate_latest(registry)


class _Common:
    """Metrics both sides expose under the same names."""

    def __init__(self, side: str, registry: CollectorRegistry | None):
        self.side = side
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.fixed_overhead = Histogram(
            "splitinfer_fixed_overhead_seconds",
            "Per decode step: local compute + cloud compute + serialization (the cloud side sees its own share).",
            registry=r, buckets=LATENCY_BUCKETS,
        )
        self.bytes = Counter("splitinfer_bytes", "Hidden-state message bytes, by direction.", ["direction"], registry=r)
        self.steps = Counter("splitinfer_steps", "Blocks sent through the middle layers, by kind.", ["kind"], registry=r)
        self.errors = Counter("splitinfer_errors", "Failures by error code (errors.py codes, http_4xx ...).", ["code"], registry=r)
        self.active_sessions = Gauge("splitinfer_active_sessions", "Sessions holding a KV cache now.", registry=r)
        self.kv_tokens = Gauge("splitinfer_kv_cache_tokens", "KV rows held over all sessions.", registry=r)
        self.kv_bytes = Gauge("splitinfer_kv_cache_bytes", "Bytes allocated for KV buffers over all sessions.", registry=r)
        # What the allocators hold, read at scrape time (allocator.heap): a leak grows in_use or python_blocks,
        # memory kept by malloc grows free.
        for key, (name, text) in HEAP_GAUGES.items():
            Gauge(name, text, registry=r).set_function(lambda key=key: heap()[key])

    def error(self, code: str) -> None:
        self.errors.labels(code=code).inc()

    def render(self) -> bytes:
        return render(self.registry)


class LocalMetrics(_Common):
    """The trusted side: generations served by the api server or the chat."""

    def __init__(self, registry: CollectorRegistry | None = None):
        super().__init__("local", registry)
        r = self.registry
        self.round_trip = Histogram(
            "splitinfer_round_trip_seconds",
            "Per decode step: network round trip (request sent -> reply received, minus server handling).",
            registry=r, buckets=LATENCY_BUCKETS,
        )
        self.accepted = Histogram(
            "splitinfer_accepted_tokens_per_step", "Tokens committed per decode step (1 = no speculation gain).",
            registry=r, buckets=ACCEPTED_BUCKETS,
        )
        self.tokens_per_s = Histogram(
            "splitinfer_tokens_per_second", "Decode throughput of each generation.", registry=r, buckets=RATE_BUCKETS
        )
        self.tokens = Counter("splitinfer_tokens", "Tokens processed, by kind (prompt, generated).", ["kind"], registry=r)
        self.requests = Counter("splitinfer_requests", "Generations finished, by finish reason.", ["finish_reason"], registry=r)
        self._kv_sources: dict[int, Callable[[], tuple[int, int]]] = {}
        self._lock = threading.Lock()
        # Read at scrape time, so an idle server reports the truth without anyone updating it.
        self.active_sessions.set_function(lambda: float(len(self._kv_sources)))
        self.kv_tokens.set_function(lambda: float(sum(t for t, _ in self._kv_snapshot())))
        self.kv_bytes.set_function(lambda: float(sum(b for _, b in self._kv_snapshot())))

    def _kv_snapshot(self) -> list[tuple[int, int]]:
        with self._lock:
            sources = list(self._kv_sources.values())
        return [source() for source in sources]

    def track_session(self, key: int, kv: Callable[[], tuple[int, int]]) -> None:
        """Count a live session; `kv()` returns its local (tokens, bytes)."""
        with self._lock:
            self._kv_sources[key] = kv

    def untrack_session(self, key: int) -> None:
        with self._lock:
            self._kv_sources.pop(key, None)

    def observe_steps(self, records: Iterable) -> None:
        """Step records (telemetry.StepRecord) of one generation or turn."""
        for r in records:
            self.steps.labels(kind=r.kind).inc()
            self.bytes.labels(direction="up").inc(r.bytes_up)
            self.bytes.labels(direction="down").inc(r.bytes_down)
            if r.kind != "decode":
                continue
            self.round_trip.observe(r.network_ms / 1e3)
            overhead_ms = r.local_ms + r.serialize_ms + (r.round_trip_ms - r.network_ms)
            self.fixed_overhead.observe(overhead_ms / 1e3)
            self.accepted.observe(r.accepted)

    def observe_generation(self, prompt_tokens: int, generated: int, tokens_per_s: float, finish_reason: str) -> None:
        self.tokens.labels(kind="prompt").inc(prompt_tokens)
        self.tokens.labels(kind="generated").inc(generated)
        if tokens_per_s > 0:
            self.tokens_per_s.observe(tokens_per_s)
        self.requests.labels(finish_reason=finish_reason).inc()


class CloudMetrics(_Common):
    """The untrusted side: steps served, and the session table's memory read at scrape time."""

    def __init__(self, table, registry: CollectorRegistry | None = None):
        super().__init__("cloud", registry)
        self.table = table
        self.rows = Histogram(
            "splitinfer_block_rows", "Rows per step received (1 = plain decode, more = speculation or prefill).",
            registry=self.registry, buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
        )
        self.registry.register(_TableCollector(self))
        self.active_sessions.set_function(lambda: float(self._stats()["sessions"]))
        self.kv_tokens.set_function(lambda: float(self._stats()["kv_tokens"]))
        self.kv_bytes.set_function(lambda: float(self._stats()["kv_bytes"]))

    def _stats(self) -> dict:
        """The session table's numbers (SessionTable.stats()), with `kv_bytes` the bytes its buffers hold."""
        stats = self.table.stats()
        return {**stats, "kv_bytes": stats["kv_allocated_bytes"]}

    def observe_step(self, rows: int, bytes_in: int, bytes_out: int, handle_s: float) -> None:
        self.steps.labels(kind="step").inc()
        self.rows.observe(rows)
        self.bytes.labels(direction="in").inc(bytes_in)
        self.bytes.labels(direction="out").inc(bytes_out)
        self.fixed_overhead.observe(handle_s)


class _TableCollector:
    """Budget, evictions and refusals from the session table at scrape time (SessionTable.stats())."""

    def __init__(self, metrics: CloudMetrics):
        self.metrics = metrics

    def collect(self):
        s = self.metrics._stats()
        yield CounterMetricFamily("splitinfer_kv_evictions", "Idle sessions evicted to make room.", value=s["evictions"])
        yield CounterMetricFamily("splitinfer_session_refusals", "Sessions refused at capacity.", value=s["refusals"])
        if s["kv_budget_bytes"] is not None:  # None: the table has no byte budget
            yield GaugeMetricFamily("splitinfer_kv_cache_budget_bytes", "KV memory budget.", value=s["kv_budget_bytes"])


def serve_metrics(metrics: _Common, host: str, port: int):
    """Expose `metrics` at http://host:port/metrics on a daemon thread; returns the HTTP server."""
    from prometheus_client import start_http_server

    from .errors import ConfigError

    try:
        server, _thread = start_http_server(port, addr=host, registry=metrics.registry)
    except OSError as exc:
        raise ConfigError(f"cannot serve metrics on {host}:{port} ({exc.strerror}); pick another --metrics-port.") from exc
    return server
