"""Ray's autoscaler launches a node of manifests/cluster.yaml's GPU type for a pagefleet
worker that asks for a GPU, the worker runs and serves there, and the node goes once
the worker is removed (the fake multi-node provider: tests/fake_autoscaler.py).

The head has no CPUs and no GPUs (the manifest's head runs the ingress, router and
scheduler, which ask for none), so the pool's one worker (`device: cpu`,
`num_gpus_per_worker: 1`: placed one per GPU, computing on CPU) can only run on a
node the autoscaler launched for it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
from cluster_fixtures import (
    generate,
    offline_tiny,
    pool_status,
    small_cluster_config,
    tokens_of,
    wait_for,
    wait_until_no_block_leaked,
)
from fake_autoscaler import (
    GPU_NODE_RESOURCES,
    GPU_NODE_TYPE,
    IDLE_TIMEOUT_S,
    FakeAutoscalingCluster,
    fake_autoscaling_cluster,
)
from ray.exceptions import RayActorError

from pagefleet import SamplingParams
from pagefleet.cluster.app import RunningCluster, start_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(600)]

__all__ = ["fake_autoscaling_cluster"]  # the module-scoped fixture, used by name

PROMPT = "A worker on a node the autoscaler launched"
MAX_TOKENS = 12
LAUNCH_TIMEOUT_S = 180.0


@pytest.fixture(scope="module")
def pagefleet_on_gpu_node(
    fake_autoscaling_cluster: FakeAutoscalingCluster,
) -> Iterator[RunningCluster]:
    """pagefleet, started once its worker has loaded on the node launched for it."""
    config = small_cluster_config(workers=1)
    config = config.replace(pools=(config.pools[0].replace(num_gpus_per_worker=1),))
    running = start_cluster(
        config, grpc_port=0, metrics_port=None, ready_timeout_s=LAUNCH_TIMEOUT_S + 120
    )
    yield running
    with contextlib.suppress(RayActorError):  # the node-removal test shut it down already
        running.shutdown()


@pytest.fixture(scope="module")
def gpu_node(
    fake_autoscaling_cluster: FakeAutoscalingCluster, pagefleet_on_gpu_node: RunningCluster
) -> dict[str, Any]:
    """The node the autoscaler launched for the worker's GPU."""
    (node,) = fake_autoscaling_cluster.gpu_nodes()
    return node


def test_a_worker_asking_for_a_gpu_launches_a_node_of_the_gpu_type(
    fake_autoscaling_cluster: FakeAutoscalingCluster, gpu_node: dict[str, Any]
) -> None:
    assert {k: gpu_node["Resources"][k] for k in GPU_NODE_RESOURCES} == GPU_NODE_RESOURCES
    # The monitor writes its log lines as it goes: the node may be up before the line is.
    launched = f"Launching 1 nodes, type {GPU_NODE_TYPE}."
    wait_for(
        lambda: launched in fake_autoscaling_cluster.monitor_log(),
        30,
        "the monitor's launch line",
        0.5,
    )


def test_the_worker_runs_on_the_launched_node_and_serves(
    gpu_node: dict[str, Any], pagefleet_on_gpu_node: RunningCluster
) -> None:
    target = pagefleet_on_gpu_node.grpc_target
    (worker,) = pool_status(target).workers
    assert worker.node_id == gpu_node["NodeID"]
    got = generate(target, PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True)
    want = offline_tiny().generate([PROMPT], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    assert tokens_of(got) == want[0].token_ids
    wait_until_no_block_leaked(pagefleet_on_gpu_node.workers["default"])


def test_the_node_goes_once_the_worker_is_removed(
    fake_autoscaling_cluster: FakeAutoscalingCluster,
    gpu_node: dict[str, Any],
    pagefleet_on_gpu_node: RunningCluster,
) -> None:
    pagefleet_on_gpu_node.shutdown()
    fake_autoscaling_cluster.wait_for_nodes(1, IDLE_TIMEOUT_S + 120)
    assert fake_autoscaling_cluster.gpu_nodes() == []
