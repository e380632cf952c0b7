"""The Triton paged-attention kernels against a naive float64 oracle.

On a machine with CUDA the kernels run on the GPU (and bf16 is checked too);
elsewhere they run under the Triton interpreter on CPU, which is slow, so the
shapes here are small. TRITON_INTERPRET is read when a kernel is decorated,
that is when its module is first imported, so it is set before that import.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ON_CUDA = torch.cuda.is_available()
if not ON_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from pagefleet.kernels import paged_attention  # noqa: E402
from pagefleet.kernels.testing import PagedBatch, make_paged_batch, naive_attention  # noqa: E402
from pagefleet.kernels.triton_attention import paged_attention_triton  # noqa: E402

DEVICE = "cuda" if ON_CUDA else "cpu"
ROOT = Path(__file__).resolve().parent.parent
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def batch(
    q_lens: list[int],
    ctx_lens: list[int],
    dtype: torch.dtype = torch.float32,
    *,
    q_heads: int = 4,
    kv_heads: int = 1,
    head_dim: int = 64,
    block_size: int = 8,
    shared_prefix_blocks: int = 0,
    seed: int = 0,
    kv_dtype: torch.dtype | None = None,
) -> PagedBatch:
    return make_paged_batch(
        q_lens,
        ctx_lens,
        num_q_heads=q_heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        kv_dtype=kv_dtype,
        device=DEVICE,
        shared_prefix_blocks=shared_prefix_blocks,
        seed=seed,
    )


def run_triton(
    b: PagedBatch, num_splits: int = 1, sliding_window: int | None = None
) -> torch.Tensor:
    out = torch.full_like(b.query, float("nan"))
    scale = b.query.shape[-1] ** -0.5
    paged_attention_triton(
        *b.kernel_args(), scale, sliding_window=sliding_window, num_splits=num_splits, out=out
    )
    return out


def assert_matches_oracle(
    b: PagedBatch, num_splits: int = 1, sliding_window: int | None = None
) -> None:
    out = run_triton(b, num_splits, sliding_window)
    expected = naive_attention(b, b.query.shape[-1] ** -0.5, sliding_window)
    assert not torch.isnan(out).any(), "some output element was never written"
    tol = TOLERANCE[b.query.dtype]
    torch.testing.assert_close(out.cpu().to(torch.float64), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_pure_decode_matches_oracle(dtype: torch.dtype) -> None:
    assert_matches_oracle(batch([1, 1, 1], [1, 9, 30], dtype, seed=1))


def test_first_chunk_without_cached_context_matches_oracle() -> None:
    assert_matches_oracle(batch([11, 4], [11, 4], seed=2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_mixed_prefill_chunks_and_decode_match_oracle(dtype: torch.dtype) -> None:
    assert_matches_oracle(batch([1, 9, 1, 3], [20, 25, 7, 3], dtype, seed=3))


@pytest.mark.parametrize("block_size", [8, 32])
@pytest.mark.parametrize("delta", [-1, 0, 1])
def test_context_lengths_at_block_boundaries_match_oracle(block_size: int, delta: int) -> None:
    ctx = [block_size + delta, 2 * block_size + delta]
    assert_matches_oracle(batch([1, 3], ctx, block_size=block_size, seed=4))


def test_blocks_shared_by_several_sequences_match_oracle() -> None:
    b = batch([1, 3, 1], [18, 21, 17], shared_prefix_blocks=2, seed=5)
    assert b.block_tables[0, :2].tolist() == b.block_tables[2, :2].tolist()
    assert_matches_oracle(b)


@pytest.mark.parametrize("group", [1, 4, 8])
def test_gqa_ratios_match_oracle(group: int) -> None:
    assert_matches_oracle(batch([1, 5], [14, 19], q_heads=group, kv_heads=1, seed=6))


@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_head_dims_including_non_powers_of_two_match_oracle(head_dim: int) -> None:
    assert_matches_oracle(batch([1, 4], [12, 17], head_dim=head_dim, seed=7))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_split_kv_matches_oracle_and_single_pass(dtype: torch.dtype) -> None:
    b = batch([1, 1], [45, 70], dtype, q_heads=2, seed=8)
    assert_matches_oracle(b, num_splits=3)
    split, single = run_triton(b, num_splits=3), run_triton(b, num_splits=1)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(split, single, rtol=tol, atol=tol)


def test_split_kv_with_more_splits_than_tiles_matches_oracle() -> None:
    # Some splits get no positions at all and must not disturb the reduce.
    assert_matches_oracle(batch([1, 1], [5, 20], q_heads=2, seed=9), num_splits=4)


def test_split_kv_handles_prefill_chunks() -> None:
    assert_matches_oracle(batch([3, 1], [35, 9], q_heads=2, seed=10), num_splits=2)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_sliding_window_matches_oracle(num_splits: int) -> None:
    b = batch([1, 6, 1], [40, 22, 5], q_heads=2, seed=11)
    assert_matches_oracle(b, num_splits=num_splits, sliding_window=10)


def test_host_hints_do_not_change_the_result() -> None:
    b = batch([1, 4], [17, 9], seed=12)
    scale = 64**-0.5
    hinted = paged_attention_triton(
        *b.kernel_args(), scale, max_query_len=4, max_context_len=17, num_splits=1
    )
    torch.testing.assert_close(hinted, run_triton(b), rtol=0, atol=0)


def test_dispatcher_runs_triton_when_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEFLEET_ATTENTION", "triton")
    monkeypatch.setenv("PAGEFLEET_KV_SPLITS", "1")
    b = batch([1, 2], [6, 11], seed=13)
    out = paged_attention(*b.kernel_args(), 64**-0.5)
    expected = naive_attention(b, 64**-0.5)
    torch.testing.assert_close(out.cpu().to(torch.float64), expected, rtol=1e-5, atol=1e-5)


def test_float64_is_rejected_with_the_supported_dtypes() -> None:
    b = batch([1], [4], torch.float64, seed=14)
    with pytest.raises(ValueError, match="fp16/bf16/fp32"):
        paged_attention_triton(*b.kernel_args(), 0.125)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_float16_cache_under_float32_queries_matches_oracle_on_the_rounded_kv(
    num_splits: int,
) -> None:
    # kv_cache_dtype "float16" on a float32 model: the kernel widens K/V as it loads them.
    b = batch([1, 6, 1], [40, 22, 5], q_heads=4, kv_heads=2, seed=16, kv_dtype=torch.float16)
    assert b.k_cache.dtype == torch.float16
    assert_matches_oracle(b, num_splits=num_splits)


def test_a_cache_wider_than_the_query_is_rejected() -> None:
    b = batch([1], [4], torch.float16, seed=17, kv_dtype=torch.float32)
    with pytest.raises(ValueError, match="float16/bfloat16"):
        paged_attention_triton(*b.kernel_args(), 0.125)


@pytest.mark.skipif(not ON_CUDA, reason="the Triton interpreter mishandles bf16; CUDA only")
def test_bfloat16_on_cuda_matches_oracle() -> None:
    assert_matches_oracle(batch([1, 7, 1], [40, 33, 300], torch.bfloat16, kv_heads=2, seed=15))


@pytest.mark.skipif(not ON_CUDA, reason="a long context is too slow for the interpreter")
def test_default_split_choice_on_cuda_matches_oracle() -> None:
    b = batch([1], [5000], torch.float16, q_heads=8, kv_heads=1, block_size=16, seed=16)
    out = paged_attention_triton(*b.kernel_args(), 64**-0.5)
    expected = naive_attention(b, 64**-0.5)
    torch.testing.assert_close(out.cpu().to(torch.float64), expected, rtol=2e-3, atol=2e-3)


def test_compiled_triton_kernels_on_cpu_tensors_fail_with_a_clear_message() -> None:
    code = (
        "import os, torch\n"
        "os.environ.pop('TRITON_INTERPRET', None)\n"
        "from pagefleet.kernels.triton_write_kv import write_kv_triton\n"
        "c = torch.zeros(2, 4, 1, 16)\n"
        "try:\n"
        "    write_kv_triton(torch.ones(1, 1, 16), torch.ones(1, 1, 16), c, c.clone(), torch.tensor([0]))\n"
        "except RuntimeError as e:\n"
        "    assert 'TRITON_INTERPRET=1' in str(e), e\n"
        "else:\n"
        "    raise SystemExit('no error')\n"
    )
    env = without_interpreter_env()
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_kernels_compile_for_a_gpu_target_without_a_gpu() -> None:
    # The interpreter runs kernels as numpy and accepts code the compiler rejects;
    # compiling for sm_90 catches that here. A fresh process: the interpreter
    # patches triton.language while it runs, which breaks the compiler.
    env = without_interpreter_env()
    proc = subprocess.run(
        [sys.executable, "-m", "pagefleet.kernels.compile_check"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    if proc.returncode == 3:
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("compiled") == 6, proc.stdout


def without_interpreter_env() -> dict[str, str]:
    """This process's environment for a child that compiles kernels for a GPU."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env
