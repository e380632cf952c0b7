"""A pool spread over two Ray nodes on one machine (`ray.cluster_utils.Cluster`).

Removing a worker node mid-run loses no request: the streams of its worker
resume on the worker of the head node, with the no-fault output.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from typing import Any

import pytest
import ray
from cluster_fixtures import generate, pool_status, small_cluster_config, stub, tokens_of, wait_for
from ray.cluster_utils import Cluster

from pagefleet.cluster.app import NAMESPACE, RunningCluster, start_cluster
from pagefleet.cluster.proto import pagefleet_pb2 as pb

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(300)]

PROMPTS = [f"Request {i} keeps streaming while a node goes away" for i in range(6)]
MAX_TOKENS = 60


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[tuple[Cluster, Any, RunningCluster]]:
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    second = nodes.add_node(num_cpus=1)
    ray.init(address=nodes.address, namespace=NAMESPACE)
    running = start_cluster(small_cluster_config(workers=2), grpc_port=0, metrics_port=None)
    try:
        yield nodes, second, running
    finally:
        running.shutdown()
        ray.shutdown()
        nodes.shutdown()


def _node_of_worker(target: str) -> dict[str, str]:
    return {w.worker_id: w.node_id for w in pool_status(target).workers if w.alive}


def test_pool_spreads_its_workers_over_both_nodes(two_nodes: tuple[Cluster, Any, RunningCluster]) -> None:
    _, _, running = two_nodes
    assert len(set(_node_of_worker(running.grpc_target).values())) == 2


def test_removing_a_node_mid_run_loses_no_request(two_nodes: tuple[Cluster, Any, RunningCluster]) -> None:
    nodes, second, running = two_nodes
    target = running.grpc_target
    want = [tokens_of(generate(target, p, max_tokens=MAX_TOKENS, ignore_eos=True)) for p in PROMPTS]
    victims = [w for w, node in _node_of_worker(target).items() if node == second.node_id]
    assert len(victims) == 1
    started: concurrent.futures.Future[None] = concurrent.futures.Future()

    def run(prompt: str) -> list[pb.GenerateResponse]:
        channel, s = stub(target)
        with channel:
            req = pb.GenerateRequest(
                prompt=prompt, sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
            )
            out = []
            for msg in s.Generate(req, timeout=240):
                out.append(msg)
                if msg.token_ids and msg.worker_id == victims[0] and not started.done():
                    started.set_result(None)
            return out

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = [pool.submit(run, p) for p in PROMPTS]
        started.result(timeout=120)  # a stream is running on the doomed node's worker
        nodes.remove_node(second, allow_graceful=False)
        results = [f.result(timeout=240) for f in futures]
    for expected, got in zip(want, results, strict=True):
        assert got[-1].finish_reason == "length"
        assert tokens_of(got) == expected
    moved = [got for got in results if got[0].worker_id == victims[0] and got[-1].worker_id != victims[0]]
    assert moved, "no stream moved off the removed node's worker"
    wait_for(
        lambda: len(_node_of_worker(target)) == 2,
        120,
        "the lost worker restarted on the remaining node",
        interval_s=0.5,
    )
