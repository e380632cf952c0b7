"""The ingress fed by the scheduler's view (no Ray): liveness, hung workers, preemption rate."""

from __future__ import annotations

import asyncio

from pagefleet.cluster.config import ClusterConfig
from pagefleet.cluster.ingress import Ingress
from pagefleet.scheduler.state import ViewUpdate, WorkerDelta
from pagefleet.worker.events import LoadReport, WorkerInfo


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
