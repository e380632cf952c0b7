"""Pick the implementation of each kernel: Triton for CUDA tensors, the CPU path elsewhere.

``PAGEFLEET_ATTENTION=triton|torch|cpu`` overrides the choice (tests use ``triton``
with ``TRITON_INTERPRET=1`` to run the Triton kernels on CPU; ``torch`` is the
padded reference, the test oracle; ``cpu`` the per-sequence CPU path). Triton modules
are imported only when they are chosen, so ``import pagefleet.kernels`` works
where triton is not installed (macOS laptops).
"""

from __future__ import annotations

import importlib.util
import os

import torch

from pagefleet.kernels.cpu_attention import paged_attention_cpu
from pagefleet.kernels.reference import paged_attention_reference, write_kv_reference

BACKEND_ENV = "PAGEFLEET_ATTENTION"
_BACKENDS = ("triton", "torch", "cpu")


def triton_available() -> bool:
    """True when the triton package can be imported on this machine."""
    return importlib.util.find_spec("triton") is not None


def choose_backend(tensor: torch.Tensor) -> str:
    """``"triton"``, ``"torch"`` or ``"cpu"`` for kernels on ``tensor``'s device and dtype."""
    forced = os.environ.get(BACKEND_ENV, "").strip().lower()
    if forced:
        if forced not in _BACKENDS:
            raise ValueError(f"{BACKEND_ENV}={forced!r}: expected one of {', '.join(_BACKENDS)}")
        return forced
    # float64 is the exact-comparison path (the frozen eval); Triton does not do it.
    if tensor.is_cuda and tensor.dtype != torch.float64 and triton_available():
        return "triton"
    return "cpu" if tensor.device.type == "cpu" else "torch"


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value`` ``[num_tokens, kv_heads, head_dim]`` into the paged caches
    ``[num_blocks, block_size, kv_heads, head_dim]`` at ``slot_mapping`` ``[num_tokens]``
    (``slot = block_id * block_size + offset``; -1 = skip). In place."""
    if choose_backend(k_cache) == "triton":
        from pagefleet.kernels.triton_write_kv import write_kv_triton

        write_kv_triton(key, value, k_cache, v_cache, slot_mapping)
    else:
        write_kv_reference(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(
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
) -> torch.Tensor:
    """Causal varlen attention of packed queries over a paged KV cache.

    query ``[num_tokens, q_heads, head_dim]`` packed over sequences; caches
    ``[num_blocks, block_size, kv_heads, head_dim]``; block_tables
    ``[num_seqs, max_blocks_per_seq]``; query_start_loc ``[num_seqs + 1]``;
    context_lens ``[num_seqs]`` (cached + new tokens). The new tokens of a
    sequence are its last ``q_len`` positions; ``sliding_window`` keeps the last
    that many positions (self included). ``max_query_len``/``max_context_len``
    are host-side hints that spare a device sync. Returns
    ``[num_tokens, q_heads, head_dim]`` in the query's dtype.
    """
    backend = choose_backend(query)
    impl = paged_attention_cpu if backend == "cpu" else paged_attention_reference
    if backend == "triton":
        from pagefleet.kernels.triton_attention import paged_attention_triton as impl
    return impl(
        query,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        context_lens,
        scale,
        sliding_window=sliding_window,
        max_query_len=max_query_len,
        max_context_len=max_context_len,
        out=out,
    )
