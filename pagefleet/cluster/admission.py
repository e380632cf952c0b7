"""Admission at the ingress: route a request when a worker has room, else queue it.

Late binding: a request is sent to a worker only when some live worker of its
pool has room for it: fewer than max_num_seqs of this replica's requests in
flight there and, by its latest load report, room for the blocks it takes.
With `scheduler.admission: full` (the default) that is every block up to its
max_tokens (its uncached part), beside what the requests already there will
still take (`policy.claim_headroom`: the report's committed blocks, with this
replica's own part replaced by its exact claims, so what it sent since the
report counts); with `prompt`, only the prompt's uncached blocks. Otherwise it
waits in the pool's bounded `FairWaitQueue` (tenants sharing the pool in
weighted fair order, higher priority first within a tenant) and is routed when
a request finishes or the view shows capacity,
so the router places it with fresh load and cache information instead of it
queuing blind inside one worker's engine. Past the queue's bound, or past the
tenant's share of it, the request is refused with RESOURCE_EXHAUSTED.

Priority: a request that finds no room, but a worker running requests of
lower priority whose blocks (and sequence slots) would make room, is sent
there now, and that worker's engine preempts them for it; it does not wait
behind them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from pagefleet.cluster.api import ErrorCode, GenerationRequest, IngressError
from pagefleet.cluster.config import ClusterConfig, PoolConfig
from pagefleet.cluster.metrics import IngressMetrics
from pagefleet.cluster.router import ROUTING_POLICIES, NoWorkerAvailable, Router
from pagefleet.cluster.worker_slots import WorkerSlot, WorkerSlots
from pagefleet.scheduler.fair_queue import FairWaitQueue
from pagefleet.scheduler.policy import (
    ADMISSION_MODES,
    Claim,
    ResourceExhausted,
    blocks_for_prompt,
    claim_headroom,
    full_claim,
)
from pagefleet.scheduler.session_pins import SessionKey
from pagefleet.worker.events import LoadReport


@dataclass
class Waiter:
    """A request waiting in its pool's wait queue for a worker with room.

    `future` resolves to the slot it was routed to (with `in_flight` already
    counted), or to None when the request was aborted while waiting.
    """

    key: str
    pool: str
    prompt_ids: list[int]
    hashes: list[bytes]
    priority: int
    max_tokens: int
    n: int
    future: asyncio.Future[WorkerSlot | None]
    adapter: str | None = None
    session: SessionKey | None = None  # (tenant, session id) of a request naming its session


class Admission:
    """The wait queues of one ingress replica and the rule that routes out of them."""

    def __init__(
        self,
        config: ClusterConfig,
        router: Router,
        slots: WorkerSlots,
        origin: str,
        metrics: IngressMetrics | None = None,
    ) -> None:
        self.config = config
        # This replica's tag in the workers' reports (`LoadReport.origin_claims`).
        self.origin = origin
        self.router = router
        self.slots = slots
        self.metrics = metrics
        self.policy: str = config.router.policy
        self.mode: str = config.scheduler.admission
        # Tenants sharing a pool split its queue by weight and are dispatched fairly.
        members = {
            pool.name: {t.name: t.weight for t in config.tenants if t.pool == pool.name}
            for pool in config.pools
        }
        self._waiting: FairWaitQueue[Waiter] = FairWaitQueue(
            config.scheduler.wait_queue_size, members
        )

    def set_policy(self, policy: str) -> None:
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"router policy must be one of {ROUTING_POLICIES}, got {policy!r}")
        self.policy = policy

    def set_mode(self, mode: str) -> None:
        """What a worker must have room for: "full" (prompt + max_tokens) or "prompt"."""
        if mode not in ADMISSION_MODES:
            raise ValueError(f"admission must be one of {ADMISSION_MODES}, got {mode!r}")
        self.mode = mode
        for pool in self.config.pools:
            self.dispatch(pool.name)  # looser room may seat waiting requests now

    # ----- the queue ----------------------------------------------------

    def waiting(self, pool: str, tenant: str | None = None) -> int:
        """Requests waiting in the pool's queue (of one tenant, if given)."""
        return self._waiting.size(pool, tenant)

    def is_waiting(self, key: str) -> bool:
        return key in self._waiting

    def admit(self, pool: PoolConfig, req: GenerationRequest, prompt_ids: list[int]) -> WorkerSlot | Waiter:
        """Route now when a worker has room and nobody waits, else join the pool's wait queue.

        Returns the routed slot (its `in_flight` counted) or the queued waiter.
        Raises UNAVAILABLE without a live worker and RESOURCE_EXHAUSTED when
        the wait queue is full.
        """
        slots = self.slots.pool(pool.name)
        live = sum(1 for slot in slots if slot.alive)
        if live == 0:
            raise IngressError(ErrorCode.UNAVAILABLE, f"no live worker in pool {pool.name!r}")
        hashes = self.router.block_hashes(pool.name, prompt_ids, salt=req.salt, adapter_id=req.adapter_id)
        waiter = Waiter(
            req.key, pool.name, prompt_ids, hashes, req.priority, req.params.max_tokens,
            req.params.n, asyncio.get_running_loop().create_future(), req.adapter,
            (req.tenant, req.session_id) if req.session_id else None,
        )
        head = self._waiting.peek(pool.name)
        # FIFO: nobody may take free room ahead of a waiting request, but a request that
        # outranks the head may still preempt lower priorities running somewhere.
        if head is None or head[1].priority < req.priority:
            slot = self._place(pool, waiter, free_room=head is None)
            if slot is not None:
                self._waiting.charge(pool.name, req.tenant)  # its turn counts in fair order
                return slot
        try:
            self._waiting.push(pool.name, req.tenant, req.key, waiter, req.priority)
        except ResourceExhausted as exc:
            raise self._refusal(pool, req.tenant, live) from exc
        return waiter

    def _refusal(self, pool: PoolConfig, tenant: str, live: int) -> IngressError:
        max_num_seqs = pool.engine.max_num_seqs
        queue = self.config.scheduler.wait_queue_size
        running = sum(slot.in_flight for slot in self.slots.pool(pool.name))
        share = self._waiting.share(pool.name, tenant)
        over_share = self._waiting.size(pool.name, tenant) >= share and share < queue
        if self.metrics is not None:
            reason = "queue_share" if over_share else "queue_full"
            self.metrics.tenant_requests_refused.labels(pool.name, tenant, reason).inc()
        if over_share:
            # The pool may have room in its queue, but not for this tenant: others
            # sharing the pool keep their part (a flood cannot lock them out).
            return IngressError(
                ErrorCode.RESOURCE_EXHAUSTED,
                f"tenant {tenant!r} has {share} requests waiting in pool {pool.name!r}, "
                f"its share of wait_queue_size {queue} (weight "
                f"{self._waiting.weight(pool.name, tenant):g}); retry later",
            )
        return IngressError(
            ErrorCode.RESOURCE_EXHAUSTED,
            f"pool {pool.name!r} is full: {running} requests running and "
            f"{self._waiting.size(pool.name)} waiting, limit {live * max_num_seqs + queue} "
            f"({live} workers x max_num_seqs {max_num_seqs} + wait_queue_size {queue}); "
            "retry later",
        )

    def cancel(self, key: str) -> bool:
        """Take a waiting request out of the queue; its waiter resolves to None. False: not waiting."""
        waiter = self._waiting.get(key)
        if waiter is None:
            return False
        self._waiting.remove(key)
        if not waiter.future.done():
            waiter.future.set_result(None)
        return True

    def leave(self, key: str, waiter: Waiter) -> None:
        """A waiting request's client went away: drop it, or give back the slot it just got."""
        if self._waiting.get(key) is waiter:
            self._waiting.remove(key)
        if not waiter.future.done():
            waiter.future.cancel()
        elif not waiter.future.cancelled() and (slot := waiter.future.result()) is not None:
            # Routed, but cancelled before it could start: the worker never saw it.
            slot.claims.pop(key, None)
        self.dispatch(waiter.pool)  # the new head of the queue may fit where this one did not

    def release(self, slot: WorkerSlot, key: str) -> None:
        """The request `key` of this replica left the worker (finished or failed)."""
        slot.claims.pop(key, None)
        self.dispatch(slot.pool)

    def move(
        self, slot: WorkerSlot, key: str, token_ids: Sequence[int], salt: str | None,
        exclude: Sequence[str] | set[str], target: WorkerSlot | None = None,
    ) -> WorkerSlot:
        """Move the request `key` running at `slot` to `target` (a migration's), or else to a
        live worker routed now (failover), room or not; its claim goes with it."""
        moved = target if target is not None else self.route(slot.pool, token_ids, salt, exclude)
        claim = slot.claims.pop(key, None)
        if claim is not None:
            moved.claims[key] = claim
        self.dispatch(slot.pool)
        return moved

    def split(
        self, slot: WorkerSlot, key: str, priority: int,
        parts: Sequence[tuple[str, Sequence[int], int]], salt: str | None,
        exclude: Sequence[str] | set[str],
    ) -> list[WorkerSlot]:
        """Move the request `key` running at `slot` as separate continuations (failover of
        a request whose completions streamed apart): each `(claim key, token ids, max_tokens
        left)` part routed to a live worker now, room or not, with a claim of its own (one
        completion to its max_tokens) in place of the request's."""
        slot.claims.pop(key, None)
        block_size = self.config.pool(slot.pool).engine.block_size
        moved = []
        for part_key, token_ids, max_tokens in parts:
            target = self.route(slot.pool, token_ids, salt, exclude)
            target.claims[part_key] = Claim(priority, full_claim(len(token_ids), max_tokens, 1, block_size))
            moved.append(target)
        self.dispatch(slot.pool)
        return moved

    # ----- routing ------------------------------------------------------

    def route(
        self, pool: str, token_ids: Sequence[int], salt: str | None, exclude: Sequence[str] | set[str]
    ) -> WorkerSlot:
        """A live worker for a request that must move now (failover), room or not."""
        try:
            decision = self.router.route(
                pool, token_ids, salt=salt, policy=self.policy, exclude=exclude
            )
        except NoWorkerAvailable as exc:
            raise IngressError(
                ErrorCode.UNAVAILABLE, f"no live worker in pool {pool!r}: {exc}"
            ) from exc
        return self.slots[decision.worker_id]

    def _place(self, pool: PoolConfig, waiter: Waiter, *, free_room: bool = True) -> WorkerSlot | None:
        """Route to a live worker with room, else to one where it may preempt lower
        priorities (its claim counted there), or None.

        Without `free_room`, only the latter: others wait for free room before it.
        """
        slots = [slot for slot in self.slots.pool(pool.name) if slot.alive]
        chosen: WorkerSlot | None = None
        if free_room:
            chosen = self._route(pool, waiter, [s for s in slots if self._has_room(s, pool, waiter)])
        if chosen is None:
            chosen = self._route(pool, waiter, [s for s in slots if self._can_preempt(s, pool, waiter)])
        if chosen is not None:
            # Counted without the prefix it may reuse: the worker's report counts it so.
            chosen.claims[waiter.key] = Claim(
                waiter.priority,
                full_claim(len(waiter.prompt_ids), waiter.max_tokens, waiter.n, pool.engine.block_size),
            )
        return chosen

    def _route(self, pool: PoolConfig, waiter: Waiter, fit: list[WorkerSlot]) -> WorkerSlot | None:
        if not fit:
            return None
        others = [slot.worker_id for slot in self.slots.pool(pool.name) if slot not in fit]
        try:
            decision = self.router.route_hashes(
                pool.name, waiter.hashes, policy=self.policy, exclude=others, adapter=waiter.adapter,
                session=waiter.session,
            )  # fmt: skip
        except NoWorkerAvailable:
            return None
        if decision.session and self.metrics is not None:
            self.metrics.session_routes.labels(pool.name, decision.session).inc()
        return self.slots[decision.worker_id]

    def _need(self, slot: WorkerSlot, pool: PoolConfig, waiter: Waiter) -> int:
        """Blocks the request takes at the worker: up to max_tokens ("full") or its prompt."""
        matched = self.router.matched_blocks(slot.worker_id, waiter.hashes)
        if self.mode == "prompt":
            return blocks_for_prompt(len(waiter.prompt_ids), pool.engine.block_size, matched)
        return full_claim(
            len(waiter.prompt_ids), waiter.max_tokens, waiter.n, pool.engine.block_size,
            matched_blocks=matched,
        )

    def _headroom(self, report: LoadReport, slot: WorkerSlot) -> int:
        if self.mode == "prompt":
            return report.num_allocatable
        return claim_headroom(
            report, list(slot.claims.values()), self.origin,
            overcommit=self.config.scheduler.admission_overcommit,
        )

    def _has_room(self, slot: WorkerSlot, pool: PoolConfig, waiter: Waiter) -> bool:
        if slot.in_flight == 0:
            return True  # an idle worker takes anything that fits max_model_len
        if slot.in_flight >= pool.engine.max_num_seqs:
            return False
        if slot.report is None:
            return True
        # The report may be one push old; the delta that refreshes it dispatches again.
        return self._headroom(slot.report, slot) >= self._need(slot, pool, waiter)

    def _can_preempt(self, slot: WorkerSlot, pool: PoolConfig, waiter: Waiter) -> bool:
        """Whether preempting requests of lower priority at the worker would seat this one.

        Lower priorities there are the report's, or this replica's own claims
        when they say more (a report older than the requests it sent).
        """
        report = slot.report
        if report is None:
            return False
        p = waiter.priority
        mine = [c for c in slot.claims.values() if c.priority < p]
        below = max(sum(n for q, (n, _) in report.priority_claims.items() if q < p), len(mine))
        if below == 0:
            return False
        if slot.in_flight - below >= pool.engine.max_num_seqs:
            return False  # even without them, its seat is taken
        freed = max(report.claimed_below(p), sum(c.blocks for c in mine))
        return self._headroom(report, slot) + freed >= self._need(slot, pool, waiter)

    def dispatch(self, pool_name: str) -> None:
        """Route the pool's waiting requests, in fair order, while a worker has room for them."""
        # With every worker out of routing (restarting, or a late report) the waiters
        # keep waiting: the view delta that shows a worker back dispatches them.
        pool = self.config.pool(pool_name)
        while (head := self._waiting.peek(pool_name)) is not None:
            key, waiter = head
            if waiter.future.done():
                # Its task was cancelled and has not run its cleanup yet: skip it.
                self._waiting.remove(key)
                continue
            slot = self._place(pool, waiter)
            if slot is None:
                return  # the head waits for room, and so does everyone behind it
            self._waiting.pop(pool_name)  # advances the pool's virtual clock (fair order)
            waiter.future.set_result(slot)

