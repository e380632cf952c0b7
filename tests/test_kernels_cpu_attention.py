"""The CPU paged attention (the CPU serving path) against the float64 oracle.

Every oracle check runs both paths: the C kernel (`cpu_decode`, the default,
for every token) and, with it switched off, one SDPA call per sequence.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from pagefleet.kernels import cpu_attention, cpu_decode, paged_attention
from pagefleet.kernels.cpu_attention import paged_attention_cpu
from pagefleet.kernels.reference import paged_attention_reference
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
    expected = naive_attention(b, b.query.shape[-1] ** -0.5, sliding_window)
    tol = TOLERANCE[b.query.dtype]
    for switch in ("on", "off"):  # the C decode kernel, then one SDPA call per sequence
        os.environ[cpu_decode.SWITCH_ENV] = switch
        try:
            out = torch.full_like(b.query, float("nan"))
            paged_attention_cpu(*b.kernel_args(), b.query.shape[-1] ** -0.5,
                                sliding_window=sliding_window, out=out)
        finally:
            del os.environ[cpu_decode.SWITCH_ENV]
        assert not torch.isnan(out).any(), f"decode kernel {switch}: an element never written"
        torch.testing.assert_close(out.to(torch.float64), expected, rtol=tol, atol=tol,
                                   msg=lambda m, switch=switch: f"decode kernel {switch}: {m}")


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


# A float16/bfloat16 cache under float32 queries (kv_cache_dtype): the oracle reads
# the same rounded K/V, so what remains is float32 rounding of the same math.
NARROW = [torch.float16, torch.bfloat16]


def narrow_batch(q_lens: list[int], ctx_lens: list[int], kv_dtype: torch.dtype, *,
                 seed: int, block_size: int = 8) -> PagedBatch:
    return make_paged_batch(q_lens, ctx_lens, num_q_heads=6, num_kv_heads=2, head_dim=32,
                            block_size=block_size, dtype=torch.float32, kv_dtype=kv_dtype,
                            seed=seed)


def widened(b: PagedBatch) -> PagedBatch:
    """The same batch with its caches widened to float32: the same rounded values."""
    return dataclasses.replace(b, k_cache=b.k_cache.float(), v_cache=b.v_cache.float())


@pytest.mark.parametrize("kv_dtype", NARROW)
@pytest.mark.parametrize("layout", [lambda b: b, consecutive], ids=["scattered", "consecutive"])
@pytest.mark.parametrize("window", [None, 6])
def test_narrow_cache_matches_the_oracle_on_the_rounded_kv(
    kv_dtype: torch.dtype, layout: Callable[[PagedBatch], PagedBatch], window: int | None
) -> None:
    # 13 decode sequences (two buckets, one part full) around prefill chunks.
    q_lens = [1, 12, 1, 1, 5, 1, 1, 1, 9, 1, 1, 1, 1, 1, 1, 1]
    ctx = [30, 40, 7, 1, 5, 17, 64, 9, 9, 33, 2, 16, 8, 50, 21, 3]
    assert_matches_oracle(layout(narrow_batch(q_lens, ctx, kv_dtype, seed=21)), window)


@pytest.mark.parametrize("kv_dtype", NARROW)
def test_narrow_cache_differs_from_the_float32_path_only_by_summation_order(
    kv_dtype: torch.dtype,
) -> None:
    q_lens = [1, 7, 1, 1, 3, 1, 1, 1, 1, 1, 1]
    b = narrow_batch(q_lens, [19, 7, 40, 3, 28, 11, 8, 65, 24, 16, 5], kv_dtype, seed=22)
    wide = widened(b)
    got = paged_attention_cpu(*b.kernel_args(), 0.125)
    reference = paged_attention_reference(*wide.kernel_args(), 0.125)
    per_sequence = paged_attention_cpu(*wide.kernel_args(), 0.125)
    prefill = torch.cat([torch.arange(s, s + n) for s, n in
                         zip(b.query_start_loc[:-1].tolist(), q_lens, strict=True) if n > 1])
    # Prefill chunks run the same per-sequence SDPA on the same float32 values: identical.
    assert torch.equal(got[prefill], per_sequence[prefill])
    # Decode tokens run the C kernel: float32 rounding of the same sums (a few ulp
    # of the largest |v|), no more.
    bound = 8 * torch.finfo(torch.float32).eps * float(wide.v_cache.abs().nan_to_num().max())
    torch.testing.assert_close(got, reference, rtol=0, atol=bound)


def test_a_narrow_cache_step_serves_layers_of_different_windows() -> None:
    b = narrow_batch([1] * 10, [3, 30, 12, 9, 41, 17, 5, 26, 8, 33], torch.float16, seed=23)
    for window in (None, 4, None, 4):  # layers of a mixed-window model share one step plan
        assert_matches_oracle(b, window)


# ----- the C decode kernel itself -------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("q_heads", "kv_heads", "head_dim"), [
    (9, 3, 64), (4, 2, 128), (3, 3, 24), (4, 1, 20),
], ids=["gqa-64", "gqa-128", "mha-24", "mqa-20-no-kernel"])  # fmt: skip
def test_every_head_shape_matches_oracle(
    dtype: torch.dtype, q_heads: int, kv_heads: int, head_dim: int
) -> None:
    # 64 and 128 run the kernel's specialised bodies, 24 its general one; 20 is no
    # multiple of its 8 lanes, so those decode tokens take SDPA.
    b = make_paged_batch([1, 1, 6, 1, 1], [37, 16, 6, 1, 90], num_q_heads=q_heads,
                         num_kv_heads=kv_heads, head_dim=head_dim, block_size=16, dtype=dtype,
                         seed=head_dim)
    assert cpu_decode.shape_fits(kv_heads, head_dim) == (head_dim % 8 == 0)
    assert_matches_oracle(b)
    assert_matches_oracle(b, sliding_window=7)


@pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler")
def test_the_decode_kernel_builds_here_and_serves_every_dtype_pair_it_names() -> None:
    for q_dtype, kv_dtype in [(torch.float32, torch.float32), (torch.float32, torch.float16),
                              (torch.float32, torch.bfloat16), (torch.float64, torch.float64)]:
        assert cpu_decode.decode_kernel(q_dtype, kv_dtype) is not None, (q_dtype, kv_dtype)
    # Half-precision queries keep the SDPA path (it computes in float32 there).
    assert cpu_decode.decode_kernel(torch.bfloat16, torch.bfloat16) is None


@pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler")
@pytest.mark.parametrize("window", [None, 6])
def test_the_kernel_takes_prefill_chunks_too_with_no_sdpa_call(
    window: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A first prefill chunk, a chunk after cached context, decode tokens, shared blocks.
    b = batch([9, 1, 12, 1, 5], [9, 30, 40, 17, 21], shared_prefix_blocks=1, seed=21)

    def no_sdpa(*args: object, **kwargs: object) -> None:
        raise AssertionError("SDPA was called: the kernel should have taken every token")

    monkeypatch.setattr(cpu_attention.F, "scaled_dot_product_attention", no_sdpa)
    out = paged_attention_cpu(*b.kernel_args(), 32**-0.5, sliding_window=window)
    torch.testing.assert_close(out.to(torch.float64), naive_attention(b, 32**-0.5, window),
                               rtol=1e-5, atol=1e-5)


def test_the_l1_data_cache_size_is_read_from_sysfs(tmp_path: Path) -> None:
    caches = {"index0": ("1", "Data", "48K"), "index1": ("1", "Instruction", "32K"),
              "index2": ("2", "Unified", "1024K"), "index3": ("3", "Unified", "32768K")}
    for index, (level, kind, size) in caches.items():
        (tmp_path / index).mkdir()
        for name, text in (("level", level), ("type", kind), ("size", size)):
            (tmp_path / index / name).write_text(text + "\n")
    assert cpu_decode.l1_data_cache_bytes(tmp_path) == 48 * 1024
    (tmp_path / "index0" / "size").write_text("1M\n")
    assert cpu_decode.l1_data_cache_bytes(tmp_path) == 1 << 20
    # No sysfs (not Linux), or no level-1 data cache in it: not known.
    assert cpu_decode.l1_data_cache_bytes(tmp_path / "absent") is None
    shutil.rmtree(tmp_path / "index0")
    assert cpu_decode.l1_data_cache_bytes(tmp_path) is None


def test_the_next_block_goes_to_l1_only_on_a_cpu_with_a_48_kib_l1_or_more() -> None:
    assert cpu_decode.prefetch_into_l1(48 * 1024)
    assert cpu_decode.prefetch_into_l1(64 * 1024)
    assert not cpu_decode.prefetch_into_l1(32 * 1024)
    assert not cpu_decode.prefetch_into_l1(None)  # L1 size not known: L2


@pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler")
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_prefetching_into_l1_or_l2_gives_the_same_bits(
    kv_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    # SmolLM2's heads and blocks; decode tokens, a first prefill chunk and one after
    # cached context, blocks scattered and shared.
    b = make_paged_batch([1, 20, 1, 7, 1], [70, 20, 33, 50, 16], num_q_heads=9, num_kv_heads=3,
                         head_dim=64, block_size=16, dtype=torch.float32, kv_dtype=kv_dtype,
                         shared_prefix_blocks=1, seed=5)
    outs = []
    for l1_bytes in (48 * 1024, 32 * 1024):  # into L1; into L2
        monkeypatch.setattr(cpu_decode, "this_cpu_l1_data_cache_bytes", lambda l1_bytes=l1_bytes: l1_bytes)
        assert cpu_decode.prefetch_into_l1(l1_bytes) == (l1_bytes == 48 * 1024)
        outs.append(paged_attention_cpu(*b.kernel_args(), 64**-0.5))
    assert torch.equal(outs[0], outs[1])
    torch.testing.assert_close(outs[0].to(torch.float64), naive_attention(widened(b), 64**-0.5),
                               rtol=1e-5, atol=1e-5)


@pytest.fixture
def fresh_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty kernel cache, and the library built again on first use (then restored)."""
    monkeypatch.setenv("PAGEFLEET_CACHE_DIR", str(tmp_path))
    cpu_decode.library.cache_clear()
    yield tmp_path
    cpu_decode.library.cache_clear()


def test_a_compiler_that_fails_leaves_decode_on_the_sdpa_path(
    fresh_build: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CC", "false")  # found on PATH, exits 1
    b = batch([1, 4, 1], [19, 9, 33], torch.float32, seed=14)
    with caplog.at_level(logging.WARNING, logger=cpu_decode.__name__):
        assert cpu_decode.decode_kernel(torch.float32, torch.float32) is None
        assert_matches_oracle(b)
    warnings = [r.getMessage() for r in caplog.records if r.name == cpu_decode.__name__]
    assert len(warnings) == 1 and "building the CPU decode kernel failed" in warnings[0]
    assert "exited 1" in warnings[0]
    assert not list(fresh_build.glob("kernels/*.so"))  # nothing half-written left behind


@pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler")
def test_the_kernel_is_built_once_into_the_cache_and_reused(fresh_build: Path) -> None:
    assert cpu_decode.decode_kernel(torch.float32, torch.float32) is not None
    built = list(fresh_build.glob("kernels/cpu_decode-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    cpu_decode.library.cache_clear()  # a new process on the same node
    assert cpu_decode.decode_kernel(torch.float64, torch.float64) is not None
    assert [p.stat().st_mtime_ns for p in fresh_build.glob("kernels/*.so")] == [stamp]


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
@pytest.mark.parametrize("refused", ["-march=native", "-fopenmp"])
def test_a_compiler_refusing_march_native_or_openmp_builds_without_it(
    refused: str, fresh_build: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wrapper = fresh_build / "cc-refusing"
    wrapper.write_text(
        "#!/bin/sh\n"
        f'for a in "$@"; do [ "$a" = {refused} ] && {{ echo "no {refused}" >&2; exit 1; }}; done\n'
        'exec cc "$@"\n'
    )
    wrapper.chmod(0o755)
    monkeypatch.setenv("CC", str(wrapper))
    assert cpu_decode.decode_kernel(torch.float32, torch.float32) is not None
    assert_matches_oracle(batch([1, 3, 1], [21, 8, 40], torch.float32, seed=15))


def outputs_on_threads(b: PagedBatch, thread_counts: tuple[int, ...]) -> list[torch.Tensor]:
    """The kernel's output for `b` with torch set to each thread count in turn."""
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in thread_counts:
            torch.set_num_threads(threads)
            outs.append(paged_attention_cpu(*b.kernel_args(), b.query.shape[-1] ** -0.5))
    finally:
        torch.set_num_threads(before)
    return outs


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_decode_kernel_gives_the_same_bits_on_one_thread_or_several(dtype: torch.dtype) -> None:
    # Sequences are shared out over torch's threads; each is computed whole by one.
    b = batch([1] * 9, [3, 40, 7, 65, 9, 17, 1, 33, 24], dtype, seed=21)
    outs = outputs_on_threads(b, (1, 2, 3))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    torch.testing.assert_close(outs[0].to(torch.float64), naive_attention(b, 32**-0.5),
                               rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("q_heads", "kv_heads", "head_dim", "block_size"), [
    (6, 2, 32, 8), (9, 3, 64, 16), (4, 4, 32, 32), (8, 2, 64, 16), (4, 2, 16, 24),
    (4, 2, 32, 4),
], ids=["gqa3-block8", "smollm2", "mha-block32", "gqa4", "gqa2-block24", "tiny-block4"])  # fmt: skip
def test_a_prefill_chunk_gives_each_row_the_bits_of_that_row_alone(
    dtype: torch.dtype, q_heads: int, kv_heads: int, head_dim: int, block_size: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The kernel takes a chunk's rows in tiles (8 rows per K/V block read), each row's
    # arithmetic its own: a recompute that runs decoded tokens as a prefill chunk gets
    # the numbers they had, on any number of threads. (SDPA, the path without the
    # kernel, gives a chunk's rows other bits.) The shapes reach every way the kernel
    # splits its work: whole groups of 16 positions' scores (blocks of 16 and 32) and
    # cut ones, and the values' bundles of 3 pairs of one row's heads (GQA 3), of
    # three rows (MHA), across rows (GQA 2 and 4) and a last short one; blocks of 4
    # (the tiny model's in some tests) end a tile's shorter rows a block or more before
    # its longest.
    monkeypatch.setenv(cpu_decode.SWITCH_ENV, "on")
    b = make_paged_batch([21], [53], num_q_heads=q_heads, num_kv_heads=kv_heads,
                         head_dim=head_dim, block_size=block_size, dtype=dtype, seed=13)
    chunks = outputs_on_threads(b, (1, 3))
    assert torch.equal(chunks[0], chunks[1])
    cached = b.ctx_lens[0] - b.q_lens[0]
    for i in range(b.q_lens[0]):
        alone = paged_attention_cpu(
            b.query[i : i + 1], b.k_cache, b.v_cache, b.block_tables,
            torch.tensor([0, 1], dtype=torch.int32),
            torch.tensor([cached + i + 1], dtype=torch.int32), head_dim**-0.5,
        )  # fmt: skip
        assert torch.equal(alone[0], chunks[0][i]), f"row {i} of the chunk"


def reblocked(b: PagedBatch, block_size: int) -> PagedBatch:
    """The same sequences' K/V in a pool of `block_size`-position blocks, one run each."""
    kv_heads, head_dim = b.k_cache.shape[2], b.k_cache.shape[3]
    counts = [-(-ctx // block_size) for ctx in b.ctx_lens]
    shape = (sum(counts), block_size, kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=b.k_cache.dtype)
    v_cache = torch.full(shape, float("nan"), dtype=b.k_cache.dtype)
    tables = torch.zeros(len(counts), max(counts), dtype=torch.int32)
    first = 0
    for i, (ctx, n) in enumerate(zip(b.ctx_lens, counts, strict=True)):
        tables[i, :n] = torch.arange(first, first + n, dtype=torch.int32)
        k_cache.view(-1, kv_heads, head_dim)[first * block_size : first * block_size + ctx] = (
            b.keys[i].to(b.k_cache.dtype))
        v_cache.view(-1, kv_heads, head_dim)[first * block_size : first * block_size + ctx] = (
            b.values[i].to(b.k_cache.dtype))
        first += n
    return dataclasses.replace(b, k_cache=k_cache, v_cache=v_cache, block_tables=tables)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_kernel_gives_the_same_bits_whatever_the_block_size(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A row's scores go 16 positions at a time (8 without AVX-512, 4 in float64), in
    # registers where a block holds the whole group, else through a scratch row; both
    # give the same sums. Blocks of 4 and 8 cut every group of 16, blocks of 16 and 32
    # none; and the values' bundles split otherwise at each block's end.
    monkeypatch.setenv(cpu_decode.SWITCH_ENV, "on")
    b = make_paged_batch([1, 1, 19, 1], [64, 37, 70, 5], num_q_heads=9, num_kv_heads=3,
                         head_dim=64, block_size=8, dtype=dtype, seed=23)
    outs = [paged_attention_cpu(*reblocked(b, size).kernel_args(), 64**-0.5)
            for size in (8, 4, 16, 32)]  # fmt: skip
    assert all(torch.equal(outs[0], out) for out in outs[1:])
    torch.testing.assert_close(outs[0].to(torch.float64), naive_attention(b, 64**-0.5),
                               rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
