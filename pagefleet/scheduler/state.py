"""The central scheduler's view of the cluster: a plain class, wrapped by the Ray actor.

This is the cluster's one source of truth for KV state. Workers register
(idempotently) and then push, on an interval, a load report and the KV
events (blocks stored / removed) since their previous push. `ClusterState`
keeps the registry (per worker its info, latest report, draining flag) and
composes the rest, one job per module:

- `kv_index.KVIndex`: the hashes each worker holds, sequence gaps, snapshots
  and drift, copies per pool;
- `liveness.LivenessRule`: live / stalled / lost, on the scheduler's clock;
- `migrations.MigrationBook`: the moves ordered, for cooldowns and reserved room;
- `replicas.Replicas`: the ingress replicas' subscriptions and abort notes;
- `session_pins.SessionPins`: the session pins relayed between replicas;
- `delta_log.DeltaLog`: every change as a versioned entry, for subscribers.

A restarted scheduler has a new `generation` and an empty view: workers
seeing the new generation (or being told they are unknown) register again
and send a snapshot, which rebuilds it. Session pins ride the same log; a
restarted scheduler starts with none, and the replicas, which keep theirs,
tell it each session's pin again as the session is pinned anew or refreshed.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from pagefleet.scheduler.delta_log import DEFAULT_LOG_SIZE, DeltaLog
from pagefleet.scheduler.kv_index import IndexChange, KVIndex
from pagefleet.scheduler.liveness import LifeSigns, Liveness, LivenessRule
from pagefleet.scheduler.messages import AbortNote, ClusterView, ViewUpdate, WorkerDelta, WorkerView
from pagefleet.scheduler.migrations import MigrationBook
from pagefleet.scheduler.policy import (
    EvictionWatermarks,
    Migration,
    MigrationPolicy,
    blocks_to_evict,
)
from pagefleet.scheduler.replicas import Replicas
from pagefleet.scheduler.session_pins import DEFAULT_MAX_PER_POOL, SessionPin, SessionPins
from pagefleet.worker.events import KVEventBatch, LoadReport, WorkerInfo

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
    # The push changed the view (a delta for the subscribers); False for a heartbeat.
    published: bool = False


class _Entry:
    __slots__ = (
        "draining", "duplicated_at", "duplicated_sent", "info", "published", "report", "shown", "signs",
    )  # fmt: skip

    def __init__(self, info: WorkerInfo, now: float) -> None:
        self.info = info
        self.report: LoadReport | None = None
        self.signs = LifeSigns(now)
        self.published = Liveness.LIVE  # the verdict its latest delta carried
        self.shown: LoadReport | None = None  # the report its latest delta carried
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
        self.index_check_interval_s = index_check_interval_s
        # None: no eviction ahead of need (workers still evict lazily on allocation).
        self.eviction = eviction
        self._log = DeltaLog(generation if generation is not None else secrets.randbits(62), log_size)
        self._clock = clock
        self._workers: dict[str, _Entry] = {}
        self._index = KVIndex()
        self._replicas = Replicas(self.liveness, clock)
        self.route_notes = 0  # routing decisions relayed between ingress replicas
        # None: no cross-worker migration (each engine preempts inside its own pool).
        self.migration = migration
        self._moves = MigrationBook()
        self.sessions = SessionPins(session_pins, clock=clock)

    @property
    def generation(self) -> int:
        """This scheduler incarnation's id."""
        return self._log.generation

    @property
    def kv_gaps(self) -> int:
        """KV sequence gaps seen so far."""
        return self._index.kv_gaps

    @property
    def snapshots(self) -> int:
        """Worker snapshots applied so far."""
        return self._index.snapshots

    @property
    def migrations(self) -> dict[str, int]:
        """Per pool: migrations ordered so far."""
        return self._moves.ordered

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
            entry.duplicated_sent = frozenset()
            entry.duplicated_at = -float("inf")
        self._index.register(info.worker_id, info.pool, now)
        self._publish(entry)
        return self.generation

    def deregister_worker(self, worker_id: str) -> bool:
        """Forget a worker; False if it was unknown."""
        entry = self._workers.pop(worker_id, None)
        if entry is None:
            return False
        self._index.remove(worker_id)
        self.sessions.drop_worker(worker_id)  # the replicas drop theirs with the delta
        self._log.append(WorkerDelta(entry.info, False, None, reset=True, gone=True))
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
        change = self._index.apply(report.worker_id, batch, self._clock())
        published = self._is_news(entry, batch, change)
        if published:
            self._publish(entry, change)
        due = self._index.check_due(report.worker_id, self._clock(), self.index_check_interval_s)
        return PushResult(
            registered=True,
            snapshot=change.snapshot or due,
            evict_blocks=self.blocks_to_evict(report.worker_id),
            duplicated=self._duplicates_news(entry),
            published=published,
        )

    def _is_news(self, entry: _Entry, batch: KVEventBatch, change: IndexChange) -> bool:
        """Whether a push tells subscribers anything: a KV change, a drift check, a new
        verdict or a load other than their last delta's. An idle worker's push is a
        heartbeat: liveness (decided here) takes it, and no delta goes out."""
        if batch.reset or change.stored or change.removed or change.offload_stored or change.offload_removed:
            return True
        if self._judge(entry, self._clock()) is not entry.published:
            return True
        return entry.report is not None and not entry.report.same_load(entry.shown)

    def _take_report(self, entry: _Entry, report: LoadReport) -> None:
        now = self._clock()
        entry.signs.heard(now)
        if not report.supersedes(entry.report):
            return
        restarted = entry.report is None or entry.report.incarnation != report.incarnation
        has_work = report.num_running + report.num_waiting > 0
        entry.signs.reported(now, report.progress, has_work, restarted, report.step_s)
        entry.report = report

    # ----- eviction -------------------------------------------------------

    def blocks_to_evict(self, worker_id: str) -> int:
        """Cached blocks the worker should evict now, by its latest report and the watermarks.

        0 without watermarks, for an unknown worker, or before its first report.
        """
        entry = self._workers.get(worker_id)
        if self.eviction is None or entry is None or entry.report is None:
            return 0
        return blocks_to_evict(entry.report, self.eviction)

    def copies(self, pool: str, block_hash: bytes) -> int:
        """How many workers of the pool hold the hash, by the index."""
        return self._index.copies(pool, block_hash)

    def duplicated_hashes(self, worker_id: str) -> frozenset[bytes]:
        """The worker's hashes whose prefix survives its eviction: another live worker of
        its pool holds them and keeps them (`KVIndex.kept_elsewhere`)."""
        if worker_id not in self._workers:
            return frozenset()
        now = self._clock()
        return self._index.kept_elsewhere(worker_id, lambda wid: self._routable(self._workers[wid], now))

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
        `MigrationBook` remembers the move for the cooldown and the target's
        reserved room.
        """
        entry = self._workers.get(worker_id)
        if self.migration is None or entry is None or entry.report is None:
            return None
        if entry.report.blocks_short <= 0:
            return None
        pool, now = entry.info.pool, self._clock()
        targets = [
            e.report
            for e in self._workers.values()
            if e is not entry and e.info.pool == pool and e.report is not None and self._routable(e, now)
        ]
        return self._moves.order(
            pool, entry.report, targets, entry.info.block_size, self.migration, now
        )

    # ----- liveness -------------------------------------------------------

    def is_alive(self, worker_id: str) -> bool:
        """Registered and live by `LivenessRule`: heard from in time, and not hung."""
        entry = self._workers.get(worker_id)
        return entry is not None and self._judge(entry, self._clock()).alive

    def is_stalled(self, worker_id: str) -> bool:
        """Hung: has work but computed nothing for `stall_timeout_s`, in no step it still
        reports from (`LivenessRule.judge`; KeyError if unknown)."""
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

    def latest_report(self, worker_id: str) -> LoadReport | None:
        """The worker's latest load report (None before the first; KeyError if unknown)."""
        return self._workers[worker_id].report

    def cached_hashes(self, worker_id: str) -> frozenset[bytes]:
        """The hashes the scheduler believes the worker holds (KeyError if unknown)."""
        return frozenset(self._index.held(worker_id))

    def index_drift(self) -> int:
        """Blocks believed cached that workers did not hold, summed over each worker's last check."""
        return self._index.total_drift()

    def view(self) -> ClusterView:
        """An immutable snapshot for status pages and tests (liveness evaluated now)."""
        now = self._clock()
        workers = tuple(
            WorkerView(
                e.info, (verdict := self._judge(e, now)).alive, e.report, e.signs.last_seen,
                verdict.stalled, len(self._index.held(wid)), self._index.drift(wid), e.draining,
            )
            for wid, e in self._workers.items()
        )
        return ClusterView(self.generation, self._log.version, workers, self._replicas.queued())

    # ----- ingress replicas -----------------------------------------------

    def note_replica(
        self, replica_id: str, generation: int | None = None, cursor: int = 0,
        found: tuple[int, ...] = (), queued: Mapping[str, int] | None = None,
    ) -> None:  # fmt: skip
        """An ingress replica subscribed from `cursor` (it has applied everything up to
        it): it is alive. `found`: abort notes it found its request for. `queued`:
        requests waiting in its queue, per pool."""
        if replica_id:
            self._replicas.note(replica_id, generation, cursor, queued or {})
        self._replicas.found(found)

    def publish_abort(self, key: str, origin: str) -> int:
        """Ask every ingress replica but `origin` to cancel the waiting request `key`;
        returns the note's id for `abort_settled`."""
        note_id = self._replicas.open_abort(self._log.version + 1)  # the note's version
        self._log.append(AbortNote(note_id, key, origin))
        return note_id

    def abort_settled(self, note_id: int, origin: str) -> bool | None:
        """True once a replica found the request; False once every other live replica
        has subscribed past the note without finding it; None while neither."""
        return self._replicas.abort_settled(note_id, origin, self.generation)

    def forget_abort(self, note_id: int) -> None:
        """Drop a note, settled or timed out."""
        self._replicas.forget_abort(note_id)

    @property
    def aborts_pending(self) -> bool:
        """Some abort note is not settled yet."""
        return self._replicas.aborts_pending

    def dead_replicas(self) -> tuple[str, ...]:
        """Replicas silent for `report_timeout_s`: workers abort the requests they sent."""
        return self._replicas.dead()

    def note_routed(self, replica_id: str, worker_id: str, hashes: tuple[bytes, ...]) -> bool:
        """Publish one routing decision of an ingress replica to the other replicas
        (a route note in the delta log); False for a worker this view does not know."""
        entry = self._workers.get(worker_id)
        if entry is None or not hashes:
            return False
        self._log.append(
            WorkerDelta(
                entry.info, entry.published.alive, entry.report,
                stalled=entry.published.stalled, drift_blocks=self._index.drift(worker_id),
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
            self._log.append(pin)
            taken += 1
        return taken

    # ----- subscriptions --------------------------------------------------

    @property
    def version(self) -> int:
        """Deltas published so far by this incarnation."""
        return self._log.version

    def updates_since(self, generation: int | None, cursor: int) -> ViewUpdate:
        """Deltas after `cursor`, or a snapshot when the subscriber cannot continue from it."""
        return self._log.since(generation, cursor) or self.snapshot()

    def snapshot(self) -> ViewUpdate:
        """Every worker's full state (index included) at the current version, then the
        live session pins."""
        now = self._clock()
        index = self._index
        deltas = tuple(
            WorkerDelta(
                e.info, (verdict := self._judge(e, now)).alive, e.report, tuple(index.held(wid)),
                (), True, False, verdict.stalled, index.drift(wid), tuple(index.offloaded(wid)),
                draining=e.draining,
            )
            for wid, e in self._workers.items()
        )
        return self._log.snapshot((*deltas, *self.sessions.pins()))

    def _publish(self, entry: _Entry, change: IndexChange | None = None) -> None:
        """Append the worker's current state (and what `change` did to its index)."""
        verdict = entry.published = self._judge(entry, self._clock())
        entry.shown = entry.report
        c = change or _NO_CHANGE
        self._log.append(
            WorkerDelta(
                entry.info, verdict.alive, entry.report, c.stored, c.removed, False, False,
                verdict.stalled, self._index.drift(entry.info.worker_id), c.offload_stored,
                c.offload_removed, draining=entry.draining,
            )
        )


_NO_CHANGE = IndexChange((), (), (), (), snapshot=False)
