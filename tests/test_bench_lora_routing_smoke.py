"""benchmarks/lora_routing.py's smoke mode runs end to end on a real local cluster (so the
script cannot rot)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(600)]

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "lora_routing.py"


def test_lora_routing_smoke_prints_a_row_per_policy_against_adapter_blind() -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke"],
        capture_output=True, text=True, timeout=540, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    # The table is printed after each row, then once more at the end: the last lines win.
    rows = {
        line.split(" | ")[0].removeprefix("| "): line
        for line in result.stdout.splitlines()
        if line.startswith(("| adapter-", "| round_robin"))
    }
    assert set(rows) == {"adapter-aware", "adapter-blind"}
    for line in rows.values():
        hit_rate = float(line.split(" | ")[1].rstrip("%"))
        assert 0.0 <= hit_rate <= 100.0
    assert rows["adapter-blind"].endswith("| 1.00x | 1.00x | 1.00x | 1.00x | 1.00x |")
