"""Cluster scheduling policies as pure functions (plus one small bounded queue).

Used by the central scheduler and by workers alike, and testable without Ray:

- admission: does a prompt fit a worker now (`can_admit`);
- eviction: how many cached blocks a worker should evict to stay above its
  free-block watermark (`blocks_to_evict`);
- a bounded cluster wait queue for when every worker of a pool is full; past
  its bound it refuses with RESOURCE_EXHAUSTED instead of growing a backlog.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Generic, TypeVar

from pagefleet.worker.events import LoadReport

_T = TypeVar("_T")

def blocks_for_prompt(num_tokens: int, block_size: int, matched_blocks: int = 0) -> int:
    """New blocks a prompt of `num_tokens` needs when `matched_blocks` are cached.

    The last prompt token is always computed (its logits are needed), so a
    fully cached prompt still needs its last block: at most
    ``(num_tokens - 1) // block_size`` blocks can come from the cache.
    """
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    total = -(-num_tokens // block_size)
    reusable = min(max(matched_blocks, 0), (num_tokens - 1) // block_size)
    return total - reusable


def can_admit(
    report: LoadReport,
    num_tokens: int,
    block_size: int,
    *,
    matched_blocks: int = 0,
    reserve_blocks: int = 0,
) -> bool:
    """Whether the worker can take the prompt now: free plus evictable blocks cover it and a reserve.

    The reserve keeps room for running sequences' next decode blocks, so an
    admission does not immediately force a preemption.
    """
    needed = blocks_for_prompt(num_tokens, block_size, matched_blocks)
    return report.num_allocatable - max(reserve_blocks, 0) >= needed


@dataclass(frozen=True)
class EvictionWatermarks:
    """Free-block fractions: below `low`, evict cached blocks until free reaches `high`."""

    low: float = 0.05
    high: float = 0.10

    def __post_init__(self) -> None:
        if not 0.0 <= self.low <= self.high <= 1.0:
            raise ValueError(f"need 0 <= low <= high <= 1, got low={self.low}, high={self.high}")


def blocks_to_evict(report: LoadReport, marks: EvictionWatermarks) -> int:
    """Cached blocks to evict now to keep the worker's free list above its watermark.

    Eviction normally happens lazily when a block is needed; evicting a little
    ahead keeps the allocation path short under bursts. Never more than the
    cached blocks there are.
    """
    total = report.total_blocks
    if total <= 0 or report.free_blocks >= marks.low * total:
        return 0
    target = int(marks.high * total + 0.999999)  # ceil without float surprises
    return max(0, min(report.cached_blocks, target - report.free_blocks))


class ResourceExhausted(RuntimeError):
    """A bounded queue is full (maps to gRPC RESOURCE_EXHAUSTED / HTTP 429)."""

    code = "RESOURCE_EXHAUSTED"


class ClusterWaitQueue(Generic[_T]):
    """Bounded FIFO of requests waiting for a pool whose workers are all full.

    The bound is per pool, so one saturated pool cannot starve another of
    queue space.
    """

    def __init__(self, max_size: int) -> None:
        if max_size < 0:
            raise ValueError(f"max_size must be >= 0, got {max_size}")
        self.max_size = max_size
        self._queues: dict[str, OrderedDict[str, _T]] = {}
        self._pool_of: dict[str, str] = {}

    def push(self, pool: str, request_id: str, item: _T) -> None:
        """Enqueue; raises ResourceExhausted when the pool's queue holds `max_size` requests."""
        if request_id in self._pool_of:
            raise ValueError(f"request {request_id!r} is already waiting")
        queue = self._queues.setdefault(pool, OrderedDict())
        if len(queue) >= self.max_size:
            raise ResourceExhausted(
                f"pool {pool!r}: wait queue is full ({self.max_size} requests waiting); retry later"
            )
        queue[request_id] = item
        self._pool_of[request_id] = pool

    def pop(self, pool: str) -> tuple[str, _T] | None:
        """The pool's oldest waiting request, or None."""
        queue = self._queues.get(pool)
        if not queue:
            return None
        request_id, item = queue.popitem(last=False)
        del self._pool_of[request_id]
        return request_id, item

    def peek(self, pool: str) -> tuple[str, _T] | None:
        """The pool's oldest waiting request without removing it, or None."""
        queue = self._queues.get(pool)
        if not queue:
            return None
        request_id = next(iter(queue))
        return request_id, queue[request_id]

    def get(self, request_id: str) -> _T | None:
        """The item of a waiting request, or None if it is not waiting."""
        pool = self._pool_of.get(request_id)
        return None if pool is None else self._queues[pool][request_id]

    def remove(self, request_id: str) -> bool:
        """Drop a waiting request (client aborted); False if it was not waiting."""
        pool = self._pool_of.pop(request_id, None)
        if pool is None:
            return False
        del self._queues[pool][request_id]
        return True

    def size(self, pool: str) -> int:
        """Requests waiting for `pool`."""
        return len(self._queues.get(pool, ()))

    def __len__(self) -> int:
        return len(self._pool_of)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._pool_of
