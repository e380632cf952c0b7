"""Scheduler policies: admission, eviction watermarks, preemption across workers, the wait queue."""

from __future__ import annotations

import pytest

from pagefleet.scheduler.policy import (
    ClusterWaitQueue,
    EvictionWatermarks,
    ResourceExhausted,
    blocks_for_prompt,
    blocks_to_evict,
    can_admit,
)
from pagefleet.worker.events import LoadReport
from pagefleet.worker.preemption import VictimCandidate


def report(
    worker_id: str = "w0", *, total: int = 100, free: int = 50, cached: int = 0
) -> LoadReport:
    return LoadReport(worker_id, "chat", 1, 0.0, total, free, total - free - cached, cached, 0)


def cand(rid: str, blocks: int, *, priority: int = 0, admitted: int = 0) -> VictimCandidate:
    return VictimCandidate(rid, priority, 0.0, admitted, blocks)


def test_prompt_needs_ceil_of_its_tokens_in_blocks() -> None:
    assert blocks_for_prompt(33, 16) == 3
    assert blocks_for_prompt(32, 16) == 2


def test_cached_blocks_are_not_needed_again() -> None:
    assert blocks_for_prompt(100, 16, matched_blocks=4) == 7 - 4


def test_fully_cached_prompt_still_computes_its_last_block() -> None:
    assert blocks_for_prompt(32, 16, matched_blocks=2) == 1


def test_empty_prompt_is_rejected() -> None:
    with pytest.raises(ValueError, match="num_tokens must be >= 1, got 0"):
        blocks_for_prompt(0, 16)


def test_admission_counts_evictable_cached_blocks() -> None:
    assert can_admit(report(free=2, cached=8), 10 * 16, 16)
    assert not can_admit(report(free=2, cached=7), 10 * 16, 16)


def test_admission_keeps_the_reserve() -> None:
    assert not can_admit(report(free=10), 10 * 16, 16, reserve_blocks=1)


def test_admission_credits_a_prefix_hit() -> None:
    assert can_admit(report(free=3), 10 * 16, 16, matched_blocks=7)


def test_no_eviction_above_the_low_watermark() -> None:
    assert blocks_to_evict(report(free=5, cached=50), EvictionWatermarks(0.05, 0.10)) == 0


def test_eviction_refills_the_free_list_to_the_high_watermark() -> None:
    assert blocks_to_evict(report(free=2, cached=50), EvictionWatermarks(0.05, 0.10)) == 8


def test_eviction_is_capped_by_cached_blocks() -> None:
    assert blocks_to_evict(report(free=0, cached=3), EvictionWatermarks(0.05, 0.20)) == 3


def test_watermarks_must_be_ordered() -> None:
    with pytest.raises(ValueError, match="low <= high"):
        EvictionWatermarks(0.3, 0.1)


def test_wait_queue_is_fifo_per_pool() -> None:
    queue: ClusterWaitQueue[str] = ClusterWaitQueue(4)
    queue.push("chat", "r1", "x")
    queue.push("batch", "r2", "y")
    queue.push("chat", "r3", "z")
    assert queue.pop("chat") == ("r1", "x")
    assert queue.pop("chat") == ("r3", "z")
    assert queue.pop("chat") is None
    assert len(queue) == 1


def test_wait_queue_past_its_bound_raises_resource_exhausted() -> None:
    queue: ClusterWaitQueue[int] = ClusterWaitQueue(2)
    queue.push("chat", "r1", 1)
    queue.push("chat", "r2", 2)
    with pytest.raises(ResourceExhausted, match="2 requests waiting") as info:
        queue.push("chat", "r3", 3)
    assert info.value.code == "RESOURCE_EXHAUSTED"
    assert queue.size("chat") == 2


def test_wait_queue_bound_is_per_pool() -> None:
    queue: ClusterWaitQueue[int] = ClusterWaitQueue(1)
    queue.push("chat", "r1", 1)
    queue.push("batch", "r2", 2)
    assert queue.size("batch") == 1


def test_aborted_request_leaves_the_wait_queue() -> None:
    queue: ClusterWaitQueue[int] = ClusterWaitQueue(2)
    queue.push("chat", "r1", 1)
    assert queue.remove("r1")
    assert "r1" not in queue
    assert not queue.remove("r1")
    queue.push("chat", "r1", 1)  # the slot and the id are free again


def test_request_cannot_wait_twice() -> None:
    queue: ClusterWaitQueue[int] = ClusterWaitQueue(2)
    queue.push("chat", "r1", 1)
    with pytest.raises(ValueError, match="already waiting"):
        queue.push("chat", "r1", 1)


def test_wait_queue_peek_shows_the_oldest_without_removing_it() -> None:
    queue: ClusterWaitQueue[str] = ClusterWaitQueue(4)
    queue.push("chat", "r1", "x")
    queue.push("chat", "r2", "y")
    assert queue.peek("chat") == ("r1", "x")
    assert queue.peek("chat") == ("r1", "x")
    assert queue.peek("batch") is None
    assert queue.size("chat") == 2


def test_wait_queue_get_finds_a_waiting_item_by_request_id() -> None:
    queue: ClusterWaitQueue[str] = ClusterWaitQueue(4)
    queue.push("chat", "r1", "x")
    assert queue.get("r1") == "x"
    queue.remove("r1")
    assert queue.get("r1") is None
