"""Scheduler policies: admission, eviction watermarks and cross-worker migration."""

from __future__ import annotations

import dataclasses

import pytest

from pagefleet.scheduler.policy import (
    Claim,
    EvictionWatermarks,
    Migration,
    MigrationPolicy,
    blocks_for_prompt,
    blocks_to_evict,
    choose_migration,
    claim_headroom,
    full_claim,
    transfer_is_cheaper,
)
from pagefleet.worker.events import LoadReport, RequestLoad


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


# ----- migration ----------------------------------------------------------------

BS = 4
POLICY = MigrationPolicy(margin_blocks=2, cooldown_s=10.0)


def short_worker(*requests: RequestLoad, short: int = 3) -> LoadReport:
    return LoadReport(
        "w0", "chat", 1, 0.0, 100, 0, 100, 0, 100, num_running=len(requests),
        blocks_short=short, requests=requests,
    )


def idle_worker(
    worker_id: str = "w1", *, free: int = 100, pool: str = "chat",
    recompute_s_per_token: float = 0.0, kv_import_s_per_block: float = 0.0,
) -> LoadReport:
    return LoadReport(worker_id, pool, 1, 0.0, 100, free, 100 - free, 0, 0,
                      recompute_s_per_token=recompute_s_per_token,
                      kv_import_s_per_block=kv_import_s_per_block)  # fmt: skip


# Request "old" was admitted first, "new" last; "low" has a lower priority than both.
OLD = RequestLoad("old", 0, 1, 40)
NEW = RequestLoad("new", 0, 3, 40)
LOW = RequestLoad("low", -1, 2, 40)


def test_migration_moves_the_lowest_priority_request_to_a_worker_with_room() -> None:
    move = choose_migration(short_worker(OLD, NEW, LOW), [idle_worker()], BS, POLICY)
    assert move == Migration("low", "w0", "w1", 10)


def test_a_fixed_policy_moves_the_kv_blocks_or_recomputes_whatever_was_measured() -> None:
    # The target measured imports 100x dearer than recompute: a fixed policy ignores it.
    dear = idle_worker(recompute_s_per_token=1e-4, kv_import_s_per_block=0.16)
    cases = {True: True, False: False}
    for transfer, expected in cases.items():
        policy = MigrationPolicy(margin_blocks=2, cooldown_s=10.0, transfer=transfer)
        move = choose_migration(short_worker(NEW), [dear], BS, policy)
        assert move is not None and move.transfer is expected


def test_auto_moves_kv_blocks_until_the_target_has_measured_an_import() -> None:
    assert POLICY.transfer == "auto"
    for target in (idle_worker(), idle_worker(recompute_s_per_token=1e-3),
                   idle_worker(kv_import_s_per_block=1e-3)):  # fmt: skip
        move = choose_migration(short_worker(NEW), [target], BS, POLICY)
        assert move is not None and move.transfer


def test_auto_weighs_the_targets_import_cost_against_recomputing_the_request() -> None:
    # NEW holds 40 tokens, 10 full blocks of 4. Recompute: 40 x 1 ms = 40 ms; transfer:
    # 10 blocks x 3.8 ms = 38 ms, or x 4.2 ms = 42 ms.
    per_token = 1e-3
    cheap = idle_worker(recompute_s_per_token=per_token, kv_import_s_per_block=3.8e-3)
    dear = idle_worker(recompute_s_per_token=per_token, kv_import_s_per_block=4.2e-3)
    by_cheap = choose_migration(short_worker(NEW), [cheap], BS, POLICY)
    by_dear = choose_migration(short_worker(NEW), [dear], BS, POLICY)
    assert by_cheap is not None and by_cheap.transfer
    assert by_dear is not None and not by_dear.transfer
    assert transfer_is_cheaper(40, BS, cheap) and not transfer_is_cheaper(40, BS, dear)
    # A partial tail is recomputed either way; shorter than one block, nothing to transfer.
    assert transfer_is_cheaper(42, BS, cheap) and not transfer_is_cheaper(3, BS, cheap)


def test_a_migration_policy_refuses_a_transfer_mode_it_does_not_know() -> None:
    with pytest.raises(ValueError, match="transfer must be true, false or 'auto', got 'sometimes'"):
        MigrationPolicy(transfer="sometimes")


def test_among_equal_priorities_the_most_recently_admitted_migrates() -> None:
    move = choose_migration(short_worker(OLD, NEW), [idle_worker()], BS, POLICY)
    assert move is not None and move.request_id == "new"


def test_no_migration_from_a_worker_that_is_not_short() -> None:
    assert choose_migration(short_worker(OLD, NEW, short=0), [idle_worker()], BS, POLICY) is None


def test_no_migration_without_a_target_with_room_for_the_request_and_the_margin() -> None:
    # "new" needs 10 blocks; 11 free leaves 9 after the margin of 2.
    assert choose_migration(short_worker(NEW), [idle_worker(free=11)], BS, POLICY) is None
    move = choose_migration(short_worker(NEW), [idle_worker(free=12)], BS, POLICY)
    assert move is not None and move.target == "w1"


def test_blocks_promised_to_a_target_count_against_its_room() -> None:
    source = short_worker(NEW)
    assert choose_migration(source, [idle_worker(free=20)], BS, POLICY, reserved={"w1": 9}) is None
    assert choose_migration(source, [idle_worker(free=20)], BS, POLICY, reserved={"w1": 8}) is not None


def test_a_smaller_request_migrates_when_the_first_victim_fits_nowhere() -> None:
    small = RequestLoad("small", 0, 1, 8)  # 2 blocks
    move = choose_migration(short_worker(small, NEW), [idle_worker(free=6)], BS, POLICY)
    assert move is not None and move.request_id == "small"


def test_no_migration_to_a_worker_short_itself_another_pool_or_the_source() -> None:
    also_short = dataclasses.replace(idle_worker(), blocks_short=1)
    other_pool = idle_worker("b0", pool="batch")
    itself = dataclasses.replace(idle_worker("w0"), free_blocks=100)
    assert choose_migration(short_worker(NEW), [also_short, other_pool, itself], BS, POLICY) is None


def test_the_target_with_the_most_room_is_chosen() -> None:
    move = choose_migration(
        short_worker(NEW), [idle_worker("w1", free=30), idle_worker("w2", free=60)], BS, POLICY
    )
    assert move is not None and move.target == "w2"


def test_a_request_in_its_cooldown_does_not_migrate_again() -> None:
    source = short_worker(OLD, NEW)
    move = choose_migration(source, [idle_worker()], BS, POLICY, recently_migrated={"new"})
    assert move is not None and move.request_id == "old"
    assert choose_migration(
        source, [idle_worker()], BS, POLICY, recently_migrated={"new", "old"}
    ) is None


def test_migration_policy_refuses_negative_settings() -> None:
    with pytest.raises(ValueError, match="margin_blocks"):
        MigrationPolicy(margin_blocks=-1)
    with pytest.raises(ValueError, match="cooldown_s"):
        MigrationPolicy(cooldown_s=-1.0)
