"""The kernel benchmarks run end to end, so the scripts cannot rot."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_kernels_benchmark_smoke_prints_a_passing_table() -> None:
    # A process of its own: its Triton rows need the interpreter set before Triton is first
    # imported, which this process (on a GPU machine) has not done.
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


@pytest.mark.parametrize("step", [[], ["--shared-prefix"]], ids=["mid-decode", "shared-prefix"])
def test_cpu_decode_attention_benchmark_quick_prints_every_row(
    step: list[str], run_benchmark: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PAGEFLEET_ATTENTION", raising=False)
    out = run_benchmark("cpu_decode_attention.py", "--quick", *step)
    for row in ("float32 KV (auto)", "float16 KV", "slot gather only", "SDPA only",
                "bytes read, from memory", "bytes read, from the caches"):
        assert row in out
    # The shared-prefix step: 32 sequences of 560-608 positions, the first 512 shared.
    cached = 8331 if not step else sum(512 + 48 + 48 * i // 31 for i in range(32))
    assert out.startswith(f"32 sequences, {cached} cached tokens"), out


def test_cpu_decode_attention_benchmark_prefill_quick_prints_every_chunk(
    run_benchmark: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PAGEFLEET_ATTENTION", raising=False)
    out = run_benchmark("cpu_decode_attention.py", "--prefill", "--quick")
    rows = [line.split() for line in out.splitlines() if line[:6].strip().isdigit()]
    assert [(r[0], r[1]) for r in rows] == [("2", "0"), ("16", "0"), ("100", "0"), ("400", "0"),
                                            ("40", "512"), ("64", "512")]
    assert all(r[4].endswith("x") and float(r[4][:-1]) > 0 for r in rows)
