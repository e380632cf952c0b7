"""`/dashboard` and `/dashboard/state` served by the OpenAI HTTP app (no cluster needed)."""

from __future__ import annotations

from starlette.testclient import TestClient

from pagefleet.cluster.config import ClusterConfig
from pagefleet.cluster.ingress import Ingress
from pagefleet.cluster.openai import build_app


def _client(tenants: list[dict[str, str]]) -> TestClient:
    config = ClusterConfig.from_dict({"pools": [{"name": "chat"}], "tenants": tenants})
    # An ingress without workers: its status lists the pools, with no worker yet.
    return TestClient(build_app(Ingress(config, {})))


def test_dashboard_page_is_html_that_polls_the_state() -> None:
    response = _client([]).get("/dashboard")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
    assert 'fetch("/dashboard/state"' in response.text


def test_dashboard_state_lists_the_pools() -> None:
    state = _client([]).get("/dashboard/state").json()
    assert [p["name"] for p in state["pools"]] == ["chat"]
    assert state["pools"][0]["preemptions"] == 0 and state["pools"][0]["workers"] == []


def test_dashboard_state_needs_a_key_when_every_tenant_has_one() -> None:
    client = _client([{"name": "acme", "pool": "chat", "api_key": "k1-0123456789abcdef"}])
    assert client.get("/dashboard/state").status_code == 401
    ok = client.get("/dashboard/state", headers={"authorization": "Bearer k1-0123456789abcdef"})
    assert ok.status_code == 200 and ok.json()["pools"][0]["name"] == "chat"


def test_dashboard_shows_each_pools_live_workers_against_its_target_and_why_it_last_moved() -> None:
    config = ClusterConfig.from_dict({"pools": [{"name": "chat", "min_workers": 1, "max_workers": 3}]})
    ingress = Ingress(config, {})
    # What the ingress plane reads from the membership every few seconds.
    reason = "scale out: 4% blocks free (< 30%) and 2 waiting for 1s"
    ingress.pool_scaling = {"chat": {"target": 2, "workers": 1, "reason": reason}}
    client = TestClient(build_app(ingress))
    pool = client.get("/dashboard/state").json()["pools"][0]
    assert (pool["target_workers"], pool["scale_reason"], pool["live_workers"]) == (2, reason, 0)
    page = client.get("/dashboard").text
    assert "`workers: ${p.live_workers} live, target ${p.target_workers}; last moved: ${p.scale_reason}`" in page


def test_dashboard_shows_a_fixed_pool_at_its_configured_size() -> None:
    pool = _client([]).get("/dashboard/state").json()["pools"][0]
    assert (pool["target_workers"], pool["scale_reason"]) == (1, "configured size")
