"""Two tenants in one shared pool on a real local cluster: a flood by one leaves the other room.

One cluster for the module: pool "shared" (2 CPU workers, max_num_seqs 4,
wait queue 8) used by tenants "a" and "b" (weight 1 each, so each may hold 4
of the 8 waiting places); b may hold at most 32 live KV blocks per worker.
"""

from __future__ import annotations

import concurrent.futures
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
import ray
from cluster_fixtures import BLOCK_SIZE, local_cluster, pool_status, stub, wait_for

from pagefleet.cluster.app import RunningCluster
from pagefleet.cluster.client import auth_metadata, build_request
from pagefleet.cluster.config import ClusterConfig

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(300)]

MAX_NUM_SEQS = 4
WAIT_QUEUE = 8
# Long enough that the flood still holds the pool while b's requests arrive.
FLOOD_TOKENS = 120
B_CAP = 32


def _config() -> ClusterConfig:
    return ClusterConfig.from_dict(
        {
            "pools": [
                {
                    "name": "shared",
                    "model": "tiny",
                    "workers": 2,
                    "block_size": BLOCK_SIZE,
                    "num_kv_blocks": 512,
                    "max_model_len": 200,
                    "max_num_seqs": MAX_NUM_SEQS,
                    "max_num_batched_tokens": 256,
                    "device": "cpu",
                }
            ],
            "tenants": [
                {"name": "a", "pool": "shared", "api_key": "key-a-0123456789abcdef"},
                {"name": "b", "pool": "shared", "api_key": "key-b-0123456789abcdef", "max_live_blocks": B_CAP},
            ],
            "scheduler": {
                "report_interval_s": 0.2,
                "report_timeout_s": 2.0,
                "wait_queue_size": WAIT_QUEUE,
            },
            "server": {"host": "127.0.0.1", "grpc_port": 0, "http_port": None},
        }
    )


@pytest.fixture(scope="module")
def cluster() -> Iterator[RunningCluster]:
    with local_cluster(_config(), grpc_port=0) as running:
        yield running


def _run(target: str, api_key: str, prompt: str, max_tokens: int) -> str:
    """Stream one request to its end: its finish reason, or the gRPC status code's name."""
    channel, s = stub(target)
    with channel:
        req = build_request(prompt, {"max_tokens": max_tokens, "ignore_eos": True})
        try:
            messages = list(s.Generate(req, timeout=240, metadata=auth_metadata(api_key)))
        except grpc.RpcError as err:
            return f"{err.code().name}: {err.details()}"
    return messages[-1].finish_reason


def _outstanding(target: str) -> int:
    p = pool_status(target, "shared", api_key="key-a-0123456789abcdef")
    return int(p.num_running + p.num_waiting)


def _pools_end_clean(cluster: RunningCluster) -> None:
    def clean() -> bool:
        for _worker_id, handle in cluster.workers["shared"]:
            s = ray.get(handle.stats.remote(), timeout=30)
            if s.live != 0 or s.free + s.cached != s.total:
                return False
        return True

    wait_for(clean, 60, "free + cached == total and no live block on every worker")
    for _worker_id, handle in cluster.workers["shared"]:
        ray.get(handle.check_integrity.remote(), timeout=30)


def test_while_a_floods_the_shared_pool_b_is_admitted_and_finishes(cluster: RunningCluster) -> None:
    target = cluster.grpc_target
    capacity = 2 * MAX_NUM_SEQS  # two workers' slots
    flood_size = capacity + WAIT_QUEUE  # what the whole queue would hold without shares
    with concurrent.futures.ThreadPoolExecutor(flood_size + 3) as pool:
        flood = [
            pool.submit(_run, target, "key-a-0123456789abcdef", f"flood {i}", FLOOD_TOKENS) for i in range(flood_size)
        ]
        # a holds every slot and its half of the queue; the rest of its flood is refused.
        wait_for(
            lambda: sum(f.done() and f.result() != "length" for f in flood) == WAIT_QUEUE // 2,
            60,
            "a's flood running and waiting, its excess refused",
        )
        assert _outstanding(target) > 0, "a's flood ended before b arrived: make it longer"
        b = [pool.submit(_run, target, "key-b-0123456789abcdef", f"b's turn {i}", 4) for i in range(3)]
        b_results = [f.result(timeout=240) for f in b]
        a_results = [f.result(timeout=240) for f in flood]
    assert b_results == ["length"] * 3
    refused = [r for r in a_results if r != "length"]
    assert len(refused) == WAIT_QUEUE // 2
    assert all(
        r.startswith("RESOURCE_EXHAUSTED") and "its share of wait_queue_size 8" in r for r in refused
    )
    _pools_end_clean(cluster)


def test_the_ingress_exports_per_tenant_refusals_and_live_blocks(cluster: RunningCluster) -> None:
    # Runs after the flood: a's requests past its queue share were counted by reason.
    url = f"http://127.0.0.1:{cluster.metrics_port}/metrics"
    body = urllib.request.urlopen(url, timeout=10).read().decode()
    assert 'tenant_requests_refused_total{pool="shared",reason="queue_share",tenant="a"} 4.0' in body
    assert 'tenant_kv_blocks_live{pool="shared",tenant="a",worker="shared-0"}' in body
    assert "tenant_kv_block_cap_refusals_total" in body
    assert "key-b-0123456789abcdef" not in body and "tenant:b" not in body  # no key, no salt


def test_a_request_larger_than_the_tenant_s_block_cap_is_invalid_naming_the_cap(
    cluster: RunningCluster,
) -> None:
    # 10 + 150 tokens need 40 blocks of 4: more than b's 32 on any worker.
    result = _run(cluster.grpc_target, "key-b-0123456789abcdef", "too big for b", 150)
    assert result.startswith("INVALID_ARGUMENT")
    assert f"max_live_blocks is {B_CAP}" in result
    assert _run(cluster.grpc_target, "key-a-0123456789abcdef", "a has no cap", 150) == "length"
    _pools_end_clean(cluster)
