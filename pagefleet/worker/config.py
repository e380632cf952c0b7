"""EngineConfig: everything one worker engine needs, validated once."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pagefleet.worker.block_pool import is_valid_block_size

PREEMPTION_MODES = ("recompute", "swap", "auto")
DTYPES = ("float16", "bfloat16", "float32", "float64")
# The one default dtype: `LLM`, `EngineConfig`, pools, `pagefleet generate` and
# `pagefleet plan` all start from it, so a plan's capacity is the engine's.
DEFAULT_DTYPE = "float32"

# Without a GPU there is no free memory to measure; this many bytes of KV pool
# is plenty for the built-in model and small enough for any laptop.
DEFAULT_CPU_KV_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class EngineConfig:
    """Configuration of one `LLMEngine` (one model, one KV pool).

    KV pool size: `num_kv_blocks` if given, else `kv_memory_bytes`, else on
    CUDA `gpu_memory_utilization` of the device minus weights and a profiled
    forward at `max_num_batched_tokens`, on CPU `DEFAULT_CPU_KV_BYTES`.
    `max_model_len` defaults to the model's `max_position_embeddings`.
    `swap_space_bytes` bounds the CPU buffer that swap preemption copies
    blocks into. `seed` seeds requests that bring no seed of their own.
    """

    model: str | Path = "tiny"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_memory_bytes: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    preemption_mode: str = "recompute"
    swap_space_bytes: int = 1024 * 1024 * 1024
    dtype: str = DEFAULT_DTYPE
    device: str = "cpu"
    seed: int = 0
    gpu_memory_utilization: float = 0.9

    def __post_init__(self) -> None:
        if not is_valid_block_size(self.block_size):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_memory_bytes is not None and self.kv_memory_bytes < 1:
            raise ValueError(f"kv_memory_bytes must be >= 1, got {self.kv_memory_bytes}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}"
            )
        if self.swap_space_bytes < 0:
            raise ValueError(f"swap_space_bytes must be >= 0, got {self.swap_space_bytes}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
