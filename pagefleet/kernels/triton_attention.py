# Triton kernel parameters cannot carry Python type hints (annotations steer specialization).
# mypy: disable-error-code="no-untyped-def"
"""Triton paged attention: a single-pass kernel and a split-KV (flash-decoding) variant.

One program owns (sequence, query block, kv head[, KV split]). Its rows are the
``BLOCK_Q`` query tokens x ``GROUP`` q heads that share the kv head (GQA), so
each K/V tile is loaded once for the whole group. It walks the sequence's
context in tiles of ``BLOCK_N`` positions, looking each position's physical
block up in the block table (tiles need not align with pages, and any block
size works), and keeps an online softmax in fp32. Head dims that are not powers
of two are padded to the next one with masked loads.

With ``num_splits > 1`` each program covers one contiguous chunk of the context
and writes a normalised partial output plus its log-sum-exp; a second kernel
combines the chunks. Logs are base 2 throughout (``exp2``/``log2`` are cheaper).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from pagefleet.kernels.split_policy import choose_num_splits
from pagefleet.kernels.triton_common import ensure_launchable

# Nominal multiprocessor count when the kernels run under the CPU interpreter.
INTERPRETER_SMS = 4


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    context_lens_ptr,
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_co,
    stride_ch,
    stride_bt,
    stride_pt,
    stride_ph,
    stride_ps,
    stride_lt,
    stride_lh,
    num_q_blocks,
    sliding_window,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    seq = pid // num_q_blocks
    q_block = pid % num_q_blocks
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= q_len:
        return
    ctx = tl.load(context_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_M)
    q_idx = q_block * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
    q_pos = ctx - q_len + q_idx
    token = (q_start + q_idx).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < HEAD_DIM

    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=row_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )

    # Causal range of this program: up to its last query's position; with a
    # window, from its first query's window start.
    last_q = tl.minimum(q_len - 1, q_block * BLOCK_Q + BLOCK_Q - 1)
    kv_end = ctx - q_len + last_q + 1
    kv_start = 0
    if USE_WINDOW:
        kv_start = tl.maximum(0, ctx - q_len + q_block * BLOCK_Q - sliding_window + 1)
    lo = kv_start
    hi = kv_end
    if NUM_SPLITS > 1:
        tiles_per_split = tl.cdiv(tl.cdiv(kv_end - kv_start, BLOCK_N), NUM_SPLITS)
        lo = kv_start + split * tiles_per_split * BLOCK_N
        hi = tl.minimum(kv_end, lo + tiles_per_split * BLOCK_N)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    head_off = kv_head * stride_ch

    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pos_valid = pos < hi
        block = tl.load(table_row + pos // PAGE_SIZE, mask=pos_valid, other=0).to(tl.int64)
        kv_off = block * stride_cb + (pos % PAGE_SIZE) * stride_co + head_off
        kv_mask = pos_valid[:, None] & dim_valid[None, :]
        # A narrower cache (kv_cache_dtype) is converted to the query's dtype as it is read.
        k = tl.load(k_cache_ptr + kv_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        k = k.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        visible = pos_valid[None, :] & (pos[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            visible = visible & (pos[None, :] > q_pos[:, None] - sliding_window)
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen nothing yet keeps m = -inf; subtract 0 instead so
        # exp2 gives 0 rather than NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    result = acc / l_safe[:, None]
    store_mask = row_valid[:, None] & dim_valid[None, :]
    if NUM_SPLITS == 1:
        tl.store(
            out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
            result.to(out_ptr.dtype.element_ty),
            mask=store_mask,
        )
    else:
        partial = token[:, None] * stride_pt + head[:, None] * stride_ph + split * stride_ps
        tl.store(partial_out_ptr + partial + dims[None, :], result, mask=store_mask)
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        tl.store(
            partial_lse_ptr + token * stride_lt + head * stride_lh + split, lse, mask=row_valid
        )


@triton.jit
def _reduce_splits_kernel(
    partial_out_ptr,
    partial_lse_ptr,
    out_ptr,
    stride_pt,
    stride_ph,
    stride_ps,
    stride_lt,
    stride_lh,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    split_valid = splits < NUM_SPLITS
    lse = tl.load(
        partial_lse_ptr + token * stride_lt + head * stride_lh + splits,
        mask=split_valid,
        other=float("-inf"),
    )
    # At least one split holds the token's own position, so the max is finite.
    weights = tl.exp2(lse - tl.max(lse, 0))
    dims = tl.arange(0, BLOCK_D)
    partial = tl.load(
        partial_out_ptr
        + token * stride_pt
        + head * stride_ph
        + splits[:, None] * stride_ps
        + dims[None, :],
        mask=split_valid[:, None] & (dims[None, :] < HEAD_DIM),
        other=0.0,
    )
    result = tl.sum(partial * weights[:, None], 0) / tl.sum(weights, 0)
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + dims,
        result.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


def paged_attention_triton(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    max_query_len: int | None = None,
    max_context_len: int | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Triton ``paged_attention``; same contract as the dispatcher's.

    ``num_splits`` forces the number of KV splits (1 = single pass); by default
    ``choose_num_splits`` decides from the grid size and the device's
    multiprocessor count. The ``max_*`` hints avoid a device-to-host sync.
    """
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    _validate(query, k_cache, v_cache, num_q_heads, num_kv_heads, head_dim, sliding_window)
    ensure_launchable(_paged_attention_kernel, query)
    if out is None:
        out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    num_seqs = context_lens.shape[0]
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    group = num_q_heads // num_kv_heads
    block_m, block_n, num_warps = tile_sizes(query.is_cuda, group, max_query_len, head_dim)
    block_q = block_m // group
    num_q_blocks = triton.cdiv(max_query_len, block_q)

    if num_splits is None:
        single_block = num_q_blocks == 1
        num_programs = num_seqs * num_q_blocks * num_kv_heads
        if single_block and max_context_len is None:
            max_context_len = int(context_lens.max())
        num_splits = choose_num_splits(
            num_programs, max_context_len or 0, _num_sms(query.device), single_block
        )

    if num_splits > 1:
        partial_out = torch.empty(
            (num_tokens, num_q_heads, num_splits, head_dim),
            dtype=torch.float32,
            device=query.device,
        )
        partial_lse = torch.empty(
            (num_tokens, num_q_heads, num_splits), dtype=torch.float32, device=query.device
        )
    else:
        # Unused by the single-pass kernel, but every pointer argument needs a tensor.
        partial_out = out
        partial_lse = out

    block_d = max(triton.next_power_of_2(head_dim), 16)
    grid = (num_seqs * num_q_blocks, num_kv_heads, num_splits)
    _paged_attention_kernel[grid](
        query,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        context_lens,
        out,
        partial_out,
        partial_lse,
        scale * math.log2(math.e),
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        partial_out.stride(0),
        partial_out.stride(1),
        partial_out.stride(2) if num_splits > 1 else 0,
        partial_lse.stride(0),
        partial_lse.stride(1),
        num_q_blocks,
        sliding_window or 0,
        HEAD_DIM=head_dim,
        PAGE_SIZE=k_cache.shape[1],
        GROUP=group,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        NUM_SPLITS=num_splits,
        USE_WINDOW=sliding_window is not None,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
    )
    if num_splits > 1:
        _reduce_splits_kernel[(num_tokens, num_q_heads)](
            partial_out,
            partial_lse,
            out,
            partial_out.stride(0),
            partial_out.stride(1),
            partial_out.stride(2),
            partial_lse.stride(0),
            partial_lse.stride(1),
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            NUM_SPLITS=num_splits,
            SPLITS_PAD=triton.next_power_of_2(num_splits),
            BLOCK_D=block_d,
        )
    return out


def _validate(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    sliding_window: int | None,
) -> None:
    if query.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"Triton paged attention takes fp16/bf16/fp32, got {query.dtype}")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache is {k_cache.dtype}, v_cache {v_cache.dtype}")
    if k_cache.dtype != query.dtype and k_cache.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(
            f"cache dtype {k_cache.dtype} with query dtype {query.dtype}: a cache must be the "
            "query's dtype or float16/bfloat16"
        )
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same shape and strides")
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"q_heads ({num_q_heads}) must be a multiple of kv_heads ({num_kv_heads})")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 (or None), got {sliding_window}")
    if not 16 <= head_dim <= 256:
        raise ValueError(f"head_dim must be within 16..256, got {head_dim}")
    if query.stride(-1) != 1 or k_cache.stride(-1) != 1:
        raise ValueError("query and caches need a unit stride on head_dim")


def tile_sizes(on_gpu: bool, group: int, max_query_len: int, head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_M rows, BLOCK_N positions per tile, num_warps) for one call.

    On sm_90 these compile without register spills for head dims up to 256
    (checked with ptxas in tests/test_kernels_triton.py).
    """
    # tl.dot needs at least 16 rows; a row block must hold a whole GQA group.
    min_rows = max(16, triton.next_power_of_2(group))
    if not on_gpu:
        # The interpreter's cost grows with tile size, not with program count.
        return min_rows, 16, 1
    if max_query_len * group <= min_rows:
        block_m = min_rows  # decode: one tile of rows covers every query of a sequence
    else:
        block_m = max(min_rows, 64 if head_dim > 128 else 128)
    block_n = 32 if head_dim > 128 else 64
    # Keep the fp32 accumulator (block_m x padded head dim) within the registers of the warps.
    acc_elements = block_m * triton.next_power_of_2(head_dim)
    return block_m, block_n, 4 if acc_elements <= 64 * 128 else 8


@functools.cache
def _num_sms_of(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETER_SMS
    return _num_sms_of(device.index if device.index is not None else torch.cuda.current_device())
