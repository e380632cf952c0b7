"""The block-manager benchmarks' --smoke modes run end to end, so the scripts cannot rot."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_smoke(script: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--smoke"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_kv_utilization_smoke_prints_every_scheme_and_meets_its_targets() -> None:
    out = run_smoke("kv_utilization.py")
    for scheme in ("paged, block 8", "paged, block 16", "paged, block 32"):
        assert any(line.startswith(scheme) for line in out.splitlines()), out
    assert any(line.startswith("contiguous, max_model_len") for line in out.splitlines())
    assert any(line.startswith("contiguous, power of 2") for line in out.splitlines())
    # Utilization and sequence counts are deterministic (seeded lengths), not timings.
    assert out.count(" met") == 2 and "MISSED" not in out


def test_block_pool_benchmark_smoke_prints_its_rows() -> None:
    out = run_smoke("block_pool.py")
    lines = out.splitlines()
    assert any(line.startswith("operation") and "ours/peer" in line for line in lines)
    for row in ("allocate+free, 16 blocks/call", "prefix lookup, 2000-token chain"):
        assert any(line.startswith(row) for line in lines), out
    assert any(line.startswith("target: allocate+free") for line in lines)
