"""One cluster-wide view on a real local Ray: two ingress replicas on one port, the
scheduler as the only source of KV state, and faults of every part mid-traffic.

One cluster for the module: pool "default" with 2 CPU workers, 2 ingress replicas
sharing one gRPC port (SO_REUSEPORT). Tests that break something run last, each
healing what it broke (the drain of one replica, the very last, needs no healing);
after every test no block is leaked on any worker.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import ray
from cluster_fixtures import (
    MAX_MODEL_LEN,
    generate,
    local_cluster,
    offline_tiny,
    small_cluster_config,
    tokens_of,
    wait_for,
    wait_until_no_block_leaked,
    worker_stats,
)
from replica_streams import REPLICA_KEY, Stream, replicas_reached, stream_on

from pagefleet import LLM, SamplingParams
from pagefleet.cluster.app import RunningCluster
from pagefleet.cluster.client import build_request
from pagefleet.cluster.proto import pagefleet_pb2 as pb
from pagefleet.cluster.proto import pagefleet_pb2_grpc as pb_grpc
from pagefleet.worker.engine import EngineStats

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(300)]



@pytest.fixture(scope="module")
def cluster() -> Iterator[RunningCluster]:
    base = small_cluster_config()
    config = base.replace(server={"ingress_replicas": 2}, scheduler={"index_check_interval_s": 1.0})
    with local_cluster(config, grpc_port=0) as running:
        yield running


@pytest.fixture(scope="module")
def target(cluster: RunningCluster) -> str:
    return cluster.grpc_target


@pytest.fixture(scope="module")
def offline() -> LLM:
    return offline_tiny()


@pytest.fixture(autouse=True)
def nothing_leaked(cluster: RunningCluster) -> Iterator[None]:
    """After every test: on every worker no live block, and free + cached == total."""
    yield
    wait_until_no_block_leaked(cluster.workers["default"])


def _pid(replica_id: str) -> int:
    return int(replica_id.split("-", 1)[0])


def _long(offline: LLM, prompt: str) -> tuple[dict[str, Any], list[int]]:
    sampling = {"max_tokens": MAX_MODEL_LEN - 20, "ignore_eos": True}
    want = offline.generate(prompt, SamplingParams(**sampling))[0].token_ids
    return sampling, want


def _index_stats(cluster: RunningCluster) -> dict[str, int]:
    return dict(ray.get(cluster.scheduler.index_stats.remote(), timeout=30))


# ----- one view, two replicas ---------------------------------------------------


def test_a_prefix_cached_through_one_replica_is_hit_through_the_other(
    cluster: RunningCluster, target: str
) -> None:
    prefix = "Shared view: you are a helpful assistant. Answer briefly and politely."
    before = {
        wid: len(ray.get(cluster.scheduler.cached_hashes.remote(wid), timeout=30))
        for wid, _ in cluster.workers["default"]
    }
    first = stream_on(target, None, f"{prefix} question 0?", max_tokens=2)
    done = first.rest()
    assert done[-1].usage.cached_tokens == 0
    worker = done[-1].worker_id
    # The worker's KV events reach the scheduler with its next push; from there every
    # replica's long poll brings them at once (the pause covers that delivery).
    wait_for(
        lambda: len(ray.get(cluster.scheduler.cached_hashes.remote(worker), timeout=30))
        >= before[worker] + 2,
        30, "the prompt's blocks in the scheduler's index", 0.1,
    )
    time.sleep(1.0)
    other = stream_on(target, first.replica, f"{prefix} question 1?", avoid=True, max_tokens=2)
    second = other.rest()
    assert other.replica != first.replica
    assert second[-1].worker_id == done[-1].worker_id
    assert second[-1].usage.cached_tokens >= 8


def test_a_routing_decision_reaches_the_other_replica_before_the_workers_kv_events(
    cluster: RunningCluster, target: str
) -> None:
    prefix = [300 + (11 * i) % 250 for i in range(6 * 16)]  # 6 blocks no other test sends
    channel0, stub0 = _replica_channel(target, avoid="")
    with channel0:
        _, call = stub0.Abort.with_call(pb.AbortRequest(request_id="probe"), timeout=30)
        replica0 = dict(call.initial_metadata())[REPLICA_KEY]
        channel1, stub1 = _replica_channel(target, avoid=replica0)
        with channel1:
            notes = _index_stats(cluster)["route_notes"]
            first = stub0.Generate(
                build_request([*prefix, 1, 2], {"max_tokens": 40, "ignore_eos": True}), timeout=120
            )
            # Its route note is at the scheduler, and so at once with every replica's long
            # poll; the worker's KV events wait for its next push (every 0.2 s here).
            wait_for(lambda: _index_stats(cluster)["route_notes"] > notes, 10, "the route note", 0.005)
            second = list(stub1.Generate(build_request([*prefix, 3, 4], {"max_tokens": 2}), timeout=120))
            rest = list(first)
    # Without the note the other replica sees two idle workers without the prefix, and
    # picks one at random.
    assert second[-1].worker_id == rest[-1].worker_id


def test_index_drift_settles_to_zero_after_traffic(cluster: RunningCluster, target: str) -> None:
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: generate(target, f"drift check {i} " * 6, max_tokens=4), range(8)))
    before = _index_stats(cluster)["snapshots"]
    # Each worker is compared with a snapshot every index_check_interval_s (1 s here).
    wait_for(
        lambda: (lambda s: s["snapshots"] >= before + 4 and s["drift_blocks"] == 0)(
            _index_stats(cluster)
        ),
        30,
        "two drift checks per worker after the traffic, all with drift 0",
        0.2,
    )


# ----- migration and aborts across replicas -----------------------------------------

# Token-id prompts: 8 shared blocks (the prefix that pins them to one worker) and 8 of
# their own; with 96 tokens out, four of them need 8 + 4 x 32 = 136 of a worker's 96
# blocks, while the other worker has nothing to do. Each run has its own prefix: a
# moved stream's blocks stay cached on its target.
def _migration_prefix(run: int) -> list[int]:
    return [50 + (7 * i + 31 * run) % 200 for i in range(32)]


def _pinned_prompt(prefix: list[int], j: int) -> list[int]:
    return prefix + [260 + (13 * i + 17 * j) % 300 for i in range(32)]


def _all_workers_stats(cluster: RunningCluster) -> dict[str, EngineStats]:
    return {wid: worker_stats(cluster, wid) for wid, _ in cluster.workers["default"]}


@pytest.mark.parametrize("transfer", [True, False], ids=["by-transfer", "by-recompute"])
def test_a_worker_short_of_blocks_hands_a_stream_to_the_idle_worker_output_unchanged(
    cluster: RunningCluster, target: str, offline: LLM, transfer: bool
) -> None:
    prefix = _migration_prefix(int(transfer))
    prompts = [_pinned_prompt(prefix, j) for j in range(4)]
    sampling = {"max_tokens": MAX_MODEL_LEN - len(prompts[0]), "ignore_eos": True}
    want = [o.token_ids for o in offline.generate(prompts, SamplingParams(**sampling))]
    for scheduler in cluster.schedulers:
        assert ray.get(scheduler.set_migration_transfer.remote(transfer), timeout=30)
    before = ray.get(cluster.scheduler.migration_stats.remote(), timeout=30).get("default", 0)
    stats_before = _all_workers_stats(cluster)
    warm = generate(target, [*prefix, 1, 2, 3, 4], max_tokens=1)
    pinned = warm[-1].worker_id
    wait_for(
        lambda: len(ray.get(cluster.scheduler.cached_hashes.remote(pinned), timeout=30)) >= 8,
        30, "the shared prefix in the scheduler's index", 0.1,
    )
    time.sleep(1.0)  # every replica's view has it
    try:
        streams = [Stream(target, p, **sampling) for p in prompts]
        started = [s.first_token().worker_id for s in streams]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            done = list(pool.map(Stream.rest, streams))
    finally:
        for scheduler in cluster.schedulers:  # the default for the tests that follow
            ray.get(scheduler.set_migration_transfer.remote(True), timeout=30)
    assert started == [pinned] * 4, "prefix affinity put every stream on one worker"
    for got, expected in zip(done, want, strict=True):
        assert tokens_of(got) == expected and got[-1].finish_reason == "length"
    moved = [got for got in done if got[-1].worker_id != pinned]
    assert moved, "some stream ended on the other worker"
    # Tokens came from both workers: it moved mid-stream, not before it started.
    assert any(m.token_ids and m.worker_id == pinned for m in moved[0])
    after = ray.get(cluster.scheduler.migration_stats.remote(), timeout=30)["default"]
    assert after > before
    # GetStatus shows the hand-off: on the worker that gave it up, and for the pool.
    with grpc.insecure_channel(target) as channel:

        def in_status() -> dict[str, int]:
            (pool,) = pb_grpc.GenerationStub(channel).GetStatus(pb.StatusRequest(), timeout=30).pools
            return {"pool": pool.migrations, **{w.worker_id: w.migrations_out for w in pool.workers}}

        wait_for(lambda: in_status()[pinned] > 0 and in_status()["pool"] >= in_status()[pinned], 10,
                 "the migration in GetStatus", 0.2)  # fmt: skip
    stats = _all_workers_stats(cluster)

    def grew(worker_id: str, key: str) -> int:
        return int(getattr(stats[worker_id], key) - getattr(stats_before[worker_id], key))

    exported = sum(grew(w, "kv_blocks_exported") for w in stats)
    imported = sum(grew(w, "kv_blocks_imported") for w in stats)
    if transfer:
        # The blocks went along (the shared prefix's 8 and more); a target skips the
        # ones it holds already.
        assert 8 <= imported <= exported
        assert all(grew(w, "kv_import_failures") == 0 for w in stats)
    else:
        assert exported == imported == 0


def _replica_channel(target: str, avoid: str) -> tuple[grpc.Channel, pb_grpc.GenerationStub]:
    """A connection (one TCP connection, so one replica) to a replica other than `avoid`."""
    for _ in range(60):
        channel = grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
        s = pb_grpc.GenerationStub(channel)
        found, call = s.Abort.with_call(pb.AbortRequest(request_id="no such request"), timeout=30)
        assert not found.found
        if dict(call.initial_metadata())[REPLICA_KEY] != avoid:
            return channel, s
        channel.close()
    raise AssertionError(f"60 connections and all reached replica {avoid}")


def test_abort_sent_to_the_replica_without_the_stream_ends_it_with_abort(
    cluster: RunningCluster, target: str, offline: LLM
) -> None:
    prompt = "Aborted through the replica that does not hold this stream"
    sampling = {"max_tokens": 120, "ignore_eos": True}
    want = offline.generate(prompt, SamplingParams(**sampling))[0].token_ids
    stream = Stream(target, prompt, **sampling)
    first = stream.first_token()
    channel, other = _replica_channel(target, avoid=stream.replica)
    with channel:
        answer, call = other.Abort.with_call(pb.AbortRequest(request_id=first.request_id), timeout=30)
        assert dict(call.initial_metadata())[REPLICA_KEY] != stream.replica
    assert answer.found
    got = stream.rest()
    assert got[-1].finish_reason == "abort"
    streamed = tokens_of(got)
    assert len(streamed) < len(want) and streamed == want[: len(streamed)]
    # The autouse check: its blocks are free on every worker.


# ----- faults (each heals what it broke) ------------------------------------------


def test_hung_worker_leaves_routing_its_stream_resumes_elsewhere_and_its_copy_is_freed(
    cluster: RunningCluster, target: str, offline: LLM
) -> None:
    sampling, want = _long(offline, "A worker hangs while this stream runs")
    stream = Stream(target, "A worker hangs while this stream runs", **sampling)
    victim = stream.first_token().worker_id
    pid = int(ray.get(cluster.worker_handle(victim).info.remote(), timeout=30)["pid"])
    os.kill(pid, signal.SIGSTOP)
    try:
        # The stream must end while the victim is still stopped: it moved.
        got = stream.rest()
    finally:
        os.kill(pid, signal.SIGCONT)
    assert tokens_of(got) == want
    assert got[-1].finish_reason == "length"
    assert got[-1].worker_id != victim
    # Awake again, the victim aborts its copy (the autouse check sees its blocks
    # freed) and comes back into routing.
    wait_for(
        lambda: any(w.alive for w in ray.get(cluster.scheduler.get_view.remote()).workers
                    if w.worker_id == victim),
        30, f"{victim} back in routing", 0.2,
    )


def test_killed_ingress_replica_loses_only_its_streams_and_theirs_are_aborted(
    cluster: RunningCluster, target: str, offline: LLM
) -> None:
    sampling, want = _long(offline, "The surviving replica streams this")
    doomed = stream_on(target, None, "This stream dies with its replica", **sampling)
    doomed.first_token()
    survivor = stream_on(target, doomed.replica, "The surviving replica streams this", avoid=True, **sampling)
    survivor.first_token()
    os.kill(_pid(doomed.replica), signal.SIGKILL)
    got = survivor.rest()
    assert tokens_of(got) == want and got[-1].finish_reason == "length"
    with pytest.raises(grpc.RpcError):
        doomed.rest()
    # The workers abort the dead replica's requests (autouse check), and Serve
    # restarts the replica: fresh connections reach two replicas again.
    wait_for(lambda: replicas_reached(target) == 2, 120, "two live replicas after Serve restarted one", 1.0)


def test_killed_scheduler_leaves_streams_intact_and_the_view_rebuilds(
    cluster: RunningCluster, target: str, offline: LLM
) -> None:
    sampling, want = _long(offline, "The scheduler dies while this streams")
    streams = [
        stream_on(target, None, "The scheduler dies while this streams", **sampling)
        for _ in range(2)
    ]
    for s in streams:
        s.first_token()
    generation = ray.get(cluster.scheduler.generation.remote(), timeout=30)
    ray.kill(cluster.scheduler, no_restart=False)
    for s in streams:
        got = s.rest()
        assert tokens_of(got) == want and got[-1].finish_reason == "length"
    assert generate(target, "served meanwhile", max_tokens=3)[-1].finish_reason == "length"

    def rebuilt() -> bool:
        if ray.get(cluster.scheduler.generation.remote(), timeout=30) == generation:
            return False
        view = ray.get(cluster.scheduler.get_view.remote(), timeout=30)
        stats = _index_stats(cluster)
        return (
            sorted(w.worker_id for w in view.workers if w.alive) == ["default-0", "default-1"]
            and stats["snapshots"] >= 4
            and stats["drift_blocks"] == 0
        )

    wait_for(rebuilt, 60, "the restarted scheduler rebuilt from worker snapshots, drift 0", 0.5)
    assert generate(target, "served after the rebuild", max_tokens=3)[-1].finish_reason == "length"


def test_a_replica_scaled_down_hands_its_clients_to_the_other_while_its_streams_finish(
    cluster: RunningCluster, target: str, offline: LLM
) -> None:
    prompt = "One of two drains now"
    sampling, want = _long(offline, prompt)
    first = stream_on(target, None, prompt, **sampling)
    second = stream_on(target, first.replica, prompt, avoid=True, **sampling)
    for s in (first, second):
        s.first_token()
    # As Serve stops a replica it scales down (`__del__`); Serve picks which one.
    drained = cluster.ingress.drain_and_stop.remote(60.0, hand_off=True)
    stubs = [pb_grpc.GenerationStub(s.channel) for s in (first, second)]

    def served_by() -> set[str]:
        # A new call on each stream's own connection; none may be refused meanwhile.
        replicas = set()
        for stub in stubs:
            call = stub.Generate(build_request("a new call on an open channel", {"max_tokens": 1}), timeout=60)
            replicas.add(dict(call.initial_metadata())[REPLICA_KEY])
            assert list(call)[-1].finish_reason == "length"
        return replicas

    # Once the drain has begun, both connections' new calls reach the replica left.
    wait_for(lambda: len(served_by()) == 1, 30, "new calls on both channels served by one replica", 0.05)
    (left,) = served_by()
    assert left in {first.replica, second.replica}
    for s in (first, second):
        got = s.rest()
        assert tokens_of(got) == want and got[-1].finish_reason == "length"
    assert drained.result(timeout_s=90) == 0  # nothing had to be aborted
    # The module's last test: the drained replica stays up, stopped on purpose, until
    # the cluster shuts down (no restart to wait for).
