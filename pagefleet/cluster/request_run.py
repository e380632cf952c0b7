"""One request's life on the workers: admitted, streamed, moved on failure or hand-off.

`RequestRun` takes a tokenized `GenerationRequest` from admission to its last
delta. Each attempt streams from one worker (`_attempt`); when the worker
dies or is hung (`WorkerLeftRouting`), the run moves to an untried live
worker of the pool and recomputes prompt + the tokens already streamed, with
`max_tokens` reduced by what was streamed; when the scheduler hands the
stream off (`Migrated`), it moves to the named target, with the KV blocks
when the source exported them for it. The client's stream simply continues.
Whatever way the run ends, its worker is told to free the request's blocks
and admission hands the room to the next waiting request.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator
from typing import Any

from ray.exceptions import (
    ActorDiedError,
    ActorUnavailableError,
    ObjectLostError,
    RayActorError,
    RayTaskError,
)

from pagefleet.cluster.admission import Admission, Waiter
from pagefleet.cluster.api import GenerationRequest, StreamDelta
from pagefleet.cluster.config import PoolConfig
from pagefleet.cluster.errors import ErrorCode, IngressError, Internal
from pagefleet.cluster.metrics import IngressMetrics
from pagefleet.cluster.worker_slots import WorkerSlot, WorkerSlots
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


def worker_request_id(key: str, replica_id: str) -> str:
    """The id a request has at the workers: its tenant-scoped key tagged with the replica,
    unique at every worker."""
    return f"{key}@{replica_id}"


class RequestRun:
    """Runs one request; iterate `deltas()` once. `abort()` ends it with "abort"."""

    def __init__(
        self,
        req: GenerationRequest,
        pool: PoolConfig,
        *,
        admission: Admission,
        slots: WorkerSlots,
        replica_id: str,
        stall_timeout_s: float,
        running: dict[str, RequestRun],
        metrics: IngressMetrics | None = None,
    ) -> None:
        self.req = req
        self.pool = pool
        self._admission = admission
        self._slots = slots
        self._running = running  # the replica's runs on a worker, by request key
        self._metrics = metrics
        self._stall_timeout_s = stall_timeout_s
        self.worker_rid = worker_request_id(req.key, replica_id)
        self.slot: WorkerSlot | None = None
        self.aborted = False
        self._tried: set[str] = set()
        self._streamed: list[int] = []
        self._cached_tokens: int | None = None
        self._started = time.monotonic()
        self._first_token_at: float | None = None
        self._finished = False
        self._kv: KVHandoff | None = None  # what goes to the next worker with the request

    # ----- the run ------------------------------------------------------

    async def deltas(self) -> AsyncGenerator[StreamDelta, None]:
        """The request's deltas to its last (finish_reason set); raises IngressError."""
        admitted = self._admission.admit(self.pool, self.req, list(self.req.prompt_ids))
        try:
            routed = admitted if isinstance(admitted, WorkerSlot) else await admitted.future
            if routed is None:  # aborted while waiting: it never reached a worker
                self._finished = True
                yield StreamDelta(self.req.request_id, [], "", "abort", "", len(self.req.prompt_ids))
                return
            self.slot = routed
            self._running[self.req.key] = self
            while True:
                migrated: Migrated | None = None
                try:
                    async with contextlib.aclosing(self._attempt(routed)) as attempt:
                        async for delta in attempt:
                            yield delta
                    if self._finished:
                        return
                    raise Internal(f"worker {routed.worker_id} ended the stream without a finish reason")
                except RayTaskError as exc:
                    # The worker is alive but its code failed on this request (e.g. its
                    # engine thread died): not a client error, not a lost worker.
                    raise Internal(
                        f"worker {routed.worker_id} failed: {type(exc.cause).__name__}: {exc.cause}"
                    ) from exc
                except Migrated as exc:
                    # The scheduler moved it off a worker short of blocks; that worker
                    # freed its blocks already and stays a fine place for a later failover.
                    migrated = exc
                    self._tried.discard(routed.worker_id)
                except (*WORKER_FAILURES, WorkerLeftRouting) as exc:
                    self._worker_failed(routed, exc)
                if self.aborted or len(self._streamed) >= self.req.params.max_tokens:
                    self._finished = True
                    yield self._last("abort" if self.aborted else "length")
                    return
                routed = self._move(routed, migrated)
        finally:
            self._release(admitted)

    async def _attempt(self, slot: WorkerSlot) -> AsyncGenerator[StreamDelta, None]:
        """Stream from one worker: prompt + what was streamed so far, for the tokens left."""
        req = self.req
        params = dataclasses.replace(req.params, max_tokens=req.params.max_tokens - len(self._streamed))
        # After a failover the new worker recomputes prompt + streamed tokens.
        request = WorkerRequest(
            self.worker_rid, (*req.prompt_ids, *self._streamed), params, req.priority, req.salt,
            self._kv, num_resumed_tokens=len(self._streamed), adapter=req.adapter,
        )
        self._tried.add(slot.worker_id)
        slot.requests_routed += 1
        async with contextlib.aclosing(self._stream(slot, request)) as items:
            async for item in items:
                if item.error is not None:
                    raise IngressError.of(ErrorCode(item.error_code), item.error)
                if self._cached_tokens is None:
                    self._cached_tokens = item.cached_tokens
                self._streamed.extend(item.token_ids)
                if item.token_ids and self._first_token_at is None:
                    self._first_token_at = time.monotonic()
                aborting = self.aborted and item.finish_reason is None
                # The worker is aborting: its last delta says "abort". A handed-off
                # stream's last delta says where it goes, and has tokens or not.
                if not aborting and (item.migrated_to is None or item.token_ids or item.text):
                    yield StreamDelta(
                        request_id=req.request_id,
                        token_ids=list(item.token_ids),
                        text=item.text,
                        finish_reason=item.finish_reason,
                        worker_id=slot.worker_id,
                        prompt_tokens=len(req.prompt_ids),
                        completion_tokens=len(self._streamed),
                        cached_tokens=self._cached_tokens or 0,
                        logprobs=None if item.logprobs is None else list(item.logprobs),
                    )
                if item.migrated_to is not None:
                    raise Migrated(item.migrated_to, item.kv)
                if item.finish_reason is not None:
                    self._finished = True
                    self._observe_done()
                    return

    def _last(self, reason: str) -> StreamDelta:
        """The closing delta the ingress writes itself (aborted, or max_tokens reached on a move)."""
        worker_id = self.slot.worker_id if self.slot is not None else ""
        return StreamDelta(
            self.req.request_id, [], "", reason, worker_id,
            len(self.req.prompt_ids), len(self._streamed), self._cached_tokens or 0,
        )  # fmt: skip

    # ----- moving -------------------------------------------------------

    def _worker_failed(self, slot: WorkerSlot, exc: BaseException) -> None:
        logger.warning(
            "worker %s failed mid-stream of %s (%s); resubmitting",
            slot.worker_id, self.req.request_id, type(exc).__name__,
        )  # fmt: skip
        if isinstance(exc, WorkerLeftRouting):
            # Hung, not dead: its copy must go when it wakes, freeing its blocks.
            fire_and_forget(slot.handle.abort.remote(self.worker_rid))
        else:
            self._slots.mark_dead(slot)
        if self._metrics is not None:
            self._metrics.failovers.labels(pool=self.pool.name).inc()

    def _move(self, source: WorkerSlot, migrated: Migrated | None) -> WorkerSlot:
        """The next worker: after a hand-off the scheduler's target, or (if it left routing
        since) any live worker, the source included; after a failure an untried one."""
        target = self._migration_target(source, migrated.target if migrated else None)
        moved = self._admission.move(
            source, self.req.key, [*self.req.prompt_ids, *self._streamed], self.req.salt,
            exclude=self._tried, target=target,
        )  # fmt: skip
        self.slot = moved
        # The blocks go only to the target the source exported them for; anywhere
        # else (and after a failure) the request recomputes them.
        self._kv = migrated.kv if migrated is not None and target is not None and moved is target else None
        if migrated is not None and self._metrics is not None:
            mode = "transfer" if self._kv is not None else "recompute"
            self._metrics.migrations.labels(pool=self.pool.name, mode=mode).inc()
        return moved

    def _migration_target(self, source: WorkerSlot, target: str | None) -> WorkerSlot | None:
        """The worker the scheduler moved a stream to, if it can take it (live, same pool)."""
        if target is None or target == source.worker_id:
            return None
        try:
            slot = self._slots[target]
        except KeyError:
            return None
        return slot if slot.alive and slot.pool == source.pool else None

    # ----- ending -------------------------------------------------------

    async def abort(self) -> None:
        """End the run with "abort": the worker stops it and frees its blocks."""
        self.aborted = True
        # A dead worker needs no abort: the failover path ends the stream with "abort".
        if self.slot is not None:
            with contextlib.suppress(*WORKER_FAILURES):
                await self.slot.handle.abort.remote(self.worker_rid)

    def abort_soon(self) -> None:
        """`abort()` without waiting for the worker's answer."""
        self.aborted = True
        if self.slot is not None:
            fire_and_forget(self.slot.handle.abort.remote(self.worker_rid))

    def _release(self, admitted: WorkerSlot | Waiter) -> None:
        # A worker may have room now: `release` hands it to the next waiting request.
        if self.slot is not None:
            self._running.pop(self.req.key, None)
            if not self._finished:
                # Client gone (cancel, disconnect) or an error: the worker must free
                # the request's blocks now, not when it would have finished.
                fire_and_forget(self.slot.handle.abort.remote(self.worker_rid))
            self._admission.release(self.slot, self.req.key)
        elif not isinstance(admitted, WorkerSlot):
            self._admission.leave(self.req.key, admitted)
        else:
            self._admission.release(admitted, self.req.key)

    def _observe_done(self) -> None:
        if self._metrics is None:
            return
        now, first = time.monotonic(), self._first_token_at
        num_tokens = len(self._streamed)
        self._metrics.observe_request(
            self.pool.name,
            ttft_s=None if first is None else first - self._started,
            e2e_s=now - self._started,
            tpot_s=(now - first) / (num_tokens - 1) if first is not None and num_tokens > 1 else None,
            adapter=self.req.adapter, tokens=num_tokens,
        )

    # ----- the worker's stream ------------------------------------------

    async def _stream(self, slot: WorkerSlot, request: WorkerRequest) -> AsyncGenerator[TokenDelta, None]:
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
        gen = slot.handle.generate.options(num_returns="streaming").remote(request)
        leaving = asyncio.ensure_future(left.wait())
        try:
            while True:
                step = asyncio.ensure_future(_next_item(gen))
                while not step.done():
                    await asyncio.wait(
                        {step, leaving}, timeout=self._stall_timeout_s,
                        return_when=asyncio.FIRST_COMPLETED,
                    )  # fmt: skip
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


async def _next_item(gen: Any) -> TokenDelta | None:
    """The next delta of a Ray streaming call, or None at its end."""
    try:
        ref = await gen.__anext__()
    except StopAsyncIteration:
        return None
    delta: TokenDelta = await ref
    return delta


_background: set[Any] = set()


def fire_and_forget(ref: Any) -> None:
    """Keep a remote call alive without awaiting it; errors (dead worker) are ignored."""

    async def wait() -> None:
        with contextlib.suppress(Exception):
            await ref

    task = asyncio.get_running_loop().create_task(wait())
    _background.add(task)
    task.add_done_callback(_background.discard)


__all__ = ["WORKER_FAILURES", "Migrated", "RequestRun", "WorkerLeftRouting", "worker_request_id"]
