"""The default KV pool on CPU: a share of the host's available memory, capped at what
the engine can ever hold."""

from __future__ import annotations

import pytest
import torch

from pagefleet import LLM
from pagefleet.worker.config import EngineConfig, available_host_memory, default_cpu_kv_bytes


def test_default_cpu_pool_holds_every_sequence_at_full_length_when_memory_allows() -> None:
    llm = LLM(model="tiny", max_num_seqs=4, max_model_len=256)
    assert llm.stats().total == 4 * 256 // 16


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


def test_a_float16_kv_cache_holds_twice_the_blocks_of_a_float32_model_in_one_budget() -> None:
    budget = 4 * 2**20
    wide = LLM(model="tiny", kv_memory_bytes=budget)
    narrow = LLM(model="tiny", kv_memory_bytes=budget, kv_cache_dtype="float16")
    assert narrow.engine.kv.cache.tensor.dtype == torch.float16
    assert narrow.stats().total == 2 * wide.stats().total
    assert narrow.engine.kv.cache.nbytes <= budget


def test_an_unknown_kv_cache_dtype_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \('auto', 'float16'"):
        EngineConfig(kv_cache_dtype="fp8")
