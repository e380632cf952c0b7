"""The ingress wait queue: bounded per pool, shared between tenants by weighted fair queueing.

Requests wait here when every worker of their pool is full. Two rules keep
one tenant from hurting another that shares the pool:

- **Fair order.** Each pool dispatches its tenants by virtual finish time
  (weighted fair queueing, each request costing 1): the head of tenant ``t``
  starts at ``S = max(V, F_t)`` when it becomes the head and finishes at
  ``S + 1 / weight_t``, where ``F_t`` is the finish time of the tenant's last
  dispatched request and ``V`` the start time of the last request dispatched
  in the pool. The smallest finish time goes first (ties:
  the earlier arrival); within a tenant, higher priority first, then FIFO. A tenant that has
  been flooding the pool has run ahead in virtual time (requests routed at
  once, without waiting, are `charge`d too), so a newcomer's first request
  goes before the flood's backlog. An idle tenant earns no credit:
  it restarts from ``V``. A request's cost does not depend on its length.
- **Fair share of the bound.** At most `max_size` requests wait per pool, and
  a tenant may hold only its weighted share of them:
  ``max(1, floor(max_size * weight_t / W))``, where ``W`` sums the weights of
  the tenants whose home pool this is (plus the tenant's own weight when it
  is a guest there, which only an open server without API keys allows). One
  tenant alone in its pool may fill the whole queue.

Priority reorders only a tenant's own requests: whichever request a tenant
sends, its turn comes by its weight, so a tenant cannot buy more than its
share of the pool by marking everything urgent; among tenants' heads the
order stays weighted fair.

Past either bound `push` raises `ResourceExhausted` (RESOURCE_EXHAUSTED / 429)
with the numbers in the message.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

from pagefleet.scheduler.policy import ResourceExhausted

_T = TypeVar("_T")

DEFAULT_WEIGHT = 1.0


@dataclass
class _Entry(Generic[_T]):
    item: _T
    arrival: int  # global push counter: the tie-break between equal finish times
    priority: int = 0  # larger first within the tenant


@dataclass
class _Pool(Generic[_T]):
    """One pool's queues, one FIFO per tenant, and its virtual clock."""

    queues: dict[str, OrderedDict[str, _Entry[_T]]]
    last_finish: dict[str, float]
    # Virtual start time of each waiting tenant's head, fixed when it became the head
    # (recomputing it from the moving clock would let a waiting tenant fall behind).
    head_start: dict[str, float]
    vtime: float = 0.0
    size: int = 0


class FairWaitQueue(Generic[_T]):
    """Bounded wait queue per pool that dispatches tenants by weighted fair queueing.

    `members` maps each pool to its home tenants and their weights (a tenant
    missing from `members` weighs `DEFAULT_WEIGHT` wherever it waits). See
    the module docstring for the order and the per-tenant share of the bound.
    """

    def __init__(
        self, max_size: int, members: Mapping[str, Mapping[str, float]] | None = None
    ) -> None:
        if max_size < 0:
            raise ValueError(f"max_size must be >= 0, got {max_size}")
        self.max_size = max_size
        self._members = {pool: dict(tenants) for pool, tenants in (members or {}).items()}
        for pool, tenants in self._members.items():
            for tenant, weight in tenants.items():
                if not weight > 0:
                    raise ValueError(f"pool {pool!r}: tenant {tenant!r} weight must be > 0, got {weight}")
        self._pools: dict[str, _Pool[_T]] = {}
        self._where: dict[str, tuple[str, str]] = {}  # request id -> (pool, tenant)
        self._arrivals = 0

    # ----- shares -------------------------------------------------------

    def weight(self, pool: str, tenant: str) -> float:
        """The tenant's weight in `pool`."""
        return self._members.get(pool, {}).get(tenant, DEFAULT_WEIGHT)

    def share(self, pool: str, tenant: str) -> int:
        """How many requests `tenant` may have waiting in `pool` at once."""
        if self.max_size == 0:
            return 0
        home = self._members.get(pool, {})
        weight = self.weight(pool, tenant)
        total = sum(home.values()) + (0.0 if tenant in home else weight)
        return max(1, int(self.max_size * weight / total))

    # ----- queue --------------------------------------------------------

    def push(self, pool: str, tenant: str, request_id: str, item: _T, priority: int = 0) -> None:
        """Enqueue behind the tenant's requests of `priority` or higher (FIFO among equals).

        Raises ResourceExhausted when the pool's queue holds `max_size`
        requests or the tenant already holds its share of them.
        """
        if request_id in self._where:
            raise ValueError(f"request {request_id!r} is already waiting")
        state = self._pools.setdefault(pool, _Pool({}, {}, {}))
        queue = state.queues.get(tenant)
        mine = len(queue) if queue else 0
        share = self.share(pool, tenant)
        if mine >= share:
            raise ResourceExhausted(
                f"pool {pool!r}: tenant {tenant!r} has {mine} requests waiting, its share of "
                f"wait_queue_size {self.max_size} (weight {self.weight(pool, tenant):g}); retry later"
            )
        if state.size >= self.max_size:
            raise ResourceExhausted(
                f"pool {pool!r}: wait queue is full ({self.max_size} requests waiting); retry later"
            )
        if queue is None:
            queue = state.queues[tenant] = OrderedDict()
            state.head_start[tenant] = max(state.vtime, state.last_finish.get(tenant, 0.0))
        self._arrivals += 1
        queue[request_id] = _Entry(item, self._arrivals, priority)
        state.size += 1
        self._where[request_id] = (pool, tenant)

    def peek(self, pool: str) -> tuple[str, _T] | None:
        """The request the pool dispatches next (smallest virtual finish time), or None."""
        head = self._head(pool)
        if head is None:
            return None
        _tenant, request_id, entry, _start = head
        return request_id, entry.item

    def pop(self, pool: str) -> tuple[str, _T] | None:
        """Remove and return the request `peek` shows, advancing the pool's virtual clock."""
        head = self._head(pool)
        if head is None:
            return None
        tenant, request_id, entry, start = head
        state = self._pools[pool]
        state.vtime = start
        finish = start + 1.0 / self.weight(pool, tenant)
        state.last_finish[tenant] = finish
        self._drop(request_id)
        if tenant in state.queues:  # still backlogged: its next request starts where this one ends
            state.head_start[tenant] = finish
        return request_id, entry.item

    def charge(self, pool: str, tenant: str) -> None:
        """Count a request of `tenant` that went to a worker without waiting.

        It takes a turn in virtual time exactly as if it had been pushed and
        popped, so a flood that is routed at once still runs ahead of a tenant
        that arrives later.
        """
        state = self._pools.setdefault(pool, _Pool({}, {}, {}))
        start = max(state.vtime, state.last_finish.get(tenant, 0.0))
        state.vtime = start
        state.last_finish[tenant] = start + 1.0 / self.weight(pool, tenant)

    def get(self, request_id: str) -> _T | None:
        """The item of a waiting request, or None if it is not waiting."""
        where = self._where.get(request_id)
        if where is None:
            return None
        pool, tenant = where
        return self._pools[pool].queues[tenant][request_id].item

    def remove(self, request_id: str) -> bool:
        """Drop a waiting request (client aborted) without charging its tenant; False if absent."""
        if request_id not in self._where:
            return False
        self._drop(request_id)
        return True

    def size(self, pool: str, tenant: str | None = None) -> int:
        """Requests waiting for `pool` (of `tenant` only, when given)."""
        state = self._pools.get(pool)
        if state is None:
            return 0
        if tenant is None:
            return state.size
        return len(state.queues.get(tenant, ()))

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._where

    # ----- internals ----------------------------------------------------

    def _head(self, pool: str) -> tuple[str, str, _Entry[_T], float] | None:
        """(tenant, request id, entry, virtual start) of the next request, or None."""
        state = self._pools.get(pool)
        if state is None or state.size == 0:
            return None
        best: tuple[float, int, str, str, _Entry[_T], float] | None = None
        for tenant, queue in state.queues.items():
            if not queue:
                continue
            request_id, entry = _first(queue)
            start = state.head_start[tenant]
            finish = start + 1.0 / self.weight(pool, tenant)
            key = (finish, entry.arrival)
            if best is None or key < (best[0], best[1]):
                best = (finish, entry.arrival, tenant, request_id, entry, start)
        assert best is not None
        return best[2], best[3], best[4], best[5]

    def _drop(self, request_id: str) -> None:
        pool, tenant = self._where.pop(request_id)
        state = self._pools[pool]
        queue = state.queues[tenant]
        del queue[request_id]
        state.size -= 1
        if not queue:
            del state.queues[tenant]
            del state.head_start[tenant]


def _first(queue: OrderedDict[str, _Entry[_T]]) -> tuple[str, _Entry[_T]]:
    """A tenant's next request: the earliest of its highest priority."""
    best_id, best = next(iter(queue.items()))
    for request_id, entry in queue.items():
        if entry.priority > best.priority:
            best_id, best = request_id, entry
    return best_id, best
