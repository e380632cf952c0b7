"""The router latency benchmark runs in its smoke mode (so it cannot rot)."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "router_latency.py"


def test_router_latency_smoke_prints_a_row_per_policy(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "--smoke"])
    with pytest.raises(SystemExit) as info:
        runpy.run_path(str(SCRIPT), run_name="__main__")
    assert info.value.code == 0
    out = capsys.readouterr().out
    for policy in ("prefix_affinity", "round_robin", "least_loaded", "power_of_two"):
        assert f"| {policy} |" in out
    assert "vs round_robin" in out
