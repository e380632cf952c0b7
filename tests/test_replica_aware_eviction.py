"""Eviction aware of replicas: the scheduler names the blocks another worker of the pool
also holds, and the worker's pool evicts exactly those (unused ones) before LRU."""

from __future__ import annotations

from pagefleet.scheduler.state import ClusterState
from pagefleet.worker.block_pool import BlockPool
from pagefleet.worker.events import KVEventBatch, LoadReport, WorkerInfo

H = [bytes([i]) * 16 for i in range(6)]


def _state_with(holdings: dict[str, list[bytes]]) -> ClusterState:
    state = ClusterState(generation=1)
    for wid, hashes in holdings.items():
        state.register_worker(WorkerInfo(wid, "chat", 100))
        report = LoadReport(wid, "chat", 1, 0.0, 100, 50, 0, 50, 0, incarnation="p")
        state.push(report, KVEventBatch(wid, 1, tuple(("stored", h) for h in hashes), True, "p"))
    return state


def test_hints_name_only_blocks_another_worker_of_the_pool_holds() -> None:
    state = _state_with({"w0": [H[0], H[1], H[2]], "w1": [H[1], H[2], H[3]]})
    assert set(state.eviction_hints("w0", 10)) == {H[1], H[2]}
    assert len(state.eviction_hints("w0", 1)) == 1
    assert state.copies("chat", H[0]) == 1 and state.copies("chat", H[1]) == 2


def test_copies_follow_removals_and_restarts() -> None:
    state = _state_with({"w0": [H[0], H[1]], "w1": [H[1]]})
    report = LoadReport("w1", "chat", 2, 0.0, 100, 50, 0, 50, 0, incarnation="p")
    state.push(report, KVEventBatch("w1", 2, (("removed", H[1]),), incarnation="p"))
    assert state.eviction_hints("w0", 10) == ()
    fresh = LoadReport("w0", "chat", 1, 0.0, 100, 50, 0, 50, 0, incarnation="q")
    state.push(fresh, KVEventBatch("w0", 1, (), True, "q"))  # w0 restarted empty
    assert state.copies("chat", H[0]) == 0


def test_pool_evicts_the_named_unused_blocks_and_keeps_the_rest() -> None:
    pool = BlockPool(8, 4)
    blocks = pool.allocate(4)
    for b, h in zip(blocks, H, strict=False):
        pool.register(b, h)
    pool.free(blocks[1:])  # blocks 1-3 cached, block 0 still live
    assert pool.evict_hashes([H[0], H[2], H[5]]) == 1  # live, cached, unknown
    assert not pool.is_cached(H[2])
    assert pool.is_cached(H[0]) and pool.is_cached(H[1]) and pool.is_cached(H[3])
    pool.free(blocks[:1])
    stats = pool.stats()
    assert stats.free + stats.cached == stats.total and stats.evictions == 1
    pool.check_integrity()
