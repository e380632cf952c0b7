"""The fleet-scale benchmark runs on a tiny fleet (so it cannot rot)."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "fleet_scale.py"


def test_fleet_scale_prints_a_column_per_shard_count_and_a_row_per_hash_range(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = ["--workers", "20", "--pools", "4", "--cached", "50", "--rounds", "1", "--routes", "20",
            "--shards", "1,2,4", "--hash-ranges", "1,2", "--reps", "2"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), *argv])
    with pytest.raises(SystemExit) as info:
        runpy.run_path(str(SCRIPT), run_name="__main__")
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "| measure | 1 shard | 2 shards | 4 shards |" in out
    # 4 pools of 5 workers: the real assignment puts whole pools on each shard.
    assert "| workers per shard (max) | 20 | 10 | 5 |" in out
    assert "| index memory, all shards (MiB) |" in out
    assert "| 1 |" in out and "| 2 |" in out  # the hash-range rows
