"""The torch paged-attention reference (the test oracle) against a naive float64 oracle."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from pagefleet.kernels import paged_attention, paged_attention_reference
from pagefleet.kernels.split_policy import (
    MAX_SPLITS,
    MIN_TOKENS_PER_SPLIT,
    SPLITS_ENV,
    choose_num_splits,
)
from pagefleet.kernels.testing import PagedBatch, make_paged_batch, naive_attention

TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5}


def run_reference(batch: PagedBatch, sliding_window: int | None = None) -> torch.Tensor:
    out = torch.full_like(batch.query, float("nan"))
    scale = batch.query.shape[-1] ** -0.5
    paged_attention_reference(*batch.kernel_args(), scale, sliding_window=sliding_window, out=out)
    return out


def assert_matches_oracle(batch: PagedBatch, sliding_window: int | None = None) -> None:
    out = run_reference(batch, sliding_window)
    expected = naive_attention(batch, batch.query.shape[-1] ** -0.5, sliding_window)
    tol = TOLERANCE[batch.query.dtype]
    assert not torch.isnan(out).any(), "some output element was never written"
    torch.testing.assert_close(out.to(torch.float64), expected, rtol=tol, atol=tol)


def batch(
    q_lens: list[int],
    ctx_lens: list[int],
    dtype: torch.dtype = torch.float32,
    *,
    q_heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 64,
    block_size: int = 8,
    shared_prefix_blocks: int = 0,
    seed: int = 0,
) -> PagedBatch:
    return make_paged_batch(
        q_lens,
        ctx_lens,
        num_q_heads=q_heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        shared_prefix_blocks=shared_prefix_blocks,
        seed=seed,
    )


DTYPES = [torch.float32, torch.float64]


@pytest.mark.parametrize("dtype", DTYPES)
def test_pure_decode_matches_oracle(dtype: torch.dtype) -> None:
    assert_matches_oracle(batch([1, 1, 1, 1], [1, 9, 23, 64], dtype, seed=1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_first_chunk_without_cached_context_matches_oracle(dtype: torch.dtype) -> None:
    assert_matches_oracle(batch([13, 8, 1], [13, 8, 1], dtype, seed=2))


@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_prefill_chunks_and_decode_match_oracle(dtype: torch.dtype) -> None:
    assert_matches_oracle(batch([1, 12, 1, 5, 1], [30, 40, 7, 5, 17], dtype, seed=3))


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("delta", [-1, 0, 1])
def test_context_lengths_at_block_boundaries_match_oracle(block_size: int, delta: int) -> None:
    ctx = [block_size + delta, 2 * block_size + delta, 3 * block_size + delta]
    assert_matches_oracle(batch([1, 3, 2 * block_size + delta], ctx, block_size=block_size, seed=4))


@pytest.mark.parametrize("dtype", DTYPES)
def test_blocks_shared_by_several_sequences_match_oracle(dtype: torch.dtype) -> None:
    b = batch([1, 4, 1], [26, 33, 17], dtype, shared_prefix_blocks=2, seed=5)
    assert b.block_tables[0, :2].tolist() == b.block_tables[1, :2].tolist()
    assert_matches_oracle(b)


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_gqa_ratios_and_head_dims_match_oracle(group: int, head_dim: int) -> None:
    b = batch([1, 6, 1], [19, 24, 40], q_heads=2 * group, head_dim=head_dim, seed=6)
    assert_matches_oracle(b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [1, 5, 16])
def test_sliding_window_matches_oracle(dtype: torch.dtype, window: int) -> None:
    assert_matches_oracle(batch([1, 9, 1, 20], [30, 21, 4, 20], dtype, seed=7), window)


def test_window_wider_than_context_equals_full_attention() -> None:
    b = batch([1, 9], [30, 21], seed=8)
    torch.testing.assert_close(run_reference(b, sliding_window=1000), run_reference(b))


def test_bfloat16_reference_is_close_to_oracle() -> None:
    b = batch([1, 7, 1], [12, 20, 33], torch.bfloat16, seed=9)
    out = run_reference(b)
    expected = naive_attention(b, 64**-0.5)
    torch.testing.assert_close(out.to(torch.float64), expected, rtol=2e-2, atol=2e-2)


def test_output_is_written_into_given_tensor() -> None:
    b = batch([2, 1], [10, 5], seed=10)
    out = torch.full_like(b.query, float("nan"))
    result = paged_attention_reference(*b.kernel_args(), 0.125, out=out)
    assert result.data_ptr() == out.data_ptr()


def test_dispatcher_runs_the_reference_when_forced_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEFLEET_ATTENTION", "torch")
    b = batch([3, 1], [11, 6], torch.float64, seed=11)
    out = paged_attention(*b.kernel_args(), 0.125)
    expected = paged_attention_reference(*b.kernel_args(), 0.125)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_unknown_backend_override_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEFLEET_ATTENTION", "cuda-magic")
    b = batch([1], [4], seed=12)
    with pytest.raises(ValueError, match="expected one of triton, torch"):
        paged_attention(*b.kernel_args(), 0.125)


def test_q_heads_not_a_multiple_of_kv_heads_is_rejected() -> None:
    b = batch([1], [4], q_heads=4, kv_heads=2, seed=13)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        _, k_cache, v_cache, tables, qsl, ctx = b.kernel_args()
        paged_attention_reference(b.query[:, :3], k_cache, v_cache, tables, qsl, ctx, 0.125)


def test_importing_kernels_does_not_import_triton_ray_or_transformers() -> None:
    import subprocess
    import sys

    code = (
        "import sys, pagefleet.kernels as k\n"
        "bad = [m for m in ('triton', 'ray', 'transformers') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    root = str(Path(__file__).resolve().parent.parent)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH")))),
    }
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_split_policy_keeps_single_pass_when_the_grid_fills_the_device() -> None:
    assert (
        choose_num_splits(
            num_programs=512, max_context_len=32768, num_sms=132, single_query_block=True
        )
        == 1
    )


def test_split_policy_keeps_single_pass_for_prefill_chunks() -> None:
    assert (
        choose_num_splits(
            num_programs=8, max_context_len=32768, num_sms=132, single_query_block=False
        )
        == 1
    )


def test_split_policy_splits_long_decode_of_few_sequences() -> None:
    splits = choose_num_splits(
        num_programs=8, max_context_len=32768, num_sms=132, single_query_block=True
    )
    assert splits == MAX_SPLITS


def test_split_policy_keeps_at_least_min_tokens_per_split() -> None:
    splits = choose_num_splits(
        num_programs=8, max_context_len=1024, num_sms=132, single_query_block=True
    )
    assert splits == 1024 // MIN_TOKENS_PER_SPLIT


def test_split_policy_can_be_forced_by_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SPLITS_ENV, "3")
    assert (
        choose_num_splits(
            num_programs=10_000, max_context_len=16, num_sms=132, single_query_block=False
        )
        == 3
    )


def test_zero_sliding_window_is_rejected() -> None:
    b = batch([1], [4], seed=14)
    with pytest.raises(ValueError, match="sliding_window must be >= 1"):
        paged_attention_reference(*b.kernel_args(), 0.125, sliding_window=0)


def test_reference_works_inside_and_then_outside_inference_mode() -> None:
    # The CPU path reuses gather buffers across calls; one made under
    # inference_mode must stay writable by a later ordinary call.
    b = batch([1, 3], [700, 650], seed=15)  # a context longer than earlier tests' buffers
    with torch.inference_mode():
        inside = run_reference(b)
    with torch.no_grad():
        outside = run_reference(b)
    torch.testing.assert_close(inside, outside, rtol=0, atol=0)


def test_reference_supports_autograd_inputs() -> None:
    b = batch([2], [9], seed=16)
    query = b.query.clone().requires_grad_(True)
    _, k_cache, v_cache, tables, qsl, ctx = b.kernel_args()
    out = paged_attention_reference(query, k_cache, v_cache, tables, qsl, ctx, 0.125)
    out.sum().backward()
    assert query.grad is not None and torch.isfinite(query.grad).all()
