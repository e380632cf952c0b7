"""Per-tenant metrics at the ingress: live blocks and cap refusals from load reports."""

from __future__ import annotations

from engine_stats import engine_stats
from prometheus_client import generate_latest

from pagefleet.cluster.metrics import IngressMetrics
from pagefleet.worker.events import LoadReport

STATS = engine_stats(total=8, free=4, live=4, peak_live=4)


def _report(seq: int, live: dict[str, int], refusals: dict[str, int]) -> LoadReport:
    return LoadReport.from_engine_stats(
        "w0", "shared", seq, STATS, tenant_live_blocks=live, tenant_cap_refusals=refusals
    )


def _scrape(metrics: IngressMetrics) -> str:
    return generate_latest(metrics.registry).decode()


def test_tenant_live_blocks_are_labelled_by_tenant_name_never_by_salt() -> None:
    metrics = IngressMetrics()
    metrics.name_tenants({"secret-salt-a": "a"})
    metrics.observe_report(_report(1, {"secret-salt-a": 3, "unknown-salt": 1}, {}))
    body = _scrape(metrics)
    assert 'tenant_kv_blocks_live{pool="shared",tenant="a",worker="w0"} 3.0' in body
    assert 'tenant_kv_blocks_live{pool="shared",tenant="other",worker="w0"} 1.0' in body
    assert "salt" not in body


def test_a_tenant_that_holds_no_block_any_more_shows_zero() -> None:
    metrics = IngressMetrics()
    metrics.name_tenants({"sa": "a"})
    metrics.observe_report(_report(1, {"sa": 3}, {}))
    metrics.observe_report(_report(2, {}, {}))
    assert 'tenant_kv_blocks_live{pool="shared",tenant="a",worker="w0"} 0.0' in _scrape(metrics)


def test_cap_refusals_count_up_from_the_reports_totals() -> None:
    metrics = IngressMetrics()
    metrics.name_tenants({"sa": "a"})
    metrics.observe_report(_report(1, {}, {"sa": 2}))
    metrics.observe_report(_report(2, {}, {"sa": 5}))
    assert (
        'tenant_kv_block_cap_refusals_total{pool="shared",tenant="a",worker="w0"} 5.0'
        in _scrape(metrics)
    )


def test_cap_refusals_survive_the_wire() -> None:
    report = _report(1, {"sa": 1}, {"sa": 4})
    assert LoadReport.decode(report.encode()).tenant_cap_refusals == {"sa": 4}
