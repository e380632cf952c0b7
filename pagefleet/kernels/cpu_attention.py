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

A cache stored narrower than the float32 compute (``kv_cache_dtype``
"float16") has to be converted before the matmuls anyway, so its decode
tokens take another path: sequences sorted by context length go in buckets of
`DECODE_BUCKET`, each bucket's slots gathered and converted into one padded
head-major float32 buffer, scores and weighted sums by batched matmul, the
padding masked with -inf (fewer, larger ops than one SDPA call per sequence;
the same math in float32, in another summation order). A float32 or float64
cache, and every prefill chunk, keep the per-sequence path.

The per-step plan (views or slot indexes, decode buckets) is made once per
step and reused by every layer: layers receive the same metadata tensors. The
loop is over sequences, never over tokens.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagefleet.kernels.reference import _check_cache_pair, _gather_rows, workspace

# Decode sequences per batched-matmul bucket on a narrow (float16/bfloat16) cache.
# SmolLM2 shapes, 32 sequences of 80-430 tokens, one thread: 4 and 8 beat one SDPA
# per sequence by 27% and 37%, 16 only by 12% (the padding to the bucket's longest).
DECODE_BUCKET = 8


@dataclass(frozen=True)
class _SeqPlan:
    q_start: int
    q_len: int
    ctx: int
    first_block: int  # >= 0: the context is blocks [first_block, ...) in one run
    slots: torch.Tensor | None  # else: its slots, gathered per layer


@dataclass(frozen=True)
class _DecodeBucket:
    rows: torch.Tensor  # [n] query rows (decode tokens) of its sequences
    slots: torch.Tensor  # [n * width] each sequence's slots, padded with its first
    bias: torch.Tensor  # [n, 1, 1, width] float32: 0 on a sequence's context, -inf past it
    width: int


class _StepPlan:
    """The per-sequence plans of one step, and its decode buckets per sliding window."""

    def __init__(self, seqs: list[_SeqPlan], block_size: int) -> None:
        self.seqs = seqs
        self.block_size = block_size
        self.decode = [p for p in seqs if p.q_len == 1]
        self._buckets: dict[int | None, list[_DecodeBucket]] = {}

    def buckets(self, sliding_window: int | None) -> list[_DecodeBucket]:
        """Decode sequences by context length (last `sliding_window` positions), in buckets."""
        cached = self._buckets.get(sliding_window)
        if cached is not None:
            return cached
        spans = []
        for p in self.decode:
            start = 0 if sliding_window is None else max(0, p.ctx - sliding_window)
            if p.slots is None:
                lo = p.first_block * self.block_size
                slots = torch.arange(lo + start, lo + p.ctx)
            else:
                slots = p.slots[start:]
            spans.append((p.q_start, slots))
        spans.sort(key=lambda span: span[1].shape[0])
        buckets = []
        for i in range(0, len(spans), DECODE_BUCKET):
            group = spans[i : i + DECODE_BUCKET]
            width = group[-1][1].shape[0]
            lens = torch.tensor([s.shape[0] for _, s in group])
            padded = [torch.cat([s, s[:1].expand(width - s.shape[0])]) for _, s in group]
            past = torch.arange(width)[None, :] >= lens[:, None]
            bias = torch.zeros(past.shape).masked_fill_(past, float("-inf"))
            rows = torch.tensor([q for q, _ in group])
            buckets.append(_DecodeBucket(rows, torch.cat(padded), bias[:, None, None, :], width))
        self._buckets[sliding_window] = buckets
        return buckets


_plans = threading.local()


def _plan(
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
) -> _StepPlan:
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
    step = _StepPlan(plans, block_size)
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
    under a float32 query is read as float32 (decode tokens in buckets).
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
    step = _plan(block_tables, query_start_loc, context_lens, block_size)
    narrow_cache = query.dtype == torch.float32 and k_cache.dtype != torch.float32
    if narrow_cache:
        for bucket in step.buckets(sliding_window):
            _attend_decode_bucket(query, k_flat, v_flat, bucket, scale, out)
    for p in step.seqs:
        if narrow_cache and p.q_len == 1:
            continue  # done in its bucket
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


def _attend_decode_bucket(
    query: torch.Tensor,
    k_flat: torch.Tensor,
    v_flat: torch.Tensor,
    bucket: _DecodeBucket,
    scale: float,
    out: torch.Tensor,
) -> None:
    """One decode token per sequence of `bucket`, over its slots of a narrow cache, in float32."""
    n, width = bucket.rows.shape[0], bucket.width
    num_kv_heads, head_dim = k_flat.shape[1], k_flat.shape[2]
    num_q_heads = query.shape[1]
    kv = []
    for name, flat in (("k", k_flat), ("v", v_flat)):
        raw = _gather_rows(flat, bucket.slots, name).view(n, width, num_kv_heads, head_dim)
        # Converted into head-major float32: contiguous [width, head_dim] per (sequence, head).
        full = workspace(f"{name}_float32", (n, num_kv_heads, width, head_dim), torch.float32)
        full.copy_(raw.transpose(1, 2))
        kv.append(full)
    # A GQA group's query heads are the rows of one matmul against their KV head.
    q = query.index_select(0, bucket.rows).view(n, num_kv_heads, num_q_heads // num_kv_heads, -1)
    scores = torch.matmul(q, kv[0].transpose(2, 3)).mul_(scale).add_(bucket.bias)
    weights = torch.softmax(scores, dim=-1)
    result = torch.matmul(weights, kv[1])  # [n, kv_heads, group, head_dim]
    out.index_copy_(0, bucket.rows, result.view(n, num_q_heads, head_dim))
