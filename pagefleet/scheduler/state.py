"""The central scheduler's view of the cluster: a plain class, wrapped by the Ray actor.

Workers register (idempotently) and then send load reports on an interval. A
worker that misses its report deadline is taken out of routing until its next
report; it is not forgotten, because a slow worker usually comes back.
The `generation` identifies this scheduler incarnation: after a restart it
changes, and workers seeing a new generation (or being told they are
unknown) register again, which rebuilds the view.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from pagefleet.scheduler.policy import EvictionWatermarks, blocks_to_evict
from pagefleet.worker.events import LoadReport, WorkerInfo


@dataclass(frozen=True)
class WorkerView:
    """One worker as the scheduler sees it at snapshot time."""

    info: WorkerInfo
    alive: bool
    report: LoadReport | None
    last_report_at: float | None  # scheduler clock of the last accepted report (or registration)

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    @property
    def pool(self) -> str:
        return self.info.pool


@dataclass(frozen=True)
class ClusterView:
    """An immutable snapshot of the cluster, cheap to ship to routers."""

    generation: int
    version: int
    workers: tuple[WorkerView, ...]

    def pool(self, name: str) -> list[WorkerView]:
        """Workers of a pool, live or not."""
        return [w for w in self.workers if w.info.pool == name]

    def alive(self, pool: str) -> list[WorkerView]:
        """Live workers of a pool."""
        return [w for w in self.workers if w.info.pool == pool and w.alive]

    def pools(self) -> list[str]:
        """Pool names, in order of first registration."""
        return list(dict.fromkeys(w.info.pool for w in self.workers))


@dataclass(frozen=True)
class PoolCapacity:
    """Block and queue totals over a pool's live workers."""

    pool: str
    workers: int
    alive: int
    total_blocks: int
    free_blocks: int
    live_blocks: int
    cached_blocks: int
    num_running: int
    num_waiting: int


class _Entry:
    __slots__ = ("info", "last_seen", "report")

    def __init__(self, info: WorkerInfo, now: float) -> None:
        self.info = info
        self.report: LoadReport | None = None
        # Registration counts as a sign of life: a fresh worker is routable before its
        # first report arrives.
        self.last_seen = now


class ClusterState:
    """Which workers exist in which pool, their latest reports, and which are alive."""

    def __init__(
        self,
        *,
        report_timeout_s: float = 3.0,
        generation: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        eviction: EvictionWatermarks | None = None,
    ) -> None:
        if not report_timeout_s > 0:
            raise ValueError(f"report_timeout_s must be > 0, got {report_timeout_s}")
        self.report_timeout_s = report_timeout_s
        # None: no eviction ahead of need (workers still evict lazily on allocation).
        self.eviction = eviction
        self.generation = generation if generation is not None else secrets.randbits(62)
        self._clock = clock
        self._workers: dict[str, _Entry] = {}
        self._version = 0

    def register_worker(self, info: WorkerInfo) -> int:
        """Add or refresh a worker (idempotent); returns this scheduler's generation."""
        entry = self._workers.get(info.worker_id)
        now = self._clock()
        if entry is None:
            self._workers[info.worker_id] = _Entry(info, now)
        else:
            if entry.info.pool != info.pool:
                raise ValueError(
                    f"worker {info.worker_id!r} is registered in pool {entry.info.pool!r}, not {info.pool!r}"
                )
            entry.info = info
            entry.last_seen = now
            # A worker registers again after it restarted: its report seq starts over,
            # and its old report describes a process that is gone.
            entry.report = None
        self._version += 1
        return self.generation

    def deregister_worker(self, worker_id: str) -> bool:
        """Forget a worker; False if it was unknown."""
        if self._workers.pop(worker_id, None) is None:
            return False
        self._version += 1
        return True

    def report(self, report: LoadReport) -> bool:
        """Record a load report; False when the worker is unknown (it must re-register).

        Reports that arrive out of order (seq not above the last one of the
        same incarnation) are dropped but still count as a sign of life.
        """
        entry = self._workers.get(report.worker_id)
        if entry is None:
            return False
        entry.last_seen = self._clock()
        if report.supersedes(entry.report):
            entry.report = report
        self._version += 1
        return True

    def report_bytes(self, worker_id: str, data: bytes) -> bool:
        """Decode and record a msgpack load report (EventDecodeError on garbage)."""
        report = LoadReport.decode(data)
        if report.worker_id != worker_id:
            raise ValueError(f"report from {worker_id!r} carries worker_id {report.worker_id!r}")
        return self.report(report)

    def is_alive(self, worker_id: str) -> bool:
        """Registered and heard from within `report_timeout_s`."""
        entry = self._workers.get(worker_id)
        return entry is not None and self._clock() - entry.last_seen <= self.report_timeout_s

    def alive_workers(self, pool: str) -> list[str]:
        """Ids of the pool's live workers."""
        return [
            wid for wid, e in self._workers.items() if e.info.pool == pool and self.is_alive(wid)
        ]

    def workers(self, pool: str | None = None) -> list[str]:
        """Ids of registered workers, optionally of one pool."""
        return [wid for wid, e in self._workers.items() if pool is None or e.info.pool == pool]

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

    def capacity(self, pool: str) -> PoolCapacity:
        """Sums over the pool's live workers (a worker without a report counts its registered size as free)."""
        entries = [e for e in self._workers.values() if e.info.pool == pool]
        live = [e for e in entries if self.is_alive(e.info.worker_id)]
        total = free = used = cached = running = waiting = 0
        for e in live:
            r = e.report
            if r is None:
                total += e.info.total_blocks
                free += e.info.total_blocks
                continue
            total += r.total_blocks
            free += r.free_blocks
            used += r.live_blocks
            cached += r.cached_blocks
            running += r.num_running
            waiting += r.num_waiting
        return PoolCapacity(pool, len(entries), len(live), total, free, used, cached, running, waiting)

    def view(self) -> ClusterView:
        """An immutable snapshot for routers (liveness evaluated now)."""
        workers = tuple(
            WorkerView(e.info, self.is_alive(wid), e.report, e.last_seen)
            for wid, e in self._workers.items()
        )
        return ClusterView(self.generation, self._version, workers)
