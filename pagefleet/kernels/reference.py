"""Torch reference of the paged KV kernels: the test oracle and the CPU serving path.

Every sequence's context is gathered through its block table with one indexing
op into a padded ``[num_seqs, kv_heads, max_ctx, head_dim]`` tensor; the causal,
sliding-window and padding masks are built for the whole batch at once, and one
``scaled_dot_product_attention`` call does the rest. There is no Python loop
over tokens or sequences. Decode tokens (one new token per sequence) and
prefill chunks are batched separately, so one long prefill chunk does not pad
every decode sequence's query up to its length.
"""

from __future__ import annotations

import math
import threading

import torch
import torch.nn.functional as F


def write_kv_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter ``key``/``value`` ``[num_tokens, kv_heads, head_dim]`` into the caches at
    ``slot_mapping`` (``slot = block_id * block_size + offset``); slot -1 is skipped."""
    _check_cache_pair(k_cache, v_cache)
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    # view() (not reshape/flatten) so that a non-contiguous cache fails loudly
    # instead of silently writing into a copy.
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    slots = slot_mapping.to(device=k_cache.device, dtype=torch.long)
    keep = slots >= 0
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[keep], value[keep]
    k_flat.index_copy_(0, slots, key.to(k_cache.dtype))
    v_flat.index_copy_(0, slots, value.to(v_cache.dtype))


def paged_attention_reference(
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
    """Varlen causal attention over a paged KV cache, in plain torch.

    query: ``[num_tokens, q_heads, head_dim]`` packed over sequences;
    k_cache/v_cache: ``[num_blocks, block_size, kv_heads, head_dim]``;
    block_tables: ``[num_seqs, max_blocks_per_seq]``; query_start_loc:
    ``[num_seqs + 1]`` cumulative query lengths; context_lens: ``[num_seqs]``
    total tokens per sequence including the new ones. The new tokens of a
    sequence are its last ``q_len`` positions. Softmax runs in float32, or in
    float64 when the query is float64. Returns ``[num_tokens, q_heads, head_dim]``
    in the query's dtype (written into ``out`` when given).
    """
    _check_cache_pair(k_cache, v_cache)
    num_tokens, num_q_heads = query.shape[0], query.shape[1]
    if num_q_heads % k_cache.shape[2] != 0:
        raise ValueError(
            f"q_heads ({num_q_heads}) must be a multiple of kv_heads ({k_cache.shape[2]})"
        )
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 (or None), got {sliding_window}")
    if out is None:
        out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    device = query.device
    qsl = query_start_loc.to(device=device, dtype=torch.long)
    ctx = context_lens.to(device=device, dtype=torch.long)
    q_lens = qsl[1:] - qsl[:-1]
    # On CPU these reads are free; on CUDA the reference is only a test oracle.
    is_decode = (q_lens == 1).tolist()
    decode = [i for i, d in enumerate(is_decode) if d]
    prefill = [i for i, d in enumerate(is_decode) if not d]
    groups = [decode, prefill] if decode and prefill else [decode or prefill]
    for seqs in groups:
        index = None if len(seqs) == len(is_decode) else torch.tensor(seqs, device=device)
        _attend_group(
            query,
            k_cache,
            v_cache,
            block_tables if index is None else block_tables.index_select(0, index),
            qsl[:-1] if index is None else qsl[:-1].index_select(0, index),
            q_lens if index is None else q_lens.index_select(0, index),
            ctx if index is None else ctx.index_select(0, index),
            scale,
            sliding_window,
            out,
        )
    return out


def _attend_group(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    q_starts: torch.Tensor,
    q_lens: torch.Tensor,
    ctx: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    out: torch.Tensor,
) -> None:
    """Attention for a group of sequences, padded to the group's longest query and context."""
    device = query.device
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    compute_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    max_q = int(q_lens.max())
    max_ctx = int(ctx.max())
    if max_q == 0:
        return

    # One slot per (sequence, position), looked up through the block table.
    # Unused table entries may hold anything (clamped into range), and positions
    # past a sequence's length read its position 0 instead: stale slots may hold
    # NaN, which a mask alone would not stop (NaN + -inf is NaN).
    num_seqs = ctx.shape[0]
    pos = torch.arange(max_ctx, device=device)
    k_valid = pos[None, :] < ctx[:, None]  # [num_seqs, max_ctx]
    table = block_tables[:, : -(-max_ctx // block_size)].to(device=device, dtype=torch.long)
    table = table.clamp(0, num_blocks - 1)
    block_of_pos = (pos // block_size).expand(num_seqs, max_ctx)
    slots = torch.gather(table, 1, block_of_pos) * block_size + pos % block_size
    slots = torch.where(k_valid, slots, slots[:, :1]).view(-1)
    # index_select on rows is several times faster than advanced indexing on CPU;
    # view() (not reshape) so a non-contiguous cache fails instead of being copied.
    kv_shape = (num_seqs, max_ctx, num_kv_heads, head_dim)
    keys = _gather_rows(k_cache.view(-1, num_kv_heads, head_dim), slots, "k").view(kv_shape)
    values = _gather_rows(v_cache.view(-1, num_kv_heads, head_dim), slots, "v").view(kv_shape)
    keys = keys.transpose(1, 2).to(compute_dtype)
    values = values.transpose(1, 2).to(compute_dtype)

    # Padded queries [num_seqs, q_heads, max_q, head_dim]; padding rows reuse a
    # real token (clamped index) so they stay finite, and are dropped at the end.
    q_offsets = torch.arange(max_q, device=device)
    q_valid = q_offsets[None, :] < q_lens[:, None]
    token_index = (q_starts[:, None] + q_offsets[None, :]).clamp(max=query.shape[0] - 1)
    q = query.index_select(0, token_index.view(-1)).view(num_seqs, max_q, *query.shape[1:])
    q = q.transpose(1, 2).to(compute_dtype)

    # Query token i of a sequence sits at ctx - q_len + i; padding rows are
    # pinned to the last position so that no row is fully masked.
    q_pos = torch.minimum((ctx - q_lens)[:, None] + q_offsets[None, :], ctx[:, None] - 1)
    visible = (pos[None, None, :] <= q_pos[:, :, None]) & k_valid[:, None, :]
    if sliding_window is not None:
        visible &= pos[None, None, :] > (q_pos[:, :, None] - sliding_window)
    # SDPA fuses scale, mask and softmax in the compute dtype (float32, or
    # float64 for the exact path) and handles GQA without copying K/V per q head.
    result = F.scaled_dot_product_attention(
        q, keys, values, attn_mask=visible[:, None], scale=scale, enable_gqa=True
    )
    result = result.transpose(1, 2).to(out.dtype)  # [num_seqs, max_q, q_heads, head_dim]
    if bool(q_valid.all()):
        out.index_copy_(0, token_index.view(-1), result.reshape(-1, *out.shape[1:]))
    else:
        out[token_index[q_valid]] = result[q_valid]


_workspace = threading.local()


def _gather_rows(source: torch.Tensor, index: torch.Tensor, name: str) -> torch.Tensor:
    """``source.index_select(0, index)``, on CPU into a reused per-thread buffer."""
    if source.device.type != "cpu" or (source.requires_grad and torch.is_grad_enabled()):
        return source.index_select(0, index)
    out = workspace(name, (index.shape[0], *source.shape[1:]), source.dtype)
    return torch.index_select(source, 0, index, out=out)


def workspace(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of ``shape`` from a per-thread buffer reused across layers and steps.

    A fresh multi-megabyte tensor per layer and step comes from the OS each
    time, and its page faults cost several times the copy itself; the buffer
    of each ``(name, dtype)`` only grows, to the largest shape seen by this thread.
    Its contents are garbage; the caller overwrites them.
    """
    numel = math.prod(shape)
    key = (name, dtype)
    buffers: dict[tuple[str, torch.dtype], torch.Tensor] = _workspace.__dict__.setdefault(
        "buffers", {}
    )
    buffer = buffers.get(key)
    if buffer is None or buffer.numel() < numel:
        # A normal tensor even when first made under inference_mode, so that later
        # calls outside inference mode may still write into it.
        with torch.inference_mode(False):
            buffer = torch.empty(numel, dtype=dtype)
        buffers[key] = buffer
    return buffer[:numel].view(shape)


def _check_cache_pair(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, kv_heads, head_dim]; "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
