"""The ingress's table of worker actors, kept by the central scheduler's view.

One `WorkerSlot` per worker of the deployment: its handle, liveness and
latest load report as the view last said, and what this ingress replica alone
knows exactly (requests it has in flight there). `WorkerSlots` applies each
`WorkerDelta` of the view (`pagefleet.cluster.fleet_view.FleetView` feeds it)
and answers "who is alive, how full is it" for admission and status.

Membership follows the view too (`pagefleet.cluster.membership` adds and
removes workers while serving): a worker of a configured pool that the view
shows for the first time gets a slot here (its handle looked up by `resolve`),
a draining one leaves routing while its streams finish, and a deregistered
one (`gone`) loses its slot, its router entry and its metric series.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pagefleet.cluster.config import ClusterConfig, PoolConfig
from pagefleet.cluster.metrics import IngressMetrics
from pagefleet.cluster.router import Router
from pagefleet.cluster.status import BLOCK_FIELDS, PoolStatus, WorkerStatus
from pagefleet.scheduler.messages import WorkerDelta
from pagefleet.scheduler.policy import Claim
from pagefleet.worker.events import LoadReport

logger = logging.getLogger(__name__)

@dataclass
class WorkerSlot:
    """The ingress's view of one worker actor."""

    worker_id: str
    pool: str
    handle: Any
    alive: bool = False
    node_id: str = ""
    node_ip: str = ""
    report: LoadReport | None = None
    requests_routed: int = 0
    # Being removed: out of routing, but the streams running there stay and finish.
    draining: bool = False
    # Set when the worker leaves routing: streams running there stop waiting on it and
    # move. A fresh event each time it comes back.
    left: asyncio.Event = field(default_factory=asyncio.Event)
    # Requests this ingress has sent to the worker and not seen finish, by request key,
    # with what each will take there at most: exact and never stale, unlike the
    # report's counts, so admission counts on them.
    claims: dict[str, Claim] = field(default_factory=dict)

    @property
    def streaming(self) -> bool:
        """Its streams run there: alive, or draining (out of routing, finishing them)."""
        return self.alive or self.draining

    @property
    def in_flight(self) -> int:
        """Requests of this replica running (or queued) at the worker now."""
        return len(self.claims)


class WorkerSlots:
    """Every worker slot of the deployment, by id and by pool, following the view.

    `on_change(pool)` is called after a delta that may have made room in the
    pool (fresh load, a worker back): the ingress dispatches its wait queue.
    `resolve(worker_id)` returns the actor handle of a worker that joined a
    configured pool after start (None: such workers are ignored).
    """

    def __init__(
        self,
        config: ClusterConfig,
        workers: Mapping[str, Sequence[tuple[str, Any]]],
        router: Router,
        on_change: Callable[[str], None],
        metrics: IngressMetrics | None = None,
        resolve: Callable[[str], Any] | None = None,
    ) -> None:
        self._router = router
        self._on_change = on_change
        self._metrics = metrics
        self._resolve = resolve
        self._slots: dict[str, WorkerSlot] = {}
        self._pools: dict[str, list[WorkerSlot]] = {}
        for pool in config.pools:
            self._pools[pool.name] = []
            for worker_id, handle in workers.get(pool.name, ()):
                self._add(worker_id, pool.name, handle)
                router.add_worker(worker_id, pool.name, block_size=pool.engine.block_size)
                # Out of routing until the scheduler's view has it (it may still be loading).
                router.set_alive(worker_id, False)
        # Per pool, (time, pool-wide preemptions so far) samples of the last minute.
        self._preemption_samples: dict[str, deque[tuple[float, int]]] = {
            pool.name: deque() for pool in config.pools
        }

    def _add(self, worker_id: str, pool: str, handle: Any) -> WorkerSlot:
        slot = WorkerSlot(worker_id, pool, handle)
        self._slots[worker_id] = slot
        self._pools[pool].append(slot)
        return slot

    def _join(self, delta: WorkerDelta) -> WorkerSlot | None:
        """A slot for a worker the view shows for the first time (added while serving),
        or None: not of a configured pool, or its actor cannot be found (yet)."""
        info = delta.info
        if self._resolve is None or info.pool not in self._pools:
            return None  # a worker this deployment does not route to (another app's pool)
        try:
            handle = self._resolve(info.worker_id)
        except Exception as exc:  # killed already, or not visible yet: a later delta retries
            logger.warning("worker %s joined the view but has no actor: %s", info.worker_id, exc)
            return None
        logger.info("worker %s joined pool %s", info.worker_id, info.pool)
        return self._add(info.worker_id, info.pool, handle)

    def _forget(self, slot: WorkerSlot) -> None:
        """A deregistered (removed) worker: no slot, no metric series; a stream still
        waiting on it moves (it was killed, so its call fails anyway)."""
        logger.info("worker %s left pool %s", slot.worker_id, slot.pool)
        self._slots.pop(slot.worker_id, None)
        self._pools[slot.pool].remove(slot)
        slot.alive = False
        slot.left.set()
        self._router.remove_worker(slot.worker_id)
        if self._metrics is not None:
            self._metrics.forget_worker(slot.pool, slot.worker_id)

    def __getitem__(self, worker_id: str) -> WorkerSlot:
        return self._slots[worker_id]

    def pool(self, name: str) -> list[WorkerSlot]:
        """The slots of a pool, in configuration order."""
        return self._pools[name]

    def all(self) -> list[WorkerSlot]:
        return list(self._slots.values())

    def mark_dead(self, slot: WorkerSlot) -> None:
        """Out of routing now, and its streams move (a failed call showed it gone)."""
        slot.alive = False
        slot.left.set()
        self._router.set_alive(slot.worker_id, False)
        if self._metrics is not None and self._slots.get(slot.worker_id) is slot:
            self._metrics.mark_dead(slot.pool, slot.worker_id)  # not for a removed one

    def apply(self, delta: WorkerDelta) -> None:
        """One worker's new state from the scheduler (the router already has it)."""
        slot = self._slots.get(delta.info.worker_id)
        if slot is None:
            slot = None if delta.gone else self._join(delta)
            if slot is None:
                # The router took the worker from the same delta: without a slot (no
                # handle) it must not be chosen. The next delta tries again.
                self._router.set_alive(delta.info.worker_id, False)
                return
        if delta.gone:
            self._forget(slot)
            self._on_change(slot.pool)  # waiting requests may now fail or fit elsewhere
            return
        slot.node_id = delta.info.node_id or slot.node_id
        slot.node_ip = delta.info.node_ip or slot.node_ip
        if delta.report is not None and delta.report.supersedes(slot.report):
            slot.report = delta.report
            self._sample_preemptions(slot.pool)
            if self._metrics is not None:
                self._metrics.observe_report(delta.report)
        if self._metrics is not None:
            self._metrics.index_drift.labels(slot.pool, slot.worker_id).set(delta.drift_blocks)
        slot.draining = delta.draining
        if delta.routable and not slot.alive:
            slot.alive = True
            slot.left = asyncio.Event()
        elif not delta.routable and slot.alive:
            if delta.draining:
                logger.info("worker %s draining: out of routing, its streams finish there", slot.worker_id)
            else:
                logger.warning("worker %s out of routing (%s)", slot.worker_id, delta.liveness.value)
            # No new requests go there. Its streams stay unless it is hung: a late
            # report alone may be a slow scheduler or a busy machine, a draining
            # worker finishes them, and a dead worker's streams fail over by themselves.
            slot.alive = False
        if self._metrics is not None and not slot.alive:
            self._metrics.mark_dead(slot.pool, slot.worker_id)  # after its report's 1
        if delta.stalled and not slot.left.is_set():
            slot.left.set()  # hung: its streams move now (see `RequestRun._stream`)
        # Fresh load or a worker back: route waiting requests it has room for.
        self._on_change(slot.pool)

    def _sample_preemptions(self, pool: str) -> None:
        now = time.monotonic()
        total = sum(
            sum(s.report.preemptions.values()) for s in self._pools[pool] if s.report is not None
        )
        samples = self._preemption_samples[pool]
        samples.append((now, total))
        while len(samples) > 1 and now - samples[1][0] >= 60.0:
            samples.popleft()

    def preemptions_per_minute(self) -> dict[str, float]:
        """Preemptions per pool over the last minute (counting from the oldest sample
        in that minute; a restarted worker's counters starting over count as 0)."""
        out: dict[str, float] = {}
        for pool, samples in self._preemption_samples.items():
            if len(samples) < 2:
                out[pool] = 0.0
                continue
            (t0, first), (t1, last) = samples[0], samples[-1]
            out[pool] = max(0, last - first) * 60.0 / max(t1 - t0, 60.0)
        return out

    def live_workers(self) -> dict[str, int]:
        """Live workers per pool: the health rule (healthy while none is 0) of both fronts."""
        return {name: sum(slot.alive for slot in slots) for name, slots in self._pools.items()}

    def pool_status(self, cfg: PoolConfig, router_policy: str, queued: int) -> PoolStatus:
        """A pool's counters summed over its live workers, with one row per worker;
        `queued`: its requests waiting in this replica's queue."""
        slots = self._pools[cfg.name]
        workers = tuple(worker_status(slot) for slot in slots)
        live = [w for w in workers if w.alive]
        query = sum(w.prefix_query_tokens for w in workers)
        hits = sum(w.prefix_hit_tokens for w in workers)
        sums = {key: sum(getattr(w, key) for w in live) for key in BLOCK_FIELDS}
        sums["num_waiting"] += queued
        return PoolStatus(
            name=cfg.name,
            model=str(cfg.engine.model),
            router_policy=router_policy,
            live_workers=len(live),
            hit_rate=hits / query if query else 0.0,
            # Cumulative over the workers' incarnations now reporting.
            migrations=sum(w.migrations_out for w in workers),
            preemptions=sum(w.preemptions for w in workers),
            evictions=sum(w.evictions for w in workers),
            workers=workers,
            **sums,
        )


def worker_status(slot: WorkerSlot) -> WorkerStatus:
    """One worker's row of the status, from its latest report (zeros before the first)."""
    r = slot.report
    known = WorkerStatus(
        slot.worker_id, slot.pool, slot.alive, slot.draining, slot.node_id, slot.node_ip,
        requests_routed=slot.requests_routed,
    )  # fmt: skip
    if r is None:
        return known
    return dataclasses.replace(
        known,
        prefix_query_tokens=r.prefix_query_tokens,
        prefix_hit_tokens=r.prefix_hit_tokens,
        hit_rate=r.hit_rate,
        migrations_out=r.migrations_out,
        preemptions=sum(r.preemptions.values()),
        evictions=r.evictions,
        tenant_live_blocks=dict(r.tenant_live_blocks),
        total_blocks=r.total_blocks,
        free_blocks=r.free_blocks,
        live_blocks=r.live_blocks,
        cached_blocks=r.cached_blocks,
        peak_live_blocks=r.peak_live_blocks,
        num_running=r.num_running,
        num_waiting=r.num_waiting,
        resident_adapters=r.resident_adapters,
    )
