"""The scheduler actor on a real local Ray: naming, reports over msgpack, restart and re-registration."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

ray = pytest.importorskip("ray")

from pagefleet.cluster.app import start_local_ray, stop_local_ray  # noqa: E402
from pagefleet.scheduler.actor import (  # noqa: E402
    SCHEDULER_NAME,
    ReportAck,
    get_scheduler,
    start_scheduler,
)
from pagefleet.scheduler.messages import ViewUpdate  # noqa: E402
from pagefleet.scheduler.policy import EvictionWatermarks  # noqa: E402
from pagefleet.worker.actor import create_worker  # noqa: E402
from pagefleet.worker.config import EngineConfig  # noqa: E402
from pagefleet.worker.events import (  # noqa: E402
    KVEventBatch,
    LoadReport,
    RequestLoad,
    WorkerInfo,
)
from pagefleet.worker.sampling_params import SamplingParams  # noqa: E402
from pagefleet.worker.wire import WorkerRequest  # noqa: E402

pytestmark = pytest.mark.cluster

NAMESPACE = "pagefleet-test-scheduler"


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    started = not ray.is_initialized()
    if started:
        start_local_ray(num_cpus=2, log_to_driver=False)
    yield
    if started:
        stop_local_ray()  # SIGKILL: Ray's own stop waits on processes that ignore SIGTERM


@pytest.fixture
def scheduler(ray_session: None) -> Iterator[Any]:
    handle = start_scheduler(namespace=NAMESPACE, report_timeout_s=30.0)
    yield handle
    ray.kill(handle, no_restart=True)


def report(worker_id: str, seq: int = 1) -> bytes:
    return LoadReport(worker_id, "chat", seq, 0.0, 64, 60, 4, 0, 4).encode()


def no_events(worker_id: str, seq: int = 1) -> bytes:
    return KVEventBatch(worker_id, seq, reset=True).encode()


def wait_for_restart(handle: Any, old_generation: int) -> None:
    # ray.kill returns before the actor is gone; the handle's calls are retried
    # against the restarted actor, so poll until the new incarnation answers.
    deadline = time.monotonic() + 60
    while ray.get(handle.generation.remote(), timeout=60) == old_generation:
        assert time.monotonic() < deadline, "scheduler did not restart within 60 s"
        time.sleep(0.1)


def test_actor_is_found_by_name(scheduler: Any) -> None:
    found = get_scheduler(NAMESPACE)
    assert found is not None
    assert ray.get(found.generation.remote()) == ray.get(scheduler.generation.remote())
    assert SCHEDULER_NAME == "pagefleet-scheduler"


def test_starting_twice_returns_the_same_actor(scheduler: Any) -> None:
    again = start_scheduler(namespace=NAMESPACE)
    assert ray.get(again.generation.remote()) == ray.get(scheduler.generation.remote())


def test_registered_worker_reports_and_appears_in_the_view(scheduler: Any) -> None:
    generation = ray.get(scheduler.register_worker.remote(WorkerInfo("w0", "chat", 64)))
    ack = ray.get(scheduler.push.remote("w0", report("w0"), no_events("w0")))
    assert ack == ReportAck(generation, True)
    view = ray.get(scheduler.get_view.remote())
    assert [(w.worker_id, w.alive, w.report.free_blocks) for w in view.workers] == [
        ("w0", True, 60)
    ]


def test_unknown_worker_is_told_to_register(scheduler: Any) -> None:
    ack = ray.get(scheduler.push.remote("ghost", report("ghost"), no_events("ghost")))
    assert ack.registered is False


def test_restarted_scheduler_has_a_new_generation_and_rebuilds_from_re_registration(
    scheduler: Any,
) -> None:
    first = ray.get(scheduler.register_worker.remote(WorkerInfo("w0", "chat", 64)))
    ray.kill(scheduler, no_restart=False)
    wait_for_restart(scheduler, first)
    ack = ray.get(scheduler.push.remote("w0", report("w0", 2), no_events("w0")))
    assert ack.registered is False
    assert ack.generation != first
    assert ray.get(scheduler.get_view.remote()).workers == ()
    ray.get(scheduler.register_worker.remote(WorkerInfo("w0", "chat", 64)))
    assert ray.get(scheduler.push.remote("w0", report("w0", 3), no_events("w0"))).registered


def test_no_scheduler_in_an_empty_namespace(ray_session: None) -> None:
    assert get_scheduler("pagefleet-test-nobody-here") is None


def test_report_below_the_low_watermark_is_answered_with_blocks_to_evict(scheduler: Any) -> None:
    generation = ray.get(scheduler.register_worker.remote(WorkerInfo("w0", "chat", 64)))
    # 64 blocks, 1 free, 23 cached: under 5% free, so evict up to 10% (7 blocks) free.
    low = LoadReport("w0", "chat", 1, 0.0, 64, 1, 40, 23, 40).encode()
    assert ray.get(scheduler.push.remote("w0", low, no_events("w0"))) == ReportAck(generation, True, 6)


def test_ack_names_the_hashes_another_worker_keeps_when_the_worker_runs_low(scheduler: Any) -> None:
    shared, own = b"s" * 16, b"o" * 16
    for wid, hashes in (("d0", (shared, own)), ("d1", (shared,))):
        ray.get(scheduler.register_worker.remote(WorkerInfo(wid, "dup", 64)))
        half_free = LoadReport(wid, "dup", 1, 0.0, 64, 32, 0, 32, 0).encode()
        batch = KVEventBatch(wid, 1, tuple(("stored", h) for h in hashes), reset=True).encode()
        assert ray.get(scheduler.push.remote(wid, half_free, batch)).duplicated is None
    low = {wid: LoadReport(wid, "dup", 2, 0.0, 64, 1, 40, 23, 40).encode() for wid in ("d0", "d1")}
    acks = [ray.get(scheduler.push.remote(w, low[w], KVEventBatch(w, 2).encode())) for w in low]
    # One of the two keeps the shared block (nothing new to tell it); the other is told
    # to evict it first. Its own block is a last copy, named to neither.
    assert sorted((ack.duplicated for ack in acks), key=lambda d: d is None) == [(shared,), None]


def test_push_of_a_worker_short_of_blocks_is_answered_with_a_migration_order(
    scheduler: Any,
) -> None:
    for wid in ("w0", "w1"):
        ray.get(scheduler.register_worker.remote(WorkerInfo(wid, "chat", 64, block_size=4)))
    ray.get(scheduler.push.remote("w1", report("w1"), no_events("w1")))  # 60 free
    short = LoadReport(
        "w0", "chat", 1, 0.0, 64, 0, 64, 0, 64, num_running=2, blocks_short=3,
        requests=(RequestLoad("a@r", 0, 1, 40), RequestLoad("b@r", 0, 2, 40)),
    ).encode()
    ack = ray.get(scheduler.push.remote("w0", short, no_events("w0")))
    assert ack.migrate == (("b@r", "w1", True),)  # the most recently admitted
    assert ray.get(scheduler.migration_stats.remote()) == {"chat": 1}


def test_worker_evicts_what_the_scheduler_asks_between_steps(ray_session: None) -> None:
    # low = high = 1.0: any cached block is below the watermark, so every one is evicted.
    sched = start_scheduler(
        namespace=NAMESPACE, report_timeout_s=30.0, eviction=EvictionWatermarks(1.0, 1.0)
    )
    worker = create_worker(
        "evicting-worker",
        "chat",
        EngineConfig(model="tiny", block_size=4, num_kv_blocks=32, max_model_len=64),
        namespace=NAMESPACE,
        name="evicting-worker",
        report_interval_s=0.1,
    )
    try:
        prompt = list(range(3, 20))  # four full blocks, cached once the request ends
        stream = worker.generate.options(num_returns="streaming").remote(
            WorkerRequest("r1", tuple(prompt), SamplingParams(max_tokens=30, ignore_eos=True))
        )
        for ref in stream:
            ray.get(ref)
        deadline = time.monotonic() + 60
        while (stats := ray.get(worker.stats.remote())).evictions == 0:
            assert time.monotonic() < deadline, f"no eviction within 60 s: {stats}"
            time.sleep(0.1)
        assert stats.cached == 0 and stats.live == 0
        assert stats.free == stats.total
        # The evictions reach the scheduler's index as "removed" events.
        while ray.get(sched.cached_hashes.remote("evicting-worker")):
            assert time.monotonic() < deadline, "the scheduler's index still lists evicted blocks"
            time.sleep(0.1)
    finally:
        ray.kill(worker, no_restart=True)
        ray.kill(sched, no_restart=True)


def test_an_idle_worker_pushes_only_its_heartbeats_and_a_request_makes_it_report_again(
    ray_session: None,
) -> None:
    sched = start_scheduler(namespace=NAMESPACE, report_timeout_s=5.0)
    worker = create_worker(
        "idle-worker", "chat",
        EngineConfig(model="tiny", block_size=4, num_kv_blocks=32, max_model_len=64),
        namespace=NAMESPACE, name="idle-worker", report_interval_s=0.1, heartbeat_s=1.0,
    )  # fmt: skip

    def heard() -> tuple[bool, float | None]:
        workers = ray.get(sched.get_view.remote()).workers
        return (workers[0].alive, workers[0].last_report_at) if workers else (False, None)

    try:
        deadline = time.monotonic() + 60
        while heard()[1] is None:
            assert time.monotonic() < deadline, "the worker never reported"
            time.sleep(0.1)
        time.sleep(1.5)  # past the first pushes of its start
        pushes, end = set(), time.monotonic() + 3.5
        while time.monotonic() < end:
            alive, at = heard()
            assert alive, "an idle worker on heartbeats fell out of its 5 s deadline"
            pushes.add(at)
            time.sleep(0.05)
        # Every 0.1 s that would be 35 pushes; on 1 s heartbeats at most 5 (4 and the start).
        assert 2 <= len(pushes) <= 5, sorted(pushes)
        # A request is news again: its blocks reach the scheduler's index.
        stream = worker.generate.options(num_returns="streaming").remote(
            WorkerRequest("r1", tuple(range(3, 20)), SamplingParams(max_tokens=4, ignore_eos=True))
        )
        for ref in stream:
            ray.get(ref)
        while not ray.get(sched.cached_hashes.remote("idle-worker")):
            assert time.monotonic() < deadline, "the request's blocks never reached the scheduler"
            time.sleep(0.05)
    finally:
        ray.kill(worker, no_restart=True)
        ray.kill(sched, no_restart=True)


def test_pushed_kv_events_reach_a_subscriber_as_deltas(scheduler: Any) -> None:
    generation = ray.get(scheduler.register_worker.remote(WorkerInfo("w0", "chat", 64)))
    first: ViewUpdate = ray.get(scheduler.subscribe.remote(None, 0, 0.1))
    assert first.snapshot and first.generation == generation
    snap = KVEventBatch("w0", 1, (("stored", b"h" * 16),), reset=True, incarnation="p")
    ack = ray.get(scheduler.push.remote("w0", report("w0"), snap.encode()))
    assert ack.registered and not ack.snapshot
    update: ViewUpdate = ray.get(scheduler.subscribe.remote(generation, first.version, 5.0))
    assert [(d.info.worker_id, d.stored) for d in update.deltas] == [("w0", (b"h" * 16,))]


def test_an_abort_reaches_a_request_waiting_in_another_replicas_queue(scheduler: Any) -> None:
    """Two real ingresses follow the real scheduler and share one real worker (one seat):
    the ingress without the request relays its abort through the scheduler, and the one
    holding it waiting cancels it."""
    import asyncio

    from pagefleet.cluster.api import Target
    from pagefleet.cluster.config import ClusterConfig
    from pagefleet.cluster.ingress import Ingress

    config = ClusterConfig.from_dict(
        {
            "pools": [{"name": "a", "model": "tiny", "block_size": 16, "max_num_seqs": 1}],
            "scheduler": {"wait_queue_size": 8},
        }
    )
    worker = create_worker(
        "w0", "a", EngineConfig(model="tiny", block_size=16, num_kv_blocks=32, max_model_len=128,
                                max_num_seqs=1),
        namespace=NAMESPACE, name="relay-abort-worker", report_interval_s=0.1,
    )  # fmt: skip

    async def until(predicate: Any) -> None:
        async def poll() -> None:
            while not predicate():
                await asyncio.sleep(0.01)

        await asyncio.wait_for(poll(), 60)

    params = SamplingParams(max_tokens=100, ignore_eos=True)

    async def scenario() -> None:
        holder = Ingress(config, {"a": [("w0", worker)]}, scheduler=scheduler)
        other = Ingress(config, {"a": [("w0", worker)]}, scheduler=scheduler)
        holder.start()
        other.start()
        try:
            await until(lambda: holder.live_workers()["a"] and other.live_workers()["a"])
            tenant = holder.tenancy.authenticate(None)
            running = holder.submit(tenant, Target(), [1, 2, 3], params, request_id="running")
            assert (await asyncio.wait_for(anext(running), 60)).token_ids
            queued = holder.submit(tenant, Target(), [1, 2, 3], params, request_id="queued")
            first = asyncio.ensure_future(anext(queued))
            await until(lambda: holder.admission.waiting("a"))  # the worker's one seat is taken
            assert await asyncio.wait_for(other.abort("queued", "default"), 30)
            assert (await asyncio.wait_for(first, 30)).finish_reason == "abort"
            assert holder.admission.waiting("a") == 0
            assert await asyncio.wait_for(other.abort("running", "default"), 30)  # by the worker
            async for delta in running:
                last = delta
            assert last.finish_reason == "abort"
            # Found nowhere: every other replica passed the note, so the answer is prompt.
            started = time.monotonic()
            assert not await asyncio.wait_for(other.abort("no such request", "default"), 30)
            assert time.monotonic() - started < 1.5
        finally:
            await holder.close()
            await other.close()

    try:
        asyncio.run(scenario())
        deadline = time.monotonic() + 30
        while (stats := ray.get(worker.stats.remote())).live:
            assert time.monotonic() < deadline, f"blocks still live: {stats}"
            time.sleep(0.1)
        assert stats.free + stats.cached == stats.total
    finally:
        ray.kill(worker, no_restart=True)
