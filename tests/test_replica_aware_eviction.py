"""Eviction aware of replicas: the scheduler tells each worker which of its hashes another
live worker of the pool keeps, and the worker's pool evicts those cached blocks before the
last copies of a prefix, LRU within each class, on allocation and ahead of need alike."""

from __future__ import annotations

import zlib

from pagefleet.scheduler.policy import EvictionWatermarks
from pagefleet.scheduler.state import DUPLICATES_INTERVAL_S, ClusterState, PushResult
from pagefleet.worker.block_pool import BlockPool
from pagefleet.worker.events import KVEventBatch, LoadReport, WorkerInfo

H = [bytes([i]) * 16 for i in range(8)]


def _report(wid: str, seq: int, free: int, incarnation: str = "p") -> LoadReport:
    return LoadReport(wid, "chat", seq, 0.0, 100, free, 0, 100 - free, 0, incarnation=incarnation)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _state_with(
    holdings: dict[str, list[bytes]], *, replica_aware: bool = True, clock: Clock | None = None
) -> ClusterState:
    marks = EvictionWatermarks(0.05, 0.10, replica_aware)
    state = ClusterState(generation=1, eviction=marks, clock=clock or Clock(), report_timeout_s=1e9)
    for wid, hashes in holdings.items():
        state.register_worker(WorkerInfo(wid, "chat", 100))
        batch = KVEventBatch(wid, 1, tuple(("stored", h) for h in hashes), True, "p")
        state.push(_report(wid, 1, 50), batch)
    return state


def _keeper(holders: list[str]) -> str:
    return max(holders, key=lambda w: (zlib.crc32(w.encode()), w))


def test_duplicates_are_shared_hashes_each_kept_by_exactly_one_holder() -> None:
    holders = {"w0": [H[0], H[1], H[2]], "w1": [H[1], H[2], H[3]], "w2": [H[2]]}
    state = _state_with(holders)
    for h in (H[1], H[2]):
        names = [w for w, hs in holders.items() if h in hs]
        keepers = [w for w in names if h not in state.duplicated_hashes(w)]
        assert keepers == [_keeper(names)]  # the others may drop it first
    # One keeper for every hash two workers share: a prefix's chain stays whole there.
    lower = "w1" if _keeper(["w0", "w1"]) == "w0" else "w0"
    assert {H[1], H[2]} <= state.duplicated_hashes(lower)
    assert H[0] not in state.duplicated_hashes("w0")  # w0's alone: a last copy
    assert state.copies("chat", H[0]) == 1 and state.copies("chat", H[2]) == 3


def test_copies_follow_removals_and_restarts() -> None:
    state = _state_with({"w0": [H[0], H[1]], "w1": [H[1]]})
    state.push(_report("w1", 2, 50), KVEventBatch("w1", 2, (("removed", H[1]),), incarnation="p"))
    assert state.duplicated_hashes("w0") == frozenset()
    state.push(_report("w0", 1, 50, "q"), KVEventBatch("w0", 1, (), True, "q"))  # restarted empty
    assert state.copies("chat", H[0]) == 0


def test_an_ack_names_duplicates_only_when_the_worker_runs_low_and_they_changed() -> None:
    clock = Clock()
    state = _state_with({"w0": [H[1], H[2]], "w1": [H[1], H[2]]}, clock=clock)
    holder = "w0" if _keeper(["w0", "w1"]) == "w1" else "w1"  # the one that drops them first
    keeper = "w1" if holder == "w0" else "w0"

    def push(wid: str, seq: int, free: int, events: tuple[tuple[str, bytes], ...] = ()) -> PushResult:
        return state.push(_report(wid, seq, free), KVEventBatch(wid, seq, events, incarnation="p"))

    assert push(holder, 2, 50).duplicated is None  # half free: no news
    low = push(holder, 3, 3)
    assert low.duplicated is not None and set(low.duplicated) == {H[1], H[2]}
    assert low.evict_blocks == 7
    clock.now += DUPLICATES_INTERVAL_S
    assert push(holder, 4, 3).duplicated is None  # unchanged: the worker keeps what it has
    push(keeper, 2, 50, (("removed", H[2]),))
    assert push(holder, 5, 3).duplicated is None  # changed, but computed too recently
    clock.now += DUPLICATES_INTERVAL_S
    assert push(holder, 6, 3).duplicated == (H[1],)


def test_switched_off_the_acks_name_no_duplicates() -> None:
    state = _state_with({"w0": [H[1]], "w1": [H[1]]}, replica_aware=False)
    for wid in ("w0", "w1"):
        result = state.push(_report(wid, 2, 3), KVEventBatch(wid, 2, (), incarnation="p"))
        assert result.duplicated is None and result.evict_blocks == 7


def _pool_with_cached(n: int) -> tuple[BlockPool, list[int]]:
    """A pool of `n` blocks, all cached under H[0..n), released in id order (block 0 is LRU)."""
    pool = BlockPool(n, 4)
    blocks = pool.allocate(n)
    for b, h in zip(blocks, H, strict=False):
        pool.register(b, h)
    pool.free(blocks)
    return pool, blocks


def test_allocation_evicts_duplicated_blocks_before_last_copies() -> None:
    pool, blocks = _pool_with_cached(6)
    pool.mark_duplicated([H[4], H[2]])
    assert pool.allocate(3) == [blocks[2], blocks[4], blocks[0]]  # duplicates LRU, then LRU
    assert not pool.is_cached(H[2]) and not pool.is_cached(H[4]) and not pool.is_cached(H[0])
    assert pool.stats().duplicate_evictions == 2 and pool.stats().evictions == 3
    pool.check_integrity()


def test_the_last_copy_of_a_hot_prefix_outlives_colder_duplicates() -> None:
    pool, _ = _pool_with_cached(4)
    pool.touch([H[0]])  # the hot prefix, most recently used
    pool.mark_duplicated([H[1], H[2], H[3]])
    assert pool.evict_cached(3) == 3
    assert pool.is_cached(H[0])
    pool.mark_duplicated([])  # nothing duplicated: plain LRU again
    pool.check_integrity()


def test_unmarking_moves_blocks_back_among_the_last_copies() -> None:
    pool, _ = _pool_with_cached(4)
    pool.mark_duplicated([H[3]])
    pool.mark_duplicated([H[1]])  # the scheduler's latest word replaces the last
    assert pool.is_duplicated(H[1]) and not pool.is_duplicated(H[3])
    assert pool.evict_cached(2) == 2
    assert not pool.is_cached(H[1]) and not pool.is_cached(H[0])
    pool.check_integrity()


def test_a_live_duplicated_block_joins_the_duplicates_when_released() -> None:
    pool = BlockPool(4, 4)
    blocks = pool.allocate(3)
    for b, h in zip(blocks, H, strict=False):
        pool.register(b, h)
    pool.mark_duplicated([H[2], H[7]])  # H[7] is not held here: ignored
    assert not pool.is_duplicated(H[7])
    pool.free(blocks)
    assert pool.allocate(2) == [3, blocks[2]]  # the free block, then the duplicate
    pool.check_integrity()


def test_a_duplicated_hash_evicted_and_stored_again_is_a_last_copy_until_told_otherwise() -> None:
    pool, _ = _pool_with_cached(2)
    pool.mark_duplicated([H[1]])
    assert pool.evict_cached(1) == 1 and not pool.is_cached(H[1])
    (b,) = pool.allocate(1)
    pool.register(b, H[1])
    pool.free([b])
    assert not pool.is_duplicated(H[1])
    pool.check_integrity()
    assert pool.stats().free + pool.stats().cached == pool.stats().total


def test_a_draining_worker_keeps_no_prefix_for_the_others() -> None:
    state = _state_with({"w0": [H[1]], "w1": [H[1]]})
    keeper = _keeper(["w0", "w1"])
    other = "w1" if keeper == "w0" else "w0"
    assert state.duplicated_hashes(other) == {H[1]}
    state.set_draining(keeper)  # about to be removed: its copy is no copy to count on
    assert state.duplicated_hashes(other) == frozenset()
