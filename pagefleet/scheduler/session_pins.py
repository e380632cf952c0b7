"""Session pins: which worker a client's session last used, per pool, bounded and expiring.

A request that names a session (`x-session-id`) goes to its session's worker
while that worker can take it, so a multi-turn conversation finds its whole
history in one prefix cache. Every ingress replica's router keeps these pins,
and so does the scheduler, which relays each new pin to the other replicas
through its view and hands the pins it holds to a replica that starts (a
snapshot). One class serves both: a map per pool, in least-recently-used
order, each pin expiring `ttl_s` after its last use, at most `max_per_pool`
pins per pool (the least recently used goes first), so memory stays bounded
whatever the clients send.

A session is scoped by tenant: the key is (tenant, session id), so one
tenant's session ids never touch another's routing.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

SessionKey = tuple[str, str]  # (tenant, session id)
# Pins kept per pool unless configured (`router.session_max_pins`): about 35 MB.
DEFAULT_MAX_PER_POOL = 100_000


@dataclass(frozen=True)
class SessionPin:
    """A session's worker, as a replica chose it or the scheduler's view relays it.

    `ttl_s`: how long the pin lasts from when it is received (a snapshot
    sends what is left of it, so no clock is shared between processes).
    """

    pool: str
    tenant: str
    session_id: str
    worker_id: str
    ttl_s: float

    @property
    def key(self) -> SessionKey:
        return self.tenant, self.session_id


class _Pin:
    __slots__ = ("expires_at", "shared_until", "worker_id")

    def __init__(self, worker_id: str, expires_at: float, shared_until: float) -> None:
        self.worker_id = worker_id
        self.expires_at = expires_at
        # Until when the other replicas (and the scheduler) hold this pin: a session used
        # only here is told again before their copies expire.
        self.shared_until = shared_until


class SessionPins:
    """Per pool, (tenant, session id) -> worker id, LRU-ordered, expiring, capped."""

    def __init__(self, max_per_pool: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        if max_per_pool < 1:
            raise ValueError(f"max_per_pool must be >= 1, got {max_per_pool}")
        self.max_per_pool = max_per_pool
        self._clock = clock
        self._pools: dict[str, OrderedDict[SessionKey, _Pin]] = {}

    def get(self, pool: str, key: SessionKey) -> str | None:
        """The session's worker while its pin lives (None: no pin, or it expired)."""
        pins = self._pools.get(pool)
        pin = None if pins is None else pins.get(key)
        if pins is None or pin is None:
            return None
        if pin.expires_at <= self._clock():
            del pins[key]
            return None
        return pin.worker_id

    def put(self, pool: str, key: SessionKey, worker_id: str, ttl_s: float, *, shared: bool = True) -> None:
        """Pin (or re-pin) a session, or refresh its pin, for `ttl_s` from now.

        `shared`: the other replicas hold this pin too (it came through the
        view, or is being told to them now); False: only this process knows
        the refresh.
        """
        now = self._clock()
        pins = self._pools.setdefault(pool, OrderedDict())
        pin = pins.get(key)
        if pin is None or pin.worker_id != worker_id:
            pins[key] = _Pin(worker_id, now + ttl_s, now + ttl_s if shared else now)
        else:
            pin.expires_at = now + ttl_s
            if shared:
                pin.shared_until = now + ttl_s
        pins.move_to_end(key)
        # Pins are in order of last use: the expired ones lead, and past the cap the
        # least recently used goes.
        while pins:
            first = next(iter(pins.values()))
            if first.expires_at > now and len(pins) <= self.max_per_pool:
                break
            pins.popitem(last=False)

    def needs_sharing(self, pool: str, key: SessionKey, ttl_s: float) -> bool:
        """Whether the others' copy of a live pin expires within half a TTL: time to tell
        them again that the session is still in use."""
        pins = self._pools.get(pool)
        pin = None if pins is None else pins.get(key)
        return pin is not None and pin.shared_until - self._clock() < ttl_s / 2

    def drop_worker(self, worker_id: str) -> int:
        """Forget every pin to a worker (it is gone); returns how many. O(pins): rare."""
        dropped = 0
        for pins in self._pools.values():
            for key in [k for k, pin in pins.items() if pin.worker_id == worker_id]:
                del pins[key]
                dropped += 1
        return dropped

    def pins(self) -> Iterator[SessionPin]:
        """Every live pin, with the TTL it has left (for a snapshot)."""
        now = self._clock()
        for pool, pins in self._pools.items():
            for (tenant, session_id), pin in pins.items():
                if pin.expires_at > now:
                    yield SessionPin(pool, tenant, session_id, pin.worker_id, pin.expires_at - now)

    def size(self, pool: str | None = None) -> int:
        """Pins held (of one pool, or all), expired ones not yet dropped included."""
        if pool is not None:
            return len(self._pools.get(pool, ()))
        return sum(len(pins) for pins in self._pools.values())
