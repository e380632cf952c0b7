"""benchmarks/lora.py's smoke mode runs end to end (so the script cannot rot)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "lora.py"


@pytest.mark.slow
def test_lora_smoke_prints_the_ratio_table_and_equals_hf_peft() -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke"],
        capture_output=True, text=True, timeout=900, check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "4 adapters, mixed batch" in result.stdout
    assert "HF + PEFT, set_adapter per request" in result.stdout
    assert "4-adapter outputs equal to HF + PEFT: 8/8" in result.stdout
    assert "adapter load into a slot:" in result.stdout and "prefilled blocks" in result.stdout
