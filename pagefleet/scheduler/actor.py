"""The central scheduler as a named, restartable Ray actor: a thin wrapper around ClusterState.

The only file of `pagefleet.scheduler` that imports Ray. The actor keeps no
state worth persisting: when Ray restarts it, `__init__` runs again with a new
generation and an empty view, and workers re-register as soon as a report is
answered with an unknown-worker or new-generation ack. Routers keep routing on
their last view meanwhile.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray

from pagefleet.scheduler.policy import EvictionWatermarks
from pagefleet.scheduler.state import ClusterState, ClusterView, PoolCapacity
from pagefleet.worker.events import SCHEDULER_ACTOR_NAME, WorkerInfo

SCHEDULER_NAME = SCHEDULER_ACTOR_NAME
# SchedulerConfig's defaults: evict ahead when under 5% of a worker's blocks are free.
DEFAULT_EVICTION = EvictionWatermarks(low=0.05, high=0.10)


@dataclass(frozen=True)
class ReportAck:
    """Answer to a load report: re-register when `registered` is False or the generation changed.

    `evict_blocks`: cached blocks the worker should evict now to get back above
    the free-block watermark (0: none).
    """

    generation: int
    registered: bool
    evict_blocks: int = 0


class SchedulerActor:
    """Plain class with the actor's methods; `start_scheduler` wraps it with `ray.remote`."""

    def __init__(
        self, report_timeout_s: float = 3.0, eviction: EvictionWatermarks | None = DEFAULT_EVICTION
    ) -> None:
        self._state = ClusterState(report_timeout_s=report_timeout_s, eviction=eviction)

    def register_worker(self, info: WorkerInfo) -> int:
        """Add or refresh a worker (idempotent); returns the scheduler's generation."""
        return self._state.register_worker(info)

    def deregister_worker(self, worker_id: str) -> bool:
        """Forget a worker; False if unknown."""
        return self._state.deregister_worker(worker_id)

    def report(self, worker_id: str, data: bytes) -> ReportAck:
        """Accept a msgpack LoadReport; the ack says whether to re-register and what to evict."""
        registered = self._state.report_bytes(worker_id, data)
        evict = self._state.blocks_to_evict(worker_id) if registered else 0
        return ReportAck(self._state.generation, registered, evict)

    def get_view(self) -> ClusterView:
        """Snapshot of workers, liveness and latest reports."""
        return self._state.view()

    def generation(self) -> int:
        """This incarnation's id; changes whenever the actor is (re)started."""
        return self._state.generation

    def capacity(self, pool: str) -> PoolCapacity:
        """Block and queue totals over the pool's live workers."""
        return self._state.capacity(pool)


def start_scheduler(
    *,
    namespace: str | None = None,
    detached: bool = False,
    report_timeout_s: float = 3.0,
    max_restarts: int = -1,
    eviction: EvictionWatermarks | None = DEFAULT_EVICTION,
) -> Any:
    """Get or create the named scheduler actor and return its handle.

    Restartable without limit by default, and its calls are retried across a
    restart. It asks for no CPU: it is bookkeeping, and must not take a slot a
    worker needs. `detached` makes it outlive the driver (for `pagefleet serve`
    joining a long-lived cluster). `eviction`: the free-block watermarks it
    asks workers to keep (`SchedulerConfig.eviction_watermarks()`; None: off).
    An existing actor keeps the settings it was started with.
    """
    options: dict[str, Any] = {
        "name": SCHEDULER_NAME,
        "get_if_exists": True,
        "max_restarts": max_restarts,
        "max_task_retries": -1 if max_restarts != 0 else 0,
        "num_cpus": 0,
    }
    if namespace is not None:
        options["namespace"] = namespace
    if detached:
        options["lifetime"] = "detached"
    return ray.remote(SchedulerActor).options(**options).remote(report_timeout_s, eviction)


def get_scheduler(namespace: str | None = None) -> Any:
    """The running scheduler's handle, or None if there is none."""
    try:
        return ray.get_actor(SCHEDULER_NAME, namespace=namespace)
    except ValueError:
        return None
