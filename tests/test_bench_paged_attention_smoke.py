"""The kernel benchmarks run end to end, so the scripts cannot rot."""

from __future__ import annotations

from collections.abc import Callable

import pytest


def test_kernels_benchmark_smoke_prints_a_passing_table(
    run_benchmark: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PAGEFLEET_ATTENTION", raising=False)
    monkeypatch.delenv("PAGEFLEET_KV_SPLITS", raising=False)
    out = run_benchmark("paged_attention.py", "--smoke")  # Triton in its interpreter (conftest)
    lines = out.splitlines()
    assert any(line.startswith("shape") and "paged/sdpa" in line for line in lines)
    assert any(line.startswith("decode b4 ctx128") and " PASS " in line for line in lines)
    assert any(line.startswith("triton interp") and " PASS " in line for line in lines)
    assert "FAIL" not in out


def test_cpu_decode_attention_benchmark_quick_prints_every_row(
    run_benchmark: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PAGEFLEET_ATTENTION", raising=False)
    out = run_benchmark("cpu_decode_attention.py", "--quick")
    for row in ("float32 KV (auto)", "float16 KV", "slot gather only", "SDPA only",
                "bytes read, from memory", "bytes read, from the caches"):
        assert row in out


def test_cpu_decode_attention_benchmark_prefill_quick_prints_every_chunk(
    run_benchmark: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PAGEFLEET_ATTENTION", raising=False)
    out = run_benchmark("cpu_decode_attention.py", "--prefill", "--quick")
    rows = [line.split() for line in out.splitlines() if line[:6].strip().isdigit()]
    assert [(r[0], r[1]) for r in rows] == [("2", "0"), ("16", "0"), ("100", "0"), ("400", "0"),
                                            ("40", "512"), ("64", "512")]
    assert all(r[4].endswith("x") and float(r[4][:-1]) > 0 for r in rows)
