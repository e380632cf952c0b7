"""The GEMM benchmark's --quick mode runs end to end (so the script cannot rot)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagefleet.worker.cpu_linear import cpu_fast_path_applies

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(
    not cpu_fast_path_applies(torch.device("cpu"), torch.float32),
    reason="torch has no MKL packed GEMM here",
)
def test_cpu_gemm_quick_prints_every_method_with_its_identity_check() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "cpu_gemm.py"), "--quick", "--threads", "1"],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for row in ("plain F.linear", "fused q/k/v, gate/up", "pagefleet's", "onednn packed",
                "LM head, plain"):
        assert row in proc.stdout
    assert "bit-identical to F.linear" in proc.stdout
