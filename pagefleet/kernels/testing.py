"""Random paged batches and a naive float64 oracle, shared by the kernel tests and benchmark.

A ``PagedBatch`` holds the same K/V twice: scattered through shuffled block
tables in a paged pool (what the kernels read) and contiguous per sequence
(what the oracle reads). Pool space no sequence owns, and slots past a
sequence's length, hold NaN so that a kernel reading them fails loudly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PagedBatch:
    """Inputs of one ``paged_attention`` call plus the contiguous K/V behind them."""

    query: torch.Tensor  # [num_tokens, q_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    context_lens: torch.Tensor  # [num_seqs] int32
    keys: list[torch.Tensor]  # per sequence [context_len, kv_heads, head_dim]
    values: list[torch.Tensor]
    q_lens: list[int]
    ctx_lens: list[int]

    @property
    def max_query_len(self) -> int:
        return max(self.q_lens)

    @property
    def max_context_len(self) -> int:
        return max(self.ctx_lens)

    def kernel_args(
        self,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Positional arguments of ``paged_attention`` before ``scale``."""
        return (
            self.query,
            self.k_cache,
            self.v_cache,
            self.block_tables,
            self.query_start_loc,
            self.context_lens,
        )


def make_paged_batch(
    q_lens: list[int],
    ctx_lens: list[int],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    kv_dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    shared_prefix_blocks: int = 0,
    spare_blocks: int = 3,
    seed: int = 0,
    poison: bool = True,
) -> PagedBatch:
    """Build a random paged batch.

    Physical blocks are handed out in a shuffled order, so neighbouring logical
    blocks are not neighbours in the pool. The first ``shared_prefix_blocks``
    logical blocks of every sequence long enough map to the same physical
    blocks (a shared prompt prefix), and their contiguous K/V agree.
    ``poison=False`` fills unused pool space with zeros (the benchmark's case).
    ``kv_dtype`` (default ``dtype``) is the caches' dtype (a narrower KV cache).
    """
    if len(q_lens) != len(ctx_lens):
        raise ValueError(f"{len(q_lens)} query lengths for {len(ctx_lens)} context lengths")
    for q_len, ctx_len in zip(q_lens, ctx_lens, strict=True):
        if not 1 <= q_len <= ctx_len:
            raise ValueError(f"need 1 <= q_len <= context_len, got {q_len} and {ctx_len}")
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-c // block_size) for c in ctx_lens]
    shared = [min(shared_prefix_blocks, c // block_size) for c in ctx_lens]
    num_shared = max(shared, default=0)
    own = [b - s for b, s in zip(blocks_per_seq, shared, strict=True)]
    num_blocks = num_shared + sum(own) + spare_blocks
    physical = torch.randperm(num_blocks, generator=gen).tolist()
    shared_ids, rest = physical[:num_shared], physical[num_shared:]

    max_blocks = max(blocks_per_seq) + 2
    # Unused table entries hold garbage (out of range both ways): kernels must not read them.
    tables = torch.randint(-5, num_blocks + 50, (len(ctx_lens), max_blocks), generator=gen)
    for i, (s, o) in enumerate(zip(shared, own, strict=True)):
        ids = shared_ids[:s] + rest[:o]
        rest = rest[o:]
        tables[i, : len(ids)] = torch.tensor(ids)

    fill = float("nan") if poison else 0.0
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, fill, dtype=torch.float64)
    v_cache = torch.full(shape, fill, dtype=torch.float64)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    for i, ctx_len in enumerate(ctx_lens):
        k = torch.randn(ctx_len, num_kv_heads, head_dim, generator=gen, dtype=torch.float64)
        v = torch.randn(ctx_len, num_kv_heads, head_dim, generator=gen, dtype=torch.float64)
        # Shared blocks were written by whoever wrote them first: copy their content.
        for b in range(shared[i]):
            blk = int(tables[i, b])
            if not torch.isnan(k_cache[blk]).any():
                k[b * block_size : (b + 1) * block_size] = k_cache[blk]
                v[b * block_size : (b + 1) * block_size] = v_cache[blk]
        slots = _slots(tables[i], ctx_len, block_size)
        k_cache.view(-1, num_kv_heads, head_dim)[slots] = k
        v_cache.view(-1, num_kv_heads, head_dim)[slots] = v
        keys.append(k)
        values.append(v)

    num_tokens = sum(q_lens)
    query = torch.randn(num_tokens, num_q_heads, head_dim, generator=gen, dtype=torch.float64)
    qsl = [0]
    for q_len in q_lens:
        qsl.append(qsl[-1] + q_len)
    # Round the oracle's data through the kernel dtypes so both see the same numbers.
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    query = query.to(dtype)
    keys = [k.to(kv_dtype).to(torch.float64) for k in keys]
    values = [v.to(kv_dtype).to(torch.float64) for v in values]
    return PagedBatch(
        query=query.to(device=device),
        k_cache=k_cache.to(device=device, dtype=kv_dtype),
        v_cache=v_cache.to(device=device, dtype=kv_dtype),
        block_tables=tables.to(dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        context_lens=torch.tensor(ctx_lens, dtype=torch.int32, device=device),
        keys=keys,
        values=values,
        q_lens=list(q_lens),
        ctx_lens=list(ctx_lens),
    )


def _slots(table_row: torch.Tensor, ctx_len: int, block_size: int) -> torch.Tensor:
    pos = torch.arange(ctx_len)
    return table_row[pos // block_size] * block_size + pos % block_size


def naive_attention(
    batch: PagedBatch, scale: float, sliding_window: int | None = None
) -> torch.Tensor:
    """Float64 attention, one sequence at a time, over the contiguous K/V."""
    query = batch.query.to(torch.float64).cpu()
    num_q_heads = query.shape[1]
    outs = []
    start = 0
    for q_len, ctx_len, k, v in zip(
        batch.q_lens, batch.ctx_lens, batch.keys, batch.values, strict=True
    ):
        q = query[start : start + q_len]  # [q_len, Hq, D]
        start += q_len
        group = num_q_heads // k.shape[1]
        k_full = k.repeat_interleave(group, dim=1)  # [ctx, Hq, D]
        v_full = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k_full) * scale
        q_pos = torch.arange(ctx_len - q_len, ctx_len)[:, None]
        k_pos = torch.arange(ctx_len)[None, :]
        visible = k_pos <= q_pos
        if sliding_window is not None:
            visible &= k_pos > q_pos - sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v_full))
    return torch.cat(outs)
