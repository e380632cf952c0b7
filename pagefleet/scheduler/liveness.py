"""The liveness rule: is a worker live, stalled or lost, and why. Decided here only.

The scheduler judges every worker on its own clock with `LivenessRule` and
publishes the verdict in its view (`WorkerDelta.alive` / `stalled`, read
back as `WorkerDelta.liveness`); the ingress replicas' router and worker
slots, the fronts' health (live workers per pool) and membership's wait for
an added worker read that verdict instead of deciding again. The same
rule's report deadline says which ingress replicas still subscribe
(`LivenessRule.heard_in_time`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Liveness(enum.Enum):
    """A worker's verdict; the value says why, in the words the logs use."""

    LIVE = "live"
    # Work (running or waiting requests) but no progress for `stall_timeout_s`: out of
    # routing, and its streams move (a SIGSTOPped worker, a stuck engine thread).
    STALLED = "hung: work but no progress"
    # No report for `report_timeout_s`: out of routing until it reports again. Its
    # streams stay: a late report may be a busy machine, and a dead worker's streams
    # fail over by themselves when their call fails.
    LOST = "no report in time"

    @property
    def alive(self) -> bool:
        """May be routed to (draining aside)."""
        return self is Liveness.LIVE

    @property
    def stalled(self) -> bool:
        """Its streams should move now."""
        return self is Liveness.STALLED

    @classmethod
    def of(cls, alive: bool, stalled: bool) -> Liveness:
        """The verdict that a view's `alive` / `stalled` flags carry."""
        return cls.STALLED if stalled else cls.LIVE if alive else cls.LOST


class LifeSigns:
    """What the scheduler has seen of one worker that its liveness depends on."""

    __slots__ = ("has_work", "last_seen", "progress", "progress_at")

    def __init__(self, now: float) -> None:
        # Registration counts as a sign of life: a fresh worker is routable before its
        # first report arrives.
        self.last_seen = now
        self.progress = 0  # tokens the worker streamed so far, by its latest report
        self.progress_at = now  # when `progress` last moved (or the stall clock restarted)
        self.has_work = False

    def heard(self, now: float) -> None:
        """The worker registered or pushed."""
        self.last_seen = now

    def reported(self, now: float, progress: int, has_work: bool, restarted: bool) -> None:
        """A newer report: `progress` tokens streamed so far, `has_work` running or waiting
        requests, `restarted` a new process (its counts start over)."""
        # The stall clock runs only while the worker has work and its count of streamed
        # tokens stands still; a fresh process or an idle spell restarts it.
        if restarted or progress > self.progress or not self.has_work:
            self.progress_at = now
        self.progress = progress
        self.has_work = has_work


@dataclass(frozen=True)
class LivenessRule:
    """The timeouts (`scheduler.report_timeout_s`, `scheduler.stall_timeout_s`) and the rule.

    A stalled worker is reported as STALLED even when its reports stopped too:
    its streams must move either way.
    """

    report_timeout_s: float = 3.0
    stall_timeout_s: float = 3.0

    def __post_init__(self) -> None:
        if not self.report_timeout_s > 0:
            raise ValueError(f"report_timeout_s must be > 0, got {self.report_timeout_s}")
        if not self.stall_timeout_s > 0:
            raise ValueError(f"stall_timeout_s must be > 0, got {self.stall_timeout_s}")

    def judge(self, signs: LifeSigns, now: float) -> Liveness:
        """The worker's verdict at `now` (the scheduler's clock)."""
        if signs.has_work and now - signs.progress_at > self.stall_timeout_s:
            return Liveness.STALLED
        return Liveness.LIVE if self.heard_in_time(signs.last_seen, now) else Liveness.LOST

    def heard_in_time(self, last_seen: float, now: float) -> bool:
        """Heard from within `report_timeout_s`: a worker's report, a replica's subscribe."""
        return now - last_seen <= self.report_timeout_s
