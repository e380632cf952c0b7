"""What health tells whom, and what it says once the head's GCS is gone.

Without a key `/health` says serving or not and names no pool; a tenant's key
sees its own pools. API keys too short to be secret are refused at load. Losing
the GCS (no fault tolerance) turns gRPC health NOT_SERVING and `/health` 503
within seconds instead of answering ok while completions hang. The GCS test
kills this module's cluster, so it runs last.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import httpx
import pytest
from cluster_fixtures import local_cluster, status
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagefleet.cluster.app import RunningCluster, _local_gcs_process
from pagefleet.cluster.config import ClusterConfig, ConfigError

KEY_ACME = "acme-health-key-0123456789"
KEY_GLOBEX = "globex-health-key-0123456789"
GCS_LOST_NOTICED_S = 10.0  # three unanswered one-second probes, on a busy machine


def _config() -> ClusterConfig:
    pool = {"model": "tiny", "workers": 1, "num_kv_blocks": 64, "block_size": 4, "device": "cpu"}
    return ClusterConfig.from_dict(
        {
            "pools": [{"name": "acme-pool", **pool}, {"name": "globex-pool", **pool}],
            "tenants": [
                {"name": "acme", "pool": "acme-pool", "api_key": KEY_ACME},
                {"name": "globex", "pool": "globex-pool", "api_key": KEY_GLOBEX},
            ],
            "server": {"host": "127.0.0.1", "grpc_port": 0, "http_port": 0},
        }
    )


@pytest.fixture(scope="module")
def cluster() -> Iterator[RunningCluster]:
    with local_cluster(_config()) as running:
        yield running


@pytest.mark.parametrize("key", ["", "   ", "short-key-15chr", " " * 20 + "abc"])
def test_a_blank_or_short_api_key_is_refused_at_load_saying_the_minimum(key: str) -> None:
    with pytest.raises(ConfigError, match=r"tenants\[0\]\.api_key: must be at least 16 characters"):
        ClusterConfig.from_dict({"pools": [{"name": "p"}], "tenants": [{"name": "t", "pool": "p", "api_key": key}]})


def test_health_details_is_an_operator_switch_off_by_default() -> None:
    assert ClusterConfig.from_dict({"pools": [{"name": "p"}]}).server.health_details is False
    with pytest.raises(ConfigError, match=r"server\.health_details: must be bool"):
        ClusterConfig.from_dict({"pools": [{"name": "p"}], "server": {"health_details": "yes"}})


@pytest.mark.cluster
def test_health_without_a_key_says_serving_and_names_no_pool(cluster: RunningCluster) -> None:
    r = httpx.get(f"{cluster.http_url}/health", timeout=30)
    assert r.status_code == 200
    assert r.json() == {"status": "ok"}


@pytest.mark.cluster
def test_health_with_a_tenant_key_lists_only_its_own_pools(cluster: RunningCluster) -> None:
    headers = {"Authorization": f"Bearer {KEY_GLOBEX}"}
    r = httpx.get(f"{cluster.http_url}/health", headers=headers, timeout=30)
    assert r.json() == {"status": "ok", "live_workers": {"globex-pool": 1}}
    wrong = httpx.get(f"{cluster.http_url}/health", headers={"x-api-key": "x" * 20}, timeout=30)
    assert wrong.json() == {"status": "ok"}


@pytest.mark.cluster
def test_losing_the_gcs_turns_grpc_and_http_health_not_serving_within_seconds(
    cluster: RunningCluster,
) -> None:
    assert status(cluster.grpc_target, api_key=KEY_ACME).pools  # answering before
    gcs = _local_gcs_process()
    gcs.kill()
    gcs.wait(timeout=30)
    killed = time.monotonic()
    channel = grpc.insecure_channel(cluster.grpc_target)
    health = health_pb2_grpc.HealthStub(channel)
    with channel:
        while True:
            grpc_status = health.Check(health_pb2.HealthCheckRequest(), timeout=10).status
            http = httpx.get(f"{cluster.http_url}/health", timeout=10)
            if grpc_status == health_pb2.HealthCheckResponse.NOT_SERVING and http.status_code == 503:
                break
            assert time.monotonic() - killed < GCS_LOST_NOTICED_S, (grpc_status, http.json())
            time.sleep(0.1)
    assert cluster.lost_gcs() is not None
