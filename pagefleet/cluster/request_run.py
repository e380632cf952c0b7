"""One request's life on the workers: admitted, streamed, moved on failure or hand-off.

`RequestRun` takes a tokenized `GenerationRequest` from admission to its last
delta. Each attempt streams from one worker (`_attempt`); when the worker
dies or is hung (`WorkerLeftRouting`), the run moves to an untried live
worker of the pool and recomputes prompt + the tokens already streamed, with
`max_tokens` reduced by what was streamed; when the scheduler hands the
stream off (`Migrated`), it moves to the named target, with the KV blocks
when the source exported them for it. The client's stream simply continues.

A request of `n` completions runs as one worker request (one prefill, forked
decodes), a `_Leg` carrying all of them. When that leg must move after some
completion streamed, each unfinished completion goes on as a leg of its own
(n=1, resumed from its own output so far); the legs stream concurrently and
their deltas are merged under the completions' indices.
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
from dataclasses import dataclass, field
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
from pagefleet.worker.seeds import derive_seed
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


@dataclass(eq=False)
class _Leg:
    """One worker request of a run: its completions (`indices`), where it runs, where it ran.

    The first leg carries all `n` completions (one prefill, forked decodes). A
    leg moves as it is after a failover or hand-off when it has one completion,
    or when none of its completions has streamed a token yet; otherwise each
    unfinished completion goes on as a leg of its own (n=1), resumed from its
    own output so far (`RequestRun._move`).
    """

    indices: tuple[int, ...]
    rid: str  # its id at the workers
    claim_key: str  # the key of its claim in admission
    slot: WorkerSlot
    tried: set[str] = field(default_factory=set)
    kv: KVHandoff | None = None  # what goes to the next worker with it
    done: bool = False  # every completion of it finished, or it went on as other legs


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
        self.aborted = False
        self._legs: list[_Leg] = []
        # Per completion: the tokens streamed so far and, once it ended, why.
        self._outputs: list[list[int]] = [[] for _ in range(req.params.n)]
        self._reasons: list[str | None] = [None] * req.params.n
        self._cached_tokens: int | None = None
        self._started = time.monotonic()
        self._first_token_at: float | None = None

    # ----- the run ------------------------------------------------------

    async def deltas(self) -> AsyncGenerator[StreamDelta, None]:
        """The request's deltas to the last of every completion (finish_reason set), the
        completions' deltas interleaved as they come; raises IngressError."""
        admitted = self._admission.admit(self.pool, self.req, list(self.req.prompt_ids))
        try:
            routed = admitted if isinstance(admitted, WorkerSlot) else await admitted.future
            if routed is None:  # aborted while waiting: it never reached a worker
                for index in range(self.req.params.n):
                    yield self._last(index, "abort", "")
                return
            self._running[self.req.key] = self
            first = _Leg(tuple(range(self.req.params.n)), self.worker_rid, self.req.key, routed)
            self._legs.append(first)
            async with contextlib.aclosing(self._merged(first)) as merged:
                async for delta in merged:
                    yield dataclasses.replace(delta, completion_tokens=self._completion_tokens())
        finally:
            self._release(admitted)

    async def _merged(self, first: _Leg) -> AsyncGenerator[StreamDelta, None]:
        """The deltas of every leg as they arrive: the legs stream concurrently."""
        gens: list[AsyncGenerator[StreamDelta | list[_Leg], None]] = []
        pending: dict[asyncio.Future[StreamDelta | list[_Leg]], AsyncGenerator[Any, None]] = {}

        def pull(gen: AsyncGenerator[StreamDelta | list[_Leg], None]) -> None:
            pending[asyncio.ensure_future(anext(gen))] = gen

        def start(leg: _Leg) -> None:
            gens.append(self._leg_deltas(leg))
            pull(gens[-1])

        start(first)
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for step in done:
                    gen = pending.pop(step)
                    try:
                        item = step.result()
                    except StopAsyncIteration:
                        continue
                    if isinstance(item, list):
                        for leg in item:
                            start(leg)
                    else:
                        yield item
                    pull(gen)
        finally:
            for step in pending:
                step.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            for gen in gens:
                await gen.aclose()

    async def _leg_deltas(self, leg: _Leg) -> AsyncGenerator[StreamDelta | list[_Leg], None]:
        """One leg's deltas to the end of its completions, moved when its worker fails or
        hands it off; a list of legs when it goes on as those instead."""
        migrated: Migrated | None = None
        moving = False  # its last attempt failed or was handed off
        while True:
            # Completions that end without a worker: aborted (also before the leg
            # reached one), or max_tokens reached before the move.
            for index in self._open(leg):
                if self.aborted or len(self._outputs[index]) >= self.req.params.max_tokens:
                    yield self._end(index, "abort" if self.aborted else "length", leg.slot.worker_id)
            if not self._open(leg):
                leg.done = True
                return
            if moving:
                moved = self._move(leg, migrated)
                if isinstance(moved, list):
                    yield moved
                    return
            migrated, moving = None, True
            try:
                async with contextlib.aclosing(self._attempt(leg)) as attempt:
                    async for delta in attempt:
                        yield delta
                if leg.done:
                    return
                raise Internal(f"worker {leg.slot.worker_id} ended the stream without a finish reason")
            except RayTaskError as exc:
                # The worker is alive but its code failed on this request (e.g. its
                # engine thread died): not a client error, not a lost worker.
                raise Internal(
                    f"worker {leg.slot.worker_id} failed: {type(exc.cause).__name__}: {exc.cause}"
                ) from exc
            except Migrated as exc:
                # The scheduler moved it off a worker short of blocks; that worker
                # freed its blocks already and stays a fine place for a later failover.
                migrated = exc
                leg.tried.discard(leg.slot.worker_id)
            except (*WORKER_FAILURES, WorkerLeftRouting) as exc:
                self._worker_failed(leg, exc)

    async def _attempt(self, leg: _Leg) -> AsyncGenerator[StreamDelta, None]:
        """Stream one leg from its worker: prompt + its output so far, for the tokens left."""
        req = self.req
        resumed = self._resumed(leg)
        params = dataclasses.replace(
            req.params, n=len(leg.indices), max_tokens=req.params.max_tokens - len(resumed),
            seed=self._seed(leg),
        )  # fmt: skip
        # After a failover the new worker recomputes prompt + streamed tokens.
        request = WorkerRequest(
            leg.rid, (*req.prompt_ids, *resumed), params, req.priority, req.salt,
            leg.kv, num_resumed_tokens=len(resumed), adapter=req.adapter,
        )  # fmt: skip
        slot = leg.slot
        leg.tried.add(slot.worker_id)
        slot.requests_routed += 1
        async with contextlib.aclosing(self._stream(slot, request)) as items:
            async for item in items:
                if item.error is not None:
                    raise IngressError.of(ErrorCode(item.error_code), item.error)
                if self._cached_tokens is None:
                    self._cached_tokens = item.cached_tokens
                index = leg.indices[item.index]
                self._outputs[index].extend(item.token_ids)
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
                        cached_tokens=self._cached_tokens or 0,
                        logprobs=None if item.logprobs is None else list(item.logprobs),
                        index=index,
                    )
                if item.migrated_to is not None:
                    raise Migrated(item.migrated_to, item.kv)
                if item.finish_reason is not None:
                    self._note_end(index, item.finish_reason)
                    if item.finish_reason == "abort":
                        # An abort ends the worker's request: its other completions too.
                        for other in self._open(leg):
                            yield self._end(other, "abort", slot.worker_id)
                    if not self._open(leg):
                        leg.done = True
                        return

    def _resumed(self, leg: _Leg) -> list[int]:
        """What a leg's worker request resumes from: the output so far of its one
        completion; a leg of several has streamed nothing (`_move`)."""
        return self._outputs[leg.indices[0]] if len(leg.indices) == 1 else []

    def _seed(self, leg: _Leg) -> int | None:
        """A leg's seed: the request's; a completion resumed on its own draws from the seed
        the engine gave that completion (`derive_seed`), so a resumed stream is as
        reproducible as an n=1 one."""
        seed = self.req.params.seed
        if seed is None or len(leg.indices) == self.req.params.n:
            return seed
        return derive_seed(seed, leg.indices[0])

    def _open(self, leg: _Leg) -> list[int]:
        return [i for i in leg.indices if self._reasons[i] is None]

    def _note_end(self, index: int, reason: str) -> None:
        self._reasons[index] = reason
        if all(r is not None for r in self._reasons):
            self._observe_done()

    def _end(self, index: int, reason: str, worker_id: str) -> StreamDelta:
        """The closing delta the ingress writes itself (aborted, or max_tokens reached on a move)."""
        self._note_end(index, reason)
        return self._last(index, reason, worker_id)

    def _last(self, index: int, reason: str, worker_id: str) -> StreamDelta:
        return StreamDelta(
            self.req.request_id, [], "", reason, worker_id, len(self.req.prompt_ids),
            cached_tokens=self._cached_tokens or 0, index=index,
        )  # fmt: skip

    def _completion_tokens(self) -> int:
        return sum(len(tokens) for tokens in self._outputs)

    # ----- moving -------------------------------------------------------

    def _worker_failed(self, leg: _Leg, exc: BaseException) -> None:
        slot = leg.slot
        logger.warning(
            "worker %s failed mid-stream of %s (%s); resubmitting",
            slot.worker_id, self.req.request_id, type(exc).__name__,
        )  # fmt: skip
        if isinstance(exc, WorkerLeftRouting):
            # Hung, not dead: its copy must go when it wakes, freeing its blocks.
            fire_and_forget(slot.handle.abort.remote(leg.rid))
        else:
            self._slots.mark_dead(slot)
        if self._metrics is not None:
            self._metrics.failovers.labels(pool=self.pool.name).inc()

    def _move(self, leg: _Leg, migrated: Migrated | None) -> _Leg | list[_Leg]:
        """Where a leg goes on: the same leg on the next worker (after a hand-off the
        scheduler's target, or if it left routing since any live worker, the source
        included; after a failure an untried one), or, when it has several completions
        and some streamed, one leg per unfinished completion, each routed now."""
        req = self.req
        open_ = self._open(leg)
        if len(leg.indices) > 1 and (len(open_) < len(leg.indices) or any(self._outputs[i] for i in open_)):
            parts = [
                (f"{req.key}#{i}", [*req.prompt_ids, *self._outputs[i]], req.params.max_tokens - len(self._outputs[i]))
                for i in open_
            ]  # fmt: skip
            slots = self._admission.split(
                leg.slot, leg.claim_key, req.priority, parts, req.salt, exclude=leg.tried
            )
            legs = [
                _Leg((i,), f"{self.worker_rid}#{i}", key, slot, tried=set(leg.tried))
                for i, (key, _, _), slot in zip(open_, parts, slots, strict=True)
            ]  # fmt: skip
            leg.done = True
            self._legs.extend(legs)
            if migrated is not None and self._metrics is not None:
                self._metrics.migrations.labels(pool=self.pool.name, mode="recompute").inc()
            return legs
        target = self._migration_target(leg.slot, migrated.target if migrated else None)
        moved = self._admission.move(
            leg.slot, leg.claim_key, [*req.prompt_ids, *self._resumed(leg)], req.salt,
            exclude=leg.tried, target=target,
        )  # fmt: skip
        leg.slot = moved
        # The blocks go only to the target the source exported them for; anywhere
        # else (and after a failure) the request recomputes them.
        leg.kv = migrated.kv if migrated is not None and target is not None and moved is target else None
        if migrated is not None and self._metrics is not None:
            mode = "transfer" if leg.kv is not None else "recompute"
            self._metrics.migrations.labels(pool=self.pool.name, mode=mode).inc()
        return leg

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

    def _live_legs(self) -> list[_Leg]:
        return [leg for leg in self._legs if not leg.done]

    async def abort(self) -> None:
        """End the run with "abort": the workers stop it and free its blocks."""
        self.aborted = True
        # A dead worker needs no abort: the failover path ends the stream with "abort".
        for leg in self._live_legs():
            with contextlib.suppress(*WORKER_FAILURES):
                await leg.slot.handle.abort.remote(leg.rid)

    def abort_soon(self) -> None:
        """`abort()` without waiting for the workers' answers."""
        self.aborted = True
        for leg in self._live_legs():
            fire_and_forget(leg.slot.handle.abort.remote(leg.rid))

    def _release(self, admitted: WorkerSlot | Waiter) -> None:
        # A worker may have room now: `release` hands it to the next waiting request.
        if self._legs:
            self._running.pop(self.req.key, None)
            for leg in self._legs:
                if not leg.done:
                    # Client gone (cancel, disconnect) or an error: the worker must free
                    # the request's blocks now, not when it would have finished.
                    fire_and_forget(leg.slot.handle.abort.remote(leg.rid))
                self._admission.release(leg.slot, leg.claim_key)
        elif not isinstance(admitted, WorkerSlot):
            self._admission.leave(self.req.key, admitted)
        else:
            self._admission.release(admitted, self.req.key)

    def _observe_done(self) -> None:
        if self._metrics is None:
            return
        now, first = time.monotonic(), self._first_token_at
        # The completions decode side by side: the time per token is the longest one's.
        longest = max(len(tokens) for tokens in self._outputs)
        self._metrics.observe_request(
            self.pool.name,
            ttft_s=None if first is None else first - self._started,
            e2e_s=now - self._started,
            tpot_s=(now - first) / (longest - 1) if first is not None and longest > 1 else None,
            adapter=self.req.adapter, tokens=self._completion_tokens(),
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
