"""AsyncEngine: the engine behind asyncio, one async iterator per request.

The engine steps in one dedicated thread (a forward pass must not block the
event loop). Callers never touch the engine directly: `generate` and `abort`
put commands on a thread-safe queue that the engine thread applies between
steps, and each step's deltas are handed back to the caller's event loop with
`call_soon_threadsafe`. Any number of concurrent streams, from any number of
event loops, are fine. Cancelling (or closing) a stream aborts its request,
which frees its blocks at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from pagefleet.worker.config import EngineConfig
from pagefleet.worker.engine import BlockClaims, EngineStats, LLMEngine
from pagefleet.worker.events import RequestLoad
from pagefleet.worker.grammar import GrammarError
from pagefleet.worker.kv_migration import ExportedKV
from pagefleet.worker.lora import LoRAUsage
from pagefleet.worker.outputs import RequestError, RequestOutput
from pagefleet.worker.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# How long the engine thread sleeps, between two steps, per check that no caller waits.
YIELD_S = 0.0002

# Finish reasons that end the whole request, whichever completion reached them first.
_ENDS_REQUEST = ("abort", "error")

T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine thread failed; the original error is the cause."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]
    n: int
    finished: set[int] = field(default_factory=set)  # seen by the engine thread only

    def push(self, item: RequestOutput | BaseException) -> bool:
        """Hand `item` to the stream's loop; False when that loop is closed (caller gone)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:
            return False
        return True


def _resolve(fut: asyncio.Future[T], error: BaseException | None, result: Any = None) -> None:
    def apply() -> None:
        if fut.done():
            return
        if error is None:
            fut.set_result(result)
        else:
            fut.set_exception(error)

    fut.get_loop().call_soon_threadsafe(apply)


@dataclass(frozen=True)
class ReportState:
    """What `AsyncEngine.report_state` read between two steps."""

    stats: EngineStats
    tenant_live_blocks: dict[str, int]
    tenant_cap_refusals: dict[str, int]
    claims: BlockClaims
    blocks_short: int
    requests: list[RequestLoad]
    block_preemptions: int  # for want of a block, so far: the next call's preemptions_seen
    recompute_s_per_token: float
    lora: LoRAUsage = field(default_factory=LoRAUsage)  # the adapter slots
    tokens_computed: int = 0  # `LLMEngine.tokens_computed`: the worker's progress
    # The prefix cache's events since the last report (`LLMEngine.drain_kv_events`; every
    # held hash for a snapshot, `LLMEngine.snapshot_kv`), and the adapter of each
    # (`LLMEngine.kv_event_adapters`).
    kv_events: list[tuple[str, bytes]] = field(default_factory=list)
    kv_adapters: tuple[str, ...] = ()


class AsyncEngine:
    """An `LLMEngine` stepping in a background thread, streamed to asyncio callers."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        engine: LLMEngine | None = None,
        *,
        on_fatal: Callable[[BaseException], None] | None = None,
    ) -> None:
        """`on_fatal` is called (in the engine thread) when a step fails for a reason that
        is no single request's fault; without it the error ends every open stream."""
        if engine is None:
            engine = LLMEngine(config or EngineConfig())
        self.engine = engine
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._wake = threading.Event()
        self._lock = threading.Lock()  # held by the engine thread while it touches the engine
        # Callers waiting for the lock between two steps (one entry each): while any
        # wait, the engine thread pauses before its next step so that they get in
        # (a plain Lock is not fair: the engine thread would take it straight back).
        self._waiting: deque[None] = deque()
        # When the step now running began (time.monotonic()); None between steps.
        self._step_started: float | None = None
        self._stopped = False
        self._error: BaseException | None = None
        self._on_fatal = on_fatal
        self._thread = threading.Thread(target=self._run, name="pagefleet-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public

    async def generate(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
        salt: str | None = None,
        adapter: str | None = None,
        num_resumed_tokens: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the deltas of one request until all its completions finish.

        Raises `RequestError` (from the first iteration) for a bad request.
        Leaving the loop early or cancelling the task aborts the request.
        """
        self._check_alive()
        if params.structured is not None:
            # A new schema compiles in milliseconds to seconds: on a thread of its own, not on
            # the event loop nor between the engine's steps (add_request then hits the cache).
            try:
                await asyncio.to_thread(self.engine.grammars.compile, params.structured)
            except GrammarError as exc:
                raise RequestError(str(exc)) from None
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue(), params.n)
        added: asyncio.Future[None] = loop.create_future()

        def add() -> None:
            try:
                self.engine.add_request(
                    request_id, prompt, params, priority, arrival_time, salt, adapter,
                    num_resumed_tokens,
                )
            except Exception as exc:
                _resolve(added, exc)
                return
            self._streams[request_id] = stream
            _resolve(added, None)

        self._submit(add)
        done = False
        finished: set[int] = set()
        try:
            await added
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    done = True
                    raise EngineDeadError("the engine thread failed") from item
                if item.finished:
                    finished.add(item.index)
                    # An abort or an error ends the request, whichever completion it reached first.
                    done = len(finished) >= stream.n or item.finish_reason in _ENDS_REQUEST
                yield item
                if done:
                    return
        finally:
            if not done:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request (from any thread); its stream ends with finish_reason "abort"."""
        def abort() -> None:
            self.engine.abort_request(request_id)

        self._submit(abort)

    def export_and_abort(self, request_id: str) -> asyncio.Future[ExportedKV | None]:
        """Copy the request's registered blocks out (`LLMEngine.export_kv`), then abort it,
        both between the same two steps; the future (on the caller's loop) gets the copy.

        Its stream's abort delta comes later than the future's result.
        """
        def export() -> ExportedKV | None:
            exported = self.engine.export_kv(request_id)
            self.engine.abort_request(request_id)
            return exported

        return self._call(export)

    async def import_kv(
        self, block_hashes: list[bytes], blocks: torch.Tensor, adapter: str | None = None
    ) -> int:
        """`LLMEngine.import_kv` between two steps; returns how many blocks were written."""
        return await self._call(lambda: self.engine.import_kv(block_hashes, blocks, adapter))

    def stats(self) -> EngineStats:
        """The engine's counters (waits for the current step to end)."""
        with self._between_steps():
            return self.engine.stats()

    def report_state(
        self, preemptions_seen: int, *, snapshot: bool = False, wait_s: float | None = None
    ) -> ReportState | None:
        """Everything a load report needs, with the prefix cache's events (`kv_events`),
        read between the same two steps (one wait for the lock, so a busy engine still
        reports on time); None when the step now running does not end within `wait_s`
        (None: wait for it), and then no event is drained.

        Blocks short is `LLMEngine.blocks_short`, at least 1 when the engine
        preempted for want of a block since `preemptions_seen`; the requests
        (`LLMEngine.request_loads`) only when it is above 0.
        """
        with self._between_steps(wait_s) as entered:
            if not entered:
                return None
            engine = self.engine
            count = engine.scheduler.block_preemptions
            short = max(engine.blocks_short(), 1 if count > preemptions_seen else 0)
            events = engine.snapshot_kv() if snapshot else engine.drain_kv_events()
            return ReportState(
                stats=engine.stats(),
                tenant_live_blocks=engine.tenant_live_blocks(),
                tenant_cap_refusals=engine.tenant_cap_refusals(),
                claims=engine.block_claims(),
                blocks_short=short,
                requests=engine.request_loads() if short > 0 else [],
                block_preemptions=count,
                recompute_s_per_token=engine.scheduler.recompute_seconds_per_token,
                lora=engine.lora_usage(),
                tokens_computed=engine.tokens_computed,
                kv_events=events,
                kv_adapters=engine.kv_event_adapters(events),
            )

    def step_seconds(self) -> float:
        """How long the step now running has run; 0.0 between steps (read without the lock)."""
        started = self._step_started
        return 0.0 if started is None else max(0.0, time.monotonic() - started)

    def evict_cached(self, n: int) -> int:
        """`LLMEngine.evict_cached`, between two steps (waits for the current step to end)."""
        with self._between_steps():
            return self.engine.evict_cached(n)

    def mark_duplicated(self, hashes: tuple[bytes, ...]) -> None:
        """`LLMEngine.mark_duplicated`, between two steps."""
        with self._between_steps():
            self.engine.mark_duplicated(hashes)

    def check_integrity(self) -> None:
        """The engine's consistency check, between steps."""
        with self._between_steps():
            self.engine.check_integrity()

    def shutdown(self) -> None:
        """Stop the engine thread (open streams stay unanswered)."""
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=30)

    # ------------------------------------------------------------ engine thread

    @contextlib.contextmanager
    def _between_steps(self, wait_s: float | None = None) -> Iterator[bool]:
        """Hold the engine between two steps: waits for the current one to end, at most
        `wait_s` (None: as long as it takes); yields whether it got in."""
        self._waiting.append(None)
        try:
            entered = self._lock.acquire(timeout=-1 if wait_s is None else wait_s)
        finally:
            self._waiting.pop()
        try:
            yield entered
        finally:
            if entered:
                self._lock.release()

    def _check_alive(self) -> None:
        if self._error is not None:
            raise EngineDeadError("the engine thread failed") from self._error
        if self._stopped:
            raise EngineDeadError("the engine was shut down")

    def _submit(self, command: Callable[[], None]) -> None:
        self._commands.put(command)
        self._wake.set()

    def _call(self, fn: Callable[[], T]) -> asyncio.Future[T]:
        """Run `fn` on the engine thread between two steps; its result (or error) comes
        back in a future of the calling event loop."""
        self._check_alive()
        fut: asyncio.Future[T] = asyncio.get_running_loop().create_future()

        def command() -> None:
            try:
                result = fn()
            except Exception as exc:
                _resolve(fut, exc)
                return
            _resolve(fut, None, result)

        self._submit(command)
        return fut

    def _run(self) -> None:
        try:
            while not self._stopped:
                with self._lock:
                    while True:
                        try:
                            self._commands.get_nowait()()
                        except queue.Empty:
                            break
                    busy = self.engine.has_unfinished_requests()
                    outputs = []
                    if busy:
                        self._step_started = time.monotonic()
                        try:
                            outputs = self.engine.step()
                        finally:
                            self._step_started = None
                self._dispatch(outputs)
                while self._waiting and not self._stopped:
                    time.sleep(YIELD_S)  # let the waiting callers in before the next step
                if not busy:
                    self._wake.wait()
                    self._wake.clear()
        except BaseException as exc:  # surfaced to every open stream, not lost in a thread
            self._error = exc
            logger.critical("the engine thread failed; the engine is dead", exc_info=exc)
            if self._on_fatal is not None:
                self._on_fatal(exc)
            for stream in self._streams.values():
                stream.push(exc)
            self._streams.clear()

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                stream.finished.add(out.index)
                if len(stream.finished) >= stream.n or out.finish_reason in _ENDS_REQUEST:
                    del self._streams[out.request_id]
            if not stream.push(out):
                # Nobody can read this stream any more: stop the request.
                self._streams.pop(out.request_id, None)
                self.abort(out.request_id)

    def __enter__(self) -> AsyncEngine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
