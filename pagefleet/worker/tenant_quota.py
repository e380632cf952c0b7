"""Per-tenant caps on the live KV blocks one worker's pool gives a tenant.

Paging alone gives no isolation: one tenant's long prompts can take every
block of a shared pool. A cap (`tenants[].max_live_blocks`, per worker) bounds
what a tenant holds: the batch scheduler admits a tenant's request only when
the tenant stays within its cap, and when a running sequence of the tenant
needs a block past the cap, it preempts (recompute) the tenant's *own* least
important sequence, never another tenant's.

Tenants are known to the engine by their prefix-cache salt (the `salt` of
`LLMEngine.add_request`): salts never share a block, so blocks are counted
per salt without double counting. Blocks of a tenant's swapped-out sequences
count as held: they come back at swap-in.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping

from pagefleet.worker.sequence import Sequence


class TenantBlockQuota:
    """Caps by tenant salt, the tenant's held blocks, and how often a cap made a tenant wait."""

    def __init__(self, caps: Mapping[str, int]) -> None:
        for salt, cap in caps.items():
            if cap < 1:
                raise ValueError(f"tenant max_live_blocks must be >= 1, got {cap} for salt {salt!r}")
        self.caps = dict(caps)
        # Admissions deferred and sequences preempted because their tenant was at its cap.
        self.refusals: Counter[str] = Counter()

    def cap(self, salt: str | None) -> int | None:
        """The tenant's cap, or None when it has none."""
        return self.caps.get(salt or "")

    def held(self, salt: str | None, running: Iterable[Sequence], swapped: Iterable[Sequence]) -> int:
        """Distinct blocks the tenant's running sequences hold, plus its swapped-out blocks."""
        key = salt or ""
        blocks: set[int] = set()
        for seq in running:
            if seq.table is not None and (seq.request.salt or "") == key:
                blocks.update(seq.table.block_ids)
        parked = sum(
            s.swapped.num_blocks
            for s in swapped
            if s.swapped is not None and (s.request.salt or "") == key
        )
        return len(blocks) + parked

    def excess(
        self,
        salt: str | None,
        new_blocks: int,
        running: Iterable[Sequence],
        swapped: Iterable[Sequence],
    ) -> int:
        """Blocks past the tenant's cap if it took `new_blocks` more now (<= 0: it fits)."""
        cap = self.cap(salt)
        if cap is None or new_blocks <= 0:
            return 0
        return self.held(salt, running, swapped) + new_blocks - cap

    def refuse(self, salt: str | None) -> None:
        """Count one wait or preemption the cap caused."""
        self.refusals[salt or ""] += 1
