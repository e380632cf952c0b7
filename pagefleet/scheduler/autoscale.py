"""When a pool grows or shrinks on load: a pure policy, fed one observation at a time.

A pool between `min_workers` and `max_workers` grows by one worker when its
KV pool runs short while requests wait (the blocks a new request could still
claim below `free_fraction` of the pool's blocks, and at least one request
waiting, in a worker's queue or in an ingress replica's), sustained for
`out_after_s`; it shrinks by one when it has been idle (nothing running or
waiting anywhere) for `in_after_s`. After any move it holds still for `cooldown_s`,
and it does not move again before the pool has reached its last target
(workers still loading, or draining, count as not there yet). The caller
executes a move (`Membership.scale`) and asks Ray's autoscaler for the
resources; this class only decides, so it is tested without a cluster.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagefleet.scheduler.messages import ClusterView
from pagefleet.scheduler.policy import AdmissionMode


@dataclass(frozen=True)
class AutoscalePolicy:
    """Bounds and thresholds of one pool's autoscaling."""

    min_workers: int
    max_workers: int
    free_fraction: float = 0.1
    out_after_s: float = 10.0
    in_after_s: float = 60.0
    cooldown_s: float = 30.0

    def __post_init__(self) -> None:
        if not 1 <= self.min_workers <= self.max_workers:
            raise ValueError(
                f"need 1 <= min_workers <= max_workers, got {self.min_workers} and {self.max_workers}"
            )
        if not 0.0 <= self.free_fraction <= 1.0:
            raise ValueError(f"free_fraction must be in [0, 1], got {self.free_fraction}")
        for name in ("out_after_s", "in_after_s", "cooldown_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    @property
    def active(self) -> bool:
        """False for a pool of fixed size (min == max): nothing to decide."""
        return self.min_workers < self.max_workers


@dataclass(frozen=True)
class PoolLoad:
    """One observation of a pool: its serving workers and their summed counters.

    `free_blocks`: blocks a new request could get (free plus evictable cached;
    under full admission, less what the requests there will still take to
    reach their max_tokens, since admission counts those taken). `waiting`: requests in the workers' queues; `queued`: those
    the ingress replicas hold back for want of room (admission).
    """

    workers: int
    free_blocks: int
    total_blocks: int
    running: int
    waiting: int
    queued: int = 0

    @property
    def pending(self) -> int:
        """Requests waiting for a worker's blocks, at the workers or at the ingress."""
        return self.waiting + self.queued

    @property
    def short_of_blocks(self) -> bool:
        return self.pending > 0 and self.total_blocks > 0

    @property
    def idle(self) -> bool:
        return self.running == 0 and self.pending == 0


def pool_load(view: ClusterView, pool: str, admission: AdmissionMode = "full") -> PoolLoad:
    """A pool's load from the scheduler's view: its alive workers that are not draining,
    the blocks a new request could get there (by `scheduler.admission`'s measure),
    their requests, and the ingress queues'."""
    serving = [w for w in view.alive(pool) if not w.draining and w.report is not None]
    reports = [w.report for w in serving if w.report is not None]
    claimed = admission == "full"
    return PoolLoad(
        workers=len(serving),
        free_blocks=sum(
            max(0, r.num_allocatable - (r.committed_blocks if claimed else 0)) for r in reports
        ),
        total_blocks=sum(r.total_blocks for r in reports),
        running=sum(r.num_running for r in reports),
        waiting=sum(r.num_waiting for r in reports),
        queued=view.queued.get(pool, 0),
    )


@dataclass(frozen=True)
class ScaleDecision:
    """A new target size and why."""

    target: int
    reason: str


class PoolAutoscaler:
    """The target size of one pool, moved by `observe`; see the module docstring."""

    def __init__(self, policy: AutoscalePolicy, target: int) -> None:
        self.policy = policy
        self.target = min(max(target, policy.min_workers), policy.max_workers)
        self.reason = "configured size"
        self._pressure_since: float | None = None
        self._idle_since: float | None = None
        self._moved_at: float | None = None

    def observe(self, now: float, load: PoolLoad) -> ScaleDecision | None:
        """Take one observation; return the new target when it moves, else None."""
        p = self.policy
        pressed = load.short_of_blocks and load.free_blocks < p.free_fraction * load.total_blocks
        self._pressure_since = _since(self._pressure_since, now) if pressed else None
        self._idle_since = _since(self._idle_since, now) if load.idle else None
        if load.workers != self.target:
            return None  # the last move is still being carried out
        if self._moved_at is not None and now - self._moved_at < p.cooldown_s:
            return None
        pressed_for = None if self._pressure_since is None else now - self._pressure_since
        idle_for = None if self._idle_since is None else now - self._idle_since
        if pressed_for is not None and pressed_for >= p.out_after_s and self.target < p.max_workers:
            free = load.free_blocks / load.total_blocks
            return self._move(
                now, self.target + 1,
                f"scale out: {100 * free:.0f}% blocks free (< {100 * p.free_fraction:.0f}%) and "
                f"{load.pending} waiting for {pressed_for:.0f}s",
            )  # fmt: skip
        if idle_for is not None and idle_for >= p.in_after_s and self.target > p.min_workers:
            return self._move(now, self.target - 1, f"scale in: idle for {idle_for:.0f}s")
        return None

    def settle(self, workers: int, reason: str) -> None:
        """The pool's size was set otherwise (`pagefleet scale`, or a move that failed and
        was rolled back): take it as the target, within the bounds."""
        self.target = min(max(workers, self.policy.min_workers), self.policy.max_workers)
        self.reason = reason
        self._pressure_since = self._idle_since = None

    def _move(self, now: float, target: int, reason: str) -> ScaleDecision:
        self.target, self.reason, self._moved_at = target, reason, now
        self._pressure_since = self._idle_since = None
        return ScaleDecision(target, reason)


def _since(started: float | None, now: float) -> float:
    """When a condition that holds now began: `started`, or now if it just began."""
    return now if started is None else started
