"""The KV pool tensor of one worker, and the model shape that sizes it.

One tensor `[layers, 2, num_blocks, block_size, kv_heads, head_dim]` holds every
layer's keys (`[:, 0]`) and values (`[:, 1]`). Block copies (copy-on-write) move
whole blocks of every layer in one indexed op; copies to and from host memory
(swap, offload tier) go through one `BlockTransfer`.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pagefleet.kernels.transfer import host_to_device
from pagefleet.worker.block_pool import is_valid_block_size
from pagefleet.worker.offload import BlockTransfer

_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float64": torch.float64,
    "fp64": torch.float64,
    "double": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "fp8": torch.float8_e4m3fn,
}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """A torch dtype from a torch dtype or a name such as "float16" or "bf16"."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = dtype.removeprefix("torch.").lower()
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {', '.join(sorted(_DTYPES))}")
    return _DTYPES[name]


@dataclass(frozen=True)
class ModelShape:
    """What one token costs in the KV cache: layers x kv_heads x head_dim x 2 (K and V) x dtype."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float16

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", parse_dtype(self.dtype))
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelShape.{name} must be a positive int, got {value!r}")

    @property
    def dtype_bytes(self) -> int:
        """Bytes of one element."""
        return self.dtype.itemsize

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token across all layers (keys and values)."""
        return self.num_layers * self.num_kv_heads * self.head_dim * 2 * self.dtype_bytes

    def bytes_per_block(self, block_size: int) -> int:
        """KV bytes of one block of `block_size` tokens."""
        return self.bytes_per_token * block_size

    @classmethod
    def from_hf_config(cls, config: Any, dtype: str | torch.dtype | None = None) -> ModelShape:
        """The shape of a Hugging Face config (object or `config.json` dict).

        `head_dim` is the config's own when present, else `hidden_size //
        num_attention_heads`; `num_key_value_heads` defaults to
        `num_attention_heads` (no GQA). `dtype` defaults to the config's dtype,
        else float32.
        """

        def get(name: str) -> Any:
            if isinstance(config, Mapping):
                return config.get(name)
            return getattr(config, name, None)

        text_config = get("text_config")  # multimodal configs nest the language model
        if text_config is not None and get("num_hidden_layers") is None:
            return cls.from_hf_config(text_config, dtype)
        layers = get("num_hidden_layers")
        heads = get("num_attention_heads")
        if layers is None or heads is None:
            raise ValueError(
                "config lacks num_hidden_layers / num_attention_heads; not a decoder LM config"
            )
        kv_heads = get("num_key_value_heads") or heads
        head_dim = get("head_dim")
        if not head_dim:
            hidden = get("hidden_size")
            if hidden is None:
                raise ValueError("config has neither head_dim nor hidden_size")
            head_dim = int(hidden) // int(heads)
        if dtype is None:
            dtype = get("dtype") or get("torch_dtype") or torch.float32
        if isinstance(dtype, str) and dtype == "auto":
            dtype = torch.float32
        return cls(int(layers), int(kv_heads), int(head_dim), parse_dtype(dtype))


class KVCache:
    """The pre-allocated KV blocks of one worker on one device."""

    def __init__(
        self,
        shape: ModelShape,
        num_blocks: int,
        block_size: int = 16,
        device: str | torch.device = "cpu",
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        if not is_valid_block_size(block_size):
            raise ValueError(f"block_size must be a power of two, got {block_size}")
        self.shape = shape
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = torch.device(device)
        # Zeroed, not empty: attention reads whole blocks and masks the unused
        # slots, and 0 * NaN from uninitialised memory would still be NaN.
        dims = (shape.num_layers, 2, num_blocks, block_size, shape.num_kv_heads, shape.head_dim)
        self._memory: mmap.mmap | None = None
        if self.device.type == "cpu":
            # Anonymous memory comes from the kernel zeroed, page by page as it is first
            # written: a pool of gigabytes costs nothing to create (torch.zeros writes
            # every page, about a second per 2 GB at a worker's start), and blocks never
            # used take no memory.
            self._memory = mmap.mmap(-1, math.prod(dims) * shape.dtype.itemsize)
            self.tensor = torch.frombuffer(self._memory, dtype=shape.dtype).view(dims)
        else:
            self.tensor = torch.zeros(dims, dtype=shape.dtype, device=self.device)
        # The one path for block copies to and from host memory (swap and offload tier).
        self.transfer = BlockTransfer(self.tensor)

    @classmethod
    def from_budget(
        cls,
        shape: ModelShape,
        budget_bytes: int,
        block_size: int = 16,
        device: str | torch.device = "cpu",
    ) -> KVCache:
        """As many blocks as fit in `budget_bytes`; ValueError if not even one fits."""
        return cls(shape, blocks_for_budget(shape, budget_bytes, block_size), block_size, device)

    @property
    def nbytes(self) -> int:
        """Bytes the pool tensor occupies."""
        return self.tensor.numel() * self.tensor.element_size()

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`(k_cache, v_cache)` of one layer, each `[num_blocks, block_size, kv_heads, head_dim]`."""
        return self.tensor[index, 0], self.tensor[index, 1]

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        return host_to_device(torch.tensor(list(block_ids), dtype=torch.long), self.device)

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy whole blocks `src -> dst` in every layer (copy-on-write), in one gather/scatter.

        All sources are read before any destination is written.
        """
        if not pairs:
            return
        src = self._index([p[0] for p in pairs])
        dst = self._index([p[1] for p in pairs])
        self.tensor.index_copy_(2, dst, self.tensor.index_select(2, src))

    def swap_out(self, block_ids: Sequence[int]) -> torch.Tensor:
        """A host copy of the blocks, `[len(block_ids), layers, 2, block_size, kv_heads, head_dim]`.

        The same copy path as the offload tier (`self.transfer`): pinned memory and a
        side stream on CUDA. It waits for the copy so that "auto" preemption
        measures the real bandwidth. The blocks themselves are untouched; the
        caller frees them in the pool afterwards.
        """
        host = self.transfer.host_buffer(len(block_ids))
        self.transfer.to_host(block_ids, host, range(len(block_ids)))
        self.transfer.synchronize()
        return host

    def swap_in(self, host: torch.Tensor, block_ids: Sequence[int]) -> None:
        """Write blocks saved by `swap_out` into `block_ids` (any free blocks of this pool)."""
        expected = (len(block_ids), *self.transfer.block_shape)
        if tuple(host.shape) != expected:
            raise ValueError(f"swap buffer has shape {tuple(host.shape)}, expected {expected}")
        self.transfer.to_device(host, range(len(block_ids)), block_ids)
        self.transfer.synchronize()


def blocks_for_budget(shape: ModelShape, budget_bytes: int, block_size: int) -> int:
    """How many blocks of `block_size` tokens fit in `budget_bytes`; ValueError if none."""
    per_block = shape.bytes_per_block(block_size)
    num_blocks = budget_bytes // per_block
    if num_blocks < 1:
        raise ValueError(
            f"a KV budget of {budget_bytes} bytes holds no block: one block of "
            f"{block_size} tokens needs {per_block} bytes"
        )
    return int(num_blocks)
