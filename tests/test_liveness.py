"""The liveness rule: live, stalled or lost, on the scheduler's clock."""

from __future__ import annotations

import pytest

from pagefleet.scheduler.liveness import LifeSigns, Liveness, LivenessRule
from pagefleet.scheduler.messages import WorkerDelta
from pagefleet.worker.events import WorkerInfo

RULE = LivenessRule(report_timeout_s=3.0, stall_timeout_s=2.0)


def test_a_registered_worker_is_live_before_its_first_report() -> None:
    assert RULE.judge(LifeSigns(now=0.0), 3.0) is Liveness.LIVE


def test_a_worker_silent_past_the_report_timeout_is_lost() -> None:
    assert RULE.judge(LifeSigns(now=0.0), 3.01) is Liveness.LOST


def test_a_worker_with_work_and_no_progress_past_the_stall_timeout_is_stalled() -> None:
    signs = LifeSigns(now=0.0)
    signs.reported(0.0, progress=5, has_work=True, restarted=False)
    signs.heard(2.5)
    signs.reported(2.5, progress=5, has_work=True, restarted=False)
    assert RULE.judge(signs, 2.6) is Liveness.STALLED


def test_a_stalled_worker_whose_reports_stopped_too_is_still_stalled() -> None:
    signs = LifeSigns(now=0.0)
    signs.reported(0.0, progress=0, has_work=True, restarted=False)
    assert RULE.judge(signs, 10.0) is Liveness.STALLED  # its streams must move


def test_progress_restarts_the_stall_clock() -> None:
    signs = LifeSigns(now=0.0)
    signs.reported(0.0, progress=1, has_work=True, restarted=False)
    signs.heard(1.9)
    signs.reported(1.9, progress=2, has_work=True, restarted=False)
    assert RULE.judge(signs, 3.0) is Liveness.LIVE


def test_an_idle_worker_never_stalls() -> None:
    signs = LifeSigns(now=0.0)
    signs.reported(0.0, progress=3, has_work=False, restarted=False)
    signs.heard(2.9)
    assert RULE.judge(signs, 2.9) is Liveness.LIVE


def test_a_restarted_process_restarts_the_stall_clock() -> None:
    signs = LifeSigns(now=0.0)
    signs.reported(0.0, progress=9, has_work=True, restarted=False)
    signs.heard(1.5)
    signs.reported(1.5, progress=0, has_work=True, restarted=True)
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
