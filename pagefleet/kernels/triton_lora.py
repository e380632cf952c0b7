# Triton kernel parameters cannot carry Python type hints (annotations steer specialization).
# mypy: disable-error-code="no-untyped-def"
"""Triton SGMV: the LoRA delta of a packed batch, one slot's segment per program row.

`_sgmv_kernel` computes ``out[t] (+)= scale[s] * x[t] @ w[s]^T`` for the tokens
`t` of each segment (the tokens of slot `s`, gathered through `token_order`),
one ``BLOCK_M x BLOCK_N`` tile of a segment per program. `add_lora_triton`
runs it twice: shrink (``x @ A^T`` into a float32 ``[tokens, rank]`` scratch)
and expand (``scale * v @ B^T`` added into the projection's output).
Accumulation is float32 (IEEE, no TF32) whatever the model dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagefleet.kernels.lora import LoRASegments
from pagefleet.kernels.triton_common import ensure_launchable

BLOCK_M = 16
BLOCK_K = 32


@triton.jit
def _sgmv_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    scale_ptr,
    order_ptr,
    starts_ptr,
    lens_ptr,
    slots_ptr,
    n_out,
    n_in,
    stride_xt,
    stride_ws,
    stride_wn,
    stride_ot,
    ACCUMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    seg = tl.program_id(0)
    m_block = tl.program_id(1)
    n_block = tl.program_id(2)
    length = tl.load(lens_ptr + seg)
    if m_block * BLOCK_M >= length:
        return
    start = tl.load(starts_ptr + seg)
    slot = tl.load(slots_ptr + seg).to(tl.int64)
    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < length
    tokens = tl.load(order_ptr + start + rows, mask=row_mask, other=0)
    cols = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_out
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_base = w_ptr + slot * stride_ws
    for k0 in range(0, n_in, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < n_in
        x = tl.load(
            x_ptr + tokens[:, None] * stride_xt + ks[None, :],
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        # w[s] is [n_out, n_in] row-major: the tile [BLOCK_K, BLOCK_N] is its transpose.
        w = tl.load(
            w_base + cols[None, :] * stride_wn + ks[:, None],
            mask=k_mask[:, None] & col_mask[None, :],
            other=0.0,
        )
        acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    acc = acc * tl.load(scale_ptr + slot).to(tl.float32)
    out_ptrs = out_ptr + tokens[:, None] * stride_ot + cols[None, :]
    mask = row_mask[:, None] & col_mask[None, :]
    if ACCUMULATE:
        acc += tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _sgmv(
    out: torch.Tensor,
    x: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor,
    segments: LoRASegments,
    accumulate: bool,
) -> None:
    n_out, n_in = w.shape[1], w.shape[2]
    block_n = max(16, min(64, triton.next_power_of_2(n_out)))
    grid = (
        len(segments.slots),
        triton.cdiv(segments.max_len, BLOCK_M),
        triton.cdiv(n_out, block_n),
    )
    _sgmv_kernel[grid](
        x,
        w,
        out,
        scale,
        segments.token_order,
        segments.starts_t,
        segments.lens_t,
        segments.slots_t,
        n_out,
        n_in,
        x.stride(0),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        ACCUMULATE=accumulate,
        BLOCK_M=BLOCK_M,
        BLOCK_N=block_n,
        BLOCK_K=BLOCK_K,
    )


def add_lora_triton(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scale: torch.Tensor,
    segments: LoRASegments,
) -> None:
    """`pagefleet.kernels.lora.add_lora` on the Triton kernel (same arguments, in place)."""
    ensure_launchable(_sgmv_kernel, x)
    if x.stride(1) != 1 or y.stride(1) != 1:
        raise ValueError("add_lora_triton needs x and y with contiguous rows")
    a, b = lora_a.contiguous(), lora_b.contiguous()
    ones = torch.ones(a.shape[0], dtype=torch.float32, device=x.device)
    shrunk = torch.zeros((x.shape[0], a.shape[1]), dtype=torch.float32, device=x.device)
    _sgmv(shrunk, x, a, ones, segments, accumulate=False)
    _sgmv(y, shrunk, b, scale, segments, accumulate=True)
