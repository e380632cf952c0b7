"""The ingress: routes each request to a worker actor and streams its tokens back.

`Ingress` is the cluster's front door without any wire protocol (gRPC lives
in `pagefleet.cluster.grpc_server`). Per request it tokenizes the prompt,
asks the local `Router` for a worker (no remote call on that path), opens a
Ray streaming call to the worker and relays the deltas. The ingress never
polls workers: a background task follows the central scheduler's view
(`pagefleet.cluster.fleet_view`: versioned deltas of liveness, load and the
prefix index) and applies it to the router and the worker slots, so every
replica routes on one cluster-wide view, kept fresh asynchronously.

Admission (late binding): a request is sent to a worker only when some live
worker of its pool has room for it (fewer than max_num_seqs of the ingress's
requests in flight there and, by its latest load report, free plus cached
blocks for the prompt's uncached blocks). Otherwise it waits in the pool's
bounded `FairWaitQueue` at the ingress (tenants sharing the pool in weighted
fair order, FIFO within a tenant) and is routed when a request finishes or the
view shows capacity, so the router places it with fresh load and cache
information instead of it queuing blind inside one worker's engine. Past the
queue's bound, or past the tenant's share of it, the request is refused with
RESOURCE_EXHAUSTED.

Faults: when a worker dies mid-stream, the request is re-submitted to
another live worker of the same pool as prompt + the tokens already streamed
(recompute), with `max_tokens` reduced by what was streamed; the client's
stream simply continues. Greedy output is unchanged by the failover. The
same happens when the scheduler takes a worker out of routing while it holds
streams here (hung: work but no progress for `scheduler.stall_timeout_s`):
the streams move by recompute, and the hung copies are aborted, so their
blocks are freed as soon as the worker wakes.

Several ingress replicas can run side by side; each has its own wait queue,
metrics and health, and tags the request ids it sends to workers with its
replica id, so ids stay unique cluster-wide.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import logging
import os
import time
import uuid
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ray.exceptions import (
    ActorDiedError,
    ActorUnavailableError,
    ObjectLostError,
    RayActorError,
    RayTaskError,
)

from pagefleet.cluster.config import ClusterConfig, PoolConfig, TenantConfig
from pagefleet.cluster.fleet_view import FleetView
from pagefleet.cluster.metrics import IngressMetrics
from pagefleet.cluster.router import ROUTING_POLICIES, NoWorkerAvailable, Router
from pagefleet.scheduler.fair_queue import FairWaitQueue
from pagefleet.scheduler.policy import ResourceExhausted, can_admit
from pagefleet.scheduler.state import WorkerDelta
from pagefleet.worker.config import EngineConfig
from pagefleet.worker.events import LoadReport
from pagefleet.worker.sampling_params import SamplingParams
from pagefleet.worker.wire import TokenDelta, WorkerRequest

logger = logging.getLogger(__name__)

# Failures that mean "the worker is gone", as opposed to an error of the request.
WORKER_FAILURES = (RayActorError, ActorDiedError, ActorUnavailableError, ObjectLostError)


class WorkerLeftRouting(Exception):
    """The scheduler took the worker out of routing (hung or silent) while a stream ran there."""


class ErrorCode(enum.Enum):
    """Why the ingress refused or ended a request (mapped to gRPC status codes)."""

    INVALID_ARGUMENT = "invalid_argument"
    UNAUTHENTICATED = "unauthenticated"
    PERMISSION_DENIED = "permission_denied"
    NOT_FOUND = "not_found"
    ALREADY_EXISTS = "already_exists"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    UNAVAILABLE = "unavailable"
    INTERNAL = "internal"


class IngressError(Exception):
    """A request the ingress cannot serve; `code` says why, `message` says what to fix."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


# Token ids travel as int32 on gRPC; no vocabulary comes near it.
MAX_TOKEN_ID = 2**31
# A client's request_id is echoed in every message and kept while the request runs.
MAX_REQUEST_ID_CHARS = 256
# Text prompts up to this many characters are tokenized inline (well under a
# millisecond); longer ones in a thread, off the event loop.
INLINE_TOKENIZE_CHARS = 4096
# A lower bound on characters per token for the prompt-length check (byte-fallback
# and <unk> tokens may stand for more characters than their own spelling).
MIN_CHARS_PER_TOKEN = 8
# HF tokenizers report a huge model_max_length when the model's limit is unknown.
UNKNOWN_MODEL_LEN = 10**7


def scoped_request_id(tenant: str, request_id: str) -> str:
    """The id a request has inside the cluster (ingress tables, workers): unique per tenant.

    Two tenants may use the same request_id; the length prefix keeps every
    (tenant, id) pair distinct whatever characters either holds.
    """
    return f"{len(tenant)}:{tenant}:{request_id}"


@dataclass(frozen=True)
class GenerationRequest:
    """One validated generation request, independent of the wire protocol.

    `tenant` (the authenticated tenant's name) scopes `request_id`: ids,
    aborts and duplicates are per tenant.
    """

    request_id: str
    prompt: str | tuple[int, ...]
    params: SamplingParams
    priority: int = 0
    pool: str = ""
    salt: str | None = None
    # The authenticated tenant's name: its fair share of the pool's wait queue,
    # and the scope of its request ids.
    tenant: str = ""

    @property
    def key(self) -> str:
        """`scoped_request_id(tenant, request_id)`: the id workers and the ingress tables use."""
        return scoped_request_id(self.tenant, self.request_id)

    @classmethod
    def create(
        cls,
        *,
        request_id: str,
        prompt: str | Sequence[int],
        sampling: Mapping[str, Any],
        priority: int = 0,
        pool: str = "",
        salt: str | None = None,
        tenant: str = "",
    ) -> GenerationRequest:
        """Build and validate; raises ValueError (from SamplingParams) with the limit."""
        if len(request_id) > MAX_REQUEST_ID_CHARS:
            raise ValueError(
                f"request_id must be at most {MAX_REQUEST_ID_CHARS} characters, got {len(request_id)}"
            )
        if not isinstance(prompt, str):
            for pos, tok in enumerate(prompt):
                # The engine checks the model's vocabulary; this bound keeps hashing safe first.
                if not 0 <= tok < MAX_TOKEN_ID:
                    raise ValueError(
                        f"prompt token id {tok} at position {pos} is outside [0, {MAX_TOKEN_ID})"
                    )
        return cls(
            request_id=request_id or uuid.uuid4().hex,
            prompt=prompt if isinstance(prompt, str) else tuple(int(t) for t in prompt),
            params=SamplingParams(**sampling),
            priority=priority,
            pool=pool,
            salt=salt,
            tenant=tenant,
        )


@dataclass(frozen=True)
class StreamDelta:
    """New tokens of one request since the previous delta; the last one has `finish_reason`."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None
    worker_id: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # With SamplingParams.logprobs: [token_id, logprob, [[id, logprob], ...]] per token.
    logprobs: list[Any] | None = None


@dataclass
class WorkerSlot:
    """The ingress's view of one worker actor."""

    worker_id: str
    pool: str
    handle: Any
    alive: bool = False
    node_id: str = ""
    report: LoadReport | None = None
    requests_routed: int = 0
    # Set when the worker leaves routing: streams running there stop waiting on it and
    # move. A fresh event each time it comes back.
    left: asyncio.Event = field(default_factory=asyncio.Event)
    # Requests this ingress has sent to the worker and not seen finish: exact and
    # never stale, unlike the report's counts, so admission counts on it.
    in_flight: int = 0


@dataclass
class _Waiter:
    """A request waiting in the cluster wait queue for a worker with room.

    `future` resolves to the slot it was routed to (with `in_flight` already
    counted), or to None when the request was aborted while waiting.
    """

    prompt_ids: list[int]
    hashes: list[bytes]
    future: asyncio.Future[WorkerSlot | None]


@dataclass
class _Running:
    """A request being streamed: where it runs now, and whether the client asked to abort."""

    slot: WorkerSlot
    aborted: bool = False
    tried: set[str] = field(default_factory=set)


class Ingress:
    """Routes requests over the worker actors of each pool; see the module docstring.

    `workers` maps pool name to (worker_id, actor handle) pairs; `scheduler`
    is the central scheduler's actor handle, whose view this replica follows
    (None: nothing follows it, and `fleet.apply` feeds the view by hand).
    Call `start()` on the event loop that will serve requests, `close()` to
    stop following.
    """

    def __init__(
        self,
        config: ClusterConfig,
        workers: Mapping[str, Sequence[tuple[str, Any]]],
        *,
        scheduler: Any = None,
        metrics: IngressMetrics | None = None,
        router_seed: int | None = None,
    ) -> None:
        self.config = config
        self.router = Router(config.router, seed=router_seed)
        self.metrics = metrics
        # The pid lets an operator (or a test) find the replica's process from a stream.
        self.replica_id = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._scheduler = scheduler
        self.fleet = FleetView(self.router, self._on_delta, self.replica_id)
        self._slots: dict[str, WorkerSlot] = {}
        self._pools: dict[str, list[WorkerSlot]] = {}
        for pool in config.pools:
            self._pools[pool.name] = []
            for worker_id, handle in workers.get(pool.name, ()):
                slot = WorkerSlot(worker_id, pool.name, handle)
                self._slots[worker_id] = slot
                self._pools[pool.name].append(slot)
                self.router.add_worker(worker_id, pool.name, block_size=pool.block_size)
                # Out of routing until the scheduler's view has it (it may still be loading).
                self.router.set_alive(worker_id, False)
        self._tokenizers: dict[str, Any] = {}
        self._max_token_chars: dict[str, int] = {}
        self._running: dict[str, _Running] = {}
        # Tenants sharing a pool split its queue by weight and are dispatched fairly.
        members = {
            pool.name: {t.name: t.weight for t in config.tenants if t.pool == pool.name}
            for pool in config.pools
        }
        self._waiting: FairWaitQueue[_Waiter] = FairWaitQueue(
            config.scheduler.wait_queue_size, members
        )
        if metrics is not None:
            metrics.track_wait_queue(
                lambda: {pool.name: self._waiting.size(pool.name) for pool in config.pools}
            )
            metrics.name_tenants({t.cache_salt(): t.name for t in config.tenants})
            metrics.track_view(self.fleet.staleness_s)
            metrics.track_preemption_rate(self.preemptions_per_minute)
        self._follower: asyncio.Task[None] | None = None
        # Per pool, (time, pool-wide preemptions so far) samples of the last minute.
        self._preemption_samples: dict[str, deque[tuple[float, int]]] = {
            pool.name: deque() for pool in config.pools
        }
        self.policy = config.router.policy

    def set_router_policy(self, policy: str) -> None:
        """Switch the routing policy at run time (benchmarks compare policies on one cluster)."""
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"router policy must be one of {ROUTING_POLICIES}, got {policy!r}")
        self.policy = policy

    # ----- lifecycle ----------------------------------------------------

    def start(self) -> None:
        """Start following the scheduler's view."""
        if self._follower is None and self._scheduler is not None:
            self._follower = asyncio.get_running_loop().create_task(
                self.fleet.follow(self._scheduler)
            )

    async def close(self) -> None:
        if self._follower is not None:
            self._follower.cancel()
            await asyncio.gather(self._follower, return_exceptions=True)
            self._follower = None

    async def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Load the tokenizers, then wait until the view shows every worker alive."""
        for pool in self.config.pools:
            # Loading blocks the event loop for a moment: do it before serving, not
            # on the first request.
            self._tokenizer(pool)
        deadline = time.monotonic() + timeout_s
        while not all(slot.alive for slot in self._slots.values()):
            if time.monotonic() > deadline:
                missing = [s.worker_id for s in self._slots.values() if not s.alive]
                raise TimeoutError(f"workers not ready after {timeout_s:.0f}s: {missing}")
            await asyncio.sleep(0.05)

    # ----- requests -----------------------------------------------------

    async def generate(self, req: GenerationRequest) -> AsyncGenerator[StreamDelta, None]:
        """Stream one request; raises IngressError before or during the stream."""
        pool = self._pool_config(req.pool)
        if req.key in self._running or req.key in self._waiting:
            raise IngressError(
                ErrorCode.ALREADY_EXISTS, f"request_id {req.request_id!r} is already running"
            )
        prompt_ids = await self._tokenize(pool, req.prompt)
        self._check_length(pool, prompt_ids, req.params)
        started = time.monotonic()
        admitted = self._admit(pool, req, prompt_ids)
        first_token_at: float | None = None
        streamed: list[int] = []
        prompt_tokens = len(prompt_ids)
        cached_tokens: int | None = None
        state: _Running | None = None
        finished = False
        try:
            routed = admitted if isinstance(admitted, WorkerSlot) else await admitted.future
            if routed is None:  # aborted while waiting: it never reached a worker
                finished = True
                yield StreamDelta(req.request_id, [], "", "abort", "", prompt_tokens)
                return
            state = _Running(routed)
            self._running[req.key] = state
            while True:
                remaining = req.params.max_tokens - len(streamed)
                params = dataclasses.replace(req.params, max_tokens=remaining)
                # After a failover the new worker recomputes prompt + streamed tokens.
                # The first attempt sends the prompt as the client gave it so a
                # text prompt is tokenized by the engine exactly as offline.
                prompt: str | list[int] = (
                    req.prompt if not streamed and isinstance(req.prompt, str)
                    else [*prompt_ids, *streamed]
                )
                state.tried.add(state.slot.worker_id)
                state.slot.requests_routed += 1
                try:
                    async for item in self._stream(state.slot, req, prompt, params):
                        if item.error is not None:
                            raise IngressError(ErrorCode(item.error_code), item.error)
                        if cached_tokens is None:
                            cached_tokens = item.cached_tokens
                        streamed.extend(item.token_ids)
                        if item.token_ids and first_token_at is None:
                            first_token_at = time.monotonic()
                        finish = item.finish_reason
                        if state.aborted and finish is None:
                            continue  # the worker is aborting; its last delta says "abort"
                        yield StreamDelta(
                            request_id=req.request_id,
                            token_ids=list(item.token_ids),
                            text=item.text,
                            finish_reason=finish,
                            worker_id=state.slot.worker_id,
                            prompt_tokens=prompt_tokens,
                            completion_tokens=len(streamed),
                            cached_tokens=cached_tokens or 0,
                            logprobs=None if item.logprobs is None else list(item.logprobs),
                        )
                        if finish is not None:
                            finished = True
                            self._observe_done(pool.name, started, first_token_at, len(streamed))
                            return
                    raise IngressError(
                        ErrorCode.INTERNAL,
                        f"worker {state.slot.worker_id} ended the stream without a finish reason",
                    )
                except RayTaskError as exc:
                    # The worker is alive but its code failed on this request (e.g. its
                    # engine thread died): not a client error, not a lost worker.
                    raise IngressError(
                        ErrorCode.INTERNAL,
                        f"worker {state.slot.worker_id} failed: {type(exc.cause).__name__}: {exc.cause}",
                    ) from exc
                except (*WORKER_FAILURES, WorkerLeftRouting) as exc:
                    logger.warning(
                        "worker %s failed mid-stream of %s (%s); resubmitting",
                        state.slot.worker_id, req.request_id, type(exc).__name__,
                    )
                    if isinstance(exc, WorkerLeftRouting):
                        # Hung, not dead: its copy must go when it wakes, freeing its blocks.
                        _fire_and_forget(state.slot.handle.abort.remote(self._worker_rid(req.key)))
                    else:
                        self._mark_dead(state.slot)
                    if self.metrics is not None:
                        self.metrics.failovers.labels(pool=pool.name).inc()
                if state.aborted or len(streamed) >= req.params.max_tokens:
                    reason = "abort" if state.aborted else "length"
                    finished = True
                    yield StreamDelta(
                        req.request_id, [], "", reason, state.slot.worker_id,
                        prompt_tokens, len(streamed), cached_tokens or 0,
                    )
                    return
                moved = self._route(
                    pool.name, [*prompt_ids, *streamed], req.salt, exclude=state.tried
                )
                state.slot.in_flight -= 1
                state.slot = moved
                moved.in_flight += 1
        finally:
            if state is not None:
                state.slot.in_flight -= 1
                self._running.pop(req.key, None)
                if not finished:
                    # Client gone (cancel, disconnect) or an error: the worker must free
                    # the request's blocks now, not when it would have finished.
                    _fire_and_forget(state.slot.handle.abort.remote(self._worker_rid(req.key)))
            elif not isinstance(admitted, WorkerSlot):
                self._leave_queue(req.key, admitted)
            else:
                admitted.in_flight -= 1
            # A worker may have room now: hand it to the oldest waiting request.
            self._dispatch(pool.name)

    async def abort(self, request_id: str, tenant: str = "") -> bool:
        """Abort a running or waiting request of `tenant`; its stream ends with finish_reason
        "abort". Another tenant's request of the same id is not found (False)."""
        request_id = scoped_request_id(tenant, request_id)
        waiter = self._find_waiter(request_id)
        if waiter is not None:
            self._waiting.remove(request_id)
            if not waiter.future.done():
                waiter.future.set_result(None)
            return True
        state = self._running.get(request_id)
        if state is None:
            return False
        state.aborted = True
        # A dead worker needs no abort: the failover path ends the stream with "abort".
        with contextlib.suppress(*WORKER_FAILURES):
            await state.slot.handle.abort.remote(self._worker_rid(request_id))
        return True

    def _worker_rid(self, key: str) -> str:
        # `key` is unique per tenant at this replica (`GenerationRequest.key`); tagged with
        # the replica, it is unique at every worker.
        return f"{key}@{self.replica_id}"

    async def _stream(
        self, slot: WorkerSlot, req: GenerationRequest, prompt: str | list[int], params: SamplingParams
    ) -> AsyncIterator[TokenDelta]:
        """The worker's deltas; raises WorkerLeftRouting when the worker is hung mid-stream
        (a hung worker never ends the stream by itself).

        Hung is either the scheduler's verdict (work without progress), or, seen
        from this stream, no delta for `stall_timeout_s` while the worker is out
        of routing for a late report: the scheduler cannot call a worker hung
        whose last report predates this request, but the stream knows it waits.
        """
        left = slot.left
        if left.is_set():
            raise WorkerLeftRouting(slot.worker_id)
        request = WorkerRequest(
            self._worker_rid(req.key),
            prompt if isinstance(prompt, str) else tuple(prompt),
            params,
            req.priority,
            req.salt,
        )
        gen = slot.handle.generate.options(num_returns="streaming").remote(request)
        leaving = asyncio.ensure_future(left.wait())
        try:
            stall_s = self.config.scheduler.stall_timeout_s
            while True:
                step = asyncio.ensure_future(_next_item(gen))
                while not step.done():
                    await asyncio.wait(
                        {step, leaving}, timeout=stall_s, return_when=asyncio.FIRST_COMPLETED
                    )
                    if not step.done() and (leaving.done() or not slot.alive):
                        step.cancel()
                        raise WorkerLeftRouting(slot.worker_id)
                item = step.result()
                if item is None:
                    return
                yield item
        finally:
            leaving.cancel()

    # ----- tenants ------------------------------------------------------

    def authenticate(self, api_key: str | None) -> TenantConfig:
        """The tenant an API key belongs to (None: the open tenant, if one exists)."""
        tenant = self.config.tenant_for_api_key(api_key)
        if tenant is None:
            raise IngressError(
                ErrorCode.UNAUTHENTICATED,
                "missing API key" if api_key is None else "unknown API key",
            )
        return tenant

    def tenant_pool(self, tenant: TenantConfig, requested: str) -> str:
        """The pool a tenant's request runs in: its own, or the one it asked for when auth is off."""
        if not requested or requested == tenant.pool:
            return tenant.pool
        if self.config.auth_required:
            # Exactly the answer of an unknown pool: a tenant learns nothing of others' pools.
            raise unknown_pool(requested)
        self._pool_config(requested)  # NOT_FOUND for an unknown pool
        return requested

    # ----- routing ------------------------------------------------------

    def _pool_config(self, name: str) -> PoolConfig:
        if not name:
            return self.config.pools[0]
        for pool in self.config.pools:
            if pool.name == name:
                return pool
        raise unknown_pool(name)

    def _route(
        self, pool: str, token_ids: Sequence[int], salt: str | None, exclude: Sequence[str] | set[str]
    ) -> WorkerSlot:
        try:
            decision = self.router.route(
                pool, token_ids, salt=salt, policy=self.policy, exclude=exclude
            )
        except NoWorkerAvailable as exc:
            raise IngressError(
                ErrorCode.UNAVAILABLE, f"no live worker in pool {pool!r}: {exc}"
            ) from exc
        return self._slots[decision.worker_id]

    def _admit(
        self, pool: PoolConfig, req: GenerationRequest, prompt_ids: list[int]
    ) -> WorkerSlot | _Waiter:
        """Route now when a worker has room and nobody waits, else join the pool's wait queue.

        Returns the routed slot (its `in_flight` counted) or the queued waiter.
        Raises UNAVAILABLE without a live worker and RESOURCE_EXHAUSTED when
        the wait queue is full.
        """
        slots = self._pools[pool.name]
        live = sum(1 for slot in slots if slot.alive)
        if live == 0:
            raise IngressError(ErrorCode.UNAVAILABLE, f"no live worker in pool {pool.name!r}")
        hashes = self.router.block_hashes(pool.name, prompt_ids, salt=req.salt)
        if self._waiting.size(pool.name) == 0:  # FIFO: nobody may overtake a waiting request
            slot = self._place(pool, prompt_ids, hashes)
            if slot is not None:
                self._waiting.charge(pool.name, req.tenant)  # its turn counts in fair order
                return slot
        waiter = _Waiter(prompt_ids, hashes, asyncio.get_running_loop().create_future())
        try:
            self._waiting.push(pool.name, req.tenant, req.key, waiter)
        except ResourceExhausted as exc:
            max_num_seqs = self._max_num_seqs(pool)
            queue = self.config.scheduler.wait_queue_size
            running = sum(slot.in_flight for slot in slots)
            share = self._waiting.share(pool.name, req.tenant)
            over_share = self._waiting.size(pool.name, req.tenant) >= share and share < queue
            if self.metrics is not None:
                reason = "queue_share" if over_share else "queue_full"
                self.metrics.tenant_requests_refused.labels(pool.name, req.tenant, reason).inc()
            if over_share:
                # The pool may have room in its queue, but not for this tenant: others
                # sharing the pool keep their part (a flood cannot lock them out).
                raise IngressError(
                    ErrorCode.RESOURCE_EXHAUSTED,
                    f"tenant {req.tenant!r} has {share} requests waiting in pool {pool.name!r}, "
                    f"its share of wait_queue_size {queue} (weight "
                    f"{self._waiting.weight(pool.name, req.tenant):g}); retry later",
                ) from exc
            raise IngressError(
                ErrorCode.RESOURCE_EXHAUSTED,
                f"pool {pool.name!r} is full: {running} requests running and "
                f"{self._waiting.size(pool.name)} waiting, limit {live * max_num_seqs + queue} "
                f"({live} workers x max_num_seqs {max_num_seqs} + wait_queue_size {queue}); "
                "retry later",
            ) from exc
        return waiter

    def _place(self, pool: PoolConfig, prompt_ids: list[int], hashes: list[bytes]) -> WorkerSlot | None:
        """Route to a live worker with room (counting it in flight there), or None if all are full."""
        full = [
            slot.worker_id
            for slot in self._pools[pool.name]
            if not self._has_room(slot, pool, prompt_ids, hashes)
        ]
        try:
            decision = self.router.route_hashes(pool.name, hashes, policy=self.policy, exclude=full)
        except NoWorkerAvailable:
            return None
        slot = self._slots[decision.worker_id]
        slot.in_flight += 1
        return slot

    def _has_room(
        self, slot: WorkerSlot, pool: PoolConfig, prompt_ids: list[int], hashes: list[bytes]
    ) -> bool:
        if not slot.alive:
            return False
        if slot.in_flight == 0:
            return True  # an idle worker takes anything that fits max_model_len
        if slot.in_flight >= self._max_num_seqs(pool):
            return False
        if slot.report is None:
            return True
        # The report may be one push old; the delta that refreshes it dispatches again.
        matched = self.router.matched_blocks(slot.worker_id, hashes)
        return can_admit(slot.report, len(prompt_ids), pool.block_size, matched_blocks=matched)

    def _dispatch(self, pool_name: str) -> None:
        """Route the pool's waiting requests, in fair order, while a worker has room for them."""
        # With every worker out of routing (restarting, or a late report) the waiters
        # keep waiting: the view delta that shows a worker back dispatches them.
        pool = self._pool_config(pool_name)
        while (head := self._waiting.peek(pool_name)) is not None:
            request_id, waiter = head
            if waiter.future.done():
                # Its task was cancelled and has not run its cleanup yet: skip it.
                self._waiting.remove(request_id)
                continue
            slot = self._place(pool, waiter.prompt_ids, waiter.hashes)
            if slot is None:
                return  # the head waits for room, and so does everyone behind it
            self._waiting.pop(pool_name)  # advances the pool's virtual clock (fair order)
            waiter.future.set_result(slot)

    def _leave_queue(self, request_id: str, waiter: _Waiter) -> None:
        """A waiting request's client went away: drop it, or give back the slot it just got."""
        if self._find_waiter(request_id) is waiter:
            self._waiting.remove(request_id)
        if not waiter.future.done():
            waiter.future.cancel()
        elif not waiter.future.cancelled() and (slot := waiter.future.result()) is not None:
            # Routed, but cancelled before it could start: the worker never saw it.
            slot.in_flight -= 1

    def _find_waiter(self, request_id: str) -> _Waiter | None:
        return self._waiting.get(request_id)

    def _max_num_seqs(self, pool: PoolConfig) -> int:
        return int(pool.engine_kwargs().get("max_num_seqs") or EngineConfig.max_num_seqs)

    async def _tokenize(self, pool: PoolConfig, prompt: str | tuple[int, ...]) -> list[int]:
        """Token ids of a prompt, refusing a text too long to fit before tokenizing it.

        A long text is tokenized in a thread: on the event loop it would stall every
        other stream of this ingress (tokenizing a megabyte takes seconds).
        """
        if isinstance(prompt, str):
            check_prompt_text(prompt, self._max_prompt_chars(pool))
            if len(prompt) > INLINE_TOKENIZE_CHARS:
                return await asyncio.to_thread(self._prompt_ids, pool, prompt)
        return self._prompt_ids(pool, prompt)

    def _max_prompt_chars(self, pool: PoolConfig) -> int | None:
        """No prompt longer than this fits: max_model_len tokens x the longest token's characters."""
        tokenizer = self._tokenizer(pool)
        limit = pool.max_model_len or getattr(tokenizer, "model_max_length", None)
        if not isinstance(limit, int) or limit > UNKNOWN_MODEL_LEN:
            return None  # HF's placeholder for "no limit known": the message size bounds it
        if pool.name not in self._max_token_chars:
            longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
            self._max_token_chars[pool.name] = max(longest, MIN_CHARS_PER_TOKEN)
        return limit * self._max_token_chars[pool.name]

    def _prompt_ids(self, pool: PoolConfig, prompt: str | tuple[int, ...]) -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)
        tokenizer = self._tokenizer(pool)
        if tokenizer is None:
            raise IngressError(
                ErrorCode.INVALID_ARGUMENT,
                f"pool {pool.name!r} serves a model without a tokenizer: send prompt_token_ids",
            )
        return [int(t) for t in tokenizer.encode(prompt)]  # as LLMEngine does

    def tokenizer(self, pool: str) -> Any:
        """The HF tokenizer of a pool (NOT_FOUND for an unknown pool); e.g. for chat templates."""
        return self._tokenizer(self._pool_config(pool))

    def _tokenizer(self, pool: PoolConfig) -> Any:
        # The same tokenizer files the workers load, so block hashes agree.
        if pool.name not in self._tokenizers:
            self._tokenizers[pool.name] = load_tokenizer(pool.model)
        return self._tokenizers[pool.name]

    def _check_length(self, pool: PoolConfig, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise IngressError(ErrorCode.INVALID_ARGUMENT, "prompt is empty")
        limit = pool.max_model_len
        if limit is not None and len(prompt_ids) + params.max_tokens > limit:
            raise IngressError(
                ErrorCode.INVALID_ARGUMENT,
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) "
                f"exceeds max_model_len {limit}",
            )

    def _observe_done(
        self, pool: str, started: float, first_token_at: float | None, num_tokens: int
    ) -> None:
        if self.metrics is None:
            return
        now = time.monotonic()
        self.metrics.observe_request(
            pool,
            ttft_s=None if first_token_at is None else first_token_at - started,
            e2e_s=now - started,
            tpot_s=(now - first_token_at) / (num_tokens - 1)
            if first_token_at is not None and num_tokens > 1
            else None,
        )

    def _mark_dead(self, slot: WorkerSlot) -> None:
        slot.alive = False
        slot.left.set()
        self.router.set_alive(slot.worker_id, False)
        if self.metrics is not None:
            self.metrics.mark_dead(slot.pool, slot.worker_id)

    # ----- the scheduler's view -------------------------------------------

    def _on_delta(self, delta: WorkerDelta) -> None:
        """One worker's new state from the scheduler (the router already has it)."""
        slot = self._slots.get(delta.info.worker_id)
        if slot is None:
            return  # a worker this deployment does not route to (another app's pool)
        if delta.gone:
            self._mark_dead(slot)
            return
        slot.node_id = delta.info.node_id or slot.node_id
        if delta.report is not None and delta.report.supersedes(slot.report):
            slot.report = delta.report
            self._sample_preemptions(slot.pool)
            if self.metrics is not None:
                self.metrics.observe_report(delta.report)
        if self.metrics is not None:
            self.metrics.index_drift.labels(slot.pool, slot.worker_id).set(delta.drift_blocks)
        if delta.alive and not slot.alive:
            slot.alive = True
            slot.left = asyncio.Event()
        elif not delta.alive and slot.alive:
            logger.warning(
                "worker %s out of routing (%s)",
                slot.worker_id, "hung: work but no progress" if delta.stalled else "no report in time",
            )
            # No new requests go there. Its streams stay unless it is hung: a late
            # report alone may be a slow scheduler or a busy machine, and a dead
            # worker's streams fail over by themselves.
            slot.alive = False
            if self.metrics is not None:
                self.metrics.mark_dead(slot.pool, slot.worker_id)
        if delta.stalled and not slot.left.is_set():
            slot.left.set()  # hung: its streams move now (see `_stream`)
        # Fresh load or a worker back: route waiting requests it has room for.
        self._dispatch(slot.pool)

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

    # ----- status -------------------------------------------------------

    def live_workers(self) -> dict[str, int]:
        """Live workers per pool: the health rule (healthy while none is 0) of both fronts."""
        return {name: sum(slot.alive for slot in slots) for name, slots in self._pools.items()}

    def worker_reports(self) -> dict[str, LoadReport | None]:
        """Each worker's latest load report by worker id (None before its first one)."""
        return {slot.worker_id: slot.report for slots in self._pools.values() for slot in slots}

    def status(self, pool: str | None = None, tenant: TenantConfig | None = None) -> list[dict[str, Any]]:
        """Per pool and per worker counters (the `StatusResponse.pools` field, as dicts).

        With `tenant`, only the pools it may use; another tenant's pool is NOT_FOUND,
        exactly like an unknown one.
        """
        visible = self.config.visible_pools(tenant)
        if pool and pool not in visible:
            raise unknown_pool(pool)
        pools = [self._pool_config(pool)] if pool else [self._pool_config(p) for p in visible]
        out = []
        for cfg in pools:
            workers = [_worker_status(slot) for slot in self._pools[cfg.name]]
            live = [w for w in workers if w["alive"]]
            query = sum(s.report.prefix_query_tokens for s in self._pools[cfg.name] if s.report)
            hits = sum(s.report.prefix_hit_tokens for s in self._pools[cfg.name] if s.report)
            entry: dict[str, Any] = {
                "name": cfg.name,
                "model": str(cfg.model),
                "router_policy": self.policy,
                "live_workers": len(live),
                "hit_rate": hits / query if query else 0.0,
                "workers": workers,
            }
            for key in _BLOCK_FIELDS:
                entry[key] = sum(w[key] for w in live)
            # Waiting in the pool = in the workers' engine queues + in the ingress's queue.
            entry["num_waiting"] += self._waiting.size(cfg.name)
            out.append(entry)
        return out


def check_prompt_text(prompt: str, max_chars: int | None) -> None:
    """INVALID_ARGUMENT for a text prompt that is not Unicode text or cannot fit max_model_len."""
    if max_chars is not None and len(prompt) > max_chars:
        raise IngressError(
            ErrorCode.INVALID_ARGUMENT,
            f"prompt of {len(prompt)} characters cannot fit: at most {max_chars} characters "
            "(max_model_len x the longest token's characters)",
        )
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate, e.g. from JSON "\ud800"
        raise IngressError(
            ErrorCode.INVALID_ARGUMENT,
            f"prompt is not valid Unicode: {exc.reason} at character {exc.start}",
        ) from exc


def unknown_pool(name: str) -> IngressError:
    """NOT_FOUND for a pool the caller may not see; names no other pool."""
    return IngressError(ErrorCode.NOT_FOUND, f"unknown pool {name!r}")


_BLOCK_FIELDS = (
    "total_blocks",
    "free_blocks",
    "live_blocks",
    "cached_blocks",
    "peak_live_blocks",
    "num_running",
    "num_waiting",
)


def load_tokenizer(model: str) -> Any:
    """The HF tokenizer of a pool's model, resolved as the workers do (None: it has none)."""
    from pagefleet.worker import model_files

    return model_files.load_tokenizer(model_files.resolve_model_path(model))


async def _next_item(gen: Any) -> TokenDelta | None:
    """The next delta of a Ray streaming call, or None at its end."""
    try:
        ref = await gen.__anext__()
    except StopAsyncIteration:
        return None
    delta: TokenDelta = await ref
    return delta


def _worker_status(slot: WorkerSlot) -> dict[str, Any]:
    r = slot.report
    entry: dict[str, Any] = {
        "worker_id": slot.worker_id,
        "pool": slot.pool,
        "alive": slot.alive,
        "requests_routed": slot.requests_routed,
        "node_id": slot.node_id,
        "prefix_query_tokens": r.prefix_query_tokens if r else 0,
        "prefix_hit_tokens": r.prefix_hit_tokens if r else 0,
        "hit_rate": r.hit_rate if r else 0.0,
    }
    for key in _BLOCK_FIELDS:
        entry[key] = int(getattr(r, key)) if r else 0
    return entry


_background: set[Any] = set()


def _fire_and_forget(ref: Any) -> None:
    """Keep a remote call alive without awaiting it; errors (dead worker) are ignored."""

    async def wait() -> None:
        with contextlib.suppress(Exception):
            await ref

    task = asyncio.get_running_loop().create_task(wait())
    _background.add(task)
    task.add_done_callback(_background.discard)


__all__ = [
    "ErrorCode",
    "GenerationRequest",
    "Ingress",
    "IngressError",
    "StreamDelta",
    "WorkerSlot",
]
