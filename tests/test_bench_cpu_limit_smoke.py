"""The CPU-limit benchmark's quick mode runs end to end (so the script cannot rot)."""

from __future__ import annotations

from collections.abc import Callable

import pytest


@pytest.mark.slow
def test_cpu_limit_quick_prints_floor_peers_and_breakdown(run_benchmark: Callable[..., str]) -> None:
    out = run_benchmark("cpu_limit.py", "--quick", "--threads", "1", "--kv-cache-dtype", "auto", "float16")
    assert "x the dense-layer floor" in out
    assert "pagefleet vs HF generate, padded batch" in out
    assert "attention (paged attention)" in out
    assert "greedy outputs equal to HF one-at-a-time" in out
    assert "pagefleet, kv_cache_dtype float16: " in out and "x the dense-layer floor" in out
    assert "greedy outputs of pagefleet, kv_cache_dtype float16 equal to kv_cache_dtype auto" in out
