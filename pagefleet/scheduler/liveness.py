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
    # Work (running or waiting requests) but no progress (tokens through the model) for
    # `stall_timeout_s`, and no report on time of a step still running (or one running
    # past `STEP_ALLOWANCE` times that): out of routing, and its streams move (a
    # SIGSTOPped worker, a stuck engine thread).
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


# A step may run this many times `stall_timeout_s` (a minute at the default 3 s) before
# the worker counts as hung: a long prompt's prefill chunk on a slow CPU takes seconds.
STEP_ALLOWANCE = 20.0


class LifeSigns:
    """What the scheduler has seen of one worker that its liveness depends on."""

    __slots__ = ("has_work", "last_seen", "progress", "progress_at", "step_since")

    def __init__(self, now: float) -> None:
        # Registration counts as a sign of life: a fresh worker is routable before its
        # first report arrives.
        self.last_seen = now
        self.progress = 0  # tokens the worker computed so far, by its latest report
        self.progress_at = now  # when `progress` last moved (or the stall clock restarted)
        self.has_work = False
        self.step_since: float | None = None  # when its running step began; None between steps

    def heard(self, now: float) -> None:
        """The worker registered or pushed."""
        self.last_seen = now

    def reported(
        self, now: float, progress: int, has_work: bool, restarted: bool, step_s: float = 0.0
    ) -> None:
        """A newer report: `progress` tokens computed so far, `has_work` running or waiting
        requests, `restarted` a new process (its counts start over), `step_s` how long
        the step running as it reported had run (0.0: between steps)."""
        # The stall clock runs only while the worker has work and its count of computed
        # tokens stands still; a fresh process or an idle spell restarts it.
        if restarted or progress > self.progress or not self.has_work:
            self.progress_at = now
        self.progress = progress
        self.has_work = has_work
        self.step_since = now - step_s if step_s > 0 else None


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
        heard = self.heard_in_time(signs.last_seen, now)
        if signs.has_work and now - signs.progress_at > self.stall_timeout_s:
            # Busy, not hung: still reporting from inside a step that has run less than
            # its allowance (a long prefill chunk computes no new token until it ends).
            in_step = signs.step_since is not None and (
                now - signs.step_since <= STEP_ALLOWANCE * self.stall_timeout_s
            )
            if not (heard and in_step):
                return Liveness.STALLED
        return Liveness.LIVE if heard else Liveness.LOST

    def heard_in_time(self, last_seen: float, now: float) -> bool:
        """Heard from within `report_timeout_s`: a worker's report, a replica's subscribe."""
        return now - last_seen <= self.report_timeout_s
