"""Moving a request's KV blocks to another worker (migration by transfer), without Ray.

The source copies the request's full, registered blocks (every layer, K and
V) out of its pool with their chained prefix hashes
(`KVCacheManager.export_blocks`, giving an `ExportedKV`); the target writes
them into blocks of its own pool and registers them as cached blocks under
the same hashes (`KVCacheManager.import_blocks`). The request then resumes on
the target as prompt + streamed tokens and its prefix lookup hits every
imported block, so only the partial tail block is recomputed.

It stays exact: a hash names one chain of tokens under one tenant salt
(`prefix_hash`), so the imported block holds byte for byte the KV the
target would have computed, and only a request of the same tenant with the
same tokens can hit it. The copies go through the pool's `BlockTransfer`
(`KVCache.swap_out` / `swap_in`), the same path as swap preemption: on CUDA
the host copy is pinned and synchronised before it is handed over.

In between, the blocks travel as plain bytes (`to_bytes` / `from_bytes`):
numpy arrays cross Ray's object store without a pickle copy, and a byte view
carries every dtype (bfloat16 and float8 have no numpy type).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pagefleet.worker.kv_cache import parse_dtype


@dataclass(frozen=True)
class ExportedKV:
    """Blocks copied out of a pool: `blocks[i]` is the KV of the block registered as
    `block_hashes[i]`, `[n, layers, 2, block_size, kv_heads, head_dim]` on the host."""

    block_hashes: tuple[bytes, ...]
    blocks: torch.Tensor

    @property
    def dtype_name(self) -> str:
        return str(self.blocks.dtype).removeprefix("torch.")


def to_bytes(blocks: torch.Tensor) -> np.ndarray:
    """The host tensor's memory as a flat uint8 array (no copy)."""
    return blocks.contiguous().view(torch.uint8).numpy().reshape(-1)


def from_bytes(raw: np.ndarray, dtype: str, shape: Sequence[int]) -> torch.Tensor:
    """The tensor `to_bytes` flattened, viewing `raw` (read only: never written to)."""
    if raw.dtype != np.uint8 or raw.ndim != 1:
        raise ValueError(f"expected a flat uint8 array, got {raw.dtype} of {raw.ndim} dims")
    torch_dtype = parse_dtype(dtype)
    want = int(np.prod(shape)) * torch_dtype.itemsize
    if raw.size != want:
        raise ValueError(f"{raw.size} bytes for KV blocks of shape {tuple(shape)} ({want} bytes)")
    # The object store hands out read-only memory; torch warns about that, but this
    # tensor is only ever read (copied into the pool).
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        tensor = torch.from_numpy(raw)
    return tensor.view(torch_dtype).view(*shape)
