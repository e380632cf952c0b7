"""benchmarks/structured.py's smoke mode runs end to end (so the script cannot rot)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "structured.py"


@pytest.mark.slow
def test_structured_smoke_prints_the_mixed_batch_ratio() -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke"],
        capture_output=True, text=True, timeout=600, check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "mixed: 2 of 4 under the schema" in result.stdout
    assert "mixed batch tokens/s vs unconstrained:" in result.stdout
