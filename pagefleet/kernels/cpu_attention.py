"""Paged attention for CPU serving: the C kernel for every token, SDPA per sequence without it.

The reference (`reference.py`, the test oracle) gathers every sequence's
context into one padded batch per layer and masks it: on a CPU that copy,
the padding up to the longest context and the dense mask cost more than the
attention itself.

Every token of a step goes to the C kernel (`cpu_decode`) in one call per
layer: a decode token is one query row over its sequence's context, a
prefill chunk's token `i` one row over the positions up to its own (causal
by construction, no mask). The kernel reads each sequence's K/V straight from
the cache through its block table, with no gather and no per-sequence call,
in float32 over a float32, float16 or bfloat16 cache and in float64 over a
float64 cache. It is faster than SDPA on decode and on prefill chunks up to
about 1,000 tokens; on longer chunks and after a cached prefix it is ahead on
some CPUs and behind on others (docs/benchmarks.md 14.9), and it takes every
token all the same: one path per machine keeps a token's numbers independent
of the step it ran in.

Where the kernel cannot be built (no C compiler), is switched off or does not
take the shape, each sequence attends on its own through SDPA:

- its keys and values are a *view* of the cache when its blocks are one
  consecutive run of block ids (the common case: a prompt's blocks are
  allocated together), else its own slots gathered (no padding);
- a first prefill chunk (nothing cached before it) uses SDPA's causal mode,
  a decode token needs no mask, and only a chunk after cached context (or a
  sliding window) builds a small ``[q_len, context]`` mask.

The per-step plan (views or slot indexes, the kernel's rows) is made once per
step and reused by every layer: layers receive the same metadata tensors. The
loop is over sequences, never over tokens.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagefleet.kernels.cpu_decode import decode_kernel, fits, shape_fits
from pagefleet.kernels.reference import _check_cache_pair


@dataclass(frozen=True)
class _SeqPlan:
    index: int  # its row in the block tables
    q_start: int
    q_len: int
    ctx: int


@dataclass(frozen=True)
class _Context:
    """Where the SDPA path finds one sequence's K/V."""

    first_block: int  # >= 0: the context is blocks [first_block, ...) in one run
    slots: torch.Tensor | None  # else: its slots, gathered per layer


@dataclass(frozen=True)
class _KernelRows:
    """Every token of a step as the C kernel takes it: one query row each (int64 each)."""

    rows: torch.Tensor  # query (and output) row
    seq: torch.Tensor  # its sequence's row in the block tables
    start: torch.Tensor  # first position attended (a sliding window moves it)
    ctx: torch.Tensor  # one past the last position attended: its own position + 1


class _StepPlan:
    """The per-sequence plans of one step: the kernel's rows per sliding window, and (only
    where the kernel cannot run) where each sequence's K/V lie for SDPA."""

    def __init__(self, seqs: list[_SeqPlan]) -> None:
        self.seqs = seqs
        self._rows: dict[int | None, _KernelRows] = {}
        self._contexts: list[_Context] | None = None

    def contexts(self, block_tables: torch.Tensor, block_size: int) -> list[_Context]:
        """Each sequence's context as one run of blocks (a view) or its gathered slots."""
        if self._contexts is None:
            tables = block_tables.tolist()
            self._contexts = []
            for p in self.seqs:
                n = -(-p.ctx // block_size)
                row = tables[p.index][:n]
                if row == list(range(row[0], row[0] + n)):
                    self._contexts.append(_Context(row[0], None))
                else:
                    blocks = torch.tensor(row, dtype=torch.long)
                    slots = (blocks[:, None] * block_size + torch.arange(block_size)).view(-1)
                    self._contexts.append(_Context(-1, slots[: p.ctx]))
        return self._contexts

    def kernel_rows(self, sliding_window: int | None) -> _KernelRows:
        """Every token, each over the positions up to its own (the last `sliding_window`
        of them, or all)."""
        cached = self._rows.get(sliding_window)
        if cached is None:
            q_lens = torch.tensor([p.q_len for p in self.seqs], dtype=torch.long)
            seq = torch.repeat_interleave(torch.tensor([p.index for p in self.seqs]), q_lens)
            first = torch.tensor([p.q_start for p in self.seqs], dtype=torch.long)
            before = torch.tensor([p.ctx - p.q_len for p in self.seqs], dtype=torch.long)
            rows = torch.arange(int(q_lens.sum()))
            # Token i of a chunk sees the context before the chunk and tokens 0..i.
            ctx = torch.repeat_interleave(before - first, q_lens) + rows + 1
            start = torch.zeros_like(ctx)
            if sliding_window is not None:
                start = (ctx - sliding_window).clamp_(min=0)
            cached = _KernelRows(rows, seq, start, ctx)
            self._rows[sliding_window] = cached
        return cached


_plans = threading.local()


def _plan(
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
) -> _StepPlan:
    key = tuple((t, t._version) for t in (block_tables, query_start_loc, context_lens))
    cached = getattr(_plans, "entry", None)
    if cached is not None and len(cached[0]) == 3 and all(
        a is b and va == vb for (a, va), (b, vb) in zip(cached[0], key, strict=True)
    ):
        return cached[1]  # type: ignore[no-any-return]
    qsl = query_start_loc.tolist()
    ctx = context_lens.tolist()
    step = _StepPlan([_SeqPlan(i, qsl[i], qsl[i + 1] - qsl[i], c) for i, c in enumerate(ctx)])
    # Holds the metadata tensors of the last step alive until the next: a few KiB.
    _plans.entry = (key, step)
    return step


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
    dtype (float64 stays float64: the exact path). A float16/bfloat16 cache
    under a float32 query is read as float32.
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
    step = _plan(block_tables, query_start_loc, context_lens)
    if _kernel(query, k_cache, v_cache, block_tables, step, scale, sliding_window, out):
        return out
    for p, where in zip(step.seqs, step.contexts(block_tables, block_size), strict=True):
        if where.slots is None:
            lo = where.first_block * block_size
            k, v = k_flat[lo : lo + p.ctx], v_flat[lo : lo + p.ctx]
        else:
            k, v = k_flat.index_select(0, where.slots), v_flat.index_select(0, where.slots)
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


def _kernel(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    step: _StepPlan,
    scale: float,
    sliding_window: int | None,
    out: torch.Tensor,
) -> bool:
    """Every token of the step through the C kernel; False when it does not apply."""
    kernel = decode_kernel(query.dtype, k_cache.dtype)
    dense = (
        shape_fits(k_cache.shape[2], query.shape[2])
        and fits(query) and fits(out) and out.dtype == query.dtype
        and k_cache.is_contiguous() and v_cache.is_contiguous()
        and block_tables.dtype == torch.int32 and block_tables.stride(1) == 1
    )  # fmt: skip
    if kernel is None or not dense:
        return False
    r = step.kernel_rows(sliding_window)
    kernel(query, k_cache, v_cache, block_tables, r.rows, r.seq, r.start, r.ctx, scale, out)
    return True
