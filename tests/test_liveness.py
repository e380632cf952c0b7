"""The liveness rule: live, stalled or lost, on the scheduler's clock."""

from __future__ import annotations

import pytest

from pagefleet.scheduler.liveness import STEP_ALLOWANCE, LifeSigns, Liveness, LivenessRule
from pagefleet.scheduler.messages import WorkerDelta
from pagefleet.worker.events import WorkerInfo

RULE = LivenessRule(report_timeout_s=3.0, stall_timeout_s=2.0)


def test_a_registered_worker_is_live_before_its_first_report() -> None:
    assert RULE.judge(LifeSigns(now=0.0), 3.0) is Liveness.LIVE


def test_a_worker_silent_past_the_report_timeout_is_lost() -> None:
    assert RULE.judge(LifeSigns(now=0.0), 3.01) is Liveness.LOST


def working(progress: int) -> LifeSigns:
    """A worker registered at 0 whose first report at 0 says it has work."""
    signs = LifeSigns(now=0.0)
    push(signs, 0.0, progress)
    return signs


def push(
    signs: LifeSigns, at: float, progress: int, has_work: bool = True, restarted: bool = False,
    step_s: float = 0.0,
) -> None:
    """What a push does to the signs: heard, and a newer report."""
    signs.heard(at)
    signs.reported(at, progress, has_work, restarted, step_s)


def test_a_worker_with_work_and_no_progress_past_the_stall_timeout_is_stalled() -> None:
    signs = working(progress=5)
    push(signs, 2.5, progress=5)
    assert RULE.judge(signs, 2.6) is Liveness.STALLED


def test_a_stalled_worker_whose_reports_stopped_too_is_still_stalled() -> None:
    assert RULE.judge(working(progress=0), 10.0) is Liveness.STALLED  # its streams must move


def test_a_worker_still_reporting_from_inside_a_long_step_is_busy_not_hung() -> None:
    signs = working(progress=5)
    for at in (1.0, 2.0, 3.0, 4.0, 5.0):  # one prefill chunk since 0.5, pushes on time
        push(signs, at, progress=5, step_s=at - 0.5)
    assert RULE.judge(signs, 5.1) is Liveness.LIVE


def test_a_step_past_its_allowance_is_hung_though_the_worker_reports() -> None:
    signs = working(progress=5)
    limit = STEP_ALLOWANCE * RULE.stall_timeout_s
    push(signs, limit + 0.4, progress=5, step_s=limit + 0.1)
    assert RULE.judge(signs, limit + 0.5) is Liveness.STALLED


def test_a_worker_stopped_inside_a_step_is_hung_once_its_reports_are_late() -> None:
    signs = working(progress=5)
    push(signs, 1.0, progress=5, step_s=0.5)  # its last push, then SIGSTOP
    assert RULE.judge(signs, 3.9) is Liveness.LIVE  # still heard in time: a busy step
    assert RULE.judge(signs, 4.1) is Liveness.STALLED  # report_timeout_s past that push


def test_a_report_between_steps_ends_the_step_allowance() -> None:
    signs = working(progress=5)
    push(signs, 1.0, progress=5, step_s=0.5)
    push(signs, 1.5, progress=5)  # between steps, no token computed: not busy
    assert RULE.judge(signs, 2.1) is Liveness.STALLED


def test_progress_restarts_the_stall_clock() -> None:
    signs = working(progress=1)
    push(signs, 1.9, progress=2)
    assert RULE.judge(signs, 3.0) is Liveness.LIVE


def test_an_idle_worker_never_stalls() -> None:
    signs = LifeSigns(now=0.0)
    push(signs, 2.9, progress=3, has_work=False)
    assert RULE.judge(signs, 5.5) is Liveness.LIVE  # stall_timeout_s past its last report


def test_a_restarted_process_restarts_the_stall_clock() -> None:
    signs = working(progress=9)
    push(signs, 1.5, progress=0, restarted=True)
    assert RULE.judge(signs, 3.0) is Liveness.LIVE


def test_the_verdict_maps_to_the_views_flags_and_back() -> None:
    for verdict in Liveness:
        assert Liveness.of(verdict.alive, verdict.stalled) is verdict


def test_the_verdict_says_why() -> None:
    assert Liveness.STALLED.value == "hung: work but no progress"
    assert Liveness.LOST.value == "no report in time"


@pytest.mark.parametrize("field", ["report_timeout_s", "stall_timeout_s"])
def test_timeouts_must_be_positive(field: str) -> None:
    with pytest.raises(ValueError, match=field):
        LivenessRule(**{field: 0.0})


def test_a_delta_carries_the_verdict_and_a_draining_worker_is_not_routable() -> None:
    info = WorkerInfo("w0", "default", total_blocks=64)
    stalled = WorkerDelta(info, alive=False, report=None, stalled=True)
    assert stalled.liveness is Liveness.STALLED and not stalled.routable
    assert WorkerDelta(info, alive=True, report=None).routable
    assert not WorkerDelta(info, alive=True, report=None, draining=True).routable
