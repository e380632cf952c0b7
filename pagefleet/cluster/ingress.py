"""The ingress: routes each request to a worker actor and streams its tokens back.

`Ingress` is the cluster's front door without any wire protocol (the fronts,
gRPC in `grpc_server` and OpenAI HTTP in `openai_http`, see it through
`pagefleet.cluster.api.Front`). Per request it tokenizes the prompt once
(`prompts`), admits it (`admission`: routed now when a worker has room, else
queued fairly), opens a Ray streaming call to the chosen worker with one typed
`WorkerRequest`, and relays its `TokenDelta`s. The ingress never polls
workers: a background task follows the central scheduler's view
(`fleet_view`: versioned deltas of liveness, load and the prefix index) and
applies it to the router and the worker slots (`worker_slots`), so every
replica routes on one cluster-wide view, kept fresh asynchronously.

Faults: when a worker dies mid-stream, the request is re-submitted to
another live worker of the same pool as prompt + the tokens already streamed
(recompute), with `max_tokens` reduced by what was streamed; the client's
stream simply continues. Greedy output is unchanged by the failover. The
same happens when the scheduler takes a worker out of routing while it holds
streams here (hung: work but no progress for `scheduler.stall_timeout_s`):
the streams move by recompute, and the hung copies are aborted, so their
blocks are freed as soon as the worker wakes. A stream the scheduler moves
off a worker short of blocks (its last delta names the target worker) moves
to that target, by KV transfer when its last delta carries the request's
blocks (`KVHandoff`, with `scheduler.migration_transfer`): the ingress
passes them on in the target's request, and the target imports them and
recomputes only the partial tail block. When the stream cannot go to that
target (it left routing meanwhile) it moves by recompute, and so does every
failover: a dead worker's blocks are lost with it.

Several ingress replicas can run side by side; each has its own wait queue,
metrics and health, and tags the request ids it sends to workers with its
replica id, so ids stay unique cluster-wide. An abort that reaches a replica
not holding the request is passed to the workers, which find it by its key,
and, if none has it, through the scheduler to the other replicas, one of
which may hold it in its wait queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ray.exceptions import (
    ActorDiedError,
    ActorUnavailableError,
    ObjectLostError,
    RayActorError,
    RayTaskError,
)

from pagefleet.cluster.admission import Admission
from pagefleet.cluster.api import (
    ErrorCode,
    GenerationRequest,
    IngressError,
    StreamDelta,
    scoped_request_id,
    unknown_pool,
)
from pagefleet.cluster.config import ClusterConfig, PoolConfig, TenantConfig
from pagefleet.cluster.fleet_view import FleetView, RouteSharer
from pagefleet.cluster.metrics import IngressMetrics
from pagefleet.cluster.prompts import Prompts, check_length
from pagefleet.cluster.router import Router
from pagefleet.cluster.worker_slots import WorkerSlot, WorkerSlots
from pagefleet.worker.events import LoadReport
from pagefleet.worker.sampling_params import SamplingParams
from pagefleet.worker.wire import KVHandoff, TokenDelta, WorkerRequest

logger = logging.getLogger(__name__)

# Failures that mean "the worker is gone", as opposed to an error of the request.
WORKER_FAILURES = (RayActorError, ActorDiedError, ActorUnavailableError, ObjectLostError)


class WorkerLeftRouting(Exception):
    """The scheduler took the worker out of routing (hung or silent) while a stream ran there."""


class Migrated(Exception):
    """The worker handed the stream off on the scheduler's order; it continues on `target`
    (with the request's KV blocks `kv`, when the order said to transfer them)."""

    def __init__(self, target: str, kv: KVHandoff | None = None) -> None:
        super().__init__(target)
        self.target = target
        self.kv = kv


@dataclass
class _Running:
    """A request being streamed: where it runs now, and whether the client asked to abort."""

    slot: WorkerSlot
    aborted: bool = False
    tried: set[str] = field(default_factory=set)


class Ingress:
    """Routes requests over the worker actors of each pool; see the module docstring.

    `workers` maps pool name to (worker_id, actor handle) pairs; `scheduler`
    is the central scheduler's actor handle, or the handles of its shards
    (`scheduler.shards`), whose view this replica follows and merges (None:
    nothing follows it, and `fleet.apply` feeds the view by hand).
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
        resolve_worker: Callable[[str], Any] | None = None,
    ) -> None:
        self.config = config
        # Per pool, `Membership.autoscale_status()` as last polled (target, reason): GetStatus.
        self.pool_scaling: dict[str, dict[str, Any]] = {}
        self.metrics = metrics
        # The pid lets an operator (or a test) find the replica's process from a stream.
        self.replica_id = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        # Other replicas may route next to this one: they learn its decisions at once.
        server = config.server
        shared = max(server.ingress_replicas, server.ingress_max_replicas or 1) > 1
        self.routes = RouteSharer(self.replica_id, config.scheduler_shards())
        self.router = Router(
            config.router, seed=router_seed, on_routed=self.routes.note if shared else None
        )
        self._scheduler = scheduler
        # `resolve_worker(worker_id)`: the handle of a worker added while serving.
        self.slots = WorkerSlots(
            config, workers, self.router, self._dispatch, metrics, resolve=resolve_worker
        )
        self.admission = Admission(config, self.router, self.slots, self.replica_id, metrics)
        self.fleet = FleetView(
            self.router, self.slots.apply, self.replica_id, on_abort=self._abort_here
        )
        self._prompts = Prompts()
        self._running: dict[str, _Running] = {}
        if metrics is not None:
            metrics.track_wait_queue(
                lambda: {pool.name: self.admission.waiting(pool.name) for pool in config.pools}
            )
            metrics.name_tenants({t.cache_salt(): t.name for t in config.tenants})
            metrics.track_view(self.fleet.staleness_s)
            metrics.track_preemption_rate(self.slots.preemptions_per_minute)
        self._follower: asyncio.Task[None] | None = None

    @property
    def policy(self) -> str:
        """The routing policy in use."""
        return self.admission.policy

    def set_router_policy(self, policy: str) -> None:
        """Switch the routing policy at run time (benchmarks compare policies on one cluster)."""
        self.admission.set_policy(policy)

    def set_admission(self, mode: str) -> None:
        """Switch `scheduler.admission` at run time (benchmarks compare the modes on one cluster)."""
        self.admission.set_mode(mode)

    def _dispatch(self, pool: str) -> None:
        self.admission.dispatch(pool)

    # ----- lifecycle ----------------------------------------------------

    def start(self) -> None:
        """Start following the scheduler's view."""
        if self._follower is None and self._scheduler is not None:
            self.routes.bind(self._scheduler)
            self._follower = asyncio.get_running_loop().create_task(
                self.fleet.follow(self._scheduler)
            )

    async def close(self) -> None:
        if self._follower is not None:
            self._follower.cancel()
            await asyncio.gather(self._follower, return_exceptions=True)
            self._follower = None
        await self.routes.close()

    async def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Load the tokenizers, then wait until the view shows every worker alive."""
        for pool in self.config.pools:
            # Loading blocks the event loop for a moment: do it before serving, not
            # on the first request.
            self._prompts.tokenizer(pool)
        deadline = time.monotonic() + timeout_s
        while not all(slot.streaming for slot in self.slots.all()):
            if time.monotonic() > deadline:
                missing = [s.worker_id for s in self.slots.all() if not s.streaming]
                raise TimeoutError(f"workers not ready after {timeout_s:.0f}s: {missing}")
            await asyncio.sleep(0.05)

    # ----- requests -----------------------------------------------------

    async def generate(self, req: GenerationRequest) -> AsyncGenerator[StreamDelta, None]:
        """Stream one request; raises IngressError before or during the stream."""
        pool = self.pool_config(req.pool)
        if req.key in self._running or self.admission.is_waiting(req.key):
            raise IngressError(
                ErrorCode.ALREADY_EXISTS, f"request_id {req.request_id!r} is already running"
            )
        prompt_ids = await self._prompts.token_ids(pool, req.prompt)
        check_length(pool, prompt_ids, req.params)
        started = time.monotonic()
        admitted = self.admission.admit(pool, req, prompt_ids)
        first_token_at: float | None = None
        streamed: list[int] = []
        prompt_tokens = len(prompt_ids)
        cached_tokens: int | None = None
        state: _Running | None = None
        finished = False
        migrate_to: str | None = None  # the scheduler's target after a hand-off
        migrate_kv: KVHandoff | None = None  # the blocks the source handed off with it
        kv: KVHandoff | None = None  # what goes to the next worker with the request
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
                    async for item in self._stream(state.slot, req, prompt, params, kv):
                        if item.error is not None:
                            raise IngressError(ErrorCode(item.error_code), item.error)
                        if cached_tokens is None:
                            cached_tokens = item.cached_tokens
                        streamed.extend(item.token_ids)
                        if item.token_ids and first_token_at is None:
                            first_token_at = time.monotonic()
                        finish = item.finish_reason
                        aborting = state.aborted and finish is None
                        # The worker is aborting: its last delta says "abort". A handed-off
                        # stream's last delta says where it goes, and has tokens or not.
                        if not aborting and (item.migrated_to is None or item.token_ids or item.text):
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
                        if item.migrated_to is not None:
                            raise Migrated(item.migrated_to, item.kv)
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
                except Migrated as exc:
                    # The scheduler moved it off a worker short of blocks; that worker
                    # freed its blocks already and stays a fine place for a later failover.
                    migrate_to, migrate_kv = exc.target, exc.kv
                    state.tried.discard(state.slot.worker_id)
                except (*WORKER_FAILURES, WorkerLeftRouting) as exc:
                    logger.warning(
                        "worker %s failed mid-stream of %s (%s); resubmitting",
                        state.slot.worker_id, req.request_id, type(exc).__name__,
                    )
                    if isinstance(exc, WorkerLeftRouting):
                        # Hung, not dead: its copy must go when it wakes, freeing its blocks.
                        _fire_and_forget(state.slot.handle.abort.remote(self._worker_rid(req.key)))
                    else:
                        self.slots.mark_dead(state.slot)
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
                # After a hand-off: the scheduler's target, or (if it left routing since)
                # any live worker, the source included; after a failure: an untried one.
                moved_to = self._migration_target(state.slot, migrate_to)
                state.slot = self.admission.move(
                    state.slot, req.key, [*prompt_ids, *streamed], req.salt, exclude=state.tried,
                    target=moved_to,
                )
                # The blocks go only to the target the source exported them for; anywhere
                # else (and after a failure) the request recomputes them.
                kv = migrate_kv if moved_to is not None and state.slot is moved_to else None
                if migrate_to is not None and self.metrics is not None:
                    mode = "transfer" if kv is not None else "recompute"
                    self.metrics.migrations.labels(pool=pool.name, mode=mode).inc()
                migrate_to, migrate_kv = None, None
        finally:
            # A worker may have room now: `release` hands it to the next waiting request.
            if state is not None:
                self._running.pop(req.key, None)
                if not finished:
                    # Client gone (cancel, disconnect) or an error: the worker must free
                    # the request's blocks now, not when it would have finished.
                    _fire_and_forget(state.slot.handle.abort.remote(self._worker_rid(req.key)))
                self.admission.release(state.slot, req.key)
            elif not isinstance(admitted, WorkerSlot):
                self.admission.leave(req.key, admitted)
            else:
                self.admission.release(admitted, req.key)

    async def abort(self, request_id: str, tenant: str = "", *, anywhere: bool = True) -> bool:
        """Abort a running or waiting request of `tenant`; its stream ends with finish_reason
        "abort". Another tenant's request of the same id is not found (False).

        With `anywhere`, a request this replica does not hold is looked for on the
        workers (another replica streams it); a drain passes False: it ends only
        its own streams, and one that just finished must not hit another replica's
        request of the same id."""
        request_id = scoped_request_id(tenant, request_id)
        if self.admission.cancel(request_id):
            return True
        state = self._running.get(request_id)
        if state is None:
            return anywhere and await self._abort_elsewhere(request_id, tenant)
        state.aborted = True
        # A dead worker needs no abort: the failover path ends the stream with "abort".
        with contextlib.suppress(*WORKER_FAILURES):
            await state.slot.handle.abort.remote(self._worker_rid(request_id))
        return True

    def _abort_here(self, key: str) -> bool:
        """Another replica's abort note: cancel `key` if it waits here (or has just been
        routed from the queue and runs here); returns whether it was here."""
        if self.admission.cancel(key):
            return True
        state = self._running.get(key)
        if state is None:
            return False
        state.aborted = True
        _fire_and_forget(state.slot.handle.abort.remote(self._worker_rid(key)))
        return True

    async def _abort_elsewhere(self, key: str, tenant: str) -> bool:
        """Abort a request another replica holds: the workers of the tenant's pools end
        it (their stream, relayed by that replica, ends with "abort") and free its blocks;
        failing that, the scheduler relays the abort to the other replicas, one of which
        may hold it waiting in its queue (`SchedulerActor.relay_abort`).

        The key is tenant-scoped, so another tenant's request is never found.
        """
        try:
            pools = self.config.visible_pools(self.config.tenant(tenant))
        except KeyError:
            pools = self.config.visible_pools(None)
        calls = [
            slot.handle.abort_key.remote(key)
            for name in pools
            for slot in self.slots.pool(name)
            if slot.streaming
        ]
        answers = await asyncio.gather(*calls, return_exceptions=True)
        if any(answer is True for answer in answers):
            return True
        if self._scheduler is None:
            return False
        # Every replica follows every shard, so shard 0 reaches them all.
        shard0 = self._scheduler[0] if isinstance(self._scheduler, Sequence) else self._scheduler
        try:
            return bool(await shard0.relay_abort.remote(key, self.replica_id))
        except Exception as exc:  # scheduler restarting: nobody can be asked now
            logger.warning("abort of %s: the scheduler could not relay it (%s)", key, type(exc).__name__)
            return False

    def _migration_target(self, source: WorkerSlot, target: str | None) -> WorkerSlot | None:
        """The worker the scheduler moved a stream to, if it can take it (live, same pool)."""
        if target is None or target == source.worker_id:
            return None
        try:
            slot = self.slots[target]
        except KeyError:
            return None
        return slot if slot.alive and slot.pool == source.pool else None

    def _worker_rid(self, key: str) -> str:
        # `key` is unique per tenant at this replica (`GenerationRequest.key`); tagged with
        # the replica, it is unique at every worker.
        return f"{key}@{self.replica_id}"

    async def _stream(
        self,
        slot: WorkerSlot,
        req: GenerationRequest,
        prompt: str | list[int],
        params: SamplingParams,
        kv: KVHandoff | None = None,
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
            kv,
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
                    # (A draining worker is out of routing too, but finishes its streams.)
                    if not step.done() and (leaving.done() or not slot.streaming):
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
        self.pool_config(requested)  # NOT_FOUND for an unknown pool
        return requested


    # ----- pools --------------------------------------------------------

    def pool_config(self, name: str) -> PoolConfig:
        """The pool called `name` (the first pool for ""); NOT_FOUND for an unknown one."""
        if not name:
            return self.config.pools[0]
        try:
            return self.config.pool(name)
        except KeyError:
            raise unknown_pool(name) from None

    def tokenizer(self, pool: str) -> Any:
        """The HF tokenizer of a pool (NOT_FOUND for an unknown pool); e.g. for chat templates."""
        return self._prompts.tokenizer(self.pool_config(pool))

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


    # ----- status -------------------------------------------------------

    def preemptions_per_minute(self) -> dict[str, float]:
        """Preemptions per pool over the last minute, from the workers' reports."""
        return self.slots.preemptions_per_minute()

    def live_workers(self) -> dict[str, int]:
        """Live workers per pool: the health rule (healthy while none is 0) of both fronts."""
        return self.slots.live_workers()

    def worker_reports(self) -> dict[str, LoadReport | None]:
        """Each worker's latest load report by worker id (None before its first one)."""
        return self.slots.worker_reports()

    def status(self, pool: str | None = None, tenant: TenantConfig | None = None) -> list[dict[str, Any]]:
        """Per pool and per worker counters (the `StatusResponse.pools` field, as dicts).

        With `tenant`, only the pools it may use; another tenant's pool is NOT_FOUND,
        exactly like an unknown one.
        """
        visible = self.config.visible_pools(tenant)
        if pool and pool not in visible:
            raise unknown_pool(pool)
        pools = [self.pool_config(pool)] if pool else [self.pool_config(p) for p in visible]
        out = []
        for cfg in pools:
            entry = self.slots.pool_status(cfg)
            entry["router_policy"] = self.policy
            # Waiting in the pool = in the workers' engine queues + in the ingress's queue.
            entry["num_waiting"] += self.admission.waiting(cfg.name)
            scaling = self.pool_scaling.get(cfg.name, {})
            entry["target_workers"] = scaling.get("target", cfg.workers)
            entry["scale_reason"] = scaling.get("reason", "configured size")
            out.append(entry)
        return out


async def _next_item(gen: Any) -> TokenDelta | None:
    """The next delta of a Ray streaming call, or None at its end."""
    try:
        ref = await gen.__anext__()
    except StopAsyncIteration:
        return None
    delta: TokenDelta = await ref
    return delta


_background: set[Any] = set()


def _fire_and_forget(ref: Any) -> None:
    """Keep a remote call alive without awaiting it; errors (dead worker) are ignored."""

    async def wait() -> None:
        with contextlib.suppress(Exception):
            await ref

    task = asyncio.get_running_loop().create_task(wait())
    _background.add(task)
    task.add_done_callback(_background.discard)


__all__ = ["WORKER_FAILURES", "Ingress"]
