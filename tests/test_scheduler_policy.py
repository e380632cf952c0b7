"""Scheduler policies: admission and eviction watermarks."""

from __future__ import annotations

import pytest

from pagefleet.scheduler.policy import (
    Claim,
    EvictionWatermarks,
    blocks_for_prompt,
    blocks_to_evict,
    claim_headroom,
    full_claim,
)
from pagefleet.worker.events import LoadReport


def report(
    worker_id: str = "w0",
    *,
    total: int = 100,
    free: int = 50,
    cached: int = 0,
    committed: int = 0,
    origin_claims: dict[str, int] | None = None,
) -> LoadReport:
    return LoadReport(
        worker_id, "chat", 1, 0.0, total, free, total - free - cached, cached, 0,
        committed_blocks=committed, origin_claims=origin_claims or {},
    )


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


def test_a_full_claim_covers_the_prompt_and_max_tokens_less_the_cached_prefix() -> None:
    # 40 + 30 tokens, the last never written: 69 tokens in 5 blocks of 16.
    assert full_claim(40, 30, 1, 16) == 5
    assert full_claim(40, 30, 1, 16, matched_blocks=2) == 3
    # Two completions share the 2 full prompt blocks and need 3 of their own each.
    assert full_claim(40, 30, 2, 16) == 5 + 3


def test_headroom_counts_evictable_cached_blocks_less_what_others_will_take() -> None:
    assert claim_headroom(report(free=2, cached=8), [], "me") == 10
    assert claim_headroom(report(free=2, cached=8, committed=7), [], "me") == 3


def test_headroom_swaps_this_replicas_reported_claims_for_its_exact_ones() -> None:
    # The report counts 6 blocks of ours (one request, since finished); now we have
    # a 4-block request the report has not seen yet.
    stale = report(free=10, committed=8, origin_claims={"me": 6, "other": 2})
    assert claim_headroom(stale, [Claim(0, 4)], "me") == 10 - 8 + 6 - 4
    assert claim_headroom(stale, [Claim(0, 4)], "other") == 10 - 8 + 2 - 4


def test_overcommit_lets_claims_exceed_the_pool_by_its_factor() -> None:
    full = report(total=100, free=10, committed=10)
    assert claim_headroom(full, [], "me") == 0
    assert claim_headroom(full, [], "me", overcommit=1.5) == 50


def test_no_eviction_above_the_low_watermark() -> None:
    assert blocks_to_evict(report(free=5, cached=50), EvictionWatermarks(0.05, 0.10)) == 0


def test_eviction_refills_the_free_list_to_the_high_watermark() -> None:
    assert blocks_to_evict(report(free=2, cached=50), EvictionWatermarks(0.05, 0.10)) == 8


def test_eviction_is_capped_by_cached_blocks() -> None:
    assert blocks_to_evict(report(free=0, cached=3), EvictionWatermarks(0.05, 0.20)) == 3


def test_watermarks_must_be_ordered() -> None:
    with pytest.raises(ValueError, match="low <= high"):
        EvictionWatermarks(0.3, 0.1)
