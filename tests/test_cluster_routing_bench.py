"""The routing benchmark's smoke mode runs end to end (so the script cannot rot)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(300)]

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "routing.py"


def test_routing_benchmark_smoke_prints_a_row_per_policy(
    capsys: pytest.CaptureFixture[str],
) -> None:
    spec = importlib.util.spec_from_file_location("routing_bench", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    assert module.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if line.split()}
    for policy in ("prefix_affinity", "round_robin", "least_loaded"):
        assert policy in rows
        hit_rate = float(rows[policy].split()[1].rstrip("%"))
        assert 0.0 <= hit_rate <= 100.0
