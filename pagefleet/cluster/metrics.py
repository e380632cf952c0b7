"""Prometheus metrics of the cluster, exported by the ingress (names as in DESIGN.md "Metrics").

Per-worker gauges and counters are copied from the workers' load reports, so
one scrape of the ingress shows the whole cluster; request histograms (TTFT,
time per output token, end-to-end latency) are measured at the ingress, which
is where the client's experience is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric

from pagefleet.worker.events import LoadReport

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

# Gauge name -> LoadReport field.
_WORKER_GAUGES = {
    "kv_blocks_total": "total_blocks",
    "kv_blocks_free": "free_blocks",
    "kv_blocks_live": "live_blocks",
    "kv_blocks_cached": "cached_blocks",
    "kv_blocks_peak_live": "peak_live_blocks",
    "num_running": "num_running",
    "num_waiting": "num_waiting",
    "kv_offload_blocks": "offload_blocks",
}

# Counter name (exported with `_total`) -> (help, cumulative LoadReport field): the offload
# tier and migration by KV transfer.
_REPORT_COUNTERS = {
    "kv_offload_hit_tokens": ("prompt tokens copied back from the offload tier", "offload_hit_tokens"),
    "kv_offload_bytes_in": ("bytes copied from the offload tier into the pool", "offload_bytes_in"),
    "kv_offload_bytes_out": ("bytes copied from the pool into the offload tier", "offload_bytes_out"),
    # Migration by KV transfer.
    "kv_migration_blocks_exported": (
        "KV blocks handed off with migrated requests to other workers", "kv_blocks_exported"
    ),
    "kv_migration_blocks_imported": (
        "KV blocks of migrated requests imported from other workers", "kv_blocks_imported"
    ),
    "kv_migration_import_failures": (
        "migrated requests whose KV blocks could not be fetched or imported (recomputed)",
        "kv_import_failures",
    ),
}

# Counter name (exported with `_total`) -> (help, LoadReport field counting per adapter).
_ADAPTER_COUNTERS = {
    "lora_adapter_loads": ("loads of the LoRA adapter into one of the worker's slots", "lora_loads"),
    "lora_adapter_evictions": ("evictions of the LoRA adapter from the worker's slots", "lora_evictions"),
}


class _ReportCounter:
    """A Counter fed from a cumulative value in reports (counters may only go up;
    a restarted worker starts again from 0, so only positive steps are added)."""

    def __init__(self, counter: Counter) -> None:
        self._counter = counter
        self._last: dict[tuple[str, ...], int] = {}

    def set_total(self, labels: tuple[str, ...], total: int) -> None:
        last = self._last.get(labels, 0)
        step = total - last if total >= last else total
        # The labelled series exists from the first report on, at 0 if nothing
        # happened yet, so rate() and alerts see it before its first event.
        child = self._counter.labels(*labels)
        if step > 0:
            child.inc(step)
        self._last[labels] = total

    def forget(self, prefix: tuple[str, ...]) -> None:
        """Drop every series whose labels start with `prefix` (a removed worker's)."""
        for labels in [k for k in self._last if k[: len(prefix)] == prefix]:
            del self._last[labels]
            self._counter.remove(*labels)


class _WaitQueueCollector:
    """Reads the ingress wait queue's length per pool at scrape time (no bookkeeping
    on the request path)."""

    def __init__(self, sizes: Callable[[], Mapping[str, int]]) -> None:
        self._sizes = sizes

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "ingress_waiting_requests",
            "requests waiting at the ingress for a worker with room",
            labels=["pool"],
        )
        for pool, size in self._sizes().items():
            family.add_metric([pool], size)
        yield family


class _ViewCollector:
    """Reads how long ago the scheduler's view was last heard from, at scrape time."""

    def __init__(self, staleness_s: Callable[[], float]) -> None:
        self._staleness_s = staleness_s

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "fleet_view_staleness_seconds",
            "seconds since this ingress replica last heard from the central scheduler",
        )
        family.add_metric([], self._staleness_s())
        yield family


class _PoolGaugeCollector:
    """A per-pool gauge read from a callback at scrape time."""

    def __init__(self, name: str, doc: str, values: Callable[[], Mapping[str, float]]) -> None:
        self._name, self._doc, self._values = name, doc, values

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(self._name, self._doc, labels=["pool"])
        for pool, value in self._values().items():
            family.add_metric([pool], value)
        yield family


class IngressMetrics:
    """All pagefleet metrics in one registry (one per ingress, so tests can make several)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        labels = ("pool", "worker")
        self._gauges = {
            name: Gauge(name, f"{field} of the worker's KV pool / engine", labels, registry=self.registry)
            for name, field in _WORKER_GAUGES.items()
        }
        self.worker_alive = Gauge(
            "worker_alive", "1 while the worker is in routing", labels, registry=self.registry
        )
        self.pool_workers = Gauge(
            "pool_workers", "a pool's workers: target (autoscaling or scale) and actual (serving)",
            ("pool", "kind"), registry=self.registry,
        )  # fmt: skip
        self._prefix_queries = _ReportCounter(
            Counter("prefix_cache_queries", "prompt tokens looked up in the prefix cache", labels, registry=self.registry)
        )
        self._prefix_hits = _ReportCounter(
            Counter("prefix_cache_hits", "prompt tokens served from the prefix cache", labels, registry=self.registry)
        )
        self._evictions = _ReportCounter(
            Counter("evictions", "cached KV blocks evicted", labels, registry=self.registry)
        )
        self._report_counters = {
            field: _ReportCounter(Counter(name, doc, labels, registry=self.registry))
            for name, (doc, field) in _REPORT_COUNTERS.items()
        }
        self._adapter_counters = {
            field: _ReportCounter(Counter(name, doc, (*labels, "adapter"), registry=self.registry))
            for name, (doc, field) in _ADAPTER_COUNTERS.items()
        }
        self._preemptions = _ReportCounter(
            Counter("preemptions", "sequences preempted", (*labels, "mode"), registry=self.registry)
        )
        self.ttft = Histogram(
            "time_to_first_token_seconds", "request arrival to first token", ("pool",),
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.tpot = Histogram(
            "time_per_output_token_seconds", "mean time between output tokens of a request",
            ("pool",), buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.e2e = Histogram(
            "e2e_request_latency_seconds", "request arrival to last token", ("pool",),
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.index_drift = Gauge(
            "kv_index_drift_blocks",
            "blocks the scheduler's index believed cached that the worker did not hold, at its last check",
            labels, registry=self.registry,
        )
        self.session_routes = Counter(
            "session_routes",
            "requests naming a session, by outcome: hit (sent to the session's worker), new "
            "(no live pin) or repin (its worker was dead, full or overloaded: routed anew)",
            ("pool", "outcome"),
            registry=self.registry,
        )
        self.failovers = Counter(
            "failovers", "streams resumed on another worker after a worker failure", ("pool",),
            registry=self.registry,
        )
        self.migrations = Counter(
            "migrations",
            "streams moved off a worker short of blocks by the scheduler, by mode (transfer: "
            "the KV blocks went with the stream; recompute: the target recomputes them)",
            ("pool", "mode"),
            registry=self.registry,
        )
        tenant_labels = (*labels, "tenant")
        self._tenant_live = Gauge(
            "tenant_kv_blocks_live", "live KV blocks a tenant holds on the worker", tenant_labels,
            registry=self.registry,
        )
        self._tenant_cap_refusals = _ReportCounter(
            Counter(
                "tenant_kv_block_cap_refusals",
                "admissions deferred and sequences preempted because the tenant was at its "
                "max_live_blocks", tenant_labels, registry=self.registry,
            )
        )
        self.tenant_requests_refused = Counter(
            "tenant_requests_refused",
            "requests refused with RESOURCE_EXHAUSTED at the ingress, by reason "
            "(queue_share: the tenant's share of the wait queue; queue_full: the pool's queue)",
            ("pool", "tenant", "reason"), registry=self.registry,
        )
        self.adapter_requests = Counter(
            "lora_adapter_requests", "requests finished on a LoRA adapter", ("pool", "adapter"),
            registry=self.registry,
        )
        self.adapter_tokens = Counter(
            "lora_adapter_generated_tokens", "tokens generated on a LoRA adapter", ("pool", "adapter"),
            registry=self.registry,
        )
        # Reports name tenants by their prefix-cache salt, which is never exported
        # (an operator-set salt is a secret): the ingress maps salts to tenant names.
        self._tenant_names: dict[str, str] = {}
        self._tenant_series: dict[tuple[str, str], set[str]] = {}

    def observe_report(self, report: LoadReport) -> None:
        """Copy one worker's load report into the gauges and counters."""
        labels = (report.pool, report.worker_id)
        for name, field in _WORKER_GAUGES.items():
            self._gauges[name].labels(*labels).set(getattr(report, field))
        self.worker_alive.labels(*labels).set(1)
        self._prefix_queries.set_total(labels, report.prefix_query_tokens)
        self._prefix_hits.set_total(labels, report.prefix_hit_tokens)
        self._evictions.set_total(labels, report.evictions)
        for field, counter in self._report_counters.items():
            counter.set_total(labels, getattr(report, field))
        for mode, count in report.preemptions.items():
            self._preemptions.set_total((*labels, mode), count)
        for field, counter in self._adapter_counters.items():
            for adapter, count in getattr(report, field).items():
                counter.set_total((*labels, adapter), count)
        self._observe_tenants(report)

    def observe_pool_sizes(self, scaling: Mapping[str, Mapping[str, Any]]) -> None:
        """Set `pool_workers{pool,kind}` from the membership's `autoscale_status()`: `target`
        (what autoscaling or `pagefleet scale` last asked for) and `actual` (serving now)."""
        for pool, entry in scaling.items():
            self.pool_workers.labels(pool, "target").set(entry["target"])
            self.pool_workers.labels(pool, "actual").set(entry["workers"])

    def name_tenants(self, names: Mapping[str, str]) -> None:
        """Map prefix-cache salts to tenant names for the `tenant` label (unknown: "other")."""
        self._tenant_names = dict(names)

    def _tenant(self, salt: str) -> str:
        return self._tenant_names.get(salt, "other")

    def _observe_tenants(self, report: LoadReport) -> None:
        labels = (report.pool, report.worker_id)
        live: dict[str, int] = {}
        for salt, blocks in report.tenant_live_blocks.items():
            tenant = self._tenant(salt)
            live[tenant] = live.get(tenant, 0) + blocks
        # A tenant whose last sequence ended drops out of the report: show 0, not its old value.
        shown = self._tenant_series.setdefault(labels, set())
        for tenant in shown - live.keys():
            self._tenant_live.labels(*labels, tenant).set(0)
        for tenant, blocks in live.items():
            self._tenant_live.labels(*labels, tenant).set(blocks)
        shown.update(live)
        refusals: dict[str, int] = {}
        for salt, count in report.tenant_cap_refusals.items():
            tenant = self._tenant(salt)
            refusals[tenant] = refusals.get(tenant, 0) + count
        for tenant, count in refusals.items():
            self._tenant_cap_refusals.set_total((*labels, tenant), count)

    def track_wait_queue(self, sizes: Callable[[], Mapping[str, int]]) -> None:
        """Export `ingress_waiting_requests{pool}`, read from `sizes()` at each scrape."""
        self.registry.register(_WaitQueueCollector(sizes))

    def track_view(self, staleness_s: Callable[[], float]) -> None:
        """Export `fleet_view_staleness_seconds`, read from `staleness_s()` at each scrape."""
        self.registry.register(_ViewCollector(staleness_s))

    def track_preemption_rate(self, per_minute: Callable[[], Mapping[str, float]]) -> None:
        """Export `preemptions_per_minute{pool}`, read from `per_minute()` at each scrape."""
        self.registry.register(
            _PoolGaugeCollector(
                "preemptions_per_minute",
                "sequences preempted in the pool over the last minute, from the workers' reports",
                per_minute,
            )
        )

    def mark_dead(self, pool: str, worker_id: str) -> None:
        self.worker_alive.labels(pool, worker_id).set(0)

    def forget_worker(self, pool: str, worker_id: str) -> None:
        """Remove every series of a worker removed from its pool (no stale 0s are left behind)."""
        labels = (pool, worker_id)
        for gauge in (*self._gauges.values(), self.worker_alive, self.index_drift):
            with contextlib.suppress(KeyError):
                gauge.remove(*labels)
        counters = (self._prefix_queries, self._prefix_hits, self._evictions, self._preemptions,
                    self._tenant_cap_refusals, *self._report_counters.values(),
                    *self._adapter_counters.values())  # fmt: skip
        for counter in counters:
            counter.forget(labels)
        for tenant in self._tenant_series.pop(labels, set()):
            with contextlib.suppress(KeyError):
                self._tenant_live.remove(*labels, tenant)

    def observe_request(
        self, pool: str, *, ttft_s: float | None, e2e_s: float, tpot_s: float | None,
        adapter: str | None = None, tokens: int = 0,
    ) -> None:  # fmt: skip
        """Record one finished request's latencies (and, on a LoRA adapter, its tokens)."""
        if adapter is not None:
            self.adapter_requests.labels(pool, adapter).inc()
            self.adapter_tokens.labels(pool, adapter).inc(tokens)
        if ttft_s is not None:
            self.ttft.labels(pool).observe(ttft_s)
        if tpot_s is not None:
            self.tpot.labels(pool).observe(tpot_s)
        self.e2e.labels(pool).observe(e2e_s)

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Expose `/metrics` over HTTP on host:`port` (0: a free port); returns the bound port.

        Localhost by default: the metrics name every pool and worker, so they are
        for the operator's scraper, not for tenants (`server.metrics_host`).
        """
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return int(server.server_port)
