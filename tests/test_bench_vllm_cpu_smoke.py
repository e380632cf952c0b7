"""The vLLM CPU benchmark's smoke mode runs end to end without vLLM (the suite does not
install it: vLLM's start-up alone takes minutes); its pagefleet rows and the skip note print."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from smollm2 import smollm2_gguf

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "vllm_cpu.py"


def run_smoke(*extra: str) -> str:
    smollm2_gguf()  # skips, saying how to install it, when the model is absent
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", *extra],
        capture_output=True, text=True, timeout=900, check=False,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    return result.stdout


@pytest.mark.slow
@pytest.mark.timeout(960)
def test_without_vllm_pagefleet_rows_print_and_the_peer_is_skipped_with_a_note(
    tmp_path: Path,
) -> None:
    out = run_smoke("--vllm-python", str(tmp_path / "no-such-python"), "--breakdown")
    assert "vLLM: skipped, no Python at" in out
    for workload in ("mixed", "shared-prefix"):
        assert re.search(rf"round 1: pagefleet defaults +{workload} ", out)
        # wall s, prefill s, decode ms/step: the last the difference of two timings, which
        # a loaded machine can make negative at 4 output tokens.
        assert re.search(rf"pagefleet defaults +{workload} +[0-9.]+ +[0-9.]+ +-?[0-9.]+", out)
        assert f"pagefleet's step on {workload}, part by part" in out
    assert "pagefleet and vLLM CPU (best of rounds by wall clock)" in out
    assert re.search(r"linear layers \(matmuls\) +[0-9.]+ +[0-9.]+%", out)

