"""The ingress fed by the scheduler's view (no Ray): liveness, hung workers, preemption rate,
and the view merged from several scheduler shards."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from prometheus_client import generate_latest

from pagefleet.cluster.config import ClusterConfig
from pagefleet.cluster.fleet_view import FleetView
from pagefleet.cluster.ingress import Ingress
from pagefleet.cluster.metrics import IngressMetrics
from pagefleet.cluster.router import Router
from pagefleet.scheduler.messages import ViewUpdate, WorkerDelta
from pagefleet.worker.events import LoadReport, WorkerInfo
from pagefleet.worker.prefix_hash import hash_token_blocks


def _ingress() -> Ingress:
    config = ClusterConfig.from_dict({"pools": [{"name": "a"}]})
    return Ingress(config, {"a": [("w0", None), ("w1", None)]})


def _delta(worker_id: str, *, alive: bool = True, stalled: bool = False, seq: int = 1,
           preempted: int = 0) -> WorkerDelta:  # fmt: skip
    report = LoadReport(
        worker_id, "a", seq, 0.0, 64, 64, 0, 0, 0, preemptions={"recompute": preempted}
    )
    return WorkerDelta(WorkerInfo(worker_id, "a", 64), alive, report, stalled=stalled)


def _apply(ingress: Ingress, version: int, *deltas: WorkerDelta) -> None:
    ingress.fleet.apply(ViewUpdate(1, version, False, deltas))


def test_workers_enter_and_leave_routing_by_the_view() -> None:
    async def scenario() -> None:
        ingress = _ingress()
        assert ingress.live_workers() == {"a": 0}
        _apply(ingress, 2, _delta("w0"), _delta("w1"))
        assert ingress.live_workers() == {"a": 2}
        _apply(ingress, 3, _delta("w1", alive=False, seq=2))
        assert ingress.live_workers() == {"a": 1}
        assert ingress.router.workers("a", alive_only=True) == ["w0"]

    asyncio.run(scenario())


def test_only_a_hung_worker_makes_its_streams_leave() -> None:
    async def scenario() -> None:
        ingress = _ingress()
        _apply(ingress, 2, _delta("w0"), _delta("w1"))
        w0, w1 = ingress.slots.pool("a")
        _apply(ingress, 3, _delta("w0", alive=False, seq=2))  # late report: streams stay
        assert not w0.left.is_set()
        _apply(ingress, 4, _delta("w1", alive=False, stalled=True, seq=2))  # hung: they move
        assert w1.left.is_set()
        _apply(ingress, 5, _delta("w1", seq=3))  # progress again: back, with a fresh signal
        assert not w1.left.is_set() and ingress.live_workers() == {"a": 1}

    asyncio.run(scenario())


def test_preemptions_per_minute_come_from_the_reports() -> None:
    async def scenario() -> None:
        ingress = _ingress()
        _apply(ingress, 2, _delta("w0"), _delta("w1"))
        _apply(ingress, 3, _delta("w0", seq=2, preempted=3), _delta("w1", seq=2, preempted=2))
        assert ingress.preemptions_per_minute() == {"a": 5.0}

    asyncio.run(scenario())


# ----- membership: workers added and removed while serving --------------------------


def _scaling_ingress(metrics: IngressMetrics | None = None) -> tuple[Ingress, list[str]]:
    """Pool a started with w0; workers joining later are resolved by id (and recorded)."""
    config = ClusterConfig.from_dict({"pools": [{"name": "a"}]})
    resolved: list[str] = []

    def resolve(worker_id: str) -> str:
        resolved.append(worker_id)
        return f"handle-of-{worker_id}"

    return Ingress(config, {"a": [("w0", None)]}, metrics=metrics, resolve_worker=resolve), resolved


def test_a_worker_the_view_shows_first_gets_a_slot_and_joins_routing() -> None:
    async def scenario() -> None:
        ingress, resolved = _scaling_ingress()
        _apply(ingress, 2, _delta("w0"), _delta("w1"))
        assert resolved == ["w1"]
        assert [s.worker_id for s in ingress.slots.pool("a")] == ["w0", "w1"]
        assert ingress.slots["w1"].handle == "handle-of-w1"
        assert ingress.live_workers() == {"a": 2}
        assert ingress.router.workers("a", alive_only=True) == ["w0", "w1"]
        assert [w.worker_id for w in ingress.status()[0].workers] == ["w0", "w1"]
        # A worker of a pool this deployment does not serve gets none.
        other = WorkerDelta(WorkerInfo("x0", "elsewhere", 64), True, None)
        _apply(ingress, 3, other)
        assert resolved == ["w1"] and [s.worker_id for s in ingress.slots.all()] == ["w0", "w1"]
        assert ingress.router.workers("elsewhere", alive_only=True) == []

    asyncio.run(scenario())


def test_a_joining_worker_without_an_actor_stays_out_of_routing_until_it_resolves() -> None:
    async def scenario() -> None:
        config = ClusterConfig.from_dict({"pools": [{"name": "a"}]})
        handles: dict[str, str] = {}

        def resolve(worker_id: str) -> str:
            return handles[worker_id]  # KeyError: not visible yet

        ingress = Ingress(config, {"a": [("w0", None)]}, resolve_worker=resolve)
        _apply(ingress, 2, _delta("w0"), _delta("w1"))
        assert ingress.router.workers("a", alive_only=True) == ["w0"]
        handles["w1"] = "h1"
        _apply(ingress, 3, _delta("w1", seq=2))
        assert ingress.router.workers("a", alive_only=True) == ["w0", "w1"]
        assert ingress.slots["w1"].handle == "h1"

    asyncio.run(scenario())


def test_a_draining_worker_leaves_routing_but_keeps_its_streams() -> None:
    async def scenario() -> None:
        ingress, _ = _scaling_ingress()
        _apply(ingress, 2, _delta("w0"), _delta("w1"))
        _apply(ingress, 3, dataclasses.replace(_delta("w1", seq=2), draining=True))
        w1 = ingress.slots["w1"]
        assert not w1.alive and w1.draining and not w1.left.is_set()
        assert ingress.router.workers("a", alive_only=True) == ["w0"]
        assert ingress.status()[0].workers[1].draining is True
        await ingress.wait_ready(1.0)  # a draining worker is not waited for

    asyncio.run(scenario())


def test_a_removed_worker_loses_its_slot_router_entry_and_metric_series() -> None:
    async def scenario() -> None:
        metrics = IngressMetrics()
        ingress, _ = _scaling_ingress(metrics)
        _apply(ingress, 2, _delta("w0"), _delta("w1"))

        def series() -> set[str]:
            text = generate_latest(metrics.registry).decode()
            return {w for w in ("w0", "w1") if f'worker="{w}"' in text}

        assert series() == {"w0", "w1"}
        w1 = ingress.slots["w1"]
        _apply(ingress, 3, WorkerDelta(WorkerInfo("w1", "a", 64), False, None, reset=True, gone=True))
        assert [s.worker_id for s in ingress.slots.all()] == ["w0"]
        assert ingress.router.workers("a") == ["w0"]
        assert w1.left.is_set()  # a stream still on it (killed at a drain timeout) moves
        assert series() == {"w0"}
        ingress.slots.mark_dead(w1)  # a late failure of that stream brings no series back
        assert series() == {"w0"}

    asyncio.run(scenario())


# ----- a view merged from scheduler shards ----------------------------------------

PROMPT = list(range(100, 100 + 4 * 16))  # 4 full blocks


def _held(worker_id: str, pool: str, *hashes: bytes, reset: bool = False) -> WorkerDelta:
    return WorkerDelta(WorkerInfo(worker_id, pool, 64), True, None, hashes, reset=reset)


def _two_shard_view() -> tuple[FleetView, list[bytes]]:
    """Pool a on shard 0 (worker a0), pool b on shard 1 (worker b0), each holding PROMPT."""
    hashes = hash_token_blocks(PROMPT, 16)
    view = FleetView(Router(seed=0), lambda _d: None, shards=2)
    view.apply(ViewUpdate(10, 1, True, (_held("a0", "a", *hashes, reset=True),)), shard=0)
    view.apply(ViewUpdate(20, 1, True, (_held("b0", "b", *hashes, reset=True),)), shard=1)
    return view, hashes


def test_each_shard_has_its_own_cursor() -> None:
    view, _ = _two_shard_view()
    view.apply(ViewUpdate(20, 5, False, (_held("b0", "b"),)), shard=1)
    assert view.cursor(0) == (10, 1) and view.cursor(1) == (20, 5)
    assert (view.generation, view.version) == (10, 1)  # shard 0's
    with pytest.raises(ValueError, match=r"shard must be in \[0, 1\], got 2"):
        view.apply(ViewUpdate(30, 1, True, ()), shard=2)


def test_a_restarted_shard_rebuilds_only_its_own_workers_index() -> None:
    view, hashes = _two_shard_view()
    # Shard 1 restarts (new generation) and so far has b0's snapshot of two blocks.
    view.apply(ViewUpdate(21, 1, True, (_held("b0", "b", *hashes[:2], reset=True),)), shard=1)
    assert view.router.matched_blocks("b0", hashes) == 2
    assert view.router.matched_blocks("a0", hashes) == 4  # shard 0's pool untouched
    assert view.cursor(1) == (21, 1) and view.cursor(0) == (10, 1)


def test_a_restarted_shard_that_does_not_know_a_worker_yet_clears_it_but_keeps_it_routable() -> None:
    view, hashes = _two_shard_view()
    view.apply(ViewUpdate(21, 0, True, ()), shard=1)  # restarted, nobody registered yet
    assert view.router.matched_blocks("b0", hashes) == 0
    assert view.router.workers("b", alive_only=True) == ["b0"]
    assert view.router.matched_blocks("a0", hashes) == 4


def test_one_shard_snapshot_still_clears_the_whole_index() -> None:
    hashes = hash_token_blocks(PROMPT, 16)
    view = FleetView(Router(seed=0), lambda _d: None)
    view.apply(ViewUpdate(1, 2, False, (_held("a0", "a", *hashes), _held("b0", "b", *hashes))))
    view.apply(ViewUpdate(2, 1, True, (_held("a0", "a", *hashes[:1], reset=True),)))
    assert view.router.matched_blocks("a0", hashes) == 1
    assert view.router.matched_blocks("b0", hashes) == 0


def test_staleness_is_the_stalest_shards() -> None:
    view = FleetView(Router(seed=0), lambda _d: None, shards=2)
    view.apply(ViewUpdate(1, 0, True, ()), shard=0)
    assert view.staleness_s() == float("inf")  # shard 1 never answered
    view.apply(ViewUpdate(2, 0, True, ()), shard=1)
    assert view.staleness_s() < 1.0


# ----- routing decisions relayed between replicas through the scheduler ---------------


def test_a_replicas_decisions_reach_the_other_replicas_through_the_scheduler() -> None:
    from pagefleet.scheduler.state import ClusterState
    from pagefleet.worker.events import KVEventBatch

    state = ClusterState(report_timeout_s=3.0, generation=1)
    views = []
    for rid in ("r0", "r1"):
        router = Router(
            seed=0, on_routed=lambda _p, w, h, rid=rid: state.note_routed(rid, w, tuple(h))
        )
        views.append(FleetView(router, lambda _d: None, rid))
    for wid in ("w0", "w1"):
        state.register_worker(WorkerInfo(wid, "a", 64))
        report = LoadReport(wid, "a", 1, 0.0, 64, 64, 0, 0, 0)
        state.push(report, KVEventBatch(wid, 1, reset=True))
    for view in views:
        view.apply(state.updates_since(None, 0))
    zero, one = (v.router for v in views)
    hashes = zero.block_hashes("a", PROMPT)
    chosen = zero.route_hashes("a", hashes).worker_id
    assert state.route_notes == 1
    for view in views:
        view.apply(state.updates_since(view.generation, view.version))
    assert one.matched_blocks(chosen, hashes) == 4  # speculative there now
    # A note is no state: a snapshot carries none, and an unknown worker's is not published.
    assert not any(d.routed for d in state.snapshot().deltas)
    assert not state.note_routed("r0", "nobody", tuple(hashes))
