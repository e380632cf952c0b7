"""Ray's autoscaler launches a node of manifests/cluster.yaml's GPU type for a pagefleet
worker that asks for a GPU, the worker runs and serves there; a load that fills that
worker grows the pool onto a second node the autoscaler launches, and once the load
ends the pool shrinks back and that node goes; the first node goes once pagefleet
is shut down (the fake multi-node provider: tests/fake_autoscaler.py).

The head has no CPUs and no GPUs (the manifest's head runs the ingress, router and
scheduler, which ask for none), so the pool's workers (`device: cpu`,
`num_gpus_per_worker: 1`: placed one per GPU, computing on CPU) can only run on
nodes the autoscaler launched for them. The pool autoscales between one and two
workers on short timers.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import ray
from cluster_fixtures import (
    BLOCK_SIZE,
    MAX_MODEL_LEN,
    generate,
    offline_tiny,
    pool_status,
    small_cluster_config,
    stub,
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

from pagefleet import LLM, SamplingParams
from pagefleet.cluster.app import RunningCluster, start_cluster
from pagefleet.cluster.client import build_request
from pagefleet.cluster.config import ClusterConfig
from pagefleet.cluster.proto import pagefleet_pb2 as pb

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(600)]

__all__ = ["fake_autoscaling_cluster"]  # the module-scoped fixture, used by name

PROMPT = "A worker on a node the autoscaler launched"
MAX_TOKENS = 12
LAUNCH_TIMEOUT_S = 180.0
LAUNCH_LINE = f"Launching 1 nodes, type {GPU_NODE_TYPE}."


def autoscaled_config() -> ClusterConfig:
    """One worker to start with, two at most, on short timers. Full admission: a
    stream claims its blocks up to max_tokens, so a client beyond two per worker
    waits at the ingress and the pool stays short for as long as the load lasts.
    While a node starts beside it, a worker busy with the load on a busy machine may
    push no report, or stream no token, for seconds: longer report and stall timeouts
    than the other cluster tests' keep the pool's only worker in routing."""
    config = small_cluster_config(workers=1, wait_queue=LOAD_CLIENTS)
    pool = config.pools[0].replace(num_gpus_per_worker=1, min_workers=1, max_workers=2)
    scheduler = config.scheduler.replace(
        report_timeout_s=30.0, stall_timeout_s=30.0, admission="full",
        autoscale_free_fraction=0.3, autoscale_out_after_s=1.0, autoscale_in_after_s=5.0,
        autoscale_cooldown_s=2.0,
    )  # fmt: skip
    return config.replace(pools=(pool,), scheduler=scheduler)


@pytest.fixture(scope="module")
def pagefleet_on_gpu_node(
    fake_autoscaling_cluster: FakeAutoscalingCluster,
) -> Iterator[RunningCluster]:
    """pagefleet, started once its first worker has loaded on the node launched for it."""
    running = start_cluster(
        autoscaled_config(), grpc_port=0, metrics_port=None, ready_timeout_s=LAUNCH_TIMEOUT_S + 120
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
    wait_for(
        lambda: LAUNCH_LINE in fake_autoscaling_cluster.monitor_log(),
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


# A stream of 120 prompt and 36 output tokens claims 39 blocks: two fill a worker's
# claims (78 of 96 blocks, under 30% left) and the other clients wait at the ingress.
# Each stream's prompt is its own, so no prefix hit makes a claim smaller.
LOAD_CLIENTS = 4
LOAD_PROMPT_TOKENS = 120
LOAD_TOKENS = 36


def load_prompt(i: int) -> list[int]:
    return [(i * 31 + j * 7) % 250 + 5 for j in range(LOAD_PROMPT_TOKENS)]


@dataclass
class Load:
    """What a load that grew the pool left: each stream's prompt index and messages,
    the worker the pool grew by and its node, the GPU nodes then, the workers that
    served the load, and why the pool's target moved (membership's word and GetStatus')."""

    streams: list[tuple[int, list[pb.GenerateResponse]]]
    grown: str
    grown_node: str
    gpu_nodes: dict[str, dict[str, Any]]
    served_by: set[str]
    reasons: tuple[str, str]


def _stream(target: str, i: int, served_by: set[str]) -> tuple[int, list[pb.GenerateResponse]]:
    channel, s = stub(target)
    with channel:
        req = build_request(load_prompt(i), {"max_tokens": LOAD_TOKENS, "ignore_eos": True})
        out = []
        for msg in s.Generate(req, timeout=600):
            out.append(msg)
            served_by.add(msg.worker_id)
        return i, out


def _streams_until(
    stop: threading.Event, target: str, ids: Iterator[int], served_by: set[str]
) -> list[tuple[int, list[pb.GenerateResponse]]]:
    """One client's streams, one after another, until `stop` (at least one): load that
    lasts as long as the node takes to launch, however fast the machine runs."""
    done = [_stream(target, next(ids), served_by)]
    while not stop.is_set():
        done.append(_stream(target, next(ids), served_by))
    return done


def _autoscale(running: RunningCluster) -> dict[str, Any]:
    return dict(ray.get(running.membership.autoscale_status.remote(), timeout=30)["default"])


def _no_client_failed(clients: list[concurrent.futures.Future[Any]]) -> bool:
    """Raise a client's error as soon as it has one (a lost stream), rather than wait on."""
    for client in clients:
        if client.done():
            client.result()
    return True


@pytest.fixture(scope="module")
def load(
    fake_autoscaling_cluster: FakeAutoscalingCluster,
    gpu_node: dict[str, Any],
    pagefleet_on_gpu_node: RunningCluster,
) -> Load:
    """Clients keep the pool's first worker full until the pool has grown by a worker and
    a stream ran there; every stream then runs to its end."""
    running = pagefleet_on_gpu_node
    target = running.grpc_target
    assert _autoscale(running) == {"target": 1, "workers": 1, "reason": "configured size"}
    stop = threading.Event()
    ids = itertools.count()  # next() on it is atomic: each stream its own prompt
    served_by: set[str] = set()
    with concurrent.futures.ThreadPoolExecutor(LOAD_CLIENTS) as pool:
        clients = [
            pool.submit(_streams_until, stop, target, ids, served_by) for _ in range(LOAD_CLIENTS)
        ]
        try:
            wait_for(
                lambda: _no_client_failed(clients) and _autoscale(running)["target"] == 2,
                120,
                "the pool's target grows to 2",
                0.5,
            )
            wait_for(
                lambda: _no_client_failed(clients) and pool_status(target).live_workers == 2,
                LAUNCH_TIMEOUT_S + 120,
                "the second worker serving",
                0.5,
            )
            grown = pool_status(target)
            (worker,) = [w for w in grown.workers if w.worker_id != "default-0"]
            reasons = (_autoscale(running)["reason"], grown.scale_reason)
            nodes = {n["NodeID"]: n for n in fake_autoscaling_cluster.gpu_nodes()}
            wait_for(
                lambda: _no_client_failed(clients) and worker.worker_id in served_by,
                120,
                f"a stream on {worker.worker_id} (served so far by {sorted(served_by)})",
                0.2,
            )
        finally:
            stop.set()
        streams = [got for client in clients for got in client.result(timeout=600)]
    return Load(streams, worker.worker_id, worker.node_id, nodes, set(served_by), reasons)


def test_a_load_that_fills_the_worker_grows_the_pool_onto_a_node_the_autoscaler_launched(
    fake_autoscaling_cluster: FakeAutoscalingCluster, gpu_node: dict[str, Any], load: Load
) -> None:
    assert [r.startswith("scale out: ") for r in load.reasons] == [True, True], load.reasons
    assert set(load.gpu_nodes) == {gpu_node["NodeID"], load.grown_node}
    grown_node = load.gpu_nodes[load.grown_node]
    assert {k: grown_node["Resources"][k] for k in GPU_NODE_RESOURCES} == GPU_NODE_RESOURCES
    wait_for(
        lambda: fake_autoscaling_cluster.monitor_log().count(LAUNCH_LINE) == 2,
        30,
        "the monitor's second launch line",
        0.5,
    )
    assert load.served_by == {"default-0", load.grown}


def test_no_stream_of_the_load_is_lost_and_each_has_the_no_fault_output(load: Load) -> None:
    prompts = sorted(i for i, _ in load.streams)
    assert prompts == list(range(len(prompts)))  # every stream a client started came back
    # The offline engine with room for every prompt at once (the answer does not depend
    # on the batch it runs in).
    blocks = len(prompts) * -(-MAX_MODEL_LEN // BLOCK_SIZE)
    offline = LLM(
        model="tiny", block_size=BLOCK_SIZE, num_kv_blocks=blocks, max_model_len=MAX_MODEL_LEN
    )
    params = SamplingParams(max_tokens=LOAD_TOKENS, ignore_eos=True)
    want = [out.token_ids for out in offline.generate([load_prompt(i) for i in prompts], params)]
    for i, got in sorted(load.streams, key=lambda s: s[0]):
        assert got[-1].finish_reason == "length"
        assert tokens_of(got) == want[i], (
            f"stream {i} (served by {sorted({m.worker_id for m in got})})"
        )


def test_after_the_load_the_pool_shrinks_back_and_the_autoscaler_removes_the_node(
    fake_autoscaling_cluster: FakeAutoscalingCluster,
    gpu_node: dict[str, Any],
    pagefleet_on_gpu_node: RunningCluster,
    load: Load,
) -> None:
    running = pagefleet_on_gpu_node
    target = running.grpc_target
    wait_for(
        lambda: _autoscale(running)["target"] == 1, 120, "the idle pool's target back to 1", 0.5
    )
    assert _autoscale(running)["reason"].startswith("scale in: idle for ")
    wait_for(
        lambda: len(pool_status(target).workers) == 1, 120, f"{load.grown} drained and removed", 0.5
    )
    assert [w.worker_id for w in pool_status(target).workers] == ["default-0"]
    fake_autoscaling_cluster.wait_for_nodes(2, IDLE_TIMEOUT_S + 120)
    assert [n["NodeID"] for n in fake_autoscaling_cluster.gpu_nodes()] == [gpu_node["NodeID"]]
    wait_until_no_block_leaked(running.workers["default"])


def test_the_node_goes_once_the_worker_is_removed(
    fake_autoscaling_cluster: FakeAutoscalingCluster,
    gpu_node: dict[str, Any],
    pagefleet_on_gpu_node: RunningCluster,
) -> None:
    pagefleet_on_gpu_node.shutdown()
    fake_autoscaling_cluster.wait_for_nodes(1, IDLE_TIMEOUT_S + 120)
    assert fake_autoscaling_cluster.gpu_nodes() == []
