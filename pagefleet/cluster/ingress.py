"""The ingress: routes each request to a worker actor and streams its tokens back.

`Ingress` is the cluster's front door without any wire protocol (the fronts,
gRPC in `grpc_server` and OpenAI HTTP in the `openai` package, see it through
`pagefleet.cluster.api.Front`). Both call `submit(tenant, target, prompt,
SamplingParams)`: it picks the tenant's pool (`tenancy`), tokenizes the
prompt once (`prompts`), and hands the request to a `RequestRun`
(`request_run`), which admits it (`admission`: routed now when a worker has
room, else queued fairly), opens a Ray streaming call to the chosen worker
with one typed `WorkerRequest` (token ids only), and relays its
`TokenDelta`s. The ingress never polls
workers: a background task follows the central scheduler's view
(`fleet_view`: versioned deltas of liveness, load and the prefix index) and
applies it to the router and the worker slots (`worker_slots`), so every
replica routes on one cluster-wide view, kept fresh asynchronously.

Faults (`RequestRun`): when a worker dies mid-stream, the request is re-submitted to
another live worker of the same pool as prompt + the tokens already streamed
(recompute), with `max_tokens` reduced by what was streamed; the client's
stream simply continues (a request of `n` completions that streamed apart goes
on as one continuation per unfinished completion). Greedy output is unchanged
by the failover. The same happens when the scheduler takes a worker out of routing while it holds
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
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from typing import Any

from pagefleet.cluster.admission import Admission
from pagefleet.cluster.api import (
    GenerationRequest,
    StreamDelta,
    request_id_or_new,
    scoped_request_id,
)
from pagefleet.cluster.config import ClusterConfig, PoolConfig, TenantConfig
from pagefleet.cluster.errors import AlreadyExists
from pagefleet.cluster.fleet_view import FleetView, RouteSharer
from pagefleet.cluster.metrics import IngressMetrics
from pagefleet.cluster.prompts import Prompts, check_length, check_n
from pagefleet.cluster.request_run import RequestRun
from pagefleet.cluster.router import Router
from pagefleet.cluster.status import PoolStatus
from pagefleet.cluster.tenancy import Target, Tenancy, unknown_pool
from pagefleet.cluster.worker_slots import WorkerSlots
from pagefleet.worker.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

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
        self.tenancy = Tenancy(config)
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
            config.router, seed=router_seed, on_routed=self.routes.note if shared else None,
            on_pinned=self.routes.pin if shared else None,
        )  # fmt: skip
        self._scheduler = scheduler
        # `resolve_worker(worker_id)`: the handle of a worker added while serving.
        self.slots = WorkerSlots(
            config, workers, self.router, self._dispatch, metrics, resolve=resolve_worker
        )
        self.admission = Admission(config, self.router, self.slots, self.replica_id, metrics)
        self.fleet = FleetView(
            self.router, self.slots.apply, self.replica_id, on_abort=self._abort_here,
            queued=self._queued,
        )
        self._prompts = Prompts()
        self._running: dict[str, RequestRun] = {}
        if metrics is not None:
            metrics.track_wait_queue(self._queued)
            metrics.name_tenants({t.cache_salt(): t.name for t in config.tenants})
            metrics.track_view(self.fleet.staleness_s)
            metrics.track_preemption_rate(self.slots.preemptions_per_minute)
        self._follower: asyncio.Task[None] | None = None

    def _queued(self) -> dict[str, int]:
        """Requests waiting in this replica's queue, per pool."""
        return {pool.name: self.admission.waiting(pool.name) for pool in self.config.pools}

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
        """Load the tokenizers and the adapters' identities, then wait until the view shows
        every worker alive."""
        for pool in self.config.pools:
            # Loading blocks the event loop for a moment: do it before serving, not
            # on the first request.
            self._prompts.tokenizer(pool)
            for name in pool.engine.adapter_dirs:
                self._prompts.adapter_id(pool, name)
        deadline = time.monotonic() + timeout_s
        while not all(slot.streaming for slot in self.slots.all()):
            if time.monotonic() > deadline:
                missing = [s.worker_id for s in self.slots.all() if not s.streaming]
                raise TimeoutError(f"workers not ready after {timeout_s:.0f}s: {missing}")
            await asyncio.sleep(0.05)

    # ----- requests -----------------------------------------------------

    async def submit(
        self,
        tenant: TenantConfig,
        target: Target,
        prompt: str | Sequence[int],
        params: SamplingParams,
        *,
        request_id: str = "",
        priority: int = 0,
        session: str = "",
    ) -> AsyncGenerator[StreamDelta, None]:
        """Stream one request of `tenant`: its pool and adapter (`Tenancy.resolve`), its prompt
        tokenized once here and checked against the pool's limits, then admitted and run
        (on its `session`'s worker, when it names one and that worker can take it).
        Raises IngressError before or during the stream."""
        resolved = self.tenancy.resolve(tenant, target)
        pool = resolved.pool
        request_id = request_id_or_new(request_id)
        key = scoped_request_id(tenant.name, request_id)
        if key in self._running or self.admission.is_waiting(key):
            raise AlreadyExists(f"request_id {request_id!r} is already running")
        check_n(params, self.config.server.max_n)
        prompt_ids = await self._prompts.token_ids(pool, prompt)
        check_length(pool, prompt_ids, params)
        adapter_id = None if resolved.adapter is None else self._prompts.adapter_id(pool, resolved.adapter)
        req = GenerationRequest(
            request_id, tuple(prompt_ids), params, priority, pool.name, tenant.cache_salt(), tenant.name,
            resolved.adapter, adapter_id, session,
        )  # fmt: skip
        run = RequestRun(
            req, pool, admission=self.admission, slots=self.slots, replica_id=self.replica_id,
            stall_timeout_s=self.config.scheduler.stall_timeout_s, running=self._running,
            metrics=self.metrics,
        )  # fmt: skip
        async with contextlib.aclosing(run.deltas()) as deltas:
            async for delta in deltas:
                yield delta

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
        run = self._running.get(request_id)
        if run is None:
            return anywhere and await self._abort_elsewhere(request_id, tenant)
        await run.abort()
        return True

    def _abort_here(self, key: str) -> bool:
        """Another replica's abort note: cancel `key` if it waits here (or has just been
        routed from the queue and runs here); returns whether it was here."""
        if self.admission.cancel(key):
            return True
        run = self._running.get(key)
        if run is None:
            return False
        run.abort_soon()
        return True

    async def _abort_elsewhere(self, key: str, tenant: str) -> bool:
        """Abort a request another replica holds: the workers of the tenant's pools end
        it (their stream, relayed by that replica, ends with "abort") and free its blocks;
        failing that, the scheduler relays the abort to the other replicas, one of which
        may hold it waiting in its queue (`SchedulerActor.relay_abort`).

        The key is tenant-scoped, so another tenant's request is never found.
        """
        pools = self.tenancy.visible_pools(self.tenancy.tenant(tenant))
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
        """The tokenizer of a pool (NOT_FOUND for an unknown pool); e.g. for chat templates."""
        return self._prompts.tokenizer(self.pool_config(pool))

    # ----- status -------------------------------------------------------

    def preemptions_per_minute(self) -> dict[str, float]:
        """Preemptions per pool over the last minute, from the workers' reports."""
        return self.slots.preemptions_per_minute()

    def live_workers(self) -> dict[str, int]:
        """Live workers per pool: the health rule (healthy while none is 0) of both fronts."""
        return self.slots.live_workers()

    def status(self, pool: str | None = None, tenant: TenantConfig | None = None) -> list[PoolStatus]:
        """Per pool and per worker counters (GetStatus, the dashboard).

        With `tenant`, only the pools it may use; another tenant's pool is NOT_FOUND,
        exactly like an unknown one.
        """
        names = [self.tenancy.visible_pool(tenant, pool).name] if pool else self.tenancy.visible_pools(tenant)
        out = []
        for name in names:
            cfg = self.config.pool(name)
            scaling = self.pool_scaling.get(name, {})
            status = self.slots.pool_status(cfg, self.policy, self.admission.waiting(name))
            if tenant is not None:  # another tenant's adapter names are not this one's business
                usable = set(self.tenancy.adapters(tenant, name))
                status = dataclasses.replace(status, workers=tuple(
                    dataclasses.replace(w, resident_adapters=tuple(a for a in w.resident_adapters if a in usable))
                    for w in status.workers
                ))  # fmt: skip
            out.append(dataclasses.replace(
                status,
                target_workers=scaling.get("target", cfg.workers),
                scale_reason=scaling.get("reason", "configured size"),
            ))  # fmt: skip
        return out


__all__ = ["Ingress"]
