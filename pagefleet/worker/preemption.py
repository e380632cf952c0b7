"""Who gets preempted when a pool runs out of blocks: a pure policy.

The engine calls it when a step cannot get a block; the cluster scheduler
(`pagefleet.scheduler.policy`) reuses it across workers. Priorities: a larger
`priority` is more important, so victims are taken from the smallest
priority first; among equals the most recently admitted goes first (it has
the least work to lose, as in vLLM V1).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class VictimCandidate:
    """A running request (or sequence) that could be preempted to free blocks."""

    request_id: str
    priority: int
    arrival_time: float
    admitted_seq: int  # monotonic admission counter: larger = admitted later
    num_blocks: int  # blocks it would release


def victim_order(candidates: Iterable[VictimCandidate]) -> list[VictimCandidate]:
    """Candidates in preemption order: lowest priority, then most recently admitted."""
    return sorted(candidates, key=lambda c: (c.priority, -c.admitted_seq, -c.arrival_time))


def choose_victims(candidates: Iterable[VictimCandidate], blocks_needed: int) -> list[str]:
    """Request ids to preempt, in order, until their blocks cover `blocks_needed`.

    Returns every candidate (in order) when all together cannot cover the need;
    the caller decides whether that is worth doing. `blocks_needed <= 0`
    returns no victim.
    """
    chosen: list[str] = []
    freed = 0
    for cand in victim_order(candidates):
        if freed >= blocks_needed:
            break
        chosen.append(cand.request_id)
        freed += cand.num_blocks
    return chosen


def choose_mode(
    num_tokens: int,
    num_bytes: int,
    recompute_seconds_per_token: float,
    swap_bytes_per_second: float,
) -> str:
    """"recompute" or "swap" for one victim, whichever is estimated cheaper.

    Recomputing costs a prefill of its `num_tokens`; swapping moves its
    `num_bytes` out and later back in (twice).
    """
    recompute_cost = num_tokens * recompute_seconds_per_token
    swap_cost = 2.0 * num_bytes / swap_bytes_per_second
    return "swap" if swap_cost < recompute_cost else "recompute"
