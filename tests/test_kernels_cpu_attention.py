"""The per-sequence CPU paged attention (the CPU serving path) against the float64 oracle."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

from pagefleet.kernels import paged_attention
from pagefleet.kernels.cpu_attention import paged_attention_cpu
from pagefleet.kernels.testing import PagedBatch, make_paged_batch, naive_attention

TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5}
DTYPES = [torch.float32, torch.float64]


def batch(q_lens: list[int], ctx_lens: list[int], dtype: torch.dtype = torch.float64,
          *, seed: int = 0, shared_prefix_blocks: int = 0, block_size: int = 8) -> PagedBatch:
    return make_paged_batch(q_lens, ctx_lens, num_q_heads=6, num_kv_heads=2, head_dim=32,
                            block_size=block_size, dtype=dtype,
                            shared_prefix_blocks=shared_prefix_blocks, seed=seed)


def consecutive(b: PagedBatch) -> PagedBatch:
    """The same batch with each sequence's blocks moved to one run of consecutive ids."""
    block_size = b.k_cache.shape[1]
    tables = b.block_tables.clone()
    order: list[int] = []
    for i, ctx in enumerate(b.ctx_lens):
        n = -(-ctx // block_size)
        tables[i, :n] = torch.arange(len(order), len(order) + n, dtype=tables.dtype)
        order += b.block_tables[i, :n].tolist()
    index = torch.tensor(order)
    return dataclasses.replace(b, k_cache=b.k_cache[index], v_cache=b.v_cache[index],
                               block_tables=tables)


def assert_matches_oracle(b: PagedBatch, sliding_window: int | None = None) -> None:
    out = torch.full_like(b.query, float("nan"))
    paged_attention_cpu(*b.kernel_args(), b.query.shape[-1] ** -0.5,
                        sliding_window=sliding_window, out=out)
    expected = naive_attention(b, b.query.shape[-1] ** -0.5, sliding_window)
    tol = TOLERANCE[b.query.dtype]
    assert not torch.isnan(out).any(), "some output element was never written"
    torch.testing.assert_close(out.to(torch.float64), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", [lambda b: b, consecutive], ids=["scattered", "consecutive"])
def test_decode_prefill_and_chunks_after_cached_context_match_oracle(
    dtype: torch.dtype, layout: Callable[[PagedBatch], PagedBatch]
) -> None:
    b = batch([1, 12, 1, 5, 9, 1], [30, 40, 7, 5, 9, 17], dtype, seed=3)
    assert_matches_oracle(layout(b))


@pytest.mark.parametrize("window", [1, 5, 16])
def test_sliding_window_matches_oracle(window: int) -> None:
    b = batch([1, 9, 1, 20], [30, 21, 4, 20], seed=7)
    assert_matches_oracle(b, window)
    assert_matches_oracle(consecutive(b), window)


def test_blocks_shared_by_several_sequences_match_oracle() -> None:
    assert_matches_oracle(batch([1, 4, 1], [26, 33, 17], shared_prefix_blocks=2, seed=5))


@pytest.mark.parametrize("delta", [-1, 0, 1])
def test_context_lengths_at_block_boundaries_match_oracle(delta: int) -> None:
    ctx = [16 + delta, 32 + delta, 48 + delta]
    assert_matches_oracle(consecutive(batch([1, 3, 32 + delta], ctx, block_size=16, seed=4)))


def test_bfloat16_is_close_to_oracle() -> None:
    b = batch([1, 7, 1], [12, 20, 33], torch.bfloat16, seed=9)
    out = paged_attention_cpu(*b.kernel_args(), 32**-0.5)
    torch.testing.assert_close(out.to(torch.float64), naive_attention(b, 32**-0.5),
                               rtol=2e-2, atol=2e-2)


def test_a_changed_block_table_is_planned_again() -> None:
    b = batch([1, 1], [9, 17], seed=12)
    paged_attention_cpu(*b.kernel_args(), 0.125)
    moved = consecutive(b)
    used = moved.k_cache.shape[0]
    b.k_cache[:used] = moved.k_cache  # same tensors, edited in place, as an engine would
    b.v_cache[:used] = moved.v_cache
    b.block_tables.copy_(moved.block_tables)
    assert_matches_oracle(b)


def test_dispatcher_runs_the_cpu_path_for_cpu_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGEFLEET_ATTENTION", raising=False)
    b = batch([3, 1], [11, 6], seed=11)
    expected = paged_attention_cpu(*b.kernel_args(), 0.125)
    torch.testing.assert_close(paged_attention(*b.kernel_args(), 0.125), expected, rtol=0, atol=0)
