"""The elementwise-layers benchmark runs end to end (so the script cannot rot), and every
layer it times gives torch's bits."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_cpu_layers_times_each_layer_and_each_gives_torchs_bits() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "cpu_layers.py"), "--rows", "3", "40",
         "--rounds", "1"],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.rstrip().endswith(("True", "False"))]
    names = {line[:32].strip() for line in rows}
    assert {"RMSNorm", "RoPE of q and k, K/V write", "SiLU and product"} <= names
    assert len(rows) >= 6 and all(line.rstrip().endswith("True") for line in rows), proc.stdout
