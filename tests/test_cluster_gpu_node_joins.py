"""A node with GPUs joins a real cluster started without any (`ray_nodes`).

A pool without `num_gpus_per_worker` asks for one GPU per worker on a cluster with
GPUs and for none on a cluster without: the worker started on the CPU-only head
holds no GPU, and a worker added once the GPU node has joined asks for its GPU.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import ray
from cluster_fixtures import pool_status, small_cluster_config, wait_for
from ray._private.state import available_resources_per_node
from ray_nodes import RayNodes, ray_nodes

from pagefleet.cluster.app import NAMESPACE, RunningCluster, start_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def nodes() -> Iterator[RayNodes]:
    with ray_nodes() as nodes:
        nodes.start_head(num_cpus=2)
        nodes.init(NAMESPACE)
        yield nodes


@pytest.fixture(scope="module")
def running(nodes: RayNodes) -> Iterator[RunningCluster]:
    running = start_cluster(small_cluster_config(workers=1), grpc_port=0, metrics_port=None)
    try:
        yield running
    finally:
        running.shutdown()


def test_a_worker_added_after_a_gpu_node_joined_takes_its_gpu(nodes: RayNodes, running: RunningCluster) -> None:
    assert nodes.head is not None
    (first,) = pool_status(running.grpc_target).workers
    assert first.node_id == nodes.head.node_id
    gpu_node = nodes.add_node(num_cpus=1, num_gpus=1)
    result = ray.get(running.membership.scale.remote("default", 2), timeout=300)
    (added,) = result["added"]

    def placed() -> dict[str, str]:
        return {w.worker_id: w.node_id for w in pool_status(running.grpc_target).workers}

    # In the scheduler's view when scale returns; the ingress's copy follows by a delta.
    wait_for(lambda: added in placed(), 30, f"{added} in the ingress's view")
    assert placed()[added] == gpu_node.node_id
    assert available_resources_per_node()[gpu_node.node_id].get("GPU", 0.0) == 0.0
