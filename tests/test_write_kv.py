"""write_kv: new keys and values land in their slots, and slot -1 writes nothing.

The torch path always runs; the Triton kernel runs on CUDA when present, else
under the Triton interpreter on CPU (skipped only where triton is not installed).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Read when a kernel is decorated, i.e. when its module is first imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pagefleet.kernels import write_kv, write_kv_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NUM_BLOCKS, BLOCK_SIZE, KV_HEADS = 6, 8, 2


def triton_write_kv() -> object:
    pytest.importorskip("triton")
    from pagefleet.kernels.triton_write_kv import write_kv_triton

    return write_kv_triton


def empty_caches(head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    kv = torch.full(
        (2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, head_dim), float("nan"), dtype=dtype, device=DEVICE
    )
    return kv[0], kv[1]


def round_trip(
    writer: object, head_dim: int, dtype: torch.dtype, seed: int, cache_dtype: torch.dtype | None = None
) -> None:
    """Write random K/V of `dtype` into caches of `cache_dtype` (default the same): each
    written slot holds the K/V rounded to the cache dtype, every other slot is untouched."""
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=gen)[:20]
    slots[[3, 11, 17]] = -1
    key = torch.randn(20, KV_HEADS, head_dim, generator=gen).to(dtype=dtype, device=DEVICE)
    value = torch.randn(20, KV_HEADS, head_dim, generator=gen).to(dtype=dtype, device=DEVICE)
    k_cache, v_cache = empty_caches(head_dim, cache_dtype or dtype)
    writer(key, value, k_cache, v_cache, slots.to(DEVICE))  # type: ignore[operator]

    written = slots >= 0
    k_flat = k_cache.reshape(-1, KV_HEADS, head_dim).cpu()
    v_flat = v_cache.reshape(-1, KV_HEADS, head_dim).cpu()
    stored = k_cache.dtype
    torch.testing.assert_close(k_flat[slots[written]], key[written].to(stored).cpu(), rtol=0, atol=0)
    torch.testing.assert_close(v_flat[slots[written]], value[written].to(stored).cpu(), rtol=0, atol=0)
    untouched = torch.ones(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool)
    untouched[slots[written]] = False
    assert torch.isnan(k_flat[untouched]).all(), "a skipped or unrelated slot was written"
    assert torch.isnan(v_flat[untouched]).all(), "a skipped or unrelated slot was written"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_reference_round_trip_skips_slot_minus_one(dtype: torch.dtype) -> None:
    round_trip(write_kv_reference, 64, dtype, seed=1)


@pytest.mark.parametrize("head_dim", [64, 80])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_round_trip_skips_slot_minus_one(head_dim: int, dtype: torch.dtype) -> None:
    round_trip(triton_write_kv(), head_dim, dtype, seed=2)


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
def test_reference_rounds_float32_kv_into_a_narrow_cache(cache_dtype: torch.dtype) -> None:
    round_trip(write_kv_reference, 64, torch.float32, seed=4, cache_dtype=cache_dtype)


def test_triton_rounds_float32_kv_into_a_float16_cache() -> None:
    round_trip(triton_write_kv(), 64, torch.float32, seed=5, cache_dtype=torch.float16)


def test_dispatcher_writes_through_default_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGEFLEET_ATTENTION", raising=False)
    round_trip(write_kv, 32, torch.float32, seed=3)


def test_int32_slot_mapping_is_accepted() -> None:
    k_cache, v_cache = empty_caches(32, torch.float32)
    key = torch.randn(2, KV_HEADS, 32, device=DEVICE)
    slots = torch.tensor([5, -1], dtype=torch.int32, device=DEVICE)
    write_kv_reference(key, key, k_cache, v_cache, slots)
    torch.testing.assert_close(k_cache[0, 5], key[0])


def test_writes_into_a_layer_view_of_the_whole_pool() -> None:
    pool = torch.zeros(3, 2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, 16, device=DEVICE)
    key = torch.randn(1, KV_HEADS, 16, device=DEVICE)
    write_kv_reference(key, -key, pool[1, 0], pool[1, 1], torch.tensor([9], device=DEVICE))
    torch.testing.assert_close(pool[1, 0, 1, 1], key[0])
    torch.testing.assert_close(pool[1, 1, 1, 1], -key[0])
    assert pool[0].abs().sum() == 0 and pool[2].abs().sum() == 0


def test_non_contiguous_cache_is_rejected_rather_than_written_to_a_copy() -> None:
    k_cache = torch.zeros(NUM_BLOCKS, KV_HEADS, BLOCK_SIZE, 16, device=DEVICE).transpose(1, 2)
    key = torch.randn(1, KV_HEADS, 16, device=DEVICE)
    with pytest.raises(RuntimeError):
        write_kv_reference(key, key, k_cache, k_cache, torch.tensor([0], device=DEVICE))
