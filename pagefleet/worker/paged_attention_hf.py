"""The attention function pagefleet registers with transformers' `AttentionInterface`.

transformers' decoder layers call `ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`
with `(module, query, key, value, attention_mask, scaling=..., **kwargs)`, where
`query` is `[batch, q_heads, seq, head_dim]` (RoPE already applied), `key`/`value`
are `[batch, kv_heads, seq, head_dim]`, and every keyword the caller gave the
model's `forward` arrives in `kwargs`. The model runner packs a step as one
batch row (`batch == 1`, `seq == total_tokens`) and passes a
`PagedAttentionMetadata` as the keyword `paged_metadata`; this function writes
the step's K/V into the pool at `slot_mapping` and attends through the block
tables. transformers expects `[batch, seq, q_heads, head_dim]` back.

No attention mask is built: `create_causal_mask` returns `None` for an
attention implementation that has no entry in `AttentionMaskInterface`, which
is what we want (causality and sequence boundaries live in the metadata; a
dense mask over the packed step would be `total_tokens ** 2` and wrong across
sequences).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pagefleet.kernels import paged_attention, write_kv
from pagefleet.worker.kv_cache import KVCache

ATTN_IMPLEMENTATION = "pagefleet_paged"
METADATA_KWARG = "paged_metadata"


@dataclass(frozen=True)
class PagedAttentionMetadata:
    """Everything the attention function needs for one step, already on the device.

    `sliding_windows[l]` is the window of layer `l` (None = full attention), as
    the runner derived it from the config when it accepted the model.
    """

    kv_cache: KVCache
    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    context_lens: torch.Tensor  # [num_seqs] int32
    max_query_len: int
    max_context_len: int
    sliding_windows: tuple[int | None, ...]


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: write K/V into the paged pool, attend through it."""
    metadata = kwargs.get(METADATA_KWARG)
    if not isinstance(metadata, PagedAttentionMetadata):
        raise RuntimeError(
            f"attention implementation {ATTN_IMPLEMENTATION!r} needs a PagedAttentionMetadata "
            f"in the {METADATA_KWARG!r} keyword; run the model through pagefleet's ModelRunner"
        )
    if query.shape[0] != 1:
        raise ValueError(
            f"paged attention expects one packed batch row, got batch {query.shape[0]}"
        )
    if attention_mask is not None:
        # A mask here means transformers built one over the packed step: wasted memory,
        # and it would also be wrong across sequence boundaries.
        raise RuntimeError("paged attention got a dense attention mask; expected None")
    layer_idx: int = module.layer_idx  # type: ignore[assignment]
    window = metadata.sliding_windows[layer_idx]
    if sliding_window != window:
        raise RuntimeError(
            f"layer {layer_idx}: the model asks for sliding window {sliding_window}, "
            f"the runner planned {window}"
        )
    # [1, heads, tokens, dim] -> [tokens, heads, dim]; the kernels want packed rows.
    q = query[0].transpose(0, 1).contiguous()
    k = key[0].transpose(0, 1).contiguous()
    v = value[0].transpose(0, 1).contiguous()
    k_cache, v_cache = metadata.kv_cache.layer(layer_idx)
    write_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
    out = paged_attention(
        q,
        k_cache,
        v_cache,
        metadata.block_tables,
        metadata.query_start_loc,
        metadata.context_lens,
        scale=scaling if scaling is not None else q.shape[-1] ** -0.5,
        sliding_window=window,
        max_query_len=metadata.max_query_len,
        max_context_len=metadata.max_context_len,
    )
    return out.unsqueeze(0), None


def register_paged_attention() -> None:
    """Register `paged_attention_forward` under `ATTN_IMPLEMENTATION` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
