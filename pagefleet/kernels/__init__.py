"""Paged KV kernels: write new K/V into cache slots and attend through block tables.

KV layout of one layer: ``k_cache``/``v_cache`` ``[num_blocks, block_size,
kv_heads, head_dim]``; ``slot = block_id * block_size + offset``. CUDA tensors
run Triton kernels; CPU tensors run the per-sequence CPU path (`cpu_attention`);
the padded torch reference is the test oracle.
This package imports torch only; triton is imported when a Triton kernel runs.
"""

from __future__ import annotations

from pagefleet.kernels.dispatch import choose_backend, paged_attention, write_kv
from pagefleet.kernels.reference import paged_attention_reference, write_kv_reference

__all__ = [
    "choose_backend",
    "paged_attention",
    "paged_attention_reference",
    "write_kv",
    "write_kv_reference",
]
