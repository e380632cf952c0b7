"""Losing a node that carries an ingress replica, on a real multi-node Ray (`ray_nodes`).

The Serve application (`serve_app.build_application`, as `serve deploy` runs it)
spreads its two ingress replicas one per node over the nodes that advertise the
`pagefleet_ingress` resource (nodes A and B, no CPU); the worker and the
workers' owner run on the head. All nodes share 127.0.0.1, so both replicas
listen on the one gRPC port (SO_REUSEPORT) and the kernel hands each new
connection to one of them, as a load balancer in front of two ingress nodes would.
Node A is then lost (SIGKILL of its raylet and every process it started).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import psutil
import pytest
import ray
from cluster_fixtures import (
    BLOCK_SIZE,
    MAX_MODEL_LEN,
    NUM_KV_BLOCKS,
    generate,
    offline_tiny,
    tokens_of,
    wait_for,
    wait_until_no_block_leaked,
)
from ray import serve
from ray_nodes import Node, RayNodes, ray_nodes
from replica_streams import Stream, replicas_reached, stream_on
from serve_process import free_port

from pagefleet.cluster.names import APP_NAME, NAMESPACE, worker_actor_name
from pagefleet.cluster.serve_app import build_application
from pagefleet.worker.sampling_params import SamplingParams

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(600)]

INGRESS_RESOURCE = "pagefleet_ingress"
PROMPT = "A stream through the ingress node that stays"


@dataclass
class IngressNodes:
    nodes: RayNodes
    a: Node  # the node the tests lose
    b: Node
    target: str
    worker: Any  # default-0's actor handle


def _app_args(grpc_port: int) -> dict[str, Any]:
    pool = {
        "name": "default", "model": "tiny", "workers": 1, "device": "cpu", "block_size": BLOCK_SIZE,
        "num_kv_blocks": NUM_KV_BLOCKS, "max_model_len": MAX_MODEL_LEN, "max_num_seqs": 4,
    }  # fmt: skip
    server = {"host": "127.0.0.1", "grpc_port": grpc_port, "http_port": None, "ingress_replicas": 2}
    return {
        "config": {"pools": [pool], "server": server},
        "metrics_port": None,
        "ingress_resource": INGRESS_RESOURCE,
        "ingress_replicas_per_node": 1,
    }


@pytest.fixture(scope="module")
def cluster() -> Iterator[IngressNodes]:
    with ray_nodes() as nodes:
        nodes.start_head(num_cpus=2)
        a, b = (nodes.add_node(num_cpus=0, resources={INGRESS_RESOURCE: 1}) for _ in range(2))
        nodes.init(NAMESPACE)
        serve.start(http_options={"location": "NoServer"})
        port = free_port()
        try:
            serve.run(build_application(_app_args(port)), name=APP_NAME, route_prefix=None)
            worker = ray.get_actor(worker_actor_name("default-0"), namespace=NAMESPACE)
            yield IngressNodes(nodes, a, b, f"127.0.0.1:{port}", worker)
        finally:
            serve.shutdown()


def _on_node(replica: str, node: Node) -> bool:
    """Whether the ingress replica (`<pid>-<suffix>`) runs on `node` (its raylet started it)."""
    raylet = node.raylet_pid()
    if raylet is None:
        return False
    pid = int(replica.split("-", 1)[0])
    return pid in {p.pid for p in psutil.Process(raylet).children(recursive=True)}


def _stream_on_node(target: str, node: Node, *, avoid: bool, **sampling: Any) -> Stream:
    """A stream served by the replica on `node` (or, with `avoid`, by the other)."""
    probe = Stream(target, "which replica", max_tokens=1)
    probe.rest()
    other = stream_on(target, probe.replica, "which replica", avoid=True, max_tokens=1)
    other.rest()
    on_node = probe.replica if _on_node(probe.replica, node) else other.replica
    assert _on_node(on_node, node), "no ingress replica on the node"
    return stream_on(target, on_node, PROMPT, avoid=avoid, **sampling)


def test_both_ingress_replicas_run_off_the_head_one_per_ingress_node(cluster: IngressNodes) -> None:
    probe = Stream(cluster.target, "hello", max_tokens=1)
    probe.rest()
    other = stream_on(cluster.target, probe.replica, "hello", avoid=True, max_tokens=1)
    other.rest()
    replicas = (probe.replica, other.replica)
    assert [_on_node(r, cluster.a) for r in replicas].count(True) == 1
    assert [_on_node(r, cluster.b) for r in replicas].count(True) == 1


def test_a_lost_ingress_node_costs_only_its_replicas_streams_and_nothing_leaks(cluster: IngressNodes) -> None:
    sampling = {"max_tokens": MAX_MODEL_LEN - 20, "ignore_eos": True}
    want = offline_tiny().generate(PROMPT, SamplingParams(**sampling))[0].token_ids
    doomed = _stream_on_node(cluster.target, cluster.a, avoid=False, **sampling)
    kept = _stream_on_node(cluster.target, cluster.a, avoid=True, **sampling)
    for s in (doomed, kept):
        s.first_token()
    cluster.nodes.kill(cluster.a)
    got = kept.rest()
    assert tokens_of(got) == want and got[-1].finish_reason == "length"
    with pytest.raises(grpc.RpcError):
        doomed.rest()
    # Every new connection reaches the replica left; none is refused.
    for i in range(8):
        assert generate(cluster.target, f"after the node loss {i}", max_tokens=2)[-1].finish_reason == "length"
    # The worker ended the lost replica's stream: every block back.
    wait_until_no_block_leaked([("default-0", cluster.worker)])


def test_serve_starts_the_lost_replica_again_on_an_ingress_node_that_joins(cluster: IngressNodes) -> None:
    cluster.nodes.add_node(num_cpus=0, resources={INGRESS_RESOURCE: 1})
    wait_for(lambda: replicas_reached(cluster.target) == 2, 180, "two ingress replicas serving again", 1.0)
