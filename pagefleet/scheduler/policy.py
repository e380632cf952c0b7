"""Cluster scheduling policies as pure functions.

Used by the central scheduler and by workers alike, and testable without Ray:

- admission: the blocks a prompt needs (`blocks_for_prompt`) or the whole
  request up to its max_tokens (`full_claim`), and what a worker can still
  give beside what the requests already there will take (`claim_headroom`);
- eviction: how many cached blocks a worker should evict to stay above its
  free-block watermark (`blocks_to_evict`);

The ingress wait queue (tenants' fair shares) is `scheduler.fair_queue`.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagefleet.worker.block_table import request_claim
from pagefleet.worker.events import LoadReport

ADMISSION_MODES = ("full", "prompt")


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


@dataclass(frozen=True)
class Claim:
    """What one request an ingress replica sent to a worker will take there at most."""

    priority: int
    blocks: int


def full_claim(
    num_tokens: int, max_tokens: int, n: int, block_size: int, *, matched_blocks: int = 0
) -> int:
    """New blocks a request takes by the time its `n` completions reach `max_tokens`.

    As in `blocks_for_prompt`, at most ``(num_tokens - 1) // block_size`` of
    them can be the `matched_blocks` a worker already holds.
    """
    reusable = min(max(matched_blocks, 0), (num_tokens - 1) // block_size)
    return request_claim(num_tokens, max_tokens, n, block_size) - reusable


def claim_headroom(
    report: LoadReport, own: list[Claim], origin: str, *, overcommit: float = 1.0
) -> int:
    """Blocks a new request may still claim on the worker (negative: overcommitted).

    The allocatable blocks, less what every request there will still take
    (`committed_blocks`), where this replica's part of the report (its
    `origin_claims`, possibly stale) is replaced by its exact `own` claims:
    requests it sent since the report count, those that finished since no
    longer do. `overcommit` > 1 lets claims exceed the pool by that factor
    (requests rarely all reach max_tokens; the engine preempts when they do).
    """
    slack = int((overcommit - 1.0) * report.total_blocks)
    mine = sum(c.blocks for c in own)
    reported_mine = report.origin_claims.get(origin, 0)
    return report.num_allocatable + slack - report.committed_blocks + reported_mine - mine


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
