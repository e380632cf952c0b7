"""Cluster scheduling policies as pure functions.

Used by the central scheduler and by workers alike, and testable without Ray:

- admission: the blocks a prompt needs (`blocks_for_prompt`) or the whole
  request up to its max_tokens (`full_claim`), and what a worker can still
  give beside what the requests already there will take (`claim_headroom`);
- eviction: how many cached blocks a worker should evict to stay above its
  free-block watermark (`blocks_to_evict`);
- migration: which request a worker short of blocks hands to which other
  worker of its pool (`choose_migration`);

The ingress wait queue (tenants' fair shares) is `scheduler.fair_queue`.
"""

from __future__ import annotations

from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from pagefleet.worker.block_table import request_claim
from pagefleet.worker.events import LoadReport
from pagefleet.worker.preemption import VictimCandidate, victim_order

AdmissionMode = Literal["full", "prompt"]
ADMISSION_MODES: tuple[str, ...] = get_args(AdmissionMode)


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


@dataclass(frozen=True)
class MigrationPolicy:
    """When a worker short of blocks hands a request to another worker of its pool.

    `margin_blocks`: the target must have room for the request plus this
    many blocks (its own running sequences grow too). `cooldown_s`: a
    request migrates at most once in this long (no ping-pong). `reserve_s`:
    blocks promised to a target stay counted against its room this long, until
    its reports show the moved request. `transfer`: True, the source hands
    the request's KV blocks to the target through the object store; False,
    the target recomputes them; "auto" (the default), whichever the target's
    own measurements make cheaper for this request (`transfer_is_cheaper`).
    """

    margin_blocks: int = 4
    cooldown_s: float = 10.0
    reserve_s: float = 2.0
    transfer: bool | str = "auto"

    def __post_init__(self) -> None:
        if self.margin_blocks < 0:
            raise ValueError(f"margin_blocks must be >= 0, got {self.margin_blocks}")
        if not self.cooldown_s >= 0:
            raise ValueError(f"cooldown_s must be >= 0, got {self.cooldown_s}")
        if not self.reserve_s >= 0:
            raise ValueError(f"reserve_s must be >= 0, got {self.reserve_s}")
        if self.transfer not in (True, False, "auto"):
            raise ValueError(f"transfer must be true, false or 'auto', got {self.transfer!r}")


@dataclass(frozen=True)
class Migration:
    """Move `request_id` from `source` to `target`, its KV blocks with it when `transfer`
    (else the target recomputes them); it needs `num_blocks` there."""

    request_id: str
    source: str
    target: str
    num_blocks: int
    transfer: bool = True


def choose_migration(
    source: LoadReport,
    targets: Sequence[LoadReport],
    block_size: int,
    policy: MigrationPolicy,
    *,
    recently_migrated: Container[str] = (),
    reserved: Mapping[str, int] | None = None,
) -> Migration | None:
    """The request a worker short of blocks should hand off, and where; None to keep all.

    Nothing moves unless `source.blocks_short > 0`. The victim order is the
    engine's (`worker.preemption.victim_order`): lowest priority, then most
    recently admitted, skipping requests in `recently_migrated` (their
    cooldown). The first victim that fits a target goes to the target with
    the most room. A target is another worker of the pool (the caller passes
    the live ones) that is not short itself and whose free + cached blocks,
    less the `reserved` blocks promised to it, cover the victim's blocks plus
    `policy.margin_blocks`.
    """
    if source.blocks_short <= 0 or not source.requests:
        return None
    reserved = reserved or {}
    room = {
        t.worker_id: t.num_allocatable - reserved.get(t.worker_id, 0) - policy.margin_blocks
        for t in targets
        if t.worker_id != source.worker_id and t.pool == source.pool and t.blocks_short <= 0
    }
    if not room:
        return None
    best = max(room, key=lambda w: (room[w], w))
    candidates = [
        VictimCandidate(r.request_id, r.priority, 0.0, r.admitted_seq, -(-r.num_tokens // block_size))
        for r in source.requests
        if r.request_id not in recently_migrated
    ]
    tokens = {r.request_id: r.num_tokens for r in source.requests}
    target = next(t for t in targets if t.worker_id == best)
    for victim in victim_order(candidates):
        if victim.num_blocks <= room[best]:
            if policy.transfer == "auto":
                transfer = transfer_is_cheaper(tokens[victim.request_id], block_size, target)
            else:
                transfer = bool(policy.transfer)
            return Migration(victim.request_id, source.worker_id, best, victim.num_blocks, transfer)
    return None


def transfer_is_cheaper(num_tokens: int, block_size: int, target: LoadReport) -> bool:
    """Whether moving a request of `num_tokens` to `target` by KV transfer beats recompute,
    by the target's own measurements (`LoadReport.kv_import_s_per_block` and
    `recompute_s_per_token`).

    A transfer imports the full blocks and recomputes the partial tail; a recompute
    prefills every token. Until the target has imported once (nothing measured),
    transfer: on CPU it measured 19-63x cheaper (docs/benchmarks.md section 16), and
    its first import gives the measurement.
    """
    if target.kv_import_s_per_block <= 0 or target.recompute_s_per_token <= 0:
        return True
    full = num_tokens // block_size
    by_transfer = (
        full * target.kv_import_s_per_block
        + (num_tokens - full * block_size) * target.recompute_s_per_token
    )
    return by_transfer < num_tokens * target.recompute_s_per_token


class ResourceExhausted(RuntimeError):
    """A bounded queue is full (maps to gRPC RESOURCE_EXHAUSTED / HTTP 429)."""

    code = "RESOURCE_EXHAUSTED"
