"""The central scheduler's view of the cluster: a plain class, wrapped by the Ray actor.

This is the cluster's one source of truth for KV state. Workers register
(idempotently) and then push, on an interval, a load report and the KV
events (blocks stored / removed) since their previous push. Per worker the
state keeps its latest report (free / live / cached / peak blocks, queues),
its liveness and the set of block hashes it holds (the prefix index).

Every KV batch carries the worker's incarnation and a sequence number. A gap
or an unknown incarnation makes the state ask that worker for a snapshot
(all hashes it holds), and so does a periodic check: comparing a snapshot
with what the events built gives the index drift (blocks believed cached
that the worker does not hold), exported so operators see it settle at 0.

Liveness has three rules, evaluated on the scheduler's clock:
- no push for `report_timeout_s`: dead (out of routing until it pushes again);
- work (running or waiting requests) but no progress (tokens streamed) for
  `stall_timeout_s`: hung, out of routing; the ingress moves its streams;
- otherwise alive.

Every change is a versioned `WorkerDelta`; subscribers (ingress replicas)
ask for the deltas after their cursor and get a snapshot instead when they
start, fall behind the bounded log, or see a new generation (a restarted
scheduler). The `generation` identifies this scheduler incarnation: after a
restart it changes, and workers seeing a new generation (or being told they
are unknown) register again and send a snapshot, which rebuilds the view.

Session pins (`session_pins`) ride the same log: an ingress replica's new pin
is kept here (bounded per pool, expiring) and relayed to every replica as a
`SessionPin`; a snapshot carries the live ones. A restarted scheduler starts
with none; the replicas keep theirs, and tell it each session's pin again as
the session is pinned anew or its pin is refreshed.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
import zlib
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from pagefleet.scheduler.liveness import LifeSigns, Liveness, LivenessRule
from pagefleet.scheduler.messages import AbortNote, ClusterView, ViewUpdate, WorkerDelta, WorkerView
from pagefleet.scheduler.policy import (
    EvictionWatermarks,
    Migration,
    MigrationPolicy,
    blocks_to_evict,
    choose_migration,
)
from pagefleet.scheduler.session_pins import DEFAULT_MAX_PER_POOL, SessionPin, SessionPins
from pagefleet.worker.events import KVEventBatch, LoadReport, WorkerInfo

# Deltas kept for subscribers that are behind; older cursors get a snapshot.
DEFAULT_LOG_SIZE = 50_000
# A dead ingress replica is announced to workers this long, then forgotten.
DEAD_REPLICA_MEMORY_S = 300.0
# Below this share of free blocks a worker may soon evict: its acks carry which of
# its hashes are duplicated elsewhere (when that changed). Above it nothing is sent.
DUPLICATES_BELOW_FREE = 0.25
# ...computed at most this often per worker.
DUPLICATES_INTERVAL_S = 0.4


@dataclass(frozen=True)
class PushResult:
    """What the state wants from a worker after its push."""

    registered: bool  # False: unknown worker, it must register (and then send a snapshot)
    snapshot: bool = False  # send all held hashes next time (gap, new incarnation, or drift check)
    evict_blocks: int = 0  # cached blocks to evict now (below the free-block watermark)
    # Its hashes another live worker of the pool keeps: evict them before last
    # copies. None: no change since the last push (keep what you have).
    duplicated: tuple[bytes, ...] | None = None


class _Entry:
    __slots__ = (
        "checked_at",
        "draining",
        "drift_blocks",
        "duplicated_at",
        "duplicated_sent",
        "hashes",
        "incarnation",
        "info",
        "kv_seq",
        "offloaded",
        "published",
        "report",
        "signs",
    )

    def __init__(self, info: WorkerInfo, now: float) -> None:
        self.info = info
        self.report: LoadReport | None = None
        self.signs = LifeSigns(now)
        self.published = Liveness.LIVE  # the verdict its latest delta carried
        self.incarnation: str | None = None
        self.kv_seq: int | None = None  # None: no consistent index yet, a snapshot is due
        self.hashes: set[bytes] = set()
        self.offloaded: set[bytes] = set()  # in the worker's offload tier (no pool copy counted)
        self.checked_at = now
        self.drift_blocks = 0
        self.draining = False  # being removed: out of routing, its streams finish
        # As the worker last heard it; a worker starts (and registers) with none.
        self.duplicated_sent: frozenset[bytes] = frozenset()
        self.duplicated_at = -float("inf")


class ClusterState:
    """Workers per pool, their reports, liveness and held hashes; see the module docstring."""

    def __init__(
        self,
        *,
        report_timeout_s: float = 3.0,
        stall_timeout_s: float = 3.0,
        index_check_interval_s: float = 10.0,
        generation: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        eviction: EvictionWatermarks | None = None,
        log_size: int = DEFAULT_LOG_SIZE,
        migration: MigrationPolicy | None = None,
        session_pins: int = DEFAULT_MAX_PER_POOL,
    ) -> None:
        """`session_pins`: how many session pins to keep per pool (the least recently
        used go first)."""
        self.liveness = LivenessRule(report_timeout_s, stall_timeout_s)
        if not index_check_interval_s > 0:
            raise ValueError(f"index_check_interval_s must be > 0, got {index_check_interval_s}")
        if log_size < 1:
            raise ValueError(f"log_size must be >= 1, got {log_size}")
        self.index_check_interval_s = index_check_interval_s
        # None: no eviction ahead of need (workers still evict lazily on allocation).
        self.eviction = eviction
        self.generation = generation if generation is not None else secrets.randbits(62)
        self._clock = clock
        self._workers: dict[str, _Entry] = {}
        self._version = 0
        self._log: deque[WorkerDelta | AbortNote | SessionPin] = deque(maxlen=log_size)
        # Counters for metrics: KV sequence gaps seen, snapshots applied.
        self.kv_gaps = 0
        self.snapshots = 0
        self.route_notes = 0  # routing decisions relayed between ingress replicas
        self._replicas: dict[str, float] = {}  # ingress replica id -> last subscribe
        self._replica_cursors: dict[str, tuple[int | None, int]] = {}  # id -> its last cursor
        self._replica_queued: dict[str, dict[str, int]] = {}  # id -> pool -> requests it queues
        # Abort notes not settled yet: note id -> (its version, found by some replica).
        self._aborts: dict[int, tuple[int, bool]] = {}
        self._next_note = 0
        # Per pool, hash -> how many of its workers hold it: eviction drops replicated
        # prefixes first and the last copy last.
        self._copies: dict[str, dict[bytes, int]] = {}
        # None: no cross-worker migration (each engine preempts inside its own pool).
        self.migration = migration
        self._migrated_at: dict[str, float] = {}  # request id -> when it was last moved
        self._promised: list[tuple[float, str, int]] = []  # (when, target, blocks) of moves
        self.migrations: dict[str, int] = {}  # per pool: migrations ordered so far
        self.sessions = SessionPins(session_pins, clock=clock)

    # ----- membership -----------------------------------------------------

    def register_worker(self, info: WorkerInfo) -> int:
        """Add or refresh a worker (idempotent); returns this scheduler's generation."""
        entry = self._workers.get(info.worker_id)
        now = self._clock()
        if entry is None:
            entry = self._workers[info.worker_id] = _Entry(info, now)
        else:
            if entry.info.pool != info.pool:
                raise ValueError(
                    f"worker {info.worker_id!r} is registered in pool {entry.info.pool!r}, not {info.pool!r}"
                )
            entry.info = info
            entry.signs.heard(now)
            # A worker registers again after it restarted: its report seq starts over,
            # and its old report describes a process that is gone.
            entry.report = None
            entry.kv_seq = None
            entry.duplicated_sent = frozenset()
            entry.duplicated_at = -float("inf")
        self._publish(entry)
        return self.generation

    def deregister_worker(self, worker_id: str) -> bool:
        """Forget a worker; False if it was unknown."""
        entry = self._workers.pop(worker_id, None)
        if entry is None:
            return False
        self._count(entry, (), tuple(entry.hashes))
        self.sessions.drop_worker(worker_id)  # the replicas drop theirs with the delta
        self._append(WorkerDelta(entry.info, False, None, reset=True, gone=True))
        return True

    def set_draining(self, worker_id: str, draining: bool = True) -> bool:
        """Take a worker out of routing for its removal (or back in); False if unknown.

        A draining worker stays registered and keeps reporting, so the streams it
        runs finish there; no request is routed or migrated to it, and it keeps
        no prefix for others (`duplicated_hashes`).
        """
        entry = self._workers.get(worker_id)
        if entry is None:
            return False
        if entry.draining != draining:
            entry.draining = draining
            self._publish(entry)
        return True

    # ----- pushes ---------------------------------------------------------

    def push(self, report: LoadReport, batch: KVEventBatch) -> PushResult:
        """Record a worker's load report and KV events of one push (one delta)."""
        if batch.worker_id != report.worker_id:
            raise ValueError(
                f"KV batch of {batch.worker_id!r} pushed with the report of {report.worker_id!r}"
            )
        entry = self._workers.get(report.worker_id)
        if entry is None:
            return PushResult(registered=False)
        self._take_report(entry, report)
        pool_events = tuple(e for e in batch.events if e[0] in _POOL_EVENTS)
        tier_events = tuple(e for e in batch.events if e[0] not in _POOL_EVENTS)
        # Before _take_kv, which records the batch's incarnation as the entry's.
        off_stored, off_removed = self._take_offload(entry, batch, tier_events)
        stored, removed, want_snapshot = self._take_kv(
            entry, dataclasses.replace(batch, events=pool_events)
        )
        self._publish(entry, stored, removed, off_stored, off_removed)
        due = self._clock() - entry.checked_at >= self.index_check_interval_s
        return PushResult(
            registered=True,
            snapshot=want_snapshot or due,
            evict_blocks=self.blocks_to_evict(report.worker_id),
            duplicated=self._duplicates_news(entry),
        )

    def _take_report(self, entry: _Entry, report: LoadReport) -> None:
        now = self._clock()
        entry.signs.heard(now)
        if not report.supersedes(entry.report):
            return
        restarted = entry.report is None or entry.report.incarnation != report.incarnation
        has_work = report.num_running + report.num_waiting > 0
        entry.signs.reported(now, report.progress, has_work, restarted)
        entry.report = report

    def _take_kv(
        self, entry: _Entry, batch: KVEventBatch
    ) -> tuple[tuple[bytes, ...], tuple[bytes, ...], bool]:
        """Apply a batch to the worker's hash set: (stored, removed, snapshot wanted).

        Snapshots are published as the difference to what was indexed, so a
        subscriber never has to rebuild a worker's index from scratch.
        """
        fresh = batch.incarnation != entry.incarnation
        if batch.reset:
            actual = {h for _, h in batch.events}
            before = set() if fresh else entry.hashes
            # A drift check: what the events built against what the worker holds. A new
            # process starts from nothing, so it cannot drift.
            consistent = entry.kv_seq is not None and not fresh
            entry.drift_blocks = len(before - actual) if consistent else 0
            stored, removed = tuple(actual - entry.hashes), tuple(entry.hashes - actual)
            self._count(entry, stored, removed)
            entry.hashes = actual
            entry.incarnation = batch.incarnation
            entry.kv_seq = batch.seq
            entry.checked_at = self._clock()
            self.snapshots += 1
            return stored, removed, False
        if fresh or entry.kv_seq is None:
            # Events of a process whose index we never saw whole: apply them for what
            # they are worth, and ask for the full picture.
            removed_old: tuple[bytes, ...] = ()
            if fresh:
                removed_old, entry.hashes = tuple(entry.hashes), set()
                self._count(entry, (), removed_old)
            entry.incarnation = batch.incarnation
            entry.kv_seq = None
            stored, removed = self._apply_events(entry, batch)
            return stored, removed_old + removed, True
        gap = batch.seq != entry.kv_seq + 1
        if gap:
            self.kv_gaps += 1
        entry.kv_seq = batch.seq
        stored, removed = self._apply_events(entry, batch)
        return stored, removed, gap

    def _take_offload(
        self, entry: _Entry, batch: KVEventBatch, events: tuple[tuple[str, bytes], ...]
    ) -> tuple[tuple[bytes, ...], tuple[bytes, ...]]:
        """Apply a batch's offload-tier events: (stored, removed) as published.

        A snapshot (`reset`) or a new process replaces the tier's set; the tier
        only lowers a worker's prefill cost, so a gap costs score, not correctness.
        """
        held = entry.offloaded
        if batch.reset or batch.incarnation != entry.incarnation:
            actual = {h for kind, h in events if kind == "offload_stored"}
            if not batch.reset:  # a new process: its events so far are all there is
                actual -= {h for kind, h in events if kind == "offload_removed"}
            stored, removed = tuple(actual - held), tuple(held - actual)
            entry.offloaded = actual
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

    def _apply_events(
        self, entry: _Entry, batch: KVEventBatch
    ) -> tuple[tuple[bytes, ...], tuple[bytes, ...]]:
        stored: list[bytes] = []
        removed: list[bytes] = []
        hashes = entry.hashes
        copies = self._copies.setdefault(entry.info.pool, {})
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

    def _count(self, entry: _Entry, stored: tuple[bytes, ...], removed: tuple[bytes, ...]) -> None:
        copies = self._copies.setdefault(entry.info.pool, {})
        for h in stored:
            copies[h] = copies.get(h, 0) + 1
        for h in removed:
            _uncount(copies, h)

    def copies(self, pool: str, block_hash: bytes) -> int:
        """How many workers of the pool hold the hash, by the index."""
        return self._copies.get(pool, {}).get(block_hash, 0)

    def duplicated_hashes(self, worker_id: str) -> frozenset[bytes]:
        """The worker's hashes whose prefix survives its eviction: another live worker of
        its pool holds them and keeps them.

        With several holders exactly one keeps each hash (the highest
        `_keeper_rank`), so holders under pressure at once do not all drop it
        first: the last copy goes last. The rank is the worker's, not the
        hash's: the keeper of a prefix keeps all of its blocks, since a chain
        cut at one block loses every block after it to lookups.
        """
        entry = self._workers.get(worker_id)
        if entry is None:
            return frozenset()
        pool = entry.info.pool
        copies = self._copies.get(pool, {})
        shared = {h for h in entry.hashes if copies.get(h, 0) > 1}
        now = self._clock()
        mine = _keeper_rank(worker_id)
        out: set[bytes] = set()
        for wid, e in self._workers.items():
            if not shared:
                break
            if e.info.pool == pool and _keeper_rank(wid) > mine and self._routable(e, now):
                kept = shared & e.hashes  # set operations: C speed, the smaller side walked
                out |= kept
                shared -= kept
        return frozenset(out)

    def _duplicates_news(self, entry: _Entry) -> tuple[bytes, ...] | None:
        """What a push's ack says about duplicates: the set when it changed and the
        worker runs low on free blocks, else None (the worker keeps its last set)."""
        marks, report = self.eviction, entry.report
        if marks is None or not marks.replica_aware or report is None or report.total_blocks <= 0:
            return None
        if report.free_blocks >= DUPLICATES_BELOW_FREE * report.total_blocks:
            return None
        now = self._clock()
        if now - entry.duplicated_at < DUPLICATES_INTERVAL_S:
            return None  # the walk costs O(pool workers) set operations: not on every push
        entry.duplicated_at = now
        current = self.duplicated_hashes(entry.info.worker_id)
        if current == entry.duplicated_sent:
            return None
        entry.duplicated_sent = current
        return tuple(current)

    # ----- migration ------------------------------------------------------

    def migration_order(self, worker_id: str) -> Migration | None:
        """A request the worker should hand to another worker of its pool, by its latest report.

        `policy.choose_migration` decides among the pool's other live workers;
        the move is then remembered: the request cannot move again for
        `cooldown_s`, and its blocks count against the target's room for
        `reserve_s` (until the target's reports show it).
        """
        entry = self._workers.get(worker_id)
        if self.migration is None or entry is None or entry.report is None:
            return None
        if entry.report.blocks_short <= 0:
            return None
        now = self._clock()
        policy = self.migration
        self._migrated_at = {
            rid: t for rid, t in self._migrated_at.items() if now - t < policy.cooldown_s
        }
        self._promised = [p for p in self._promised if now - p[0] < policy.reserve_s]
        reserved: dict[str, int] = {}
        for _, target, blocks in self._promised:
            reserved[target] = reserved.get(target, 0) + blocks
        targets = [
            e.report
            for e in self._workers.values()
            if e is not entry and e.info.pool == entry.info.pool
            and e.report is not None and self._routable(e, now)
        ]
        move = choose_migration(
            entry.report, targets, entry.info.block_size, policy,
            recently_migrated=self._migrated_at, reserved=reserved,
        )
        if move is not None:
            self._migrated_at[move.request_id] = now
            self._promised.append((now, move.target, move.num_blocks))
            pool = entry.info.pool
            self.migrations[pool] = self.migrations.get(pool, 0) + 1
        return move

    # ----- liveness -------------------------------------------------------

    def is_alive(self, worker_id: str) -> bool:
        """Registered and live by `LivenessRule`: heard from in time, and not hung."""
        entry = self._workers.get(worker_id)
        return entry is not None and self._judge(entry, self._clock()).alive

    def is_stalled(self, worker_id: str) -> bool:
        """Has work but streamed nothing for `stall_timeout_s` (KeyError if unknown)."""
        return self._judge(self._workers[worker_id], self._clock()).stalled

    def _judge(self, entry: _Entry, now: float) -> Liveness:
        return self.liveness.judge(entry.signs, now)

    def _routable(self, entry: _Entry, now: float) -> bool:
        """Alive and not draining: may take new work (a request, a migration, a kept prefix)."""
        return not entry.draining and self._judge(entry, now).alive

    def tick(self) -> int:
        """Publish liveness changes that time alone caused (deadlines, stalls); returns how many."""
        now = self._clock()
        changed = 0
        for entry in self._workers.values():
            if self._judge(entry, now) is not entry.published:
                self._publish(entry)
                changed += 1
        return changed

    def alive_workers(self, pool: str) -> list[str]:
        """Ids of the pool's live workers."""
        return [
            wid for wid, e in self._workers.items() if e.info.pool == pool and self.is_alive(wid)
        ]

    def workers(self, pool: str | None = None) -> list[str]:
        """Ids of registered workers, optionally of one pool."""
        return [wid for wid, e in self._workers.items() if pool is None or e.info.pool == pool]

    # ----- queries --------------------------------------------------------

    def blocks_to_evict(self, worker_id: str) -> int:
        """Cached blocks the worker should evict now, by its latest report and the watermarks.

        0 without watermarks, for an unknown worker, or before its first report.
        """
        entry = self._workers.get(worker_id)
        if self.eviction is None or entry is None or entry.report is None:
            return 0
        return blocks_to_evict(entry.report, self.eviction)

    def latest_report(self, worker_id: str) -> LoadReport | None:
        """The worker's latest load report (None before the first; KeyError if unknown)."""
        return self._workers[worker_id].report

    def cached_hashes(self, worker_id: str) -> frozenset[bytes]:
        """The hashes the scheduler believes the worker holds (KeyError if unknown)."""
        return frozenset(self._workers[worker_id].hashes)

    def index_drift(self) -> int:
        """Blocks believed cached that workers did not hold, summed over each worker's last check."""
        return sum(e.drift_blocks for e in self._workers.values())

    def view(self) -> ClusterView:
        """An immutable snapshot for status pages and tests (liveness evaluated now)."""
        now = self._clock()
        workers = tuple(
            WorkerView(
                e.info, (verdict := self._judge(e, now)).alive, e.report, e.signs.last_seen,
                verdict.stalled, len(e.hashes), e.drift_blocks, e.draining,
            )
            for e in self._workers.values()
        )
        queued: dict[str, int] = {}
        for rid, seen in self._replicas.items():
            if self.liveness.heard_in_time(seen, now):  # a dead replica's queue died with it
                for pool, n in self._replica_queued.get(rid, {}).items():
                    queued[pool] = queued.get(pool, 0) + n
        return ClusterView(self.generation, self._version, workers, queued)

    # ----- ingress replicas -----------------------------------------------

    def note_replica(
        self, replica_id: str, generation: int | None = None, cursor: int = 0,
        found: tuple[int, ...] = (), queued: Mapping[str, int] | None = None,
    ) -> None:  # fmt: skip
        """An ingress replica subscribed from `cursor` (it has applied everything up to
        it): it is alive. `found`: abort notes it found its request for. `queued`:
        requests waiting in its queue, per pool."""
        if replica_id:
            self._replicas[replica_id] = self._clock()
            self._replica_cursors[replica_id] = (generation, cursor)
            self._replica_queued[replica_id] = {p: n for p, n in (queued or {}).items() if n > 0}
        for note_id in found:
            if note_id in self._aborts:
                self._aborts[note_id] = (self._aborts[note_id][0], True)

    def publish_abort(self, key: str, origin: str) -> int:
        """Ask every ingress replica but `origin` to cancel the waiting request `key`;
        returns the note's id for `abort_settled`."""
        self._next_note += 1
        note_id = self._next_note
        self._append(AbortNote(note_id, key, origin))
        self._aborts[note_id] = (self._version, False)
        return note_id

    def abort_settled(self, note_id: int, origin: str) -> bool | None:
        """True once a replica found the request; False once every other live replica
        has subscribed past the note without finding it; None while neither."""
        version, found = self._aborts[note_id]
        if found:
            return True
        now = self._clock()
        for rid, seen in self._replicas.items():
            if rid == origin or not self.liveness.heard_in_time(seen, now):
                continue
            generation, cursor = self._replica_cursors.get(rid, (None, 0))
            if generation != self.generation or cursor < version:
                return None
        return False

    def forget_abort(self, note_id: int) -> None:
        """Drop a note, settled or timed out."""
        self._aborts.pop(note_id, None)

    @property
    def aborts_pending(self) -> bool:
        return bool(self._aborts)

    def dead_replicas(self) -> tuple[str, ...]:
        """Replicas silent for `report_timeout_s`: workers abort the requests they sent.

        Only replicas this incarnation has seen can be dead, so a restarted
        scheduler never makes workers abort the streams of a live replica.
        """
        now = self._clock()
        for rid in [r for r, t in self._replicas.items() if now - t > DEAD_REPLICA_MEMORY_S]:
            del self._replicas[rid]
            self._replica_cursors.pop(rid, None)
            self._replica_queued.pop(rid, None)
        return tuple(r for r, t in self._replicas.items() if not self.liveness.heard_in_time(t, now))

    def note_routed(self, replica_id: str, worker_id: str, hashes: tuple[bytes, ...]) -> bool:
        """Publish one routing decision of an ingress replica to the other replicas
        (a route note in the delta log); False for a worker this view does not know."""
        entry = self._workers.get(worker_id)
        if entry is None or not hashes:
            return False
        self._append(
            WorkerDelta(
                entry.info, entry.published.alive, entry.report,
                stalled=entry.published.stalled, drift_blocks=entry.drift_blocks,
                routed=hashes, routed_by=replica_id, draining=entry.draining,
            )
        )
        self.route_notes += 1
        return True

    def note_pins(self, pins: tuple[SessionPin, ...]) -> int:
        """Keep ingress replicas' session pins and relay them to every replica; returns
        how many were taken (a pin to a worker of another pool, or unknown, is not)."""
        taken = 0
        for pin in pins:
            entry = self._workers.get(pin.worker_id)
            if entry is None or entry.info.pool != pin.pool:
                continue
            self.sessions.put(pin.pool, pin.key, pin.worker_id, pin.ttl_s)
            self._append(pin)
            taken += 1
        return taken

    # ----- subscriptions --------------------------------------------------

    @property
    def version(self) -> int:
        """Deltas published so far by this incarnation."""
        return self._version

    def updates_since(self, generation: int | None, cursor: int) -> ViewUpdate:
        """Deltas after `cursor`, or a snapshot when the subscriber cannot continue from it."""
        oldest = self._version - len(self._log)  # the first kept delta has version oldest + 1
        if generation != self.generation or not oldest <= cursor <= self._version:
            return self.snapshot()
        start = cursor - oldest
        deltas = tuple(self._log[i] for i in range(start, len(self._log)))
        return ViewUpdate(self.generation, self._version, False, deltas)

    def snapshot(self) -> ViewUpdate:
        """Every worker's full state (index included) at the current version."""
        now = self._clock()
        deltas = tuple(
            WorkerDelta(
                e.info, (verdict := self._judge(e, now)).alive, e.report, tuple(e.hashes), (),
                True, False, verdict.stalled, e.drift_blocks, tuple(e.offloaded),
                draining=e.draining,
            )
            for e in self._workers.values()
        )
        return ViewUpdate(self.generation, self._version, True, (*deltas, *self.sessions.pins()))

    def _publish(
        self,
        entry: _Entry,
        stored: tuple[bytes, ...] = (),
        removed: tuple[bytes, ...] = (),
        offload_stored: tuple[bytes, ...] = (),
        offload_removed: tuple[bytes, ...] = (),
    ) -> None:
        verdict = entry.published = self._judge(entry, self._clock())
        self._append(
            WorkerDelta(
                entry.info, verdict.alive, entry.report, stored, removed, False, False,
                verdict.stalled, entry.drift_blocks, offload_stored, offload_removed,
                draining=entry.draining,
            )
        )

    def _append(self, delta: WorkerDelta | AbortNote | SessionPin) -> None:
        self._version += 1
        self._log.append(delta)


# KV event kinds of the pool itself; the others ("offload_*") are the offload tier's.
_POOL_EVENTS = ("stored", "removed")


def _uncount(copies: dict[bytes, int], block_hash: bytes) -> None:
    left = copies.get(block_hash, 0) - 1
    if left > 0:
        copies[block_hash] = left
    else:
        copies.pop(block_hash, None)


def _keeper_rank(worker_id: str) -> tuple[int, str]:
    """Which holder keeps a duplicated hash: the highest rank (stable across processes)."""
    return zlib.crc32(worker_id.encode()), worker_id
