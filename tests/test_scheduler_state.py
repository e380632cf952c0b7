"""ClusterState: registration, pushes, liveness (deadlines, hung workers), the KV index and its deltas."""

from __future__ import annotations

import dataclasses

import pytest

from pagefleet.scheduler.messages import WorkerDelta
from pagefleet.scheduler.policy import EvictionWatermarks, MigrationPolicy
from pagefleet.scheduler.state import ClusterState
from pagefleet.worker.events import KVEventBatch, LoadReport, RequestLoad, WorkerInfo


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def report(worker_id: str, seq: int = 1, *, free: int = 40, pool: str = "chat") -> LoadReport:
    # Busy (2 running) and making progress: each report has streamed more tokens.
    return LoadReport(
        worker_id, pool, seq, 0.0, 100, free, 100 - free - 10, 10, 60, num_running=2, progress=seq
    )


def send(state: ClusterState, r: LoadReport) -> bool:
    """Push a load report with an empty KV batch; False if the worker must register."""
    batch = KVEventBatch(r.worker_id, r.seq, incarnation=r.incarnation)
    return state.push(r, batch).registered


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def state(clock: FakeClock) -> ClusterState:
    s = ClusterState(report_timeout_s=3.0, generation=7, clock=clock)
    s.register_worker(WorkerInfo("w0", "chat", 100))
    s.register_worker(WorkerInfo("w1", "chat", 100))
    s.register_worker(WorkerInfo("b0", "batch", 50))
    return s


def test_registration_returns_the_generation_and_is_idempotent(state: ClusterState) -> None:
    assert state.register_worker(WorkerInfo("w0", "chat", 100)) == 7
    assert state.workers("chat") == ["w0", "w1"]


def test_worker_cannot_move_pools_by_registering_again(state: ClusterState) -> None:
    with pytest.raises(ValueError, match="registered in pool 'chat'"):
        state.register_worker(WorkerInfo("w0", "batch", 100))


def test_fresh_state_gets_a_random_generation() -> None:
    assert ClusterState().generation != ClusterState().generation


def test_report_from_unknown_worker_asks_it_to_register(state: ClusterState) -> None:
    assert send(state, report("ghost")) is False


def test_latest_report_is_kept(state: ClusterState) -> None:
    assert send(state, report("w0", 1, free=40))
    assert send(state, report("w0", 2, free=30))
    assert state.latest_report("w0").free_blocks == 30  # type: ignore[union-attr]


def test_out_of_order_report_is_dropped(state: ClusterState) -> None:
    send(state, report("w0", 5, free=30))
    send(state, report("w0", 4, free=90))
    assert state.latest_report("w0").free_blocks == 30  # type: ignore[union-attr]


def test_worker_that_misses_its_deadline_is_not_alive(
    state: ClusterState, clock: FakeClock
) -> None:
    clock.now += 2.0
    send(state, report("w0"))
    clock.now += 2.0
    assert state.alive_workers("chat") == ["w0"]
    assert not state.is_alive("w1")


def test_late_report_brings_a_worker_back(state: ClusterState, clock: FakeClock) -> None:
    clock.now += 10.0
    assert not state.is_alive("w1")
    send(state, report("w1"))
    assert state.is_alive("w1")


def test_push_refuses_a_kv_batch_of_another_worker(state: ClusterState) -> None:
    with pytest.raises(ValueError, match="KV batch of 'w1'"):
        state.push(report("w0"), KVEventBatch("w1", 1))


def test_view_is_a_snapshot_with_liveness_and_reports(
    state: ClusterState, clock: FakeClock
) -> None:
    send(state, report("w0"))
    view = state.view()
    assert view.generation == 7
    assert view.pools() == ["chat", "batch"]
    assert [w.worker_id for w in view.alive("chat")] == ["w0", "w1"]
    assert view.pool("chat")[0].report == report("w0")
    state.deregister_worker("w0")
    assert [w.worker_id for w in view.pool("chat")] == ["w0", "w1"]  # unchanged snapshot


def test_view_version_bumps_on_change(state: ClusterState) -> None:
    before = state.view().version
    send(state, report("w0"))
    assert state.view().version > before


def test_an_idle_workers_unchanged_push_renews_its_life_and_publishes_nothing(
    state: ClusterState, clock: FakeClock
) -> None:
    idle = LoadReport("w0", "chat", 1, 0.0, 100, 90, 0, 10, 60)
    assert state.push(idle, KVEventBatch("w0", 1, incarnation="")).published  # the first news
    version = state.view().version
    for seq in range(2, 6):  # heartbeats: the same load, no KV event
        clock.now += 2.0
        result = state.push(dataclasses.replace(idle, seq=seq, timestamp=float(seq)), KVEventBatch("w0", seq))
        assert result.registered and not result.published
        assert state.is_alive("w0")  # 8 s in all against a 3 s deadline
    assert state.view().version == version
    assert state.updates_since(7, version).deltas == ()
    # A new load is news, and so is a KV event on the same load.
    assert state.push(dataclasses.replace(idle, seq=6, free_blocks=89), KVEventBatch("w0", 6)).published
    stored = KVEventBatch("w0", 7, (("stored", b"h" * 16),))
    assert state.push(dataclasses.replace(idle, seq=7, free_blocks=89), stored).published
    assert [d.stored for d in state.updates_since(7, version).deltas] == [(), (b"h" * 16,)]


def test_a_heartbeat_after_a_missed_deadline_publishes_the_worker_alive_again(
    state: ClusterState, clock: FakeClock
) -> None:
    idle = LoadReport("w0", "chat", 1, 0.0, 100, 90, 0, 10, 60)
    state.push(idle, KVEventBatch("w0", 1))
    clock.now += 4.0
    assert state.tick() >= 1 and not state.is_alive("w0")
    version = state.view().version
    assert state.push(dataclasses.replace(idle, seq=2), KVEventBatch("w0", 2)).published
    [delta] = [d for d in state.updates_since(7, version).deltas if d.info.worker_id == "w0"]
    assert delta.alive


def test_deregistered_worker_leaves_the_view(state: ClusterState) -> None:
    assert state.deregister_worker("w1")
    assert not state.deregister_worker("w1")
    assert [w.worker_id for w in state.view().pool("chat")] == ["w0"]


def test_re_registration_forgets_the_old_processes_report(state: ClusterState) -> None:
    send(state, report("w0", 40, free=5))
    state.register_worker(WorkerInfo("w0", "chat", 100))  # the worker restarted
    send(state, report("w0", 1, free=77))
    assert state.latest_report("w0").free_blocks == 77  # type: ignore[union-attr]


def _full_report(worker_id: str, *, free: int, cached: int) -> LoadReport:
    # 100 blocks: `free` free, `cached` evictable, the rest in use.
    return LoadReport(worker_id, "chat", 1, 0.0, 100, free, 100 - free - cached, cached, 90)


def test_blocks_to_evict_refills_the_free_list_to_the_high_watermark(clock: FakeClock) -> None:
    s = ClusterState(report_timeout_s=3.0, clock=clock, eviction=EvictionWatermarks(0.05, 0.10))
    s.register_worker(WorkerInfo("w0", "chat", 100))
    assert s.blocks_to_evict("w0") == 0  # no report yet
    send(s, _full_report("w0", free=2, cached=30))
    assert s.blocks_to_evict("w0") == 8  # 2 free -> 10 free (10% of 100)


def test_blocks_to_evict_is_zero_above_the_low_watermark_or_without_watermarks(
    state: ClusterState, clock: FakeClock
) -> None:
    send(state, _full_report("w0", free=2, cached=30))
    assert state.blocks_to_evict("w0") == 0  # this state has no watermarks
    s = ClusterState(report_timeout_s=3.0, clock=clock, eviction=EvictionWatermarks(0.05, 0.10))
    s.register_worker(WorkerInfo("w0", "chat", 100))
    send(s, _full_report("w0", free=6, cached=30))
    assert s.blocks_to_evict("w0") == 0
    assert s.blocks_to_evict("ghost") == 0


# ----- KV index, deltas, hung workers -------------------------------------------

H = [bytes([i]) * 16 for i in range(8)]


def kv(worker_id: str, seq: int, *events: tuple[str, bytes], reset: bool = False, inc: str = "p1") -> KVEventBatch:
    return KVEventBatch(worker_id, seq, events, reset=reset, incarnation=inc)


def snapshot(worker_id: str, seq: int, *hashes: bytes, inc: str = "p1") -> KVEventBatch:
    return kv(worker_id, seq, *(("stored", h) for h in hashes), reset=True, inc=inc)


def test_first_events_of_an_incarnation_ask_for_a_snapshot(state: ClusterState) -> None:
    result = state.push(report("w0"), kv("w0", 1, ("stored", H[0])))
    assert result.registered and result.snapshot
    assert not state.push(report("w0", 2), snapshot("w0", 2, H[0], H[1])).snapshot
    assert state.cached_hashes("w0") == {H[0], H[1]}


def test_sequence_gap_asks_for_a_snapshot_and_counts_the_gap(state: ClusterState) -> None:
    state.push(report("w0"), snapshot("w0", 1, H[0]))
    assert not state.push(report("w0", 2), kv("w0", 2, ("stored", H[1]))).snapshot
    assert state.push(report("w0", 3), kv("w0", 4, ("removed", H[0]))).snapshot
    assert state.kv_gaps == 1


def test_snapshot_measures_drift_and_corrects_the_index(state: ClusterState) -> None:
    state.push(report("w0"), snapshot("w0", 1, H[0], H[1]))
    # The "removed" event of H[1] was lost; the next check finds one block of drift.
    state.push(report("w0", 2), snapshot("w0", 2, H[0]))
    assert state.index_drift() == 1
    assert state.cached_hashes("w0") == {H[0]}
    state.push(report("w0", 3), snapshot("w0", 3, H[0]))
    assert state.index_drift() == 0


def test_new_incarnation_drops_the_old_processes_hashes(state: ClusterState) -> None:
    state.push(report("w0"), snapshot("w0", 1, H[0], H[1]))
    state.push(report("w0"), snapshot("w0", 1, H[2], inc="p2"))
    assert state.cached_hashes("w0") == {H[2]}
    assert state.index_drift() == 0


def test_periodic_drift_check_asks_for_a_snapshot(clock: FakeClock) -> None:
    s = ClusterState(clock=clock, index_check_interval_s=5.0)
    s.register_worker(WorkerInfo("w0", "chat", 100))
    s.push(report("w0"), snapshot("w0", 1))
    assert not s.push(report("w0", 2), kv("w0", 2)).snapshot
    clock.now += 6.0
    assert s.push(report("w0", 3), kv("w0", 3)).snapshot


def test_busy_worker_without_progress_is_hung_and_leaves_routing(
    state: ClusterState, clock: FakeClock
) -> None:
    send(state, report("w0", 1))
    for seq in range(2, 6):  # it keeps reporting, but streams nothing
        clock.now += 1.0
        send(state, dataclasses.replace(report("w0", seq), progress=1))
    assert state.is_stalled("w0") and not state.is_alive("w0")
    clock.now += 1.0
    send(state, report("w0", 9))  # progress again
    assert state.is_alive("w0")


def test_silent_busy_worker_is_hung_before_its_report_deadline(clock: FakeClock) -> None:
    s = ClusterState(report_timeout_s=10.0, stall_timeout_s=3.0, clock=clock)
    s.register_worker(WorkerInfo("w0", "chat", 100))
    send(s, report("w0"))
    clock.now += 4.0  # SIGSTOP: no report at all
    assert s.is_stalled("w0") and not s.is_alive("w0")


def test_idle_worker_is_never_hung(state: ClusterState, clock: FakeClock) -> None:
    idle = dataclasses.replace(report("w0"), num_running=0)
    send(state, idle)
    clock.now += 2.5
    send(state, dataclasses.replace(idle, seq=2))
    clock.now += 2.5
    assert state.is_alive("w0")


def test_tick_publishes_a_liveness_change_caused_by_time(
    state: ClusterState, clock: FakeClock
) -> None:
    send(state, report("w0"))
    cursor = state.version
    clock.now += 4.0
    assert state.tick() == 3  # every worker missed its deadline
    update = state.updates_since(state.generation, cursor)
    assert not update.snapshot
    assert [(d.info.worker_id, d.alive) for d in update.deltas] == [
        ("w0", False), ("w1", False), ("b0", False)
    ]
    assert state.tick() == 0


def test_subscriber_gets_deltas_after_its_cursor(state: ClusterState) -> None:
    cursor = state.version
    state.push(report("w0"), snapshot("w0", 1, H[0]))
    state.push(report("w0", 2), kv("w0", 2, ("stored", H[1]), ("removed", H[0])))
    update = state.updates_since(state.generation, cursor)
    assert update.version == cursor + 2 and not update.snapshot
    assert [(d.stored, d.removed) for d in update.deltas] == [((H[0],), ()), ((H[1],), (H[0],))]
    assert state.updates_since(state.generation, update.version).deltas == ()


def test_fresh_or_lagging_subscriber_gets_a_snapshot(clock: FakeClock) -> None:
    s = ClusterState(clock=clock, log_size=2)
    s.register_worker(WorkerInfo("w0", "chat", 100))
    s.push(report("w0"), snapshot("w0", 1, H[0]))
    s.push(report("w0", 2), kv("w0", 2, ("stored", H[1])))
    for update in (s.updates_since(None, 0), s.updates_since(s.generation, 0)):
        assert update.snapshot
        assert [(d.info.worker_id, set(d.stored), d.reset) for d in update.deltas] == [
            ("w0", {H[0], H[1]}, True)
        ]


def test_a_worker_past_its_deadline_that_then_counts_as_hung_is_published_again(
    clock: FakeClock,
) -> None:
    s = ClusterState(report_timeout_s=2.0, stall_timeout_s=3.0, clock=clock)
    s.register_worker(WorkerInfo("w0", "chat", 100))
    send(s, report("w0"))
    clock.now += 2.5
    assert s.tick() == 1  # out of routing: no report in time
    cursor = s.version
    clock.now += 1.0
    assert s.tick() == 1  # now also hung: the ingress moves its streams
    assert [(d.alive, d.stalled) for d in s.updates_since(s.generation, cursor).deltas] == [
        (False, True)
    ]


# ----- migration ----------------------------------------------------------------


def test_a_short_worker_is_told_to_migrate_once_and_the_request_cannot_bounce_back(
    clock: FakeClock,
) -> None:
    state = ClusterState(
        report_timeout_s=3.0, generation=7, clock=clock,
        migration=MigrationPolicy(margin_blocks=0, cooldown_s=10.0, reserve_s=2.0),
    )
    state.register_worker(WorkerInfo("w0", "chat", 100, block_size=4))
    state.register_worker(WorkerInfo("w1", "chat", 100, block_size=4))
    request = RequestLoad("r@replica", 0, 5, 40)  # 10 blocks
    short = dataclasses.replace(report("w0", free=0), blocks_short=2, requests=(request,))
    send(state, short)
    send(state, report("w1", free=90))
    move = state.migration_order("w0")
    assert move is not None and (move.request_id, move.target) == ("r@replica", "w1")
    assert state.migrations == {"chat": 1}
    # Now short on w1 (where it moved), with w0 free: it stays, for the cooldown.
    send(state, dataclasses.replace(report("w1", 2, free=0), blocks_short=2, requests=(request,)))
    send(state, report("w0", 2, free=90))
    assert state.migration_order("w1") is None
    clock.now += 10.0
    send(state, dataclasses.replace(report("w1", 3, free=0), blocks_short=2, requests=(request,)))
    send(state, report("w0", 3, free=90))
    assert state.migration_order("w1") is not None


def test_no_migration_order_without_a_migration_policy(state: ClusterState) -> None:
    request = RequestLoad("r", 0, 1, 8)
    send(state, dataclasses.replace(report("w0", free=0), blocks_short=2, requests=(request,)))
    send(state, report("w1", free=90))
    assert state.migration_order("w0") is None


def test_an_abort_note_settles_when_found_or_when_every_other_live_replica_passed_it(
    state: ClusterState, clock: FakeClock
) -> None:
    for rid in ("origin", "r1", "r2", "gone"):
        state.note_replica(rid, state.generation, state.version)
    clock.now += 2.0
    for rid in ("origin", "r1", "r2"):
        state.note_replica(rid, state.generation, state.version)
    clock.now += 2.0  # "gone" is silent past report_timeout_s: not waited for
    note = state.publish_abort("3:ten:req", "origin")
    assert [d.key for d in state.updates_since(state.generation, state.version - 1).deltas] == ["3:ten:req"]
    assert state.abort_settled(note, "origin") is None
    state.note_replica("r1", state.generation, state.version)
    assert state.abort_settled(note, "origin") is None  # r2 has not passed it yet
    state.note_replica("r2", state.generation, state.version)
    assert state.abort_settled(note, "origin") is False
    found = state.publish_abort("3:ten:other", "origin")
    state.note_replica("r2", state.generation, state.version - 1, found=(found,))
    assert state.abort_settled(found, "origin") is True
    assert all(isinstance(d, WorkerDelta) for d in state.snapshot().deltas)  # notes are no state
    state.forget_abort(note)
    state.forget_abort(found)
    assert not state.aborts_pending


# ----- membership changes: draining before a removal ---------------------------------


def test_a_draining_worker_stays_alive_but_is_published_out_of_routing(state: ClusterState) -> None:
    send(state, report("w0"))
    cursor = state.version
    assert state.set_draining("w0")
    (delta,) = state.updates_since(7, cursor).deltas
    assert delta.info.worker_id == "w0" and delta.alive and delta.draining
    assert state.is_alive("w0")  # it still reports: its streams finish there
    assert [w.draining for w in state.view().workers] == [True, False, False]
    assert [d.draining for d in state.snapshot().deltas] == [True, False, False]
    send(state, report("w0", 2))  # later pushes keep saying so
    assert state.updates_since(7, state.version - 1).deltas[0].draining
    assert not state.set_draining("nope")


def test_no_migration_goes_to_a_draining_worker(clock: FakeClock) -> None:
    state = ClusterState(
        report_timeout_s=3.0, generation=7, clock=clock, migration=MigrationPolicy(margin_blocks=0)
    )
    state.register_worker(WorkerInfo("w0", "chat", 100, block_size=4))
    state.register_worker(WorkerInfo("w1", "chat", 100, block_size=4))
    request = RequestLoad("r@replica", 0, 5, 40)
    send(state, dataclasses.replace(report("w0", free=0), blocks_short=2, requests=(request,)))
    send(state, report("w1", free=90))
    state.set_draining("w1")
    assert state.migration_order("w0") is None
    state.set_draining("w1", False)
    assert state.migration_order("w0") is not None


def test_a_removed_workers_hashes_leave_the_index_with_it(state: ClusterState) -> None:
    h = b"h" * 16
    for wid in ("w0", "w1"):
        state.push(report(wid), KVEventBatch(wid, 1, (("stored", h),), True))
    assert state.copies("chat", h) == 2
    state.set_draining("w1")
    assert state.deregister_worker("w1")
    assert state.copies("chat", h) == 1 and state.workers("chat") == ["w0"]
    assert state.updates_since(7, state.version - 1).deltas[0].gone
