"""The kernel benchmark's --smoke mode runs end to end, so the script cannot rot."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_kernels_benchmark_smoke_prints_a_passing_table() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1"}
    env.pop("PAGEFLEET_ATTENTION", None)
    env.pop("PAGEFLEET_KV_SPLITS", None)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "paged_attention.py"), "--smoke"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert any(line.startswith("shape") and "paged/sdpa" in line for line in lines)
    assert any(line.startswith("decode b4 ctx128") and " PASS " in line for line in lines)
    assert any(line.startswith("triton interp") and " PASS " in line for line in lines)
    assert "FAIL" not in proc.stdout


def test_cpu_decode_attention_benchmark_quick_prints_every_row() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PAGEFLEET_ATTENTION", None)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "cpu_decode_attention.py"), "--quick"],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for row in ("float32 KV (auto)", "float16 KV", "slot gather only", "SDPA only",
                "bytes read, from memory", "bytes read, from the caches"):
        assert row in proc.stdout


def test_cpu_decode_attention_benchmark_prefill_quick_prints_every_chunk() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PAGEFLEET_ATTENTION", None)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "cpu_decode_attention.py"), "--prefill",
         "--quick"],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines() if line[:6].strip().isdigit()]
    assert [(r[0], r[1]) for r in rows] == [("2", "0"), ("16", "0"), ("100", "0"), ("400", "0"),
                                            ("40", "512"), ("64", "512")]
    assert all(r[4].endswith("x") and float(r[4][:-1]) > 0 for r in rows)
