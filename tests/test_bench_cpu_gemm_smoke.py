"""The GEMM benchmark's --quick mode runs end to end (so the script cannot rot)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from pagefleet.worker.cpu_linear import MKL, ONEDNN, available_backends


@pytest.mark.skipif(
    not {MKL, ONEDNN} <= set(available_backends()),
    reason="torch lacks MKL's or oneDNN's packed GEMM here",
)
def test_cpu_gemm_quick_prints_every_method_with_its_identity_check(
    run_benchmark: Callable[..., str],
) -> None:
    out = run_benchmark("cpu_gemm.py", "--quick", "--threads", "1")
    for row in ("plain F.linear", "fused q/k/v, gate/up", "pagefleet's on Intel",
                "pagefleet's elsewhere", "LM head, plain"):
        assert row in out
    assert "bit-identical to F.linear" in out
