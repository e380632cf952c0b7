"""Scheduler policies: admission, eviction watermarks, preemption across workers."""

from __future__ import annotations

import pytest

from pagefleet.scheduler.policy import (
    EvictionWatermarks,
    PreemptionPlan,
    blocks_for_prompt,
    blocks_to_evict,
    can_admit,
    choose_preemption,
    choose_preemption_mode,
)
from pagefleet.worker.events import LoadReport
from pagefleet.worker.preemption import VictimCandidate


def report(
    worker_id: str = "w0", *, total: int = 100, free: int = 50, cached: int = 0
) -> LoadReport:
    return LoadReport(worker_id, "chat", 1, 0.0, total, free, total - free - cached, cached, 0)


def cand(rid: str, blocks: int, *, priority: int = 0, admitted: int = 0) -> VictimCandidate:
    return VictimCandidate(rid, priority, 0.0, admitted, blocks)


def test_prompt_needs_ceil_of_its_tokens_in_blocks() -> None:
    assert blocks_for_prompt(33, 16) == 3
    assert blocks_for_prompt(32, 16) == 2


def test_cached_blocks_are_not_needed_again() -> None:
    assert blocks_for_prompt(100, 16, matched_blocks=4) == 7 - 4


def test_fully_cached_prompt_still_computes_its_last_block() -> None:
    assert blocks_for_prompt(32, 16, matched_blocks=2) == 1


def test_empty_prompt_is_rejected() -> None:
    with pytest.raises(ValueError, match="num_tokens must be >= 1, got 0"):
        blocks_for_prompt(0, 16)


def test_admission_counts_evictable_cached_blocks() -> None:
    assert can_admit(report(free=2, cached=8), 10 * 16, 16)
    assert not can_admit(report(free=2, cached=7), 10 * 16, 16)


def test_admission_keeps_the_reserve() -> None:
    assert not can_admit(report(free=10), 10 * 16, 16, reserve_blocks=1)


def test_admission_credits_a_prefix_hit() -> None:
    assert can_admit(report(free=3), 10 * 16, 16, matched_blocks=7)


def test_no_eviction_above_the_low_watermark() -> None:
    assert blocks_to_evict(report(free=5, cached=50), EvictionWatermarks(0.05, 0.10)) == 0


def test_eviction_refills_the_free_list_to_the_high_watermark() -> None:
    assert blocks_to_evict(report(free=2, cached=50), EvictionWatermarks(0.05, 0.10)) == 8


def test_eviction_is_capped_by_cached_blocks() -> None:
    assert blocks_to_evict(report(free=0, cached=3), EvictionWatermarks(0.05, 0.20)) == 3


def test_watermarks_must_be_ordered() -> None:
    with pytest.raises(ValueError, match="low <= high"):
        EvictionWatermarks(0.3, 0.1)


def test_preemption_takes_victims_only_from_workers_short_of_blocks() -> None:
    plans = choose_preemption(
        {"w0": [cand("a", 4), cand("b", 4, admitted=1)], "w1": [cand("c", 9)]},
        {"w0": report("w0", free=0), "w1": report("w1", free=50)},
        {"w0": 3, "w1": 10},
    )
    assert plans == [PreemptionPlan("w0", ("b",), "recompute", 4)]


def test_preemption_reuses_the_engines_victim_order() -> None:
    plans = choose_preemption(
        {
            "w0": [
                cand("old", 2, admitted=1),
                cand("new", 2, admitted=2),
                cand("vip", 2, priority=5, admitted=3),
            ]
        },
        {"w0": report("w0", free=0)},
        {"w0": 4},
    )
    assert plans[0].request_ids == ("new", "old")


def test_preemption_plans_the_fullest_worker_first() -> None:
    plans = choose_preemption(
        {"w0": [cand("a", 10)], "w1": [cand("b", 10)]},
        {"w0": report("w0", free=1), "w1": report("w1", free=0)},
        {"w0": 2, "w1": 5},
    )
    assert [p.worker_id for p in plans] == ["w1", "w0"]


def test_swap_setting_swaps_only_when_swap_space_has_room() -> None:
    assert choose_preemption_mode(4, 64, setting="swap", swap_free_blocks=4) == "swap"
    assert choose_preemption_mode(4, 64, setting="swap", swap_free_blocks=3) == "recompute"


def test_recompute_setting_never_swaps() -> None:
    assert choose_preemption_mode(1, 16, setting="recompute", swap_free_blocks=100) == "recompute"


def test_auto_setting_weighs_bytes_against_recompute() -> None:
    # 4 blocks of 1 KiB: moving them is far cheaper than recomputing 4096 tokens.
    cheap_swap = choose_preemption_mode(
        4, 4096, setting="auto", swap_free_blocks=4, bytes_per_block=1024
    )
    assert cheap_swap == "swap"
    costly_swap = choose_preemption_mode(
        4, 4, setting="auto", swap_free_blocks=4, bytes_per_block=10**9
    )
    assert costly_swap == "recompute"


def test_preemption_plan_carries_the_mode() -> None:
    plans = choose_preemption(
        {"w0": [cand("a", 4)]},
        {"w0": report("w0", free=0)},
        {"w0": 4},
        setting="swap",
        swap_free_blocks={"w0": 16},
    )
    assert plans[0].mode == "swap"
