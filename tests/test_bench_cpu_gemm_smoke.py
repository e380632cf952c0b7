"""The GEMM benchmark's --quick mode runs end to end (so the script cannot rot)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagefleet.worker.cpu_linear import MKL, ONEDNN, available_backends

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(
    not {MKL, ONEDNN} <= set(available_backends()),
    reason="torch lacks MKL's or oneDNN's packed GEMM here",
)
def test_cpu_gemm_quick_prints_every_method_with_its_identity_check() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "cpu_gemm.py"), "--quick", "--threads", "1"],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for row in ("plain F.linear", "fused q/k/v, gate/up", "pagefleet's on Intel",
                "pagefleet's elsewhere", "LM head, plain"):
        assert row in proc.stdout
    assert "bit-identical to F.linear" in proc.stdout
