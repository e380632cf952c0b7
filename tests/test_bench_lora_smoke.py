"""benchmarks/lora.py's smoke mode runs end to end (so the script cannot rot)."""

from __future__ import annotations

from collections.abc import Callable

import pytest


@pytest.mark.slow
def test_lora_smoke_prints_the_ratio_table_and_equals_hf_peft(run_benchmark: Callable[..., str]) -> None:
    out = run_benchmark("lora.py", "--smoke")
    assert "4 adapters, mixed batch" in out
    assert "HF + PEFT, set_adapter per request" in out
    assert "4-adapter outputs equal to HF + PEFT: 8/8" in out
    assert "adapter load into a slot:" in out and "prefilled blocks" in out
