"""The Ray actor around one `AsyncEngine`: one per GPU (or one per CPU slot without a GPU).

This is the only module in `pagefleet.worker` that imports Ray. `WorkerActor`
is a plain class; `create_worker` turns it into a restartable async actor at
build time. The engine loop runs in the background of the actor's event loop;
each `generate` call is one Ray streaming generator, so many streams share
one worker.

Load reports and KV events leave the worker one way: every
`report_interval_s` the worker pushes both (msgpack, `pagefleet.worker.events`)
to the central scheduler (the shard owning its pool, when it is sharded), which holds the cluster's one view and fans it out
to the ingress replicas. An idle worker whose state has not changed since its
last push pushes only every `heartbeat_s`, which keeps it alive in the
scheduler's view. Each KV batch carries the incarnation and a sequence
number; the first batch of an incarnation, and any batch the scheduler asks
for (after a gap, or to measure drift), is a snapshot of every held hash.
The report loop starts with the actor, so a worker Ray restarted rejoins
without anyone calling it. A step that runs long (a long prompt's prefill
chunk) does not hold the report back: it goes out on time with the state
read after the previous step and how long this one has run. Every call that
reads the engine between two steps (the report, `stats`, `info`, eviction)
waits on a thread, never on the actor's event loop, so a long step stalls
none of the actor's streams, polls or reports. The push's ack may order a
hand-off (migration): the worker aborts that request and ends its stream with
`migrated_to`, and the ingress resumes it on the named worker. When the order
says to transfer (`scheduler.migration_transfer`), the worker first copies the
request's full, registered KV blocks out of its pool, between the same two
engine steps as the abort, and puts them in the object store; the last delta
carries them as a `KVHandoff`, and the target worker fetches and imports them
as cached blocks before it admits the resumed request, so it recomputes only
the partial tail block. A hand-off it cannot fetch (or import) in
`KV_FETCH_TIMEOUT_S` is recomputed instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ray

from pagefleet.worker.config import EngineConfig
from pagefleet.worker.events import SCHEDULER_ACTOR_NAME, KVEventBatch, LoadReport, WorkerInfo
from pagefleet.worker.outputs import RequestError
from pagefleet.worker.wire import KVHandoff, TokenDelta, WorkerRequest, origin_of

# The engine (and torch with it) loads in the worker's own process only, in
# `WorkerActor.__init__`: the processes that only create workers or call them (the
# membership actor, the driver, the ingress) do not pay torch's import (about 1.5
# CPU-seconds each) at every start.
if TYPE_CHECKING:
    from pagefleet.worker.async_engine import ReportState
    from pagefleet.worker.engine import EngineStats
    from pagefleet.worker.kv_migration import ExportedKV

logger = logging.getLogger(__name__)

# Concurrent calls one worker accepts (streams + polls + aborts); the engine's
# own max_num_seqs bounds what runs, the rest waits in its queue.
MAX_CONCURRENCY = 1024

# How long a target waits for a hand-off's KV blocks before it recomputes them instead.
KV_FETCH_TIMEOUT_S = 10.0
IMPORT_COST_WEIGHT = 0.3  # weight of a new import's seconds per block in the moving average


@dataclass
class _Handoff:
    """A request being handed off: where to, and (by transfer) its exported KV blocks."""

    target: str
    exported: asyncio.Future[ExportedKV | None] | None = None  # None: by recompute


class WorkerActor:
    """One engine with a private KV pool, driven through Ray calls."""

    def __init__(
        self,
        worker_id: str,
        pool: str,
        engine_config: EngineConfig,
        *,
        report_interval_s: float = 0.5,
        heartbeat_s: float | None = None,
        scheduler_namespace: str | None = None,
        scheduler_name: str = SCHEDULER_ACTOR_NAME,
        torch_threads: int | None = None,
    ) -> None:
        if torch_threads is not None:
            import torch

            torch.set_num_threads(torch_threads)
        self.worker_id = worker_id
        self.pool = pool
        # A new id per (re)start: the ingress notices a restart by it changing.
        self.incarnation = uuid.uuid4().hex
        from pagefleet.worker.async_engine import AsyncEngine

        engine_config = dataclasses.replace(engine_config, device=resolve_device(engine_config.device))
        self._engine = AsyncEngine(engine_config, on_fatal=_exit_for_restart)
        self._block_size = engine_config.block_size
        self._report_interval_s = report_interval_s
        self._heartbeat_s = report_interval_s if heartbeat_s is None else heartbeat_s
        self._scheduler_namespace = scheduler_namespace
        self._scheduler_name = scheduler_name  # the shard owning this worker's pool
        self._report_seq = 0
        self._kv_seq = 0
        self._active: set[str] = set()  # ids of the requests streaming now
        self._migrating: dict[str, _Handoff] = {}  # request id -> where it is handed to
        self._kv_import_failures = 0  # hand-offs whose blocks could not be fetched or imported
        # Seconds per block of an import by transfer (fetch + write), a moving average;
        # 0.0 until the first one. The scheduler weighs it against recompute per move.
        self._kv_import_s_per_block = 0.0
        # Requests importing a hand-off's blocks, not in the engine yet: an abort meanwhile
        # cancels the import, and the request ends there instead of being submitted.
        self._importing: dict[str, asyncio.Task[None]] = {}
        self._preemptions_seen = 0
        self._last_state: ReportState | None = None  # the engine's state at the last report
        self._migrations_out = 0  # hand-offs ordered by the scheduler, for GetStatus
        self._reporter: asyncio.Task[None] | None = None
        with contextlib.suppress(RuntimeError):  # an async actor's __init__ runs on its loop
            self._ensure_reporter()

    # ----- requests -----------------------------------------------------

    async def generate(self, request: WorkerRequest) -> AsyncIterator[TokenDelta]:
        """Stream one request's `TokenDelta`s.

        Bad input ends the stream with one delta whose `error` is set instead of
        raising, so the caller can tell a client error from a worker failure.
        """
        self._ensure_reporter()
        request_id = request.request_id
        self._active.add(request_id)
        prompt = list(request.prompt)
        try:
            if request.kv is not None:
                task = asyncio.ensure_future(self._import_kv(request_id, request.kv, request.adapter))
                self._importing[request_id] = task
                await asyncio.wait({task})
                del self._importing[request_id]
                if task.cancelled():  # aborted while importing
                    yield TokenDelta(finish_reason="abort")
                    return
            stream = self._engine.generate(
                request_id,
                prompt,
                request.params,
                priority=request.priority,
                salt=request.salt,
                adapter=request.adapter,
                num_resumed_tokens=request.num_resumed_tokens,
            )
            async for out in stream:
                if out.error is not None:  # this request alone failed; the engine goes on
                    yield TokenDelta(error=out.error, error_code="internal")
                    return
                handoff = self._migrating.get(request_id)
                if handoff is not None and out.finish_reason == "abort":
                    # Handed off (its blocks are free already): the ingress resumes it there.
                    delta = TokenDelta.from_output(out)
                    kv = await self._handoff_kv(request_id, handoff)
                    yield dataclasses.replace(
                        delta, finish_reason=None, migrated_to=handoff.target, kv=kv
                    )
                    return
                yield TokenDelta.from_output(out)
        except RequestError as exc:
            yield TokenDelta(error=str(exc))
        finally:
            self._active.discard(request_id)
            importing = self._importing.pop(request_id, None)
            if importing is not None:  # the caller left while the blocks were fetched
                importing.cancel()
            self._migrating.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        """Abort a request (unknown or finished ids are ignored); its blocks return to the pool
        between two engine steps, and its stream ends with finish_reason "abort"."""
        self._abort(request_id)

    async def abort_key(self, key: str) -> bool:
        """Abort the streaming request whose id is `key` tagged by any ingress replica
        (`<key>@<replica>`): how a replica that does not hold the stream aborts it.
        Returns whether one was found."""
        found = False
        for request_id in list(self._active):
            if request_id.rpartition("@")[0] == key:
                self._abort(request_id)
                found = True
        return found

    def _abort(self, request_id: str) -> None:
        importing = self._importing.get(request_id)
        if importing is not None:
            importing.cancel()
        self._engine.abort(request_id)

    def _migrate(self, request_id: str, target: str, *, transfer: bool) -> None:
        """Hand a request off on the scheduler's order: abort it here (its blocks return to
        the pool between two steps) and end its stream with `migrated_to=target`; with
        `transfer`, copy its registered blocks out first, between the same two steps."""
        if request_id in self._active and request_id not in self._migrating:
            how = "transfer" if transfer else "recompute"
            self._migrations_out += 1
            logger.info("worker %s: migrating %s to %s by %s", self.worker_id, request_id, target, how)
            if transfer:
                self._migrating[request_id] = _Handoff(target, self._engine.export_and_abort(request_id))
            else:
                self._migrating[request_id] = _Handoff(target)
                self._engine.abort(request_id)

    async def _handoff_kv(self, request_id: str, handoff: _Handoff) -> KVHandoff | None:
        """The exported blocks of a handed-off request, put in the object store (None:
        by recompute, or nothing to move)."""
        if handoff.exported is None:
            return None
        try:
            exported = await handoff.exported
        except Exception as exc:  # the target recomputes: slower, never wrong
            logger.warning("worker %s: KV export of %s failed: %s", self.worker_id, request_id, exc)
            return None
        if exported is None:
            return None
        from pagefleet.worker.kv_migration import to_bytes

        return KVHandoff(
            exported.block_hashes,
            ray.put(to_bytes(exported.blocks)),
            tuple(exported.blocks.shape[1:]),
            exported.dtype_name,
        )

    async def _import_kv(self, request_id: str, kv: KVHandoff, adapter: str | None) -> None:
        """Fetch a hand-off's blocks and import them as cached blocks, before the request is
        admitted; on any failure (object lost with its worker, timeout, another layout)
        the request just recomputes them."""
        from pagefleet.worker.kv_migration import from_bytes

        started = time.perf_counter()
        try:
            raw = await asyncio.wait_for(_fetch(kv.blocks), KV_FETCH_TIMEOUT_S)
            blocks = from_bytes(raw, kv.dtype, kv.shape)
            n = await self._engine.import_kv(list(kv.block_hashes), blocks, adapter)
        except Exception as exc:
            self._kv_import_failures += 1
            logger.warning(
                "worker %s: the KV blocks of %s could not be imported (%s: %s); recomputing",
                self.worker_id, request_id, type(exc).__name__, exc,
            )
            return
        if kv.block_hashes:
            per_block = (time.perf_counter() - started) / len(kv.block_hashes)
            previous = self._kv_import_s_per_block
            self._kv_import_s_per_block = (
                per_block if previous == 0 else previous + IMPORT_COST_WEIGHT * (per_block - previous)
            )
        logger.info(
            "worker %s: imported %d of %d KV blocks of %s",
            self.worker_id, n, len(kv.block_hashes), request_id,
        )

    # ----- state --------------------------------------------------------

    async def info(self) -> dict[str, Any]:
        """Identity and placement of this worker incarnation."""
        self._ensure_reporter()
        stats = await asyncio.to_thread(self._engine.stats)
        return {
            "worker_id": self.worker_id,
            "pool": self.pool,
            "incarnation": self.incarnation,
            "node_id": ray.get_runtime_context().get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
            "block_size": self._block_size,
            "total_blocks": stats.total,
            # Streams open now (running or queued): a removal waits for 0 before the kill.
            "active_streams": len(self._active),
        }

    async def stats(self) -> EngineStats:
        """The engine's pool and queue counters (`LLMEngine.stats()`), with the hand-offs
        whose KV blocks could not be imported (`kv_import_failures`)."""
        return self._with_import_failures(await asyncio.to_thread(self._engine.stats))

    def _with_import_failures(self, stats: EngineStats) -> EngineStats:
        return dataclasses.replace(stats, kv_import_failures=self._kv_import_failures)

    def evict_cached(self, n: int) -> int:
        """Evict up to `n` cached blocks between two engine steps: those another worker
        also holds first, then last copies, LRU within each. Returns how many."""
        evicted = self._engine.evict_cached(n)
        if evicted:
            logger.debug("worker %s evicted %d cached blocks", self.worker_id, evicted)
        return evicted

    async def check_integrity(self) -> None:
        """Raise AssertionError if the block pool's bookkeeping is inconsistent."""
        await asyncio.to_thread(self._engine.check_integrity)

    # ----- scheduler reports --------------------------------------------

    async def _next_report(
        self, snapshot: bool, wait_s: float | None = None
    ) -> tuple[LoadReport, KVEventBatch, bool]:
        """The next load report and KV batch (with `snapshot`, of every held hash), and
        whether the batch is what was asked for (a snapshot asked for during a long step
        is still owed).

        The engine's state is read between two steps, off the event loop. While
        a step runs on past `wait_s` (the report loop's `report_interval_s`: a
        long prefill chunk), the report goes anyway: the state read last time,
        how long the step has run so far (`LoadReport.step_s`) and a KV batch
        without events (they wait in the engine for the next one). So the
        scheduler hears from a busy worker on time. The first report waits.
        """
        state = await asyncio.to_thread(
            self._engine.report_state, self._preemptions_seen, snapshot=snapshot,
            wait_s=wait_s if self._last_state is not None else None,
        )  # fmt: skip
        step_s = 0.0
        events: list[tuple[str, bytes]] = []
        adapters: tuple[str, ...] = ()
        reset = False
        if state is None:
            assert self._last_state is not None
            state, step_s = self._last_state, self._engine.step_seconds()
        else:
            self._last_state = state
            # A preemption for want of a block since the last report means short of
            # blocks, even when the victim got back in before this report was taken.
            self._preemptions_seen = state.block_preemptions
            events, adapters, reset = state.kv_events, state.kv_adapters, snapshot
        self._report_seq += 1
        report = LoadReport.from_engine_stats(
            self.worker_id,
            self.pool,
            self._report_seq,
            self._with_import_failures(state.stats),
            tenant_live_blocks=state.tenant_live_blocks,
            tenant_cap_refusals=state.tenant_cap_refusals,
            incarnation=self.incarnation,
            progress=state.tokens_computed,
            step_s=step_s,
            committed_blocks=state.claims.committed,
            priority_claims=state.claims.by_priority,
            origin_claims=_by_origin(state.claims.by_request),
            blocks_short=state.blocks_short,
            requests=state.requests,
            migrations_out=self._migrations_out,
            recompute_s_per_token=state.recompute_s_per_token,
            kv_import_s_per_block=self._kv_import_s_per_block,
            resident_adapters=state.lora.resident,
            lora_slots=state.lora.slots,
            lora_loads=state.lora.loads,
            lora_evictions=state.lora.evictions,
        )
        batch = KVEventBatch.from_engine(
            self.worker_id, self._kv_seq + 1, events, reset=reset,
            incarnation=self.incarnation, adapters=adapters,
        )  # fmt: skip
        return report, batch, reset == snapshot

    def _ensure_reporter(self) -> None:
        if self._reporter is None and self._report_interval_s > 0:
            self._reporter = asyncio.get_running_loop().create_task(self._report_loop())

    async def _report_loop(self) -> None:
        scheduler: Any = None
        generation: int | None = None
        snapshot = True  # the scheduler has no consistent index of this incarnation yet
        pushed: LoadReport | None = None  # the last report pushed, and when
        pushed_at = -float("inf")
        while True:
            try:
                if scheduler is None:
                    scheduler = _find_scheduler(self._scheduler_name, self._scheduler_namespace)
                    generation = None
                if scheduler is not None:
                    if generation is None:
                        info = await self.info()
                        generation = await scheduler.register_worker.remote(
                            WorkerInfo(
                                worker_id=self.worker_id,
                                pool=self.pool,
                                total_blocks=info["total_blocks"],
                                block_size=self._block_size,
                                node_id=info["node_id"],
                                node_ip=info["node_ip"],
                            )
                        )
                        snapshot = True
                        # A fresh scheduler state knows of no duplicates told before.
                        await asyncio.to_thread(self._engine.mark_duplicated, ())
                    report, batch, as_asked = await self._next_report(
                        snapshot, self._report_interval_s
                    )
                    now = time.monotonic()
                    if _idle(report, batch, pushed) and now - pushed_at < self._heartbeat_s:
                        await asyncio.sleep(self._report_interval_s)
                        continue
                    self._kv_seq, pushed, pushed_at = batch.seq, report, now
                    ack = await scheduler.push.remote(self.worker_id, report.encode(), batch.encode())
                    snapshot = ack.snapshot or not as_asked
                    if ack.dead_replicas:
                        self._abort_orphans(set(ack.dead_replicas))
                    for request_id, target, transfer in ack.migrate:
                        self._migrate(request_id, target, transfer=transfer)
                    if not ack.registered or ack.generation != generation:
                        generation = None  # the scheduler restarted: register again
                    else:
                        if ack.duplicated is not None:
                            # Kept until the next change: every eviction (on allocation
                            # too) takes these before the last copies of a prefix.
                            await asyncio.to_thread(self._engine.mark_duplicated, ack.duplicated)
                        if ack.evict_blocks > 0:
                            # Below the free-block watermark: evict cached blocks now, so
                            # the next bursts allocate from the free list.
                            await asyncio.to_thread(self.evict_cached, ack.evict_blocks)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                # Serving never depends on the scheduler: skip this push, look it up again.
                # The drained events may be lost with it, so the next batch is a snapshot.
                logger.debug("worker %s: scheduler push failed: %s", self.worker_id, exc)
                scheduler = None
                snapshot = True
            await asyncio.sleep(self._report_interval_s)

    def _abort_orphans(self, dead_replicas: set[str]) -> None:
        """Abort the requests a dead ingress replica sent: nobody reads their streams."""
        for request_id in list(self._active):
            if origin_of(request_id) in dead_replicas:
                logger.info("worker %s: aborting %s of a dead ingress", self.worker_id, request_id)
                self._abort(request_id)


def _idle(report: LoadReport, batch: KVEventBatch, pushed: LoadReport | None) -> bool:
    """A push that would tell the scheduler nothing but that the worker lives: no
    request, no KV event, the load of the last push."""
    no_work = report.num_running + report.num_waiting == 0
    return no_work and not batch.events and not batch.reset and report.same_load(pushed)


def _by_origin(by_request: dict[str, int]) -> dict[str, int]:
    """Per ingress replica (the tag after "@" in its request ids), the blocks its requests claim."""
    out: dict[str, int] = {}
    for request_id, blocks in by_request.items():
        replica = origin_of(request_id)
        if replica:
            out[replica] = out.get(replica, 0) + blocks
    return out


async def _fetch(ref: Any) -> Any:
    return await ref


def _exit_for_restart(exc: BaseException) -> None:
    """The engine died (no single request's fault): end the process so Ray restarts the
    actor; its streams fail like a crash and the ingress resumes them elsewhere. A worker
    must never answer polls (look alive) with a dead engine."""
    logger.critical("worker process exits so Ray restarts it: %s: %s", type(exc).__name__, exc)
    logging.shutdown()
    os._exit(1)


def resolve_device(device: str) -> str:
    """The device a worker computes on: `auto` is cuda when Ray assigned this process a
    GPU and torch can use it, else cpu; cpu and cuda stay what they say (a cpu worker
    holding Ray GPUs computes on CPU). On cuda, Ray's CUDA_VISIBLE_DEVICES makes the
    GPU it assigned the worker's cuda:0."""
    if device != "auto":
        return device
    import torch

    return "cuda" if ray.get_gpu_ids() and torch.cuda.is_available() else "cpu"


def _find_scheduler(name: str, namespace: str | None) -> Any:
    """The scheduler's (or its pool's shard's) handle, or None while there is none."""
    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        return None


def create_worker(
    worker_id: str,
    pool: str,
    engine_config: EngineConfig,
    *,
    num_gpus: float = 0.0,
    num_cpus: float = 0.5,
    name: str | None = None,
    namespace: str | None = None,
    report_interval_s: float = 0.5,
    heartbeat_s: float | None = None,
    scheduler_name: str = SCHEDULER_ACTOR_NAME,
    torch_threads: int | None = None,
    scheduling_strategy: Any = None,
    label_selector: dict[str, str] | None = None,
) -> Any:
    """Start a `WorkerActor` as a restartable Ray actor and return its handle.

    `max_restarts=-1`: Ray brings a dead worker back (empty cache, new
    incarnation) and it rejoins routing. `max_task_retries=0`: a stream cut by
    a failure is resumed by the ingress on another worker, never replayed by
    Ray on the same one. `heartbeat_s`: how often an idle worker with nothing new
    pushes (default: every `report_interval_s`). `scheduler_name`: the named
    scheduler actor (the shard owning `pool`) the worker pushes to.
    `label_selector`: only nodes with these Ray labels take it.
    """
    options: dict[str, Any] = {
        "num_cpus": num_cpus,
        "num_gpus": num_gpus,
        "max_restarts": -1,
        "max_task_retries": 0,
        "max_concurrency": MAX_CONCURRENCY,
    }
    if name is not None:
        options["name"] = name
        options["namespace"] = namespace
    if scheduling_strategy is not None:
        options["scheduling_strategy"] = scheduling_strategy
    if label_selector:
        options["label_selector"] = label_selector
    cls = ray.remote(WorkerActor).options(**options)
    return cls.remote(
        worker_id,
        pool,
        engine_config,
        report_interval_s=report_interval_s,
        heartbeat_s=heartbeat_s,
        scheduler_namespace=namespace,
        scheduler_name=scheduler_name,
        torch_threads=torch_threads,
    )
