"""The typed messages of the scheduler's view, as they cross actor boundaries.

`ClusterView` (with one `WorkerView` per worker) is what status pages, the
autoscaler and membership read. `ViewUpdate` is the answer to an ingress
replica's subscription: `WorkerDelta`s (with `AbortNote`s and session pins
riding the same log) after its cursor, or a snapshot.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from pagefleet.scheduler.liveness import Liveness
from pagefleet.scheduler.session_pins import SessionPin
from pagefleet.worker.events import LoadReport, WorkerInfo


@dataclass(frozen=True)
class WorkerView:
    """One worker as the scheduler sees it at snapshot time."""

    info: WorkerInfo
    alive: bool
    report: LoadReport | None
    last_report_at: float | None  # scheduler clock of the last accepted report (or registration)
    stalled: bool = False
    num_cached_hashes: int = 0
    drift_blocks: int = 0
    draining: bool = False

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
    # Per pool: requests waiting in the live ingress replicas' queues (not yet at a worker).
    queued: Mapping[str, int] = field(default_factory=dict)

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
class WorkerDelta:
    """One change of one worker's state, as subscribers apply it.

    Add `stored` to what is indexed for the worker and drop `removed`;
    likewise `offload_stored` / `offload_removed` for its offload tier.
    `reset`: the delta is part of a snapshot (`stored` is everything the
    worker holds; the subscriber cleared its index first). `gone`: the worker
    was deregistered; forget it. `draining`: the worker is being removed; it
    takes no new request, and the streams it runs finish there.
    """

    info: WorkerInfo
    alive: bool
    report: LoadReport | None
    stored: tuple[bytes, ...] = ()
    removed: tuple[bytes, ...] = ()
    reset: bool = False
    gone: bool = False
    stalled: bool = False
    drift_blocks: int = 0
    offload_stored: tuple[bytes, ...] = ()
    offload_removed: tuple[bytes, ...] = ()
    # A route note, not a change of state: ingress replica `routed_by` sent a prompt
    # with these block hashes to the worker (subscribers other than it index them
    # as speculative, `Router.note_routed_elsewhere`). Never part of a snapshot.
    routed: tuple[bytes, ...] = ()
    routed_by: str = ""
    draining: bool = False

    @property
    def liveness(self) -> Liveness:
        """The scheduler's verdict this delta carries (`alive` / `stalled`)."""
        return Liveness.of(self.alive, self.stalled)

    @property
    def routable(self) -> bool:
        """May take new requests: live by the scheduler's verdict and not draining."""
        return self.alive and not self.draining


@dataclass(frozen=True)
class AbortNote:
    """An abort looking for a request that waits in some ingress replica's queue.

    Replica `origin` could not find the request (tenant-scoped `key`) in its
    own tables nor on any worker; every other replica that holds it cancels
    it and says so with its next subscribe (`found`). Never part of a snapshot.
    """

    note_id: int
    key: str
    origin: str


@dataclass(frozen=True)
class ViewUpdate:
    """The answer to a subscriber: deltas after its cursor, or a snapshot.

    Apply `deltas` in order, then continue from `version`. With `snapshot`,
    every worker appears once with `reset=True`, followed by the live session pins.
    """

    generation: int
    version: int
    snapshot: bool
    deltas: tuple[WorkerDelta | AbortNote | SessionPin, ...]
