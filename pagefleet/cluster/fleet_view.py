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

Each subscribe also tells the scheduler how many requests wait in this
replica's queues, per pool (`queued`): requests held back at the ingress
for want of room are load the workers' own reports do not show, and the
pool autoscaler counts them.

The view also carries `AbortNote`s: an abort that reached another replica
and found its request nowhere else. The replica holding that request
waiting cancels it and says so with its next subscribe.

`RouteSharer` carries this replica's routing decisions the other way, to
the scheduler shard owning the pool, which relays them to the other
replicas as route notes (`Router.note_routed_elsewhere`): one call per
shard per `ROUTE_NOTE_INTERVAL_S` at most, carrying every decision made
since the previous one, and every session pin (`Router.on_pinned`). The
scheduler keeps the pins and relays each, as a `SessionPin` in the view, to
every replica, this one included: all apply them in the scheduler's order,
so when two replicas pin one session at once they end up agreeing on the
last.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pagefleet.cluster.router import Router
from pagefleet.scheduler.messages import AbortNote, ViewUpdate, WorkerDelta
from pagefleet.scheduler.session_pins import SessionPin

logger = logging.getLogger(__name__)

# A long poll answers at the latest after this long without news; short enough
# that "last heard from the scheduler" stays a useful staleness signal.
LONG_POLL_S = 1.0
RETRY_S = 0.2
# A replica sends the routing decisions of this long in one call to a shard: at most
# 1 / ROUTE_NOTE_INTERVAL_S calls a second per replica and shard, whatever the rate.
ROUTE_NOTE_INTERVAL_S = 0.01


class FleetView:
    """Applies the scheduler shards' `ViewUpdate`s to a router and a per-worker callback.

    One cursor per shard (`shards` of them; `follow` adds one per handle it
    is given); `generation` and `version` are shard 0's, the only one unless
    the scheduler is sharded.
    """

    def __init__(
        self,
        router: Router,
        on_delta: Callable[[WorkerDelta], None],
        replica_id: str = "",
        *,
        shards: int = 1,
        on_abort: Callable[[str], bool] | None = None,
        queued: Callable[[], Mapping[str, int]] | None = None,
    ) -> None:
        """`on_abort(key)`: cancel the request `key` if this replica holds it (an
        `AbortNote` of another replica); returns whether it did. `queued()`: the
        requests waiting in this replica's queues, per pool, told with each subscribe."""
        if shards < 1:
            raise ValueError(f"shards must be >= 1, got {shards}")
        self.router = router
        self.replica_id = replica_id
        self._on_delta = on_delta
        self._on_abort = on_abort
        self._queued = queued
        self._cursors: list[_Cursor] = [_Cursor() for _ in range(shards)]
        self.snapshots = 0

    @property
    def generation(self) -> int | None:
        """Shard 0's generation the view follows (None before its first answer)."""
        return self._cursors[0].generation

    @property
    def version(self) -> int:
        """Shard 0's version the view has applied up to."""
        return self._cursors[0].version

    def cursor(self, shard: int = 0) -> tuple[int | None, int]:
        """(generation, version) of a shard's view as applied here."""
        c = self._cursor(shard)
        return c.generation, c.version

    def apply(self, update: ViewUpdate, shard: int = 0) -> None:
        """Apply one answer of shard `shard`'s `subscribe` and move its cursor past it."""
        cursor = self._cursor(shard)
        if update.snapshot:
            if len(self._cursors) == 1:
                self.router.clear_index()
            else:
                # Only this shard's workers: the ones it told us of, and the ones it tells now.
                cursor.workers.update(d.info.worker_id for d in update.deltas if isinstance(d, WorkerDelta))
                self.router.clear_index(cursor.workers)
            self.snapshots += 1
        for delta in update.deltas:
            if isinstance(delta, SessionPin):
                self.router.apply_pin(delta)
                continue
            if isinstance(delta, AbortNote):
                if delta.origin != self.replica_id and self._on_abort and self._on_abort(delta.key):
                    cursor.found.append(delta.note_id)
                continue
            if delta.routed:  # another replica's routing decision, no change of state
                if delta.routed_by != self.replica_id:
                    self.router.note_routed_elsewhere(delta.info.worker_id, delta.routed)
                continue
            if delta.gone:
                cursor.workers.discard(delta.info.worker_id)
            else:
                cursor.workers.add(delta.info.worker_id)
            self.router.apply_delta(delta)
            self._on_delta(delta)
        cursor.generation = update.generation
        cursor.version = update.version
        cursor.last_update_at = time.monotonic()

    def staleness_s(self) -> float:
        """Seconds since the stalest shard last answered (inf before every shard's first answer)."""
        if any(c.last_update_at is None for c in self._cursors):
            return float("inf")
        return time.monotonic() - min(c.last_update_at or 0.0 for c in self._cursors)

    async def follow(self, schedulers: Any | Sequence[Any]) -> None:
        """Long-poll the scheduler (an actor handle), or each shard of a sequence of
        handles, forever, applying every answer."""
        shards = list(schedulers) if isinstance(schedulers, Sequence) else [schedulers]
        if not shards:
            raise ValueError("follow needs at least one scheduler handle")
        while len(self._cursors) < len(shards):
            self._cursors.append(_Cursor())
        await asyncio.gather(*(self._follow_shard(i, handle) for i, handle in enumerate(shards)))

    async def _follow_shard(self, shard: int, scheduler: Any) -> None:
        cursor = self._cursors[shard]
        while True:
            found, cursor.found = tuple(cursor.found), []
            queued = tuple(sorted(self._queued().items())) if self._queued is not None else ()
            try:
                update = await scheduler.subscribe.remote(
                    cursor.generation, cursor.version, LONG_POLL_S, self.replica_id, found, queued
                )
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # scheduler restarting or gone: keep the last view
                cursor.found[:0] = found
                logger.debug(
                    "fleet view: scheduler shard %d unreachable (%s); retrying", shard, type(exc).__name__
                )
                await asyncio.sleep(RETRY_S)
                continue
            try:
                self.apply(update, shard)
            except Exception:  # a bad update must not stop the subscription
                logger.exception("fleet view: applying an update failed; asking for a snapshot")
                cursor.generation = None

    def _cursor(self, shard: int) -> _Cursor:
        if not 0 <= shard < len(self._cursors):
            raise ValueError(f"shard must be in [0, {len(self._cursors) - 1}], got {shard}")
        return self._cursors[shard]


class _Cursor:
    """Where the view stands with one scheduler shard."""

    __slots__ = ("found", "generation", "last_update_at", "version", "workers")

    def __init__(self) -> None:
        self.generation: int | None = None
        self.version = 0
        self.last_update_at: float | None = None  # monotonic time of the shard's last answer
        self.workers: set[str] = set()  # the workers this shard's deltas described
        self.found: list[int] = []  # abort notes found here, told with the next subscribe


class RouteSharer:
    """Sends this replica's routing decisions to the scheduler shards (see the module docstring).

    `note` is the router's `on_routed` callback, `pin` its `on_pinned`:
    synchronous and cheap, they only buffer. Nothing is sent before `bind`
    gives the shards' handles. A failed call drops its notes: they are hints
    that expire within `speculative_ttl_s` anyway, and the workers' KV
    events follow; a lost pin leaves the other replicas to score the
    session's next turn by prefix, which mostly finds the same worker.
    """

    def __init__(self, replica_id: str, shard_of: Mapping[str, int]) -> None:
        self.replica_id = replica_id
        self._shard_of = dict(shard_of)
        self._schedulers: list[Any] = []
        self._pending: dict[int, list[tuple[str, tuple[bytes, ...]]]] = {}
        self._pins: dict[int, list[SessionPin]] = {}
        self._sending: dict[int, asyncio.Task[None]] = {}

    def bind(self, schedulers: Any | Sequence[Any]) -> None:
        self._schedulers = list(schedulers) if isinstance(schedulers, Sequence) else [schedulers]

    def note(self, pool: str, worker_id: str, hashes: Sequence[bytes]) -> None:
        shard = self._shard(pool)
        if shard is not None:
            self._pending.setdefault(shard, []).append((worker_id, tuple(hashes)))
            self._start(shard)

    def pin(self, pin: SessionPin) -> None:
        shard = self._shard(pin.pool)
        if shard is not None:
            self._pins.setdefault(shard, []).append(pin)
            self._start(shard)

    def _shard(self, pool: str) -> int | None:
        shard = self._shard_of.get(pool, 0)
        return shard if shard < len(self._schedulers) else None

    def _start(self, shard: int) -> None:
        if shard not in self._sending:
            self._sending[shard] = asyncio.get_running_loop().create_task(self._send(shard))

    async def _send(self, shard: int) -> None:
        try:
            while True:
                await asyncio.sleep(ROUTE_NOTE_INTERVAL_S)  # the burst so far goes in one call
                notes = self._pending.pop(shard, [])
                pins = self._pins.pop(shard, [])
                if not notes and not pins:
                    return
                try:
                    await self._schedulers[shard].routed.remote(self.replica_id, tuple(notes), tuple(pins))
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # scheduler restarting: these hints are lost
                    logger.debug("route notes to shard %d dropped (%s)", shard, type(exc).__name__)
        finally:
            del self._sending[shard]

    async def close(self) -> None:
        tasks = list(self._sending.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
