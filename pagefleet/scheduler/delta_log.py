"""The scheduler's delta log: every change of the view, versioned, the latest kept.

Subscribers (ingress replicas) ask for the entries after their cursor, and
get a snapshot instead when they start, fall behind the bounded log, or see
a new generation. The `generation` identifies one scheduler incarnation:
after a restart it changes, and with it the meaning of every version.
"""

from __future__ import annotations

from collections import deque

from pagefleet.scheduler.messages import AbortNote, ViewUpdate, WorkerDelta
from pagefleet.scheduler.session_pins import SessionPin

# Deltas kept for subscribers that are behind; older cursors get a snapshot.
DEFAULT_LOG_SIZE = 50_000

LogEntry = WorkerDelta | AbortNote | SessionPin


class DeltaLog:
    """The bounded, versioned log of one scheduler incarnation (`generation`)."""

    def __init__(self, generation: int, size: int = DEFAULT_LOG_SIZE) -> None:
        if size < 1:
            raise ValueError(f"log_size must be >= 1, got {size}")
        self.generation = generation
        self._version = 0
        self._entries: deque[LogEntry] = deque(maxlen=size)

    @property
    def version(self) -> int:
        """Entries appended so far; the latest has this version."""
        return self._version

    def append(self, entry: LogEntry) -> None:
        """Publish one entry at the next version (the oldest falls out when full)."""
        self._version += 1
        self._entries.append(entry)

    def since(self, generation: int | None, cursor: int) -> ViewUpdate | None:
        """The entries after `cursor`, or None when the subscriber cannot continue from it
        (another generation, or a cursor the log no longer reaches): it needs a snapshot."""
        oldest = self._version - len(self._entries)  # the first kept entry has version oldest + 1
        if generation != self.generation or not oldest <= cursor <= self._version:
            return None
        entries = self._entries
        deltas = tuple(entries[i] for i in range(cursor - oldest, len(entries)))
        return ViewUpdate(self.generation, self._version, False, deltas)

    def snapshot(self, entries: tuple[LogEntry, ...]) -> ViewUpdate:
        """A snapshot made of `entries` at the current version."""
        return ViewUpdate(self.generation, self._version, True, entries)
