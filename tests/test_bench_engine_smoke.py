"""The engine benchmarks' smoke modes run end to end (so the scripts cannot rot)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def run_smoke(script: str, *extra: str) -> str:
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--smoke", *extra],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.mark.slow
def test_throughput_smoke_prints_the_ratio_table() -> None:
    out = run_smoke("throughput.py")
    assert "pagefleet vs padded batch" in out and "HF generate, one at a time" in out
    assert "greedy outputs equal to HF one-at-a-time" in out


@pytest.mark.slow
def test_prefix_cache_smoke_hits_the_ideal_prefix() -> None:
    out = run_smoke("prefix_cache.py")
    assert "hit tokens vs ideal: 100.0%" in out


@pytest.mark.slow
def test_offload_smoke_brings_every_history_back_unchanged() -> None:
    out = run_smoke("offload.py")
    assert "tier hit rate vs ideal: 100.0%" in out
    assert "outputs equal with and without the tier: True" in out


@pytest.mark.slow
def test_prefix_cache_smoke_hits_the_ideal_prefix_when_submitted_together() -> None:
    out = run_smoke("prefix_cache.py", "--together")
    assert "hit tokens vs ideal: 100.0%" in out
