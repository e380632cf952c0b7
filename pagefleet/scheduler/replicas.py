"""The ingress replicas as the scheduler hears them, and the abort notes they settle.

A replica names itself with every subscribe: that is its sign of life
(judged by the same `LivenessRule` deadline as a worker's reports), its
cursor (how far it has applied the view) and its queue depths per pool. A
replica silent past the deadline is dead: workers abort the requests it
sent, and its queue no longer counts.

An abort note looks for a request waiting in some replica's queue: it is
settled once a replica found it, or once every other live replica has
subscribed past the note without finding it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from pagefleet.scheduler.liveness import LivenessRule

# A dead ingress replica is announced to workers this long, then forgotten.
DEAD_REPLICA_MEMORY_S = 300.0


@dataclass
class _Replica:
    seen: float  # its last subscribe
    generation: int | None  # ...and the cursor it came with: it applied the view up to it
    cursor: int
    queued: dict[str, int]  # pool -> requests waiting in its queue


class Replicas:
    """Every ingress replica this scheduler incarnation has heard from; see the module docstring."""

    def __init__(self, rule: LivenessRule, clock: Callable[[], float]) -> None:
        self._rule = rule
        self._clock = clock
        self._replicas: dict[str, _Replica] = {}
        # Abort notes not settled yet: note id -> (its version, found by some replica).
        self._aborts: dict[int, tuple[int, bool]] = {}
        self._next_note = 0

    def note(
        self, replica_id: str, generation: int | None, cursor: int, queued: Mapping[str, int]
    ) -> None:
        """The replica subscribed from `cursor` of `generation` with `queued` requests
        waiting per pool."""
        self._replicas[replica_id] = _Replica(
            self._clock(), generation, cursor, {p: n for p, n in queued.items() if n > 0}
        )

    def queued(self) -> dict[str, int]:
        """Requests waiting per pool in the live replicas' queues."""
        now = self._clock()
        out: dict[str, int] = {}
        for replica in self._replicas.values():
            if self._rule.heard_in_time(replica.seen, now):  # a dead replica's queue died with it
                for pool, n in replica.queued.items():
                    out[pool] = out.get(pool, 0) + n
        return out

    def dead(self) -> tuple[str, ...]:
        """Replicas silent past the report deadline: workers abort the requests they sent.

        Only replicas this incarnation has seen can be dead, so a restarted
        scheduler never makes workers abort the streams of a live replica.
        """
        now = self._clock()
        replicas = self._replicas
        for rid in [r for r, rep in replicas.items() if now - rep.seen > DEAD_REPLICA_MEMORY_S]:
            del replicas[rid]
        return tuple(r for r, rep in replicas.items() if not self._rule.heard_in_time(rep.seen, now))

    # ----- abort notes ----------------------------------------------------

    def open_abort(self, version: int) -> int:
        """A new abort note that the view publishes at `version`; returns its id."""
        self._next_note += 1
        self._aborts[self._next_note] = (version, False)
        return self._next_note

    def found(self, note_ids: tuple[int, ...]) -> None:
        """A replica found (and cancelled) the requests of these notes."""
        for note_id in note_ids:
            if note_id in self._aborts:
                self._aborts[note_id] = (self._aborts[note_id][0], True)

    def abort_settled(self, note_id: int, origin: str, generation: int) -> bool | None:
        """True once a replica found the request; False once every live replica but
        `origin` has subscribed past the note (in `generation`) without finding it;
        None while neither."""
        version, found = self._aborts[note_id]
        if found:
            return True
        now = self._clock()
        for rid, replica in self._replicas.items():
            if rid == origin or not self._rule.heard_in_time(replica.seen, now):
                continue
            if replica.generation != generation or replica.cursor < version:
                return None
        return False

    def forget_abort(self, note_id: int) -> None:
        """Drop a note, settled or timed out."""
        self._aborts.pop(note_id, None)

    @property
    def aborts_pending(self) -> bool:
        """Some abort note is not settled yet."""
        return bool(self._aborts)
