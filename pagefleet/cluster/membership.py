"""Add and remove workers of a pool while serving.

`Membership` owns a deployment's worker actors: it starts the configured
ones, adds workers to a pool and removes them with a drain. It runs as the
named Ray actor `pagefleet-membership` (namespace `pagefleet`), created by
`start_cluster` (`pagefleet serve`) or by the Serve application's
`WorkerOwner` deployment; each owns it, and it owns the workers, so they end
with their owner as before. `pagefleet scale` and the `WorkerOwner`'s
`user_config` (`reconfigure`) both call it.

Adding a worker: a fresh id (`<pool>-<n>`, n counting up, never reused by
this owner, so a removed worker's id never names another process), created
with the same options as the configured ones. It joins routing by the
ordinary path: its first push registers it with the scheduler, the view
reports it, and every ingress replica creates a slot for it and routes to it
once it is alive. A worker Ray cannot place (or that does not load) within
`timeout_s` is killed and reported, with the resources it asked for and what
the cluster has free.

Removing a worker: the scheduler marks it draining, so every replica takes it
out of routing (no new request or migration goes there) while its streams
finish there; once it has had no stream for `SETTLE_S` (a stream already on
its way there arrives meanwhile), or at `drain_timeout_s`, it is killed
without restart (streams still running then fail over by recompute, as after
a worker death); once Ray reports it dead, the scheduler forgets it (its
index entries go), and the `gone` delta makes every replica drop its slot,
router entry and metric series. The last worker of a pool is never removed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import re
import time
from dataclasses import dataclass, replace
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from pagefleet.cluster.config import (
    DEFAULT_WORKER_ADD_TIMEOUT_S,
    DEFAULT_WORKER_DRAIN_TIMEOUT_S,
    ClusterConfig,
    PoolConfig,
)
from pagefleet.cluster.names import (
    HEAD_NODE_RESOURCE,
    MEMBERSHIP_NAME,
    NAMESPACE,
    worker_actor_name,
)
from pagefleet.cluster.placement import (
    WorkerShape,
    autoscaler_request,
    cannot_place,
    capacity,
    cluster_nodes,
)
from pagefleet.scheduler.actor import shard_actor_name
from pagefleet.scheduler.autoscale import PoolAutoscaler, pool_load

logger = logging.getLogger(__name__)

# Logical CPUs a CPU-only worker asks Ray for: two workers fit a 2-core laptop
# next to the ingress and the scheduler (which ask for none).
CPU_WORKER_NUM_CPUS = 0.5
DEFAULT_ADD_TIMEOUT_S = DEFAULT_WORKER_ADD_TIMEOUT_S
DEFAULT_DRAIN_TIMEOUT_S = DEFAULT_WORKER_DRAIN_TIMEOUT_S
# A draining worker must be idle this long before the kill: a request routed just
# before a replica saw the draining delta arrives meanwhile and runs there.
SETTLE_S = 1.0
POLL_S = 0.2
# How often the owner looks for workers whose node died (a replacement is due).
NODE_CHECK_S = 1.0
JOIN_TIMEOUT_S = 30.0  # from "loaded" to "in the scheduler's view, alive"
# Loads of a configured worker at start-up before the start fails: a worker that
# cannot load (out of memory, no CUDA, a bad device or model) fails the same way again.
LOAD_ATTEMPTS = 3


class MembershipError(ValueError):
    """A scale or remove request that cannot be carried out; the message says why."""


def worker_shape(pool: PoolConfig, cluster_gpus: float) -> WorkerShape:
    """What one worker of `pool` asks Ray for: `num_gpus_per_worker` GPUs (default one on
    a cluster with GPUs, none without), one CPU beside a GPU (else CPU_WORKER_NUM_CPUS),
    on a node with the pool's `node_labels`. The pool's `device` does not change it:
    a cpu pool on GPU nodes takes one GPU per worker and computes on CPU."""
    if pool.num_gpus_per_worker is not None:
        num_gpus = pool.num_gpus_per_worker
    else:
        num_gpus = 1.0 if cluster_gpus > 0 else 0.0
    return WorkerShape(1.0 if num_gpus > 0 else CPU_WORKER_NUM_CPUS, num_gpus, pool.node_labels)


@dataclass
class _Member:
    worker_id: str
    handle: Any
    # The worker's first `info()`: done once Ray placed it and its engine loaded.
    loaded: concurrent.futures.Future[dict[str, Any]]
    draining: bool = False

    @property
    def node_id(self) -> str | None:
        """The node it was placed on, once it has loaded (None before, or if that failed)."""
        if not self.loaded.done() or self.loaded.exception() is not None:
            return None
        return str(self.loaded.result()["node_id"])


class Membership:
    """The workers of every pool of one deployment; see the module docstring.

    `schedulers` are the scheduler shards' handles (the shard owning a pool
    marks its workers draining and forgets removed ones). A plain class:
    `start_membership` makes it the named async actor.
    """

    def __init__(self, config: ClusterConfig, namespace: str, schedulers: tuple[Any, ...]) -> None:
        self._config = config
        self._namespace = namespace
        self._schedulers = schedulers
        self._shards = config.scheduler_shards()
        self._scheduler_names = {p: shard_actor_name(s) for p, s in self._shards.items()}
        self._cluster_gpus = 0.0  # the most GPUs the cluster has advertised (`_shape`)
        self._members: dict[str, list[_Member]] = {pool.name: [] for pool in config.pools}
        self._next_index = {pool.name: 0 for pool in config.pools}
        self._lock = asyncio.Lock()  # one membership change at a time
        self._watcher: asyncio.Task[None] | None = None
        # Pools with min_workers < max_workers, and the scale each one runs now.
        self._autoscalers = {
            pool.name: PoolAutoscaler(config.scheduler.autoscale_policy(*pool.worker_bounds()), pool.workers)
            for pool in config.pools
            if pool.worker_bounds()[0] < pool.worker_bounds()[1]
        }
        self._autoscaling: dict[str, asyncio.Task[None]] = {}
        # The other pools' sizes: the configured one until `pagefleet scale` sets another.
        self._sizes = {pool.name: (pool.workers, "configured size") for pool in config.pools}
        for pool in config.pools:
            for _ in range(pool.workers):
                self._create(pool)
        with contextlib.suppress(RuntimeError):  # an async actor's __init__ runs on its loop
            self._ensure_watcher()

    # ----- queries --------------------------------------------------------

    def members(self) -> dict[str, list[tuple[str, Any]]]:
        """`{pool: [(worker_id, actor handle), ...]}`, draining workers included."""
        return {pool: [(m.worker_id, m.handle) for m in ms] for pool, ms in self._members.items()}

    async def wait_loaded(self, timeout_s: float, attempts: int = LOAD_ATTEMPTS) -> str | None:
        """Wait until every configured worker is placed and has loaded its model, starting
        one whose load failed again (a fresh id) up to `attempts` loads in all; returns why
        a pool cannot start (one line: the pool, the worker and the cause, or what its
        workers ask Ray for against what the cluster has), None once all are loaded."""
        self._ensure_watcher()
        deadline = time.monotonic() + timeout_s
        for pool in self._config.pools:
            for i in range(len(self._members[pool.name])):
                for attempt in range(1, attempts + 1):
                    member = self._members[pool.name][i]
                    # asyncio.wait, not wait_for: a timeout must not cancel the load.
                    loaded = asyncio.wrap_future(member.loaded)
                    done, _ = await asyncio.wait({loaded}, timeout=max(1.0, deadline - time.monotonic()))
                    if not done:
                        unplaced = sum(not m.loaded.done() for m in self._members[pool.name])
                        shape = self._shape(pool)
                        return f"{cannot_place(pool.name, shape, unplaced, cluster_nodes())} (waited {timeout_s:g}s)"
                    exc = loaded.exception()
                    if exc is None:
                        break
                    if not isinstance(exc, RayActorError):
                        raise exc
                    cause = load_failure(exc)
                    logger.warning(
                        "pool %s: worker %s failed to load (attempt %d of %d): %s",
                        pool.name, member.worker_id, attempt, attempts, cause,
                    )
                    ray.kill(member.handle, no_restart=True)
                    if attempt == attempts:
                        return (
                            f"pool {pool.name}: worker {member.worker_id} failed to load "
                            f"{attempts} times: {cause}"
                        )
                    self._members[pool.name].remove(member)
                    replacement = self._create(pool)
                    # Keep the configured order: the replacement takes the dead one's place.
                    self._members[pool.name].remove(replacement)
                    self._members[pool.name].insert(i, replacement)
        return None

    # ----- changes --------------------------------------------------------

    async def scale(
        self,
        pool: str,
        workers: int,
        timeout_s: float = DEFAULT_ADD_TIMEOUT_S,
        drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
        wait_for_nodes: bool = False,
        settle: bool = True,
    ) -> dict[str, Any]:
        """Bring `pool` to `workers` serving workers: add new ones (each loaded and in the
        view before this returns) or remove the newest ones (drained first).

        All or nothing: a scale-out the free resources of the pool's nodes cannot hold
        is refused before anything starts (unless `wait_for_nodes`: nodes are on their
        way, e.g. asked of the autoscaler), and one that does not reach its target
        within `timeout_s` removes the workers it added again.

        An autoscaled pool takes the new size as its target (`settle`; the
        autoscaler's own moves pass False).

        Returns `{"pool", "added", "removed", "failed_over", "workers"}`; raises
        MembershipError for a bad request or a scale-out that could not be carried out.
        """
        cfg = self._pool(pool)
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise MembershipError(
                f"pool {pool!r}: workers must be an integer >= 1 (a pool keeps at least one), got {workers!r}"
            )
        self._ensure_watcher()
        async with self._lock:
            serving = [m for m in self._members[pool] if not m.draining]
            added: list[str] = []
            removed: list[str] = []
            failed_over = 0
            if workers > len(serving):
                wanted = workers - len(serving)
                if not wait_for_nodes:
                    nodes = cluster_nodes()
                    if capacity(self._shape(cfg), nodes, free=True) < wanted:
                        raise MembershipError(
                            f"scale of pool {pool!r} to {workers} refused, nothing was started: "
                            f"{cannot_place(pool, self._shape(cfg), wanted, nodes)}"
                        )
                results = await asyncio.gather(
                    *(self._add(cfg, timeout_s) for _ in range(wanted)), return_exceptions=True
                )
                added = [r for r in results if isinstance(r, str)]
                errors = [r for r in results if isinstance(r, BaseException)]
                if errors:
                    await self._roll_back(pool, added, drain_timeout_s)
                    undone = f"removed {', '.join(added)} again" if added else "none had started"
                    raise MembershipError(
                        f"scale of pool {pool!r} to {workers} failed and was rolled back "
                        f"({undone}; the pool keeps {len(serving)}): {errors[0]}"
                    )
            elif workers < len(serving):
                victims = serving[workers:][::-1]  # the newest first
                counts = await asyncio.gather(*(self._remove(pool, m, drain_timeout_s) for m in victims))
                removed, failed_over = [m.worker_id for m in victims], sum(counts)
            if pool not in self._autoscalers:
                self._sizes[pool] = (workers, "pagefleet scale")
            elif settle:
                self._autoscalers[pool].settle(workers, "pagefleet scale")
            return self._result(pool, added, removed, failed_over)

    async def remove(self, worker_id: str, drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S) -> dict[str, Any]:
        """Drain and remove one worker; refused for the last serving worker of its pool."""
        async with self._lock:
            found = [(p, m) for p, ms in self._members.items() for m in ms if m.worker_id == worker_id]
            if not found:
                known = [m.worker_id for ms in self._members.values() for m in ms]
                raise MembershipError(f"unknown worker {worker_id!r} (workers: {', '.join(known)})")
            pool, member = found[0]
            ms = self._members[pool]
            if member.draining:
                raise MembershipError(f"worker {worker_id!r} is being removed already")
            serving = [m.worker_id for m in ms if not m.draining]
            if serving == [worker_id]:
                raise MembershipError(
                    f"worker {worker_id!r} is the last worker of pool {pool!r}; a pool keeps at least "
                    f"one: add another first (pagefleet scale --pool {pool} --workers 2)"
                )
            failed_over = await self._remove(pool, member, drain_timeout_s)
            return self._result(pool, [], [worker_id], failed_over)

    # ----- internals ------------------------------------------------------

    def _ensure_watcher(self) -> None:
        if self._watcher is None:
            self._watcher = asyncio.get_running_loop().create_task(self._watch_nodes())

    async def _watch_nodes(self) -> None:
        """Every NODE_CHECK_S: replace each worker whose node died (refill), and move the
        autoscaled pools' targets on their load."""
        while True:
            await asyncio.sleep(NODE_CHECK_S)
            try:
                await self._autoscale()
            except asyncio.CancelledError:
                raise
            except Exception:  # the refill below must run whatever happens here
                logger.exception("membership: autoscaling the pools failed")
            try:
                nodes = await asyncio.to_thread(ray.nodes)
                alive = {str(n["NodeID"]) for n in nodes if n["Alive"]}
                for pool, ms in self._members.items():
                    for member in list(ms):
                        node = member.node_id
                        if node is not None and node not in alive and not member.draining:
                            await self._replace(pool, member)
            except asyncio.CancelledError:
                raise
            except Exception:  # look again next time; serving goes on meanwhile
                logger.exception("membership: checking the workers' nodes failed")

    def autoscale_status(self) -> dict[str, dict[str, Any]]:
        """Per pool: `target` and `workers` (serving now), and `reason`, why the target
        last moved (`configured size` until it does)."""
        out: dict[str, dict[str, Any]] = {}
        for pool, ms in self._members.items():
            scaler = self._autoscalers.get(pool)
            target, reason = (scaler.target, scaler.reason) if scaler else self._sizes[pool]
            serving = [m for m in ms if not m.draining and m.node_id is not None]
            out[pool] = {"target": target, "workers": len(serving), "reason": reason}
        return out

    async def _autoscale(self) -> None:
        """Feed each autoscaled pool's load (the scheduler's view) to its policy; carry out
        a move as `pagefleet scale` would, after asking Ray's autoscaler for the nodes."""
        views: dict[int, Any] = {}
        for pool, scaler in self._autoscalers.items():
            running = self._autoscaling.get(pool)
            if running is not None and not running.done():
                continue
            shard = self._shards[pool]
            if shard not in views:
                views[shard] = await self._schedulers[shard].get_view.remote()
            load = pool_load(views[shard], pool, self._config.scheduler.admission)
            decision = scaler.observe(time.monotonic(), load)
            if decision is None:
                continue
            logger.warning("pool %s: target %d workers (%s)", pool, decision.target, decision.reason)
            await asyncio.to_thread(self._request_resources)
            self._autoscaling[pool] = asyncio.ensure_future(self._autoscale_to(pool, decision.target))

    async def _autoscale_to(self, pool: str, target: int) -> None:
        try:
            await self.scale(
                pool, target, DEFAULT_ADD_TIMEOUT_S, self._config.server.drain_timeout_s,
                wait_for_nodes=True, settle=False,
            )  # fmt: skip
        except MembershipError as exc:
            serving = len([m for m in self._members[pool] if not m.draining])
            self._autoscalers[pool].settle(serving, f"scale to {target} failed: {exc}")
            logger.error("pool %s: %s", pool, exc)

    def _request_resources(self) -> None:
        """Ask Ray's autoscaler for every pool's workers at their targets, on nodes with the
        pool's labels (a standing request: it launches nodes where the cluster allows, and
        no-ops without one)."""
        from ray.autoscaler.sdk import request_resources

        wanted = []
        for pool in self._config.pools:
            scaler = self._autoscalers.get(pool.name)
            wanted.append((self._shape(pool), scaler.target if scaler else len(self._members[pool.name])))
        bundles, selectors = autoscaler_request(wanted)
        request_resources(bundles=bundles, bundle_label_selectors=selectors)

    async def _replace(self, pool: str, lost: _Member) -> None:
        """A worker's node died: forget it and start a replacement under a fresh id.

        Not under the lock (a scale may be waiting for its workers): the replacement
        is created at once and Ray places it whenever a node has room (a node that
        comes back, one that joins, one the autoscaler launches for the pending
        actor); it joins routing once loaded, like an added worker. Ray's own restart
        of the lost actor is cancelled, so exactly one replacement runs.
        """
        self._members[pool].remove(lost)
        try:
            ray.kill(lost.handle, no_restart=True)
            await self._await_dead(lost)
            await self._scheduler_of(pool).deregister_worker.remote(lost.worker_id)
        except Exception as exc:  # the replacement comes all the same; the view times it out
            logger.warning("pool %s: forgetting lost worker %s failed: %r", pool, lost.worker_id, exc)
        replacement = self._create(self._pool(pool))
        logger.warning(
            "pool %s: worker %s was lost with node %s; %s replaces it once Ray places it",
            pool, lost.worker_id, lost.node_id, replacement.worker_id,
        )

    async def _await_dead(self, member: _Member) -> None:
        """Wait (at most JOIN_TIMEOUT_S) until Ray reports the killed worker dead: only then
        may the scheduler forget it, since a push of a live process would register it again."""
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                await asyncio.wait_for(member.handle.info.remote(), 5.0)
            except RayActorError:
                return
            except (asyncio.TimeoutError, GetTimeoutError):
                pass
            await asyncio.sleep(POLL_S)

    def _pool(self, name: str) -> PoolConfig:
        try:
            return self._config.pool(name)
        except KeyError:
            known = ", ".join(p.name for p in self._config.pools)
            raise MembershipError(f"unknown pool {name!r} (pools: {known})") from None

    def _result(self, pool: str, added: list[str], removed: list[str], failed_over: int) -> dict[str, Any]:
        return {
            "pool": pool,
            "added": added,
            "removed": removed,
            "failed_over": failed_over,
            "workers": [m.worker_id for m in self._members[pool] if not m.draining],
        }

    def _shape(self, pool: PoolConfig) -> WorkerShape:
        # Read at each decision, so a node with GPUs that joined since the start counts;
        # never lowered, so the replacement of a worker lost with the last GPU node waits
        # for a GPU rather than landing on a CPU node.
        self._cluster_gpus = max(self._cluster_gpus, float(ray.cluster_resources().get("GPU", 0)))
        return worker_shape(pool, self._cluster_gpus)

    def _create(self, pool: PoolConfig) -> _Member:
        from pagefleet.worker.actor import create_worker

        shape = self._shape(pool)
        engine_config = replace(
            pool.engine,
            # The pool's own device; `auto` is resolved on the worker, which sees its GPU.
            device=pool.device,
            tenant_max_live_blocks=self._config.tenant_block_caps(),
        )
        worker_id = f"{pool.name}-{self._next_index[pool.name]}"
        self._next_index[pool.name] += 1
        handle = create_worker(
            worker_id,
            pool.name,
            engine_config,
            num_cpus=shape.num_cpus,
            num_gpus=shape.num_gpus,
            name=worker_actor_name(worker_id),
            namespace=self._namespace,
            report_interval_s=self._config.scheduler.report_interval_s,
            heartbeat_s=self._config.scheduler.heartbeat_s,
            scheduler_name=self._scheduler_names[pool.name],
            torch_threads=max(1, int(shape.num_cpus)),
            scheduling_strategy="SPREAD",  # one per GPU, across the nodes
            label_selector=dict(pool.node_labels) or None,
        )
        member = _Member(worker_id, handle, handle.info.remote().future())
        self._members[pool.name].append(member)
        return member

    async def _add(self, pool: PoolConfig, timeout_s: float) -> str:
        """Start one worker and return its id once it is loaded and alive in the view."""
        member = self._create(pool)
        started = time.monotonic()
        try:
            await asyncio.wait_for(asyncio.wrap_future(member.loaded), timeout_s)
        except (asyncio.TimeoutError, GetTimeoutError, RayActorError) as exc:
            self._members[pool.name].remove(member)
            ray.kill(member.handle, no_restart=True)
            raise MembershipError(self._not_started(pool, member.worker_id, timeout_s, exc)) from exc
        scheduler = self._scheduler_of(pool.name)
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while time.monotonic() < deadline:
            view = await scheduler.get_view.remote()
            if any(w.worker_id == member.worker_id and w.alive for w in view.workers):
                break
            await asyncio.sleep(POLL_S)
        else:
            logger.warning("worker %s loaded but not alive in the view yet", member.worker_id)
        logger.info(
            "pool %s: added worker %s in %.1fs", pool.name, member.worker_id, time.monotonic() - started
        )
        return member.worker_id

    def _not_started(self, pool: PoolConfig, worker_id: str, timeout_s: float, exc: BaseException) -> str:
        if isinstance(exc, RayActorError):
            return f"worker {worker_id} of pool {pool.name!r} failed to start: {exc}"
        return (
            f"worker {worker_id} did not start within {timeout_s:g}s: "
            f"{cannot_place(pool.name, self._shape(pool), 1, cluster_nodes())} (no room: add a "
            "node or shrink another pool; room: its model is still loading, allow a longer "
            "timeout); it was not added"
        )

    async def _roll_back(self, pool: str, added: list[str], drain_timeout_s: float) -> None:
        """Remove the workers a failed scale-out added (drained: requests may have gone there)."""
        victims = [m for m in self._members[pool] if m.worker_id in added]
        await asyncio.gather(*(self._remove(pool, m, drain_timeout_s) for m in victims))

    def _scheduler_of(self, pool: str) -> Any:
        return self._schedulers[self._shards[pool]]

    async def _remove(self, pool: str, member: _Member, drain_timeout_s: float) -> int:
        """Drain, kill and forget one worker; returns how many streams had to fail over."""
        scheduler = self._scheduler_of(pool)
        member.draining = True
        started = time.monotonic()
        await scheduler.set_draining.remote(member.worker_id, True)
        active = await self._drain(member, scheduler, drain_timeout_s)
        ray.kill(member.handle, no_restart=True)
        await self._await_dead(member)
        await scheduler.deregister_worker.remote(member.worker_id)
        if member in self._members[pool]:  # not replaced meanwhile (its node died)
            self._members[pool].remove(member)
        logger.info(
            "pool %s: removed worker %s in %.1fs (%d streams failed over)",
            pool, member.worker_id, time.monotonic() - started, active,
        )
        return active

    async def _drain(self, member: _Member, scheduler: Any, timeout_s: float) -> int:
        """Wait until the worker has had no stream for SETTLE_S, at most `timeout_s`;
        returns the streams still open at the end (0 when it drained)."""
        deadline = time.monotonic() + timeout_s
        idle_since: float | None = None
        active = 0
        while True:
            # Said again on every poll (a no-op when unchanged): a restarted scheduler
            # starts with no draining mark and would route to the worker again.
            with contextlib.suppress(Exception):
                await scheduler.set_draining.remote(member.worker_id, True)
            now = time.monotonic()
            try:
                info = await asyncio.wait_for(member.handle.info.remote(), max(1.0, deadline - now))
            except RayActorError:
                return 0  # died meanwhile: its streams failed over already
            except (asyncio.TimeoutError, GetTimeoutError):
                return active
            active = int(info.get("active_streams", 0))
            now = time.monotonic()
            if active == 0:
                idle_since = now if idle_since is None else idle_since
                if now - idle_since >= SETTLE_S:
                    return 0
            else:
                idle_since = None
            if now >= deadline:
                return active
            await asyncio.sleep(POLL_S)


def withdraw_resource_request(config: ClusterConfig) -> None:
    """Withdraw the request an autoscaled pool made of Ray's autoscaler (`_request_resources`),
    once the deployment stops: a standing request keeps its nodes up with no worker on them.
    Ray keeps one request per cluster, so this clears whoever made it last."""
    if any(low < high for low, high in (pool.worker_bounds() for pool in config.pools)):
        from ray.autoscaler.sdk import request_resources

        request_resources(bundles=[])


def load_failure(exc: BaseException) -> str:
    """The cause of a worker's failed load, one line: the last `SomeError: message` line of
    its constructor's traceback, else the error's first line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    errors = [line for line in lines if _ERROR_LINE.match(line)]
    return errors[-1] if errors else (lines[0] if lines else type(exc).__name__)


_ERROR_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt): ")


def describe_change(result: dict[str, Any]) -> str:
    """One line: what changed in the pool and who serves it now."""
    changes = []
    if result["added"]:
        changes.append(f"added {', '.join(result['added'])}")
    if result["removed"]:
        moved = f" ({result['failed_over']} streams failed over)" if result["failed_over"] else ""
        changes.append(f"removed {', '.join(result['removed'])}{moved}")
    done = "; ".join(changes) or "no change"
    return f"pool {result['pool']}: {done}; workers: {', '.join(result['workers'])}"


def start_membership(config: ClusterConfig, namespace: str, schedulers: tuple[Any, ...]) -> Any:
    """Create the named `Membership` actor (it starts the configured workers) and return its handle.

    On the head node, like the ingress: losing a worker node must not take the
    workers' owner with it. Not restartable: a new one would start a second set
    of workers; its owner (the `pagefleet serve` driver or the `WorkerOwner`
    replica) ends with it anyway.
    """
    actor = ray.remote(Membership).options(
        name=MEMBERSHIP_NAME,
        namespace=NAMESPACE,
        num_cpus=0,
        max_restarts=0,
        resources={HEAD_NODE_RESOURCE: 0.001},
    )
    return actor.remote(config, namespace, schedulers)


def get_membership() -> Any:
    """The running deployment's `Membership` actor; MembershipError when none runs."""
    try:
        return ray.get_actor(MEMBERSHIP_NAME, namespace=NAMESPACE)
    except ValueError:
        raise MembershipError(
            f"no pagefleet deployment on this Ray cluster (no actor {MEMBERSHIP_NAME!r} in "
            f"namespace {NAMESPACE!r}); start one with `pagefleet serve` or `serve run`"
        ) from None

