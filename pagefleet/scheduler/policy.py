"""Cluster scheduling policies as pure functions.

Used by the central scheduler and by workers alike, and testable without Ray:

- admission: does a prompt fit a worker now (`can_admit`);
- eviction: how many cached blocks a worker should evict to stay above its
  free-block watermark (`blocks_to_evict`);
- preemption: which sequences, on which worker, in which mode, when a pool
  fills (`choose_preemption`, reusing the engine's `choose_victims`).

The ingress wait queue (tenants' fair shares) is `scheduler.fair_queue`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pagefleet.worker.events import LoadReport
from pagefleet.worker.preemption import VictimCandidate, choose_mode, choose_victims

# Rough costs for choosing a preemption mode when the caller has no measurement:
# a prefill token on a mid-size GPU model vs. moving KV over PCIe.
DEFAULT_RECOMPUTE_SECONDS_PER_TOKEN = 1e-4
DEFAULT_SWAP_BYTES_PER_SECOND = 10e9


def blocks_for_prompt(num_tokens: int, block_size: int, matched_blocks: int = 0) -> int:
    """New blocks a prompt of `num_tokens` needs when `matched_blocks` are cached.

    The last prompt token is always computed (its logits are needed), so a
    fully cached prompt still needs its last block: at most
    ``(num_tokens - 1) // block_size`` blocks can come from the cache.
    """
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    total = -(-num_tokens // block_size)
    reusable = min(max(matched_blocks, 0), (num_tokens - 1) // block_size)
    return total - reusable


def can_admit(
    report: LoadReport,
    num_tokens: int,
    block_size: int,
    *,
    matched_blocks: int = 0,
    reserve_blocks: int = 0,
) -> bool:
    """Whether the worker can take the prompt now: free plus evictable blocks cover it and a reserve.

    The reserve keeps room for running sequences' next decode blocks, so an
    admission does not immediately force a preemption.
    """
    needed = blocks_for_prompt(num_tokens, block_size, matched_blocks)
    return report.num_allocatable - max(reserve_blocks, 0) >= needed


@dataclass(frozen=True)
class EvictionWatermarks:
    """Free-block fractions: below `low`, evict cached blocks until free reaches `high`."""

    low: float = 0.05
    high: float = 0.10

    def __post_init__(self) -> None:
        if not 0.0 <= self.low <= self.high <= 1.0:
            raise ValueError(f"need 0 <= low <= high <= 1, got low={self.low}, high={self.high}")


def blocks_to_evict(report: LoadReport, marks: EvictionWatermarks) -> int:
    """Cached blocks to evict now to keep the worker's free list above its watermark.

    Eviction normally happens lazily when a block is needed; evicting a little
    ahead keeps the allocation path short under bursts. Never more than the
    cached blocks there are.
    """
    total = report.total_blocks
    if total <= 0 or report.free_blocks >= marks.low * total:
        return 0
    target = int(marks.high * total + 0.999999)  # ceil without float surprises
    return max(0, min(report.cached_blocks, target - report.free_blocks))


def choose_preemption_mode(
    num_blocks: int,
    num_tokens: int,
    *,
    setting: str = "recompute",
    swap_free_blocks: int = 0,
    bytes_per_block: int = 0,
    recompute_seconds_per_token: float = DEFAULT_RECOMPUTE_SECONDS_PER_TOKEN,
    swap_bytes_per_second: float = DEFAULT_SWAP_BYTES_PER_SECOND,
) -> str:
    """``"recompute"`` or ``"swap"`` for one victim under the configured `setting`.

    ``setting="recompute"`` always recomputes; ``"swap"`` swaps when the CPU
    swap space has room, else recomputes; ``"auto"`` swaps only when there is
    room and the engine's cost model says moving the bytes is cheaper
    (it recomputes when `bytes_per_block` is unknown, i.e. 0).
    """
    if setting not in ("recompute", "swap", "auto"):
        raise ValueError(f"setting must be recompute, swap or auto, got {setting!r}")
    if setting == "recompute" or num_blocks > swap_free_blocks:
        return "recompute"
    if setting == "swap":
        return "swap"
    if bytes_per_block <= 0:
        return "recompute"
    return choose_mode(
        num_tokens, num_blocks * bytes_per_block, recompute_seconds_per_token, swap_bytes_per_second
    )


@dataclass(frozen=True)
class PreemptionPlan:
    """Preempt these requests on this worker, in this mode, to free `blocks_freed` blocks."""

    worker_id: str
    request_ids: tuple[str, ...]
    mode: str
    blocks_freed: int


def choose_preemption(
    candidates: Mapping[str, Sequence[VictimCandidate]],
    reports: Mapping[str, LoadReport],
    blocks_needed: Mapping[str, int],
    *,
    setting: str = "recompute",
    swap_free_blocks: Mapping[str, int] | None = None,
    block_size: int = 16,
    bytes_per_block: int = 0,
) -> list[PreemptionPlan]:
    """Per worker short of blocks, which of its sequences to preempt and how.

    `blocks_needed` is what each worker must allocate next; what its free and
    cached blocks already cover is not preempted for. Workers are planned in
    order of pressure (largest shortfall first) so a caller acting on the
    first plans relieves the fullest workers first. Blocks live in one
    worker's pool, so victims always come from the worker that lacks blocks.
    """
    swap_free = dict(swap_free_blocks or {})
    shortfalls = []
    for worker_id, need in blocks_needed.items():
        report = reports.get(worker_id)
        have = report.num_allocatable if report is not None else 0
        if need > have:
            shortfalls.append((need - have, worker_id))
    shortfalls.sort(key=lambda s: (-s[0], s[1]))
    plans: list[PreemptionPlan] = []
    for shortfall, worker_id in shortfalls:
        pool = {c.request_id: c for c in candidates.get(worker_id, ())}
        victims = choose_victims(pool.values(), shortfall)
        if not victims:
            continue
        freed = sum(pool[v].num_blocks for v in victims)
        mode = choose_preemption_mode(
            freed,
            freed * block_size,
            setting=setting,
            swap_free_blocks=swap_free.get(worker_id, 0),
            bytes_per_block=bytes_per_block,
        )
        plans.append(PreemptionPlan(worker_id, tuple(victims), mode, freed))
    return plans


class ResourceExhausted(RuntimeError):
    """A bounded queue is full (maps to gRPC RESOURCE_EXHAUSTED / HTTP 429)."""

    code = "RESOURCE_EXHAUSTED"
