"""Pools on a real multi-node Ray cluster: one `ray start` raylet per node (`ray_nodes`).

The head runs the scheduler, membership and ingress; three nodes advertise
one GPU each (the machine needs none: the pools compute on CPU), one of them
labelled `pool=acme`. The tenant pool `acme` is pinned there by its
`node_labels`; the pool `default` (`node_labels: {pool: "!acme"}`) takes one
GPU per worker on the other two. Later tests kill one of those nodes (SIGKILL
of its raylet), add a node for the pool to refill onto, and a spare node: a
scale-out to two more workers cannot complete there, and load grows the
autoscaled `default` (2 to 3 workers) onto it.
"""

from __future__ import annotations

import concurrent.futures
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import ray
from cluster_fixtures import (
    generate,
    pool_status,
    small_cluster_config,
    stub,
    tokens_of,
    wait_for,
    wait_until_no_block_leaked,
)
from ray import serve
from ray._private.state import actors as actors_in_gcs
from ray._private.state import available_resources_per_node
from ray_nodes import Node, RayNodes, ray_nodes

from pagefleet.cluster.app import APP_NAME, INGRESS_NAME, NAMESPACE, RunningCluster, start_cluster
from pagefleet.cluster.client import build_request
from pagefleet.cluster.config import ClusterConfig
from pagefleet.cluster.membership import Membership, MembershipError
from pagefleet.cluster.proto import pagefleet_pb2 as pb

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(600)]


@dataclass
class Fleet:
    nodes: RayNodes
    acme: Node
    shared: list[Node]
    running: RunningCluster
    spare: Node | None = None  # joined for the scale tests: room for one more worker
    lost: str = ""  # the worker the node-loss test lost with its node
    stopped: bool = False  # the last test stops pagefleet itself

    @property
    def target(self) -> str:
        return self.running.grpc_target


def fleet_config() -> ClusterConfig:
    """`default` autoscales between 2 and 3 workers on short timers; `acme` has one."""
    base = small_cluster_config(workers=2, policy="round_robin")
    default = base.pools[0].replace(node_labels={"pool": "!acme"}, min_workers=2, max_workers=3)
    acme = default.replace(name="acme", workers=1, node_labels={"pool": "acme"}, min_workers=None,
                               max_workers=None)  # fmt: skip
    # Full admission: the load test's streams claim their blocks up to max_tokens, so a
    # client beyond two per worker waits at the ingress, and the pool stays short for as
    # long as the load lasts.
    scheduler = base.scheduler.replace(
        admission="full", autoscale_free_fraction=0.3, autoscale_out_after_s=1.0,
        autoscale_in_after_s=5.0, autoscale_cooldown_s=2.0,
    )  # fmt: skip
    return base.replace(pools=(default, acme), scheduler=scheduler)


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    with ray_nodes() as nodes:
        nodes.start_head(num_cpus=2)
        acme = nodes.add_node(num_cpus=1, num_gpus=1, labels={"pool": "acme"})
        shared = [nodes.add_node(num_cpus=1, num_gpus=1) for _ in range(2)]
        nodes.init(NAMESPACE)
        running = start_cluster(fleet_config(), grpc_port=0, metrics_port=None)
        fleet = Fleet(nodes, acme, shared, running)
        try:
            yield fleet
        finally:
            if not fleet.stopped:
                running.shutdown()


def _nodes_of(target: str, pool: str) -> dict[str, str]:
    """worker id -> node id of the pool's alive workers."""
    return {w.worker_id: w.node_id for w in pool_status(target, pool).workers if w.alive}


def test_cpu_workers_holding_a_gpu_each_serve_one_per_gpu_node(fleet: Fleet) -> None:
    assert sorted(_nodes_of(fleet.target, "default").values()) == sorted(n.node_id for n in fleet.shared)
    for worker in pool_status(fleet.target, "default").workers:
        assert worker.node_ip and worker.total_blocks > 0
    out = generate(fleet.target, "placed on a GPU node", max_tokens=4, ignore_eos=True)
    assert len(tokens_of(out)) == 4 and out[-1].finish_reason == "length"


def test_node_labels_pin_the_tenant_pool_to_its_labelled_node(fleet: Fleet) -> None:
    assert list(_nodes_of(fleet.target, "acme").values()) == [fleet.acme.node_id]
    assert fleet.acme.node_id not in _nodes_of(fleet.target, "default").values()
    out = generate(fleet.target, "a tenant's request", pool="acme", max_tokens=4, ignore_eos=True)
    assert out[-1].worker_id == "acme-0" and len(tokens_of(out)) == 4


def test_the_scheduler_membership_and_ingress_run_on_the_head_node(fleet: Fleet) -> None:
    assert fleet.nodes.head is not None
    head = fleet.nodes.wait_alive(fleet.nodes.head)
    actors = [a for a in actors_in_gcs().values() if a["State"] == "ALIVE"]
    control = {
        a["ActorClassName"]: a["Address"]["NodeID"]
        for a in actors
        if a["Name"] in ("pagefleet-scheduler", "pagefleet-membership") or INGRESS_NAME in a["ActorClassName"]
    }
    assert len(control) == 3 and set(control.values()) == {head}, control


def test_a_pool_that_cannot_be_placed_fails_naming_its_labels_and_what_each_node_has(
    fleet: Fleet,
) -> None:
    ghost = fleet_config().pools[1].replace(name="ghost", node_labels={"pool": "beta"})
    config = fleet_config().replace(pools=(ghost,), tenants=())
    owner = ray.remote(Membership).options(name="ghost-membership", num_cpus=0).remote(
        config, NAMESPACE, fleet.running.schedulers
    )
    try:
        message = ray.get(owner.wait_loaded.remote(3.0), timeout=60)
    finally:
        ray.kill(owner, no_restart=True)  # its pending worker ends with it
    assert "pool 'ghost': 1 worker(s) cannot be placed: each asks Ray for 1 CPU and 1 GPU on a node " \
        "labelled {pool: beta}; the cluster has node " in message
    assert f"node {fleet.acme.node_id[:8]} (" in message and "labels {pool: acme}: 0/1 CPU, 0/1 GPU free" in message
    assert message.endswith("(waited 3s)")


def test_a_scale_past_the_free_gpus_of_the_pools_nodes_is_refused_before_anything_starts(
    fleet: Fleet,
) -> None:
    with pytest.raises(MembershipError) as exc:
        ray.get(fleet.running.membership.scale.remote("acme", 2), timeout=60)
    message = str(exc.value.cause)  # type: ignore[attr-defined]
    assert message.startswith("scale of pool 'acme' to 2 refused, nothing was started: pool 'acme': ")
    assert "on a node labelled {pool: acme}" in message
    wait_for(lambda: len(pool_status(fleet.target, "acme").workers) == 1, 10, "acme keeps its one worker")


PROMPTS = [f"Request {i} keeps streaming while its node goes away" for i in range(4)]
TENANT_PROMPT = "the tenant's stream runs on its own node"
MAX_TOKENS = 80  # long enough that the node dies under the streams, not after them


def _stream(target: str, prompt: str, pool: str = "", on_token: Any = None) -> list[pb.GenerateResponse]:
    channel, s = stub(target)
    with channel:
        req = pb.GenerateRequest(
            prompt=prompt, pool=pool, sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
        )
        out = []
        for msg in s.Generate(req, timeout=300):
            out.append(msg)
            if on_token is not None and msg.token_ids:
                on_token(msg)
        return out


def _serving(fleet: Fleet) -> list[tuple[str, Any]]:
    """(worker id, handle) of every worker the view has alive (a pending one has no stats)."""
    alive = {w.worker_id for pool in ("default", "acme") for w in pool_status(fleet.target, pool).workers if w.alive}
    return [(wid, h) for ws in fleet.running.workers.values() for wid, h in ws if wid in alive]


def test_a_lost_node_moves_its_streams_with_the_no_fault_output_and_spares_the_other_pool(
    fleet: Fleet,
) -> None:
    target = fleet.target
    want = [tokens_of(generate(target, p, max_tokens=MAX_TOKENS, ignore_eos=True)) for p in PROMPTS]
    tenant_want = tokens_of(generate(target, TENANT_PROMPT, pool="acme", max_tokens=MAX_TOKENS, ignore_eos=True))
    doomed = fleet.shared[1]
    victim = next(w for w, node in _nodes_of(target, "default").items() if node == doomed.node_id)
    fleet.lost = victim
    started: concurrent.futures.Future[None] = concurrent.futures.Future()

    def on_token(msg: pb.GenerateResponse) -> None:
        if msg.worker_id == victim and not started.done():
            started.set_result(None)

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS) + 1) as clients:
        tenant = clients.submit(_stream, target, TENANT_PROMPT, "acme")
        streams = [clients.submit(_stream, target, p, "", on_token) for p in PROMPTS]
        started.result(timeout=120)  # a stream runs on the doomed node's worker
        fleet.nodes.kill(doomed)
        lost_at = time.monotonic()
        wait_for(lambda: pool_status(target).live_workers == 1, 15, "the pool reports its lost worker", 0.1)
        reported_s = time.monotonic() - lost_at
        results = [f.result(timeout=300) for f in streams]
        tenant_out = tenant.result(timeout=300)
    assert reported_s < 15
    for expected, got in zip(want, results, strict=True):
        assert got[-1].finish_reason == "length"
        assert tokens_of(got) == expected
    assert any(got[0].worker_id == victim and got[-1].worker_id != victim for got in results)
    assert tokens_of(tenant_out) == tenant_want
    assert {m.worker_id for m in tenant_out} == {"acme-0"}
    wait_until_no_block_leaked(_serving(fleet))


def test_the_pool_refills_onto_a_node_that_joins_and_routes_to_the_new_worker(fleet: Fleet) -> None:
    target, lost = fleet.target, fleet.lost
    assert lost, "the node-loss test before loses a worker"
    (kept,) = {"default-0", "default-1"} - {lost}

    def replaced() -> bool:
        members = ray.get(fleet.running.membership.members.remote(), timeout=30)["default"]
        return len(members) == 2 and lost not in {w for w, _ in members}

    # The lost worker is forgotten and its replacement (a fresh id) waits for a node.
    wait_for(replaced, 60, "a replacement for the lost worker", 0.5)
    wait_for(lambda: {w.worker_id for w in pool_status(target).workers} == {kept}, 30, f"{lost} gone", 0.2)
    joined = fleet.nodes.add_node(num_cpus=1, num_gpus=1)
    wait_for(lambda: pool_status(target).live_workers == 2, 180, "the replacement serving", 0.5)
    assert _nodes_of(target, "default")["default-2"] == joined.node_id
    served_by = {generate(target, f"after the refill {i}", max_tokens=2)[-1].worker_id for i in range(4)}
    assert served_by == {kept, "default-2"}
    wait_until_no_block_leaked(_serving(fleet))


def test_a_scale_that_cannot_reach_its_target_removes_the_workers_it_added(fleet: Fleet) -> None:
    spare = fleet.nodes.add_node(num_cpus=1, num_gpus=1)  # room for one more worker, not two
    with pytest.raises(MembershipError) as exc:
        call = fleet.running.membership.scale.remote("default", 4, timeout_s=12.0, wait_for_nodes=True)
        ray.get(call, timeout=300)
    message = str(exc.value.cause)  # type: ignore[attr-defined]
    # Rolled back: the worker that found room is removed again (or, on a machine too busy
    # for it to load within the timeout, was never added).
    assert re.search(
        r"to 4 failed and was rolled back \((removed default-[34] again|none had started); the pool keeps 2\)",
        message,
    )
    assert "did not start within 12s" in message
    wait_for(lambda: len(pool_status(fleet.target).workers) == 2, 60, "only the two workers it had", 0.5)

    def spare_free() -> bool:
        return available_resources_per_node().get(spare.node_id, {}).get("GPU") == 1.0

    wait_for(spare_free, 60, "the spare node's GPU free again")
    wait_until_no_block_leaked(_serving(fleet))
    fleet.spare = spare


LOAD_TOKENS = 100
# Two streams fill a worker's claims (2 x 39 of 96 blocks): with two workers, four run
# and the fifth client waits in the ingress queue (its bound, 2, never reached).
LOAD_CLIENTS = 5


def _long_stream(target: str, i: int) -> list[pb.GenerateResponse]:
    """56 prompt + 100 output tokens: 39 blocks; four of them overfill a worker's 96."""
    channel, s = stub(target)
    with channel:
        prompt = [(i * 31 + j * 7) % 250 + 5 for j in range(56)]
        req = build_request(prompt, {"max_tokens": LOAD_TOKENS, "ignore_eos": True})
        return list(s.Generate(req, timeout=600))


def _streams_until(stop: threading.Event, target: str, client: int) -> list[list[pb.GenerateResponse]]:
    """One client's long streams, one after another, until `stop` (at least one): load
    that lasts as long as the test needs, however fast the machine runs the model."""
    done = [_long_stream(target, client)]
    while not stop.is_set():
        done.append(_long_stream(target, client + LOAD_CLIENTS * len(done)))
    return done


def _autoscale(fleet: Fleet) -> dict[str, Any]:
    return dict(ray.get(fleet.running.membership.autoscale_status.remote(), timeout=30)["default"])


def test_load_grows_the_pool_onto_a_spare_node_and_idleness_shrinks_it_back(fleet: Fleet) -> None:
    target, spare = fleet.target, fleet.spare
    assert spare is not None, "the scale test before adds the spare node"
    assert _autoscale(fleet) == {"target": 2, "workers": 2, "reason": "configured size"}
    stop = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(LOAD_CLIENTS) as clients:
        streams = [clients.submit(_streams_until, stop, target, i) for i in range(LOAD_CLIENTS)]
        try:
            wait_for(lambda: _autoscale(fleet)["target"] == 3, 120, "the pool's target grows to 3", 0.5)
            assert _autoscale(fleet)["reason"].startswith("scale out: ")
            wait_for(lambda: pool_status(target).target_workers == 3, 30, "GetStatus: target 3", 0.5)
            assert pool_status(target).scale_reason.startswith("scale out: ")
            wait_for(lambda: pool_status(target).live_workers == 3, 240, "the third worker serving", 0.5)
            grown = _nodes_of(target, "default")
            assert spare.node_id in grown.values()
        finally:
            stop.set()
        results = [got for f in streams for got in f.result(timeout=600)]
    for got in results:  # no stream lost
        assert got[-1].finish_reason == "length" and len(tokens_of(got)) == LOAD_TOKENS
    wait_for(lambda: _autoscale(fleet)["target"] == 2, 120, "the idle pool's target back to 2", 0.5)
    assert _autoscale(fleet)["reason"].startswith("scale in: idle for ")
    wait_for(lambda: len(pool_status(target).workers) == 2, 120, "the pool back to two workers", 0.5)
    assert spare.node_id not in _nodes_of(target, "default").values()
    wait_until_no_block_leaked(_serving(fleet))


@serve.deployment(ray_actor_options={"num_cpus": 0})
class Neighbour:
    """Another team's Serve app on the same cluster."""

    def __call__(self) -> str:
        return "still here"


def test_stopping_pagefleet_on_a_joined_cluster_leaves_another_serve_app_serving(fleet: Fleet) -> None:
    # The module's last test: it stops pagefleet.
    neighbour = serve.run(Neighbour.bind(), name="neighbour", route_prefix=None)
    assert neighbour.remote().result(timeout_s=60) == "still here"
    fleet.stopped = True
    fleet.running.shutdown()
    apps = serve.status().applications
    assert APP_NAME not in apps and apps["neighbour"].status == "RUNNING", apps
    assert neighbour.remote().result(timeout_s=60) == "still here"

    def pagefleet_actors() -> list[str]:
        alive = [a for a in actors_in_gcs().values() if a["State"] == "ALIVE"]
        return [a["Name"] for a in alive if a["Name"].startswith("pagefleet")]

    wait_for(lambda: not pagefleet_actors(), 60, "no pagefleet actor left on the cluster", 0.5)
    serve.delete("neighbour")
