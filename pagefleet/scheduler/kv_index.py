"""The scheduler's KV index: which block hashes each worker holds, built from its KV events.

Per worker: the hashes of its pool (prefix cache) and of its offload tier,
and how consistent that is. Every KV batch carries the worker's incarnation
and a sequence number; a gap or an unknown incarnation makes the index ask
for a snapshot (all hashes the worker holds), and so does a periodic check.
Comparing a snapshot with what the events built gives the index drift
(blocks believed cached that the worker does not hold).

Per pool it counts each hash's copies, so eviction drops replicated
prefixes first and the last copy last (`kept_elsewhere`).
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable, Set
from dataclasses import dataclass

from pagefleet.worker.events import KVEventBatch

# KV event kinds of the pool itself; the others ("offload_*") are the offload tier's.
_POOL_EVENTS = ("stored", "removed")
Hashes = tuple[bytes, ...]


@dataclass(frozen=True)
class IndexChange:
    """What one KV batch changed in a worker's index, as subscribers apply it."""

    stored: Hashes
    removed: Hashes
    offload_stored: Hashes
    offload_removed: Hashes
    snapshot: bool  # the index is not whole (a gap, a new process): ask for a snapshot


class _WorkerIndex:
    __slots__ = ("checked_at", "drift_blocks", "hashes", "incarnation", "kv_seq", "offloaded", "pool")

    def __init__(self, pool: str, now: float) -> None:
        self.pool = pool
        self.incarnation: str | None = None
        self.kv_seq: int | None = None  # None: no consistent index yet, a snapshot is due
        self.hashes: set[bytes] = set()
        self.offloaded: set[bytes] = set()  # in the worker's offload tier (no pool copy counted)
        self.checked_at = now
        self.drift_blocks = 0


class KVIndex:
    """Every registered worker's held hashes, with copy counts per pool; see the module docstring."""

    def __init__(self) -> None:
        self._workers: dict[str, _WorkerIndex] = {}
        # Per pool, hash -> how many of its workers hold it.
        self._copies: dict[str, dict[bytes, int]] = {}
        # Counters for metrics: KV sequence gaps seen, snapshots applied.
        self.kv_gaps = 0
        self.snapshots = 0

    def register(self, worker_id: str, pool: str, now: float) -> None:
        """A worker (re)registered: a restarted one's batch sequence starts over, so its
        index is not consistent until its next snapshot."""
        index = self._workers.get(worker_id)
        if index is None:
            self._workers[worker_id] = _WorkerIndex(pool, now)
        else:
            index.kv_seq = None

    def remove(self, worker_id: str) -> None:
        """Forget a deregistered worker and its copies."""
        index = self._workers.pop(worker_id)
        self._count(index, (), tuple(index.hashes))

    def apply(self, worker_id: str, batch: KVEventBatch, now: float) -> IndexChange:
        """Apply one batch of the worker's KV events (its pool's and its offload tier's)."""
        index = self._workers[worker_id]
        pool_events = tuple(e for e in batch.events if e[0] in _POOL_EVENTS)
        tier_events = tuple(e for e in batch.events if e[0] not in _POOL_EVENTS)
        # Before _take_kv, which records the batch's incarnation as the worker's.
        off_stored, off_removed = _take_offload(index, batch, tier_events)
        stored, removed, snapshot = self._take_kv(
            index, dataclasses.replace(batch, events=pool_events), now
        )
        return IndexChange(stored, removed, off_stored, off_removed, snapshot)

    def check_due(self, worker_id: str, now: float, interval_s: float) -> bool:
        """Whether the worker's last drift check (snapshot) is `interval_s` old."""
        return now - self._workers[worker_id].checked_at >= interval_s

    def held(self, worker_id: str) -> Set[bytes]:
        """The hashes the worker holds in its pool, by the index (KeyError if unknown)."""
        return self._workers[worker_id].hashes

    def offloaded(self, worker_id: str) -> Set[bytes]:
        """The hashes in the worker's offload tier, by the index."""
        return self._workers[worker_id].offloaded

    def drift(self, worker_id: str) -> int:
        """Blocks believed cached that the worker did not hold at its last check."""
        return self._workers[worker_id].drift_blocks

    def total_drift(self) -> int:
        """`drift` summed over every worker."""
        return sum(index.drift_blocks for index in self._workers.values())

    def copies(self, pool: str, block_hash: bytes) -> int:
        """How many workers of the pool hold the hash."""
        return self._copies.get(pool, {}).get(block_hash, 0)

    def kept_elsewhere(self, worker_id: str, keeps: Callable[[str], bool]) -> frozenset[bytes]:
        """The worker's hashes that another worker of its pool holds and keeps (`keeps`:
        whether a worker may keep prefixes for others: live, not draining).

        With several holders exactly one keeps each hash (the highest
        `_keeper_rank`), so holders under pressure at once do not all drop it
        first: the last copy goes last. The rank is the worker's, not the
        hash's: the keeper of a prefix keeps all of its blocks, since a chain
        cut at one block loses every block after it to lookups.
        """
        index = self._workers[worker_id]
        copies = self._copies.get(index.pool, {})
        shared = {h for h in index.hashes if copies.get(h, 0) > 1}
        mine = _keeper_rank(worker_id)
        out: set[bytes] = set()
        for other, held in self._workers.items():
            if not shared:
                break
            # `keeps` last: judging a worker costs more than comparing ranks.
            if held.pool == index.pool and _keeper_rank(other) > mine and keeps(other):
                kept = shared & held.hashes  # set operations: C speed, the smaller side walked
                out |= kept
                shared -= kept
        return frozenset(out)

    def _take_kv(self, index: _WorkerIndex, batch: KVEventBatch, now: float) -> tuple[Hashes, Hashes, bool]:
        """Apply a batch to the worker's hash set: (stored, removed, snapshot wanted).

        Snapshots are published as the difference to what was indexed, so a
        subscriber never has to rebuild a worker's index from scratch.
        """
        fresh = batch.incarnation != index.incarnation
        if batch.reset:
            actual = {h for _, h in batch.events}
            before = set() if fresh else index.hashes
            # A drift check: what the events built against what the worker holds. A new
            # process starts from nothing, so it cannot drift.
            consistent = index.kv_seq is not None and not fresh
            index.drift_blocks = len(before - actual) if consistent else 0
            stored, removed = tuple(actual - index.hashes), tuple(index.hashes - actual)
            self._count(index, stored, removed)
            index.hashes = actual
            index.incarnation = batch.incarnation
            index.kv_seq = batch.seq
            index.checked_at = now
            self.snapshots += 1
            return stored, removed, False
        if fresh or index.kv_seq is None:
            # Events of a process whose index we never saw whole: apply them for what
            # they are worth, and ask for the full picture.
            removed_old: Hashes = ()
            if fresh:
                removed_old, index.hashes = tuple(index.hashes), set()
                self._count(index, (), removed_old)
            index.incarnation = batch.incarnation
            index.kv_seq = None
            stored, removed = self._apply_events(index, batch)
            return stored, removed_old + removed, True
        gap = batch.seq != index.kv_seq + 1
        if gap:
            self.kv_gaps += 1
        index.kv_seq = batch.seq
        stored, removed = self._apply_events(index, batch)
        return stored, removed, gap

    def _apply_events(self, index: _WorkerIndex, batch: KVEventBatch) -> tuple[Hashes, Hashes]:
        stored: list[bytes] = []
        removed: list[bytes] = []
        hashes = index.hashes
        copies = self._copies.setdefault(index.pool, {})
        for kind, block_hash in batch.events:
            if kind == "stored":
                if block_hash not in hashes:
                    hashes.add(block_hash)
                    copies[block_hash] = copies.get(block_hash, 0) + 1
                stored.append(block_hash)
            else:
                if block_hash in hashes:
                    hashes.discard(block_hash)
                    _uncount(copies, block_hash)
                removed.append(block_hash)
        return tuple(stored), tuple(removed)

    def _count(self, index: _WorkerIndex, stored: Hashes, removed: Hashes) -> None:
        copies = self._copies.setdefault(index.pool, {})
        for h in stored:
            copies[h] = copies.get(h, 0) + 1
        for h in removed:
            _uncount(copies, h)


def _take_offload(
    index: _WorkerIndex, batch: KVEventBatch, events: tuple[tuple[str, bytes], ...]
) -> tuple[Hashes, Hashes]:
    """Apply a batch's offload-tier events: (stored, removed) as published.

    A snapshot (`reset`) or a new process replaces the tier's set; the tier
    only lowers a worker's prefill cost, so a gap costs score, not correctness.
    """
    held = index.offloaded
    if batch.reset or batch.incarnation != index.incarnation:
        actual = {h for kind, h in events if kind == "offload_stored"}
        if not batch.reset:  # a new process: its events so far are all there is
            actual -= {h for kind, h in events if kind == "offload_removed"}
        stored, removed = tuple(actual - held), tuple(held - actual)
        index.offloaded = actual
        return stored, removed
    stored_l: list[bytes] = []
    removed_l: list[bytes] = []
    for kind, h in events:
        if kind == "offload_stored":
            held.add(h)
            stored_l.append(h)
        else:
            held.discard(h)
            removed_l.append(h)
    return tuple(stored_l), tuple(removed_l)


def _uncount(copies: dict[bytes, int], block_hash: bytes) -> None:
    left = copies.get(block_hash, 0) - 1
    if left > 0:
        copies[block_hash] = left
    else:
        copies.pop(block_hash, None)


def _keeper_rank(worker_id: str) -> tuple[int, str]:
    """Which holder keeps a duplicated hash: the highest rank (stable across processes)."""
    return zlib.crc32(worker_id.encode()), worker_id
