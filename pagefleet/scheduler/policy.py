"""Cluster scheduling policies as pure functions.

Used by the central scheduler and by workers alike, and testable without Ray:

- admission: does a prompt fit a worker now (`can_admit`);
- eviction: how many cached blocks a worker should evict to stay above its
  free-block watermark (`blocks_to_evict`);

The ingress wait queue (tenants' fair shares) is `scheduler.fair_queue`.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagefleet.worker.events import LoadReport


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
    """Free-block fractions: below `low`, evict cached blocks until free reaches `high`.

    `replica_aware`: tell each worker which of its hashes another live worker of
    its pool also holds, so that every eviction (ahead of need and on
    allocation) takes those before the last copies of a prefix; off: plain LRU.
    """

    low: float = 0.05
    high: float = 0.10
    replica_aware: bool = True

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
