# Triton kernel parameters cannot carry Python type hints (annotations steer specialization).
# mypy: disable-error-code="no-untyped-def"
"""Triton kernel that scatters new keys and values into paged cache slots.

One program per token: it reads the token's slot, returns at once for slot -1
(padding), and copies ``kv_heads * head_dim`` elements of key and value.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagefleet.kernels.triton_common import ensure_launchable


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_co,
    stride_ch,
    block_size,
    head_dim,
    num_elements,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // block_size
    offset = slot % block_size
    cache_base = block * stride_cb + offset * stride_co
    for start in range(0, num_elements, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        mask = idx < num_elements
        head = idx // head_dim
        dim = idx % head_dim
        k = tl.load(key_ptr + token * stride_kt + head * stride_kh + dim, mask=mask)
        v = tl.load(value_ptr + token * stride_vt + head * stride_vh + dim, mask=mask)
        dst = cache_base + head * stride_ch + dim
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Triton version of ``write_kv``; same arguments and semantics (slot -1 skipped)."""
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same shape and strides")
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    ensure_launchable(_write_kv_kernel, k_cache)
    # The head dim must be the innermost, unit-stride axis everywhere; heads and
    # tokens may be strided (e.g. slices of a fused qkv projection).
    for name, t in (("key", key), ("value", value), ("k_cache", k_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a unit stride on head_dim, got {t.stride()}")
    num_elements = num_kv_heads * head_dim
    block = min(triton.next_power_of_2(num_elements), 2048)
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        k_cache.shape[1],
        head_dim,
        num_elements,
        BLOCK=block,
    )
