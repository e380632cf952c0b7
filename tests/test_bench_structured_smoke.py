"""benchmarks/structured.py's smoke mode runs end to end (so the script cannot rot)."""

from __future__ import annotations

from collections.abc import Callable

import pytest


@pytest.mark.slow
def test_structured_smoke_prints_the_mixed_batch_ratio(run_benchmark: Callable[..., str]) -> None:
    out = run_benchmark("structured.py", "--smoke")
    assert "mixed: 2 of 4 under the schema" in out
    assert "mixed batch tokens/s vs unconstrained:" in out
