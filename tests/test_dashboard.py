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
