"""The pure victim policy and mode choice (also used by the cluster scheduler)."""

from __future__ import annotations

from pagefleet.worker.preemption import VictimCandidate, choose_mode, choose_victims


def cand(request_id: str, priority: int, admitted_seq: int, num_blocks: int = 2) -> VictimCandidate:
    return VictimCandidate(request_id, priority, arrival_time=0.0, admitted_seq=admitted_seq,
                           num_blocks=num_blocks)


def test_lowest_priority_goes_first_even_if_admitted_earliest() -> None:
    cands = [cand("old-low", 0, 1), cand("new-high", 5, 9)]
    assert choose_victims(cands, 1) == ["old-low"]


def test_among_equal_priorities_the_most_recently_admitted_goes_first() -> None:
    cands = [cand("a", 0, 1), cand("c", 0, 3), cand("b", 0, 2)]
    assert choose_victims(cands, 1) == ["c"]


def test_victims_are_added_until_their_blocks_cover_the_need() -> None:
    cands = [cand("a", 0, 1, num_blocks=4), cand("b", 0, 2, num_blocks=1), cand("c", 0, 3, num_blocks=1)]
    assert choose_victims(cands, 2) == ["c", "b"]
    assert choose_victims(cands, 3) == ["c", "b", "a"]


def test_everyone_is_returned_when_all_together_fall_short() -> None:
    assert choose_victims([cand("a", 0, 1), cand("b", 1, 2)], 100) == ["a", "b"]


def test_no_victim_when_nothing_is_needed() -> None:
    assert choose_victims([cand("a", 0, 1)], 0) == []


def test_mode_is_whichever_is_estimated_cheaper() -> None:
    # 1000 tokens x 1 ms = 1 s to recompute vs 2 x 1 MB / 1 GB/s = 2 ms to swap.
    assert choose_mode(1000, 10**6, 1e-3, 1e9) == "swap"
    # 10 tokens x 1 us = 10 us to recompute vs 2 ms to swap.
    assert choose_mode(10, 10**6, 1e-6, 1e9) == "recompute"
