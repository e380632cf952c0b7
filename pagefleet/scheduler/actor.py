"""The central scheduler as a named, restartable Ray actor: a thin wrapper around ClusterState.

The only file of `pagefleet.scheduler` that imports Ray. Workers `push` their
load reports and KV events here (nowhere else); ingress replicas `subscribe`
to the resulting view as versioned deltas (a long poll from a cursor). A
background task publishes liveness changes that only time causes (missed
deadlines, hung workers).

The actor keeps no state worth persisting: when Ray restarts it, `__init__`
runs again with a new generation and an empty view; workers re-register as
soon as a push is answered with an unknown-worker or new-generation ack, and
send a snapshot of their cached hashes, which rebuilds the view within a
push interval or two. Ingress replicas keep routing on their last view
meanwhile, and switch to a snapshot of the new generation when it answers.

With `scheduler.shards` > 1 several of these actors run, each the source of
truth for the pools it owns (`ClusterConfig.scheduler_shards`): shard 0 is
named `pagefleet-scheduler` like the only one, shard k `pagefleet-scheduler-k`.
Nothing is shared between shards; each restarts and rebuilds on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import ray

from pagefleet.scheduler.messages import ClusterView, ViewUpdate
from pagefleet.scheduler.policy import EvictionWatermarks, MigrationPolicy
from pagefleet.scheduler.session_pins import DEFAULT_MAX_PER_POOL, SessionPin
from pagefleet.scheduler.state import ClusterState
from pagefleet.worker.events import SCHEDULER_ACTOR_NAME, KVEventBatch, LoadReport, WorkerInfo

logger = logging.getLogger(__name__)

# How often time-only liveness changes (deadlines, stalls) are published.
TICK_INTERVAL_S = 0.1

SCHEDULER_NAME = SCHEDULER_ACTOR_NAME
# SchedulerConfig's defaults: evict ahead when under 5% of a worker's blocks are free.
DEFAULT_EVICTION = EvictionWatermarks(low=0.05, high=0.10)
DEFAULT_MIGRATION = MigrationPolicy()


@dataclass(frozen=True)
class ReportAck:
    """Answer to a load report: re-register when `registered` is False or the generation changed.

    `evict_blocks`: cached blocks the worker should evict now to get back above
    the free-block watermark (0: none). `duplicated`: the worker's hashes
    another live worker of its pool keeps; it evicts them before last copies
    (None: unchanged since the last ack).
    """

    generation: int
    registered: bool
    evict_blocks: int = 0
    snapshot: bool = False  # send a snapshot of every held hash with the next push
    # Ingress replicas gone silent: abort the requests they sent (their clients are gone).
    dead_replicas: tuple[str, ...] = ()
    duplicated: tuple[bytes, ...] | None = None
    # (request id, target worker id, transfer): hand these requests off, with their KV
    # blocks when transfer is true; the ingress resumes each on the target (the worker
    # is short of blocks, the target has room).
    migrate: tuple[tuple[str, str, bool], ...] = ()


class SchedulerActor:
    """Plain class with the actor's methods; `start_scheduler` wraps it with `ray.remote`.

    Its methods are coroutines, so Ray runs it as an async actor: a long-polling
    subscriber waits without holding a thread.
    """

    def __init__(
        self,
        report_timeout_s: float = 3.0,
        eviction: EvictionWatermarks | None = DEFAULT_EVICTION,
        stall_timeout_s: float = 3.0,
        index_check_interval_s: float = 10.0,
        migration: MigrationPolicy | None = DEFAULT_MIGRATION,
        session_pins: int = DEFAULT_MAX_PER_POOL,
    ) -> None:
        self._state = ClusterState(
            report_timeout_s=report_timeout_s,
            eviction=eviction,
            stall_timeout_s=stall_timeout_s,
            index_check_interval_s=index_check_interval_s,
            migration=migration,
            session_pins=session_pins,
        )
        self._changed = asyncio.Event()
        self._acked = asyncio.Event()  # a replica subscribed while abort notes are pending
        self._ticker: asyncio.Task[None] | None = None
        with contextlib.suppress(RuntimeError):  # an async actor's __init__ runs on its loop
            self._ticker = asyncio.get_running_loop().create_task(self._tick_loop())

    async def register_worker(self, info: WorkerInfo) -> int:
        """Add or refresh a worker (idempotent); returns the scheduler's generation."""
        generation = self._state.register_worker(info)
        self._wake()
        return generation

    async def deregister_worker(self, worker_id: str) -> bool:
        """Forget a worker; False if unknown."""
        found = self._state.deregister_worker(worker_id)
        self._wake()
        return found

    async def set_draining(self, worker_id: str, draining: bool = True) -> bool:
        """Take a worker out of routing before its removal (its streams finish); False if unknown."""
        found = self._state.set_draining(worker_id, draining)
        self._wake()
        return found

    async def push(self, worker_id: str, report: bytes, kv_events: bytes) -> ReportAck:
        """Accept one push of a worker: its msgpack LoadReport and KVEventBatch.

        The ack says whether to re-register, what to evict, whether to
        send a snapshot next (after a sequence gap, for a new incarnation, or
        for the periodic drift check), and which request to migrate where.
        """
        load = LoadReport.decode(report)
        batch = KVEventBatch.decode(kv_events)
        if load.worker_id != worker_id:
            raise ValueError(f"push from {worker_id!r} carries worker_id {load.worker_id!r}")
        result = self._state.push(load, batch)
        if result.published:
            self._wake()
        move = self._state.migration_order(worker_id) if result.registered else None
        return ReportAck(
            self._state.generation, result.registered, result.evict_blocks, result.snapshot,
            self._state.dead_replicas(), result.duplicated,
            () if move is None else ((move.request_id, move.target, move.transfer),),
        )

    async def subscribe(
        self, generation: int | None, cursor: int, timeout_s: float = 5.0, replica_id: str = "",
        found: tuple[int, ...] = (), queued: tuple[tuple[str, int], ...] = (),
    ) -> ViewUpdate:  # fmt: skip
        """Deltas after `cursor` (a snapshot when the subscriber cannot continue from it).

        Waits up to `timeout_s` for something new before answering with no deltas.
        `replica_id` names the subscribing ingress replica: one that stops
        subscribing is dead, and workers abort the requests it sent. `found`:
        the abort notes whose request it found and cancelled (`relay_abort`).
        `queued`: (pool, requests waiting in its queue) pairs, for the autoscaler.
        """
        self._state.note_replica(replica_id, generation, cursor, found, dict(queued))
        if self._state.aborts_pending:
            self._acked.set()
            self._acked = asyncio.Event()
        update = self._state.updates_since(generation, cursor)
        if update.snapshot or update.deltas:
            return update
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout_s)
        return self._state.updates_since(generation, cursor)

    async def routed(
        self, replica_id: str, notes: tuple[tuple[str, tuple[bytes, ...]], ...],
        pins: tuple[SessionPin, ...] = (),
    ) -> int:  # fmt: skip
        """Relay an ingress replica's routing decisions, `(worker_id, block hashes)`
        each, to the other replicas through the view, and its session pins to every
        replica (the scheduler keeps them too); returns how many were published."""
        published = sum(self._state.note_routed(replica_id, w, hashes) for w, hashes in notes)
        published += self._state.note_pins(pins)
        if published:
            self._wake()
        return published

    async def relay_abort(self, key: str, origin: str, timeout_s: float = 2.0) -> bool:
        """Find and cancel a request waiting in another ingress replica's queue: every
        replica but `origin` gets an abort note with its view. True as soon as one
        found it; False once all the live others have passed the note, or after
        `timeout_s`."""
        note_id = self._state.publish_abort(key, origin)
        self._wake()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        try:
            while (settled := self._state.abort_settled(note_id, origin)) is None:
                left = deadline - loop.time()
                if left <= 0:
                    return False
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._acked.wait(), left)
            return settled
        finally:
            self._state.forget_abort(note_id)

    async def get_view(self) -> ClusterView:
        """Snapshot of workers, liveness and latest reports."""
        return self._state.view()

    async def generation(self) -> int:
        """This incarnation's id; changes whenever the actor is (re)started."""
        return self._state.generation

    async def cached_hashes(self, worker_id: str) -> frozenset[bytes]:
        """The hashes the scheduler's index holds for a worker."""
        return self._state.cached_hashes(worker_id)

    async def index_stats(self) -> dict[str, int]:
        """Index drift (blocks), KV sequence gaps, snapshots applied and route notes relayed
        so far, and the session pins held now."""
        return {
            "drift_blocks": self._state.index_drift(),
            "kv_gaps": self._state.kv_gaps,
            "snapshots": self._state.snapshots,
            "route_notes": self._state.route_notes,
            "session_pins": self._state.sessions.size(),
        }

    async def set_migration_transfer(self, transfer: bool | str) -> bool:
        """Switch `scheduler.migration_transfer` (true, false or "auto") at run time (a
        benchmark compares the ways on one cluster); returns False when migration is off."""
        policy = self._state.migration
        if policy is None:
            return False
        self._state.migration = dataclasses.replace(policy, transfer=transfer)
        return True

    async def migration_stats(self) -> dict[str, int]:
        """Migrations ordered per pool by this incarnation."""
        return dict(self._state.migrations)

    def _wake(self) -> None:
        # Wake every waiting subscriber; the next waiters get a fresh event.
        self._changed.set()
        self._changed = asyncio.Event()

    async def _tick_loop(self) -> None:
        while True:
            try:
                if self._state.tick():
                    self._wake()
            except Exception:  # never let one bad tick stop liveness updates
                logger.exception("scheduler tick failed")
            await asyncio.sleep(TICK_INTERVAL_S)


def shard_actor_name(shard: int) -> str:
    """The named actor of a scheduler shard: shard 0 keeps the unsharded scheduler's name."""
    if shard < 0:
        raise ValueError(f"shard must be >= 0, got {shard}")
    return SCHEDULER_NAME if shard == 0 else f"{SCHEDULER_NAME}-{shard}"


def start_scheduler(
    *,
    namespace: str | None = None,
    shard: int = 0,
    detached: bool = False,
    report_timeout_s: float = 3.0,
    max_restarts: int = -1,
    eviction: EvictionWatermarks | None = DEFAULT_EVICTION,
    stall_timeout_s: float = 3.0,
    index_check_interval_s: float = 10.0,
    migration: MigrationPolicy | None = DEFAULT_MIGRATION,
    resources: dict[str, float] | None = None,
    session_pins: int = DEFAULT_MAX_PER_POOL,
) -> Any:
    """Get or create the named scheduler actor and return its handle.

    Restartable without limit by default, and its calls are retried across a
    restart. It asks for no CPU: it is bookkeeping, and must not take a slot a
    worker needs. `detached` makes it outlive the driver (for `pagefleet serve`
    joining a long-lived cluster). `eviction`: the free-block watermarks it
    asks workers to keep (`SchedulerConfig.eviction_watermarks()`; None: off).
    `stall_timeout_s`: a worker with work that computes nothing this long leaves
    routing. `index_check_interval_s`: how often each worker is asked for a
    snapshot to measure index drift. `shard`: which scheduler shard (its actor
    name, `shard_actor_name`). `migration`: when a worker short of blocks hands
    a request to another worker of its pool (None: never). An existing actor
    keeps the settings it was started with. `resources`: custom Ray resources it
    asks for (the cluster pins it to the head node with Ray's head-node marker).
    `session_pins`: session pins kept per pool (`router.session_max_pins`).
    """
    options: dict[str, Any] = {
        "name": shard_actor_name(shard),
        "get_if_exists": True,
        "max_restarts": max_restarts,
        "max_task_retries": -1 if max_restarts != 0 else 0,
        "num_cpus": 0,
    }
    if resources:
        options["resources"] = resources
    if namespace is not None:
        options["namespace"] = namespace
    if detached:
        options["lifetime"] = "detached"
    return ray.remote(SchedulerActor).options(**options).remote(
        report_timeout_s, eviction, stall_timeout_s, index_check_interval_s, migration, session_pins
    )


def get_scheduler(namespace: str | None = None, shard: int = 0) -> Any:
    """The running scheduler's (or scheduler shard's) handle, or None if there is none."""
    try:
        return ray.get_actor(shard_actor_name(shard), namespace=namespace)
    except ValueError:
        return None
