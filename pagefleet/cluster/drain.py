"""Graceful drain: stop accepting, let running streams finish, then end what is left.

One `Drain` is shared by the gRPC and HTTP fronts of an ingress. Every
generation request runs inside `Drain.track`; once `start()` is called new
requests get UNAVAILABLE (and health says NOT_SERVING / 503), while requests
already streaming go on. `wait(timeout_s)` returns when they are all done, or
at the timeout aborts the rest through the ingress, so each still ends with a
proper last message (finish_reason "abort"; SSE streams still end with
`[DONE]`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator, Mapping, Sequence

from pagefleet.cluster.api import Front, StreamDelta, Target, request_id_or_new
from pagefleet.cluster.config import TenantConfig
from pagefleet.cluster.errors import Unavailable
from pagefleet.worker.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# After aborting at the timeout: how long the aborted streams get to send their last message.
ABORT_GRACE_S = 5.0


class Drain:
    """Tracks the requests in flight on one ingress and drains them on shutdown."""

    def __init__(self, ingress: Front) -> None:
        self._ingress = ingress
        # (tenant name, request_id) of each request in flight, to abort at the timeout.
        self._active: dict[int, tuple[str, str]] = {}
        self._next = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._on_start: list[Callable[[], Awaitable[None]]] = []
        self.draining = False
        # The gRPC server stops by itself while other replicas serve its port (`hand_off`).
        self._grpc_stopping = False

    def on_start(self, callback: Callable[[], Awaitable[None]]) -> None:
        """Await `callback()` as soon as draining starts (the gRPC health service goes
        NOT_SERVING at once, not at its next refresh)."""
        self._on_start.append(callback)

    def serving(self, live_workers: Mapping[str, int]) -> bool:
        """The health both fronts report (gRPC SERVING, HTTP 200): every pool has a live
        worker (`Front.live_workers()`) and draining has not started."""
        return all(n > 0 for n in live_workers.values()) and not self.draining

    @property
    def in_flight(self) -> int:
        """Generation requests accepted and not finished yet."""
        return len(self._active)

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
        grpc: bool = False,
    ) -> AsyncGenerator[StreamDelta, None]:
        """`Ingress.submit`, counted in flight; UNAVAILABLE once draining has started.

        `grpc`: the call came through the gRPC server. During a hand-off that server
        refuses new calls itself (GOAWAY, its clients reconnect to a replica still
        listening), so a call that reaches the handler was accepted before its stop
        began: it is served, not refused."""
        request_id = request_id_or_new(request_id)  # the id a timeout aborts
        refuse = self.draining and not (grpc and self._grpc_stopping)
        with self._track(tenant.name, request_id, refuse=refuse):
            stream = self._ingress.submit(
                tenant, target, prompt, params, request_id=request_id, priority=priority,
                session=session,
            )  # fmt: skip
            async with contextlib.aclosing(stream) as deltas:
                async for delta in deltas:
                    yield delta

    @contextlib.contextmanager
    def _track(self, tenant: str, request_id: str, *, refuse: bool) -> Iterator[None]:
        if refuse:
            raise Unavailable("the server is shutting down; retry on another replica")
        token = self._next
        self._next += 1
        self._active[token] = (tenant, request_id)
        self._idle.clear()
        try:
            yield
        finally:
            del self._active[token]
            if not self._active:
                self._idle.set()

    def hand_off(self) -> None:
        """The gRPC server's own stop has begun: from now on it refuses new calls itself."""
        self._grpc_stopping = True

    def start(self) -> None:
        """Stop accepting new requests (idempotent)."""
        if not self.draining:
            logger.warning("draining: %d requests in flight", self.in_flight)
        self.draining = True

    async def wait(self, timeout_s: float) -> int:
        """Wait up to `timeout_s` for the running requests; abort the rest. Returns how many were aborted."""
        self.start()
        for callback in self._on_start:
            await callback()
        started = time.monotonic()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        left = list(self._active.values())
        for tenant, request_id in left:
            await self._ingress.abort(request_id, tenant, anywhere=False)
        if left:
            logger.warning(
                "drain timeout (%.0fs): aborted %d requests still running", timeout_s, len(left)
            )
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._idle.wait(), ABORT_GRACE_S)
        logger.warning("drained in %.1fs", time.monotonic() - started)
        return len(left)
