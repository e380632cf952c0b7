"""Scheduler policies: admission and eviction watermarks."""

from __future__ import annotations

import pytest

from pagefleet.scheduler.policy import (
    EvictionWatermarks,
    blocks_for_prompt,
    blocks_to_evict,
    can_admit,
)
from pagefleet.worker.events import LoadReport


def report(
    worker_id: str = "w0", *, total: int = 100, free: int = 50, cached: int = 0
) -> LoadReport:
    return LoadReport(worker_id, "chat", 1, 0.0, total, free, total - free - cached, cached, 0)


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
