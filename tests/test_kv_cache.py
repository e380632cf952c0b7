"""KV pool tensors: shape, sizing from a budget, batched block copy and swap."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from pagefleet.worker.block_pool import BlockPool
from pagefleet.worker.block_table import BlockTable
from pagefleet.worker.kv_cache import KVCache, ModelShape, blocks_for_budget, parse_dtype

SHAPE = ModelShape(num_layers=3, num_kv_heads=2, head_dim=4, dtype=torch.float32)


def random_cache(num_blocks: int = 6, block_size: int = 4) -> KVCache:
    kv = KVCache(SHAPE, num_blocks, block_size)
    kv.tensor.copy_(torch.randn(kv.tensor.shape, generator=torch.Generator().manual_seed(0)))
    return kv


def test_bytes_per_token_is_layers_kv_heads_head_dim_two_dtype_bytes() -> None:
    shape = ModelShape(32, 8, 128, torch.bfloat16)
    assert shape.bytes_per_token == 32 * 8 * 128 * 2 * 2
    assert shape.bytes_per_block(16) == 16 * shape.bytes_per_token


@pytest.mark.parametrize("field", ["num_layers", "num_kv_heads", "head_dim"])
def test_model_shape_rejects_non_positive_sizes(field: str) -> None:
    sizes = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 1, field: 0}
    with pytest.raises(ValueError, match=field):
        ModelShape(sizes["num_layers"], sizes["num_kv_heads"], sizes["head_dim"])


def test_model_shape_accepts_a_dtype_name() -> None:
    assert ModelShape(1, 1, 1, "bf16").dtype == torch.bfloat16  # type: ignore[arg-type]


def test_unknown_dtype_name_is_rejected_with_the_choices() -> None:
    with pytest.raises(ValueError, match="float16"):
        parse_dtype("float13")


def test_shape_from_hf_config_object_with_gqa() -> None:
    config = LlamaConfig(
        hidden_size=256, num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=4
    )
    assert ModelShape.from_hf_config(config, "float16") == ModelShape(4, 2, 32, torch.float16)


def test_shape_from_config_dict_prefers_explicit_head_dim() -> None:
    config = {
        "hidden_size": 256,
        "num_attention_heads": 8,
        "num_hidden_layers": 2,
        "head_dim": 64,
        "torch_dtype": "bfloat16",
    }
    assert ModelShape.from_hf_config(config) == ModelShape(2, 8, 64, torch.bfloat16)


def test_shape_from_config_without_layer_count_is_rejected() -> None:
    with pytest.raises(ValueError, match="num_hidden_layers"):
        ModelShape.from_hf_config({"hidden_size": 8})


def test_pool_tensor_has_the_documented_layout() -> None:
    kv = KVCache(SHAPE, num_blocks=5, block_size=8)
    assert kv.tensor.shape == (3, 2, 5, 8, 2, 4)
    assert kv.tensor.dtype == torch.float32
    assert kv.nbytes == 5 * SHAPE.bytes_per_block(8)
    assert not kv.tensor.any()


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads Linux's /proc")
def test_a_cpu_pool_is_zeroed_and_takes_memory_only_for_the_blocks_written() -> None:
    shape = ModelShape(num_layers=16, num_kv_heads=8, head_dim=128, dtype=torch.float32)
    before = _resident_bytes()
    kv = KVCache(shape, 1024, 16)  # 2 GiB
    assert kv.nbytes == 2 << 30
    assert _resident_bytes() - before < 64 << 20  # not written, so not resident
    k, v = kv.layer(3)
    k[7].fill_(1.5)  # one block of one layer: 64 KiB
    assert _resident_bytes() - before < 64 << 20
    assert not k[:4].any() and not v[-4:].any() and float(k[7].sum()) == 1.5 * k[7].numel()


def test_layer_returns_views_into_the_pool() -> None:
    kv = KVCache(SHAPE, 4, 4)
    k, v = kv.layer(1)
    assert k.shape == (4, 4, 2, 4)
    k[2, 3].fill_(1.0)
    v[0, 0].fill_(2.0)
    assert kv.tensor[1, 0, 2, 3].eq(1.0).all() and kv.tensor[1, 1, 0, 0].eq(2.0).all()


def test_from_budget_fits_whole_blocks_only() -> None:
    per_block = SHAPE.bytes_per_block(4)
    kv = KVCache.from_budget(SHAPE, 7 * per_block + per_block - 1, block_size=4)
    assert kv.num_blocks == 7


def test_budget_below_one_block_is_rejected_with_the_block_size_in_bytes() -> None:
    per_block = SHAPE.bytes_per_block(4)
    with pytest.raises(ValueError, match=f"needs {per_block} bytes"):
        blocks_for_budget(SHAPE, per_block - 1, 4)


def test_copy_blocks_copies_every_layer_and_reads_sources_before_writing() -> None:
    kv = random_cache()
    before = kv.tensor.clone()
    kv.copy_blocks([(1, 4), (4, 1), (2, 5)])  # 1 <-> 4 swap: sources read first
    assert torch.equal(kv.tensor[:, :, 4], before[:, :, 1])
    assert torch.equal(kv.tensor[:, :, 1], before[:, :, 4])
    assert torch.equal(kv.tensor[:, :, 5], before[:, :, 2])
    assert torch.equal(kv.tensor[:, :, [0, 2, 3]], before[:, :, [0, 2, 3]])


def test_swap_out_then_in_restores_blocks_exactly() -> None:
    kv = random_cache()
    before = kv.tensor.clone()
    host = kv.swap_out([3, 0])
    assert host.device.type == "cpu" and host.shape == (2, 3, 2, 4, 2, 4)
    kv.tensor.zero_()
    kv.swap_in(host, [3, 0])
    assert torch.equal(kv.tensor[:, :, [3, 0]], before[:, :, [3, 0]])


def test_swap_in_to_other_blocks_moves_the_data_there() -> None:
    kv = random_cache()
    before = kv.tensor.clone()
    host = kv.swap_out([0, 1])
    kv.swap_in(host, [4, 5])
    assert torch.equal(kv.tensor[:, :, [4, 5]], before[:, :, [0, 1]])


def test_swap_out_is_a_copy_not_a_view() -> None:
    kv = random_cache()
    host = kv.swap_out([2])
    saved = host.clone()
    kv.tensor.zero_()
    assert torch.equal(host, saved)


def test_swap_in_with_the_wrong_block_count_is_rejected() -> None:
    kv = random_cache()
    host = kv.swap_out([0, 1])
    with pytest.raises(ValueError, match="expected"):
        kv.swap_in(host, [2])


def test_copy_on_write_gives_the_fork_the_parents_kv() -> None:
    pool = BlockPool(6, 4)
    kv = KVCache(SHAPE, 6, 4)
    flat_k = kv.tensor[0, 0].view(-1, 2, 4)  # [slots, heads, dim] of layer 0 keys
    parent = BlockTable(pool)
    slots = parent.append_slots(6).slots
    flat_k[slots] = torch.arange(6, dtype=torch.float32)[:, None, None] + 1
    child = parent.fork()
    result = child.append_slots(1)
    kv.copy_blocks(result.copies)
    flat_k[result.slots] = -1.0
    child_tokens = torch.stack([flat_k[child.slot(p)] for p in range(7)])
    parent_tokens = torch.stack([flat_k[parent.slot(p)] for p in range(6)])
    assert torch.equal(child_tokens[:6], parent_tokens)
    assert child_tokens[6].eq(-1.0).all()
    parent.free()
    child.free()
    pool.check_integrity()
    stats = pool.stats()
    assert stats.free + stats.cached == stats.total
