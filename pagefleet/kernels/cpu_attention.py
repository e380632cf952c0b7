"""Paged attention for CPU serving: one SDPA call per sequence, no padded gather.

The reference (`reference.py`, the test oracle) gathers every sequence's
context into one padded batch per layer and masks it: on a CPU that copy,
the padding up to the longest context and the dense mask cost more than the
attention itself. Here each sequence attends on its own:

- its keys and values are a *view* of the cache when its blocks are one
  consecutive run of block ids (the common case: a prompt's blocks are
  allocated together), else its own slots gathered (no padding);
- a first prefill chunk (nothing cached before it) uses SDPA's causal mode,
  a decode token needs no mask, and only a chunk after cached context (or a
  sliding window) builds a small ``[q_len, context]`` mask.

The per-sequence plan (views or slot indexes) is made once per step and
reused by every layer: layers receive the same metadata tensors. The loop is
over sequences, never over tokens.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagefleet.kernels.reference import _check_cache_pair


@dataclass(frozen=True)
class _SeqPlan:
    q_start: int
    q_len: int
    ctx: int
    first_block: int  # >= 0: the context is blocks [first_block, ...) in one run
    slots: torch.Tensor | None  # else: its slots, gathered per layer


_plans = threading.local()


def _plan(
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
) -> list[_SeqPlan]:
    key = tuple((t, t._version) for t in (block_tables, query_start_loc, context_lens))
    cached = getattr(_plans, "entry", None)
    if cached is not None and len(cached[0]) == 3 and all(
        a is b and va == vb for (a, va), (b, vb) in zip(cached[0], key, strict=True)
    ):
        return cached[1]  # type: ignore[no-any-return]
    qsl = query_start_loc.tolist()
    ctx = context_lens.tolist()
    tables = block_tables.tolist()
    plans = []
    for i, c in enumerate(ctx):
        n = -(-c // block_size)
        row = tables[i][:n]
        if row == list(range(row[0], row[0] + n)):
            plans.append(_SeqPlan(qsl[i], qsl[i + 1] - qsl[i], c, row[0], None))
        else:
            blocks = torch.tensor(row, dtype=torch.long)
            slots = (blocks[:, None] * block_size + torch.arange(block_size)).view(-1)[:c]
            plans.append(_SeqPlan(qsl[i], qsl[i + 1] - qsl[i], c, -1, slots))
    # Holds the metadata tensors of the last step alive until the next: a few KiB.
    _plans.entry = (key, plans)
    return plans


def paged_attention_cpu(
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
    """`paged_attention` on CPU tensors (same arguments and result as the reference).

    Softmax runs in float32 for half-precision inputs, else in the input's
    dtype (float64 stays float64: the exact path).
    """
    _check_cache_pair(k_cache, v_cache)
    num_tokens, num_q_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"q_heads ({num_q_heads}) must be a multiple of kv_heads ({num_kv_heads})")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 (or None), got {sliding_window}")
    if out is None:
        out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    compute = query.dtype if query.dtype in (torch.float32, torch.float64) else torch.float32
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    gqa = num_q_heads != num_kv_heads
    for p in _plan(block_tables, query_start_loc, context_lens, block_size):
        if p.slots is None:
            lo = p.first_block * block_size
            k, v = k_flat[lo : lo + p.ctx], v_flat[lo : lo + p.ctx]
        else:
            k, v = k_flat.index_select(0, p.slots), v_flat.index_select(0, p.slots)
        start = 0
        if sliding_window is not None and p.q_len == 1:
            start = max(0, p.ctx - sliding_window)  # a decode token sees only the window
            k, v = k[start:], v[start:]
        q = query[p.q_start : p.q_start + p.q_len]
        # [tokens, heads, dim] -> [1, heads, tokens, dim]: views, SDPA takes the strides.
        q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0).to(compute) for t in (q, k, v))
        mask = None
        causal = False
        if p.q_len > 1:
            if p.q_len == p.ctx and sliding_window is None:
                causal = True
            else:
                q_pos = torch.arange(p.ctx - p.q_len, p.ctx)[:, None]
                k_pos = torch.arange(p.ctx)[None, :]
                mask = k_pos <= q_pos
                if sliding_window is not None:
                    mask &= k_pos > q_pos - sliding_window
        result = F.scaled_dot_product_attention(
            q4, k4, v4, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa
        )
        out[p.q_start : p.q_start + p.q_len] = result[0].transpose(0, 1)
    return out
