"""An engine's counters for tests that build load reports without an engine."""

from __future__ import annotations

import dataclasses

from pagefleet.worker.engine import EngineStats


def engine_stats(**counters: int) -> EngineStats:
    """`EngineStats` with these counters, every other one 0."""
    zeros = {f.name: 0 for f in dataclasses.fields(EngineStats)}
    return EngineStats(**{**zeros, **counters})
