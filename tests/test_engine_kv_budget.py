"""The default KV pool on CPU: a share of the host's available memory, capped at what
the engine can ever hold."""

from __future__ import annotations

import pytest

from pagefleet import LLM
from pagefleet.worker.config import EngineConfig, available_host_memory, default_cpu_kv_bytes


def test_default_cpu_pool_holds_every_sequence_at_full_length_when_memory_allows() -> None:
    llm = LLM(model="tiny", max_num_seqs=4, max_model_len=256)
    assert llm.stats()["total"] == 4 * 256 // 16


def test_default_cpu_budget_is_the_configured_share_of_available_memory() -> None:
    config = EngineConfig(cpu_kv_memory_fraction=0.05)
    before = available_host_memory()
    budget = default_cpu_kv_bytes(config, bytes_per_token=1 << 20, max_model_len=1 << 20)
    after = available_host_memory()
    assert before is not None and after is not None
    # Other processes allocate meanwhile: the share lies between the two readings.
    assert min(before, after) * 0.05 * 0.9 <= budget <= max(before, after) * 0.05 * 1.1


@pytest.mark.parametrize("fraction", [0.0, 0.95, -0.1])
def test_a_cpu_kv_memory_fraction_outside_its_range_is_refused(fraction: float) -> None:
    with pytest.raises(ValueError, match=r"cpu_kv_memory_fraction must be in \(0, 0.9\]"):
        EngineConfig(cpu_kv_memory_fraction=fraction)
