"""The scheduler's memory of the migrations it ordered, which the next decisions depend on.

`policy.choose_migration` decides; this remembers each move so that the
request cannot move again for `cooldown_s`, and its blocks count against
the target's room for `reserve_s` (until the target's reports show them).
"""

from __future__ import annotations

from collections.abc import Sequence

from pagefleet.scheduler.policy import Migration, MigrationPolicy, choose_migration
from pagefleet.worker.events import LoadReport


class MigrationBook:
    """Recent moves (for cooldowns and reserved room) and the count ordered per pool."""

    def __init__(self) -> None:
        self._migrated_at: dict[str, float] = {}  # request id -> when it was last moved
        self._promised: list[tuple[float, str, int]] = []  # (when, target, blocks) of moves
        self.ordered: dict[str, int] = {}  # per pool: migrations ordered so far

    def order(
        self, pool: str, source: LoadReport, targets: Sequence[LoadReport], block_size: int,
        policy: MigrationPolicy, now: float,
    ) -> Migration | None:  # fmt: skip
        """A request the worker of `source` should hand to one of `targets` (the other
        live workers of its pool), remembered as ordered; None: no move now."""
        self._migrated_at = {
            rid: t for rid, t in self._migrated_at.items() if now - t < policy.cooldown_s
        }
        self._promised = [p for p in self._promised if now - p[0] < policy.reserve_s]
        reserved: dict[str, int] = {}
        for _, target, blocks in self._promised:
            reserved[target] = reserved.get(target, 0) + blocks
        move = choose_migration(
            source, targets, block_size, policy,
            recently_migrated=self._migrated_at, reserved=reserved,
        )  # fmt: skip
        if move is not None:
            self._migrated_at[move.request_id] = now
            self._promised.append((now, move.target, move.num_blocks))
            self.ordered[pool] = self.ordered.get(pool, 0) + 1
        return move
