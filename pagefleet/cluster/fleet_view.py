"""An ingress replica's local copy of the central scheduler's view.

The scheduler is the one source of truth for worker liveness, load and the
prefix index. Each ingress replica subscribes to it with a long poll from a
cursor (`SchedulerActor.subscribe`) and applies the answer to its `Router`
and to its worker slots; routing then reads only this local copy, so no
remote call sits on the routing path.

A replica that starts fresh, falls behind the scheduler's bounded delta log,
or meets a restarted scheduler (a new generation) gets a snapshot: it clears
its index and rebuilds it from the snapshot. Workers a restarted scheduler
does not know yet keep their last state here, so routing goes on while the
scheduler rebuilds. While the scheduler is unreachable the replica keeps the
last view and retries.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from pagefleet.cluster.router import Router
from pagefleet.scheduler.state import ViewUpdate, WorkerDelta

logger = logging.getLogger(__name__)

# A long poll answers at the latest after this long without news; short enough
# that "last heard from the scheduler" stays a useful staleness signal.
LONG_POLL_S = 1.0
RETRY_S = 0.2


class FleetView:
    """Applies the scheduler's `ViewUpdate`s to a router and a per-worker callback."""

    def __init__(
        self, router: Router, on_delta: Callable[[WorkerDelta], None], replica_id: str = ""
    ) -> None:
        self.router = router
        self.replica_id = replica_id
        self._on_delta = on_delta
        self.generation: int | None = None
        self.version = 0
        self.snapshots = 0
        self.last_update_at: float | None = None  # monotonic time of the last answer

    def apply(self, update: ViewUpdate) -> None:
        """Apply one answer of `subscribe` and move the cursor past it."""
        if update.snapshot:
            self.router.clear_index()
            self.snapshots += 1
        for delta in update.deltas:
            self.router.apply_delta(delta)
            self._on_delta(delta)
        self.generation = update.generation
        self.version = update.version
        self.last_update_at = time.monotonic()

    def staleness_s(self) -> float:
        """Seconds since the scheduler last answered (inf before the first answer)."""
        if self.last_update_at is None:
            return float("inf")
        return time.monotonic() - self.last_update_at

    async def follow(self, scheduler: Any) -> None:
        """Long-poll `scheduler` (an actor handle) forever, applying every answer."""
        while True:
            try:
                update = await scheduler.subscribe.remote(
                    self.generation, self.version, LONG_POLL_S, self.replica_id
                )
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # scheduler restarting or gone: keep the last view
                logger.debug("fleet view: scheduler unreachable (%s); retrying", type(exc).__name__)
                await asyncio.sleep(RETRY_S)
                continue
            try:
                self.apply(update)
            except Exception:  # a bad update must not stop the subscription
                logger.exception("fleet view: applying an update failed; asking for a snapshot")
                self.generation = None
