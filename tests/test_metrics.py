"""Ingress metrics that need no cluster: the wait queue gauge is read at scrape time."""

from __future__ import annotations

from engine_stats import engine_stats
from prometheus_client import generate_latest

from pagefleet.cluster.metrics import IngressMetrics


def test_wait_queue_gauge_reads_the_queue_at_each_scrape() -> None:
    metrics = IngressMetrics()
    sizes = {"default": 3, "other": 0}
    metrics.track_wait_queue(lambda: sizes)
    body = generate_latest(metrics.registry).decode()
    assert 'ingress_waiting_requests{pool="default"} 3.0' in body
    assert 'ingress_waiting_requests{pool="other"} 0.0' in body
    sizes["default"] = 1
    assert 'ingress_waiting_requests{pool="default"} 1.0' in generate_latest(
        metrics.registry
    ).decode()


def test_report_counters_exist_at_zero_before_their_first_event() -> None:
    from pagefleet.worker.events import LoadReport

    metrics = IngressMetrics()
    stats = engine_stats(total=8, free=8)
    metrics.observe_report(LoadReport.from_engine_stats("w0", "default", 1, stats))
    body = generate_latest(metrics.registry).decode()
    assert 'prefix_cache_hits_total{pool="default",worker="w0"} 0.0' in body
    assert 'evictions_total{pool="default",worker="w0"} 0.0' in body


def test_migration_counters_follow_the_reports_through_the_wire() -> None:
    from pagefleet.worker.events import LoadReport

    metrics = IngressMetrics()
    stats = engine_stats(total=8, free=8, kv_blocks_exported=5, kv_blocks_imported=3,
                         kv_import_failures=1)
    report = LoadReport.decode(LoadReport.from_engine_stats("w0", "default", 1, stats).encode())
    metrics.observe_report(report)
    metrics.migrations.labels(pool="default", mode="transfer").inc()
    body = generate_latest(metrics.registry).decode()
    assert 'kv_migration_blocks_exported_total{pool="default",worker="w0"} 5.0' in body
    assert 'kv_migration_blocks_imported_total{pool="default",worker="w0"} 3.0' in body
    assert 'kv_migration_import_failures_total{pool="default",worker="w0"} 1.0' in body
    assert 'migrations_total{mode="transfer",pool="default"} 1.0' in body


def test_pool_workers_shows_each_pools_target_and_actual_size() -> None:
    metrics = IngressMetrics()
    metrics.observe_pool_sizes({
        "default": {"target": 3, "workers": 2, "reason": "scale out: 4% blocks free (< 30%) and 2 waiting for 1s"},
        "acme": {"target": 1, "workers": 1, "reason": "configured size"},
    })  # fmt: skip
    body = generate_latest(metrics.registry).decode()
    assert 'pool_workers{kind="target",pool="default"} 3.0' in body
    assert 'pool_workers{kind="actual",pool="default"} 2.0' in body
    assert 'pool_workers{kind="target",pool="acme"} 1.0' in body
    assert 'pool_workers{kind="actual",pool="acme"} 1.0' in body


def test_adapter_loads_and_evictions_are_counted_per_adapter_and_worker() -> None:
    from pagefleet.worker.events import LoadReport

    metrics = IngressMetrics()
    stats = engine_stats(total=8, free=8)

    def report(seq: int, loads: dict[str, int], evictions: dict[str, int]) -> LoadReport:
        sent = LoadReport.from_engine_stats(
            "w0", "default", seq, stats, lora_slots=1, lora_loads=loads, lora_evictions=evictions
        )
        return LoadReport.decode(sent.encode())

    metrics.observe_report(report(1, {"alpha": 1}, {}))
    metrics.observe_report(report(2, {"alpha": 2, "beta": 1}, {"alpha": 1}))
    body = generate_latest(metrics.registry).decode()
    assert 'lora_adapter_loads_total{adapter="alpha",pool="default",worker="w0"} 2.0' in body
    assert 'lora_adapter_loads_total{adapter="beta",pool="default",worker="w0"} 1.0' in body
    assert 'lora_adapter_evictions_total{adapter="alpha",pool="default",worker="w0"} 1.0' in body
    metrics.forget_worker("default", "w0")
    assert "lora_adapter_loads_total{" not in generate_latest(metrics.registry).decode()
