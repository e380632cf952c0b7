"""EngineConfig: everything one worker engine needs, validated once."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from pagefleet.worker.block_pool import is_valid_block_size
from pagefleet.worker.sizes import ByteSize

PREEMPTION_MODES = ("recompute", "swap", "auto")
DTYPES = ("float16", "bfloat16", "float32", "float64")
# The one default dtype: `LLM`, `EngineConfig`, pools, `pagefleet generate` and
# `pagefleet plan` all start from it, so a plan's capacity is the engine's.
DEFAULT_DTYPE = "float32"
# What the KV cache stores (vLLM's --kv-cache-dtype): "auto" = the model dtype; a
# narrower one halves the KV bytes (twice the blocks per budget), and attention
# converts it back to the compute dtype as it reads.
KV_CACHE_DTYPES = ("auto", "float16", "bfloat16")

# The CPU KV pool when the host's available memory cannot be read (not Linux):
# plenty for the built-in model and small enough for any laptop.
DEFAULT_CPU_KV_BYTES = 256 * 1024 * 1024


class InvalidField(ValueError):
    """A setting that breaks a rule: `field` names it, `reason` says why.

    Reads "field reason"; a config file that holds the setting reports it at
    its own path (`pools[0].block_size: must be a power of two ...`).
    """

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field} {reason}")
        self.field = field
        self.reason = reason


def available_host_memory() -> int | None:
    """Bytes the host can still hand out without swapping (Linux `MemAvailable`), or None."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def default_cpu_kv_bytes(config: EngineConfig, bytes_per_token: int, max_model_len: int) -> int:
    """The CPU KV budget when none is given: `cpu_kv_memory_fraction` of available memory.

    Capped at what the engine can ever hold (`max_num_seqs` sequences of
    `max_model_len` tokens), so a small model does not pin gigabytes it never
    uses; `DEFAULT_CPU_KV_BYTES` where available memory cannot be read.
    """
    available = available_host_memory()
    if available is None:
        return DEFAULT_CPU_KV_BYTES
    ceiling = config.max_num_seqs * max_model_len * bytes_per_token
    return max(1, min(int(available * config.cpu_kv_memory_fraction), ceiling))


@dataclass(frozen=True)
class EngineConfig:
    """Configuration of one `LLMEngine` (one model, one KV pool).

    KV pool size: `num_kv_blocks` if given, else `kv_memory_bytes`, else on
    CUDA `gpu_memory_utilization` of the device minus weights and a profiled
    forward at `max_num_batched_tokens`, on CPU `cpu_kv_memory_fraction` of the
    host memory available at start (capped at `max_num_seqs` full-length
    sequences; see `default_cpu_kv_bytes`).
    `max_model_len` defaults to the model's `max_position_embeddings`.
    `swap_space_bytes` bounds the CPU buffer that swap preemption copies
    blocks into. `kv_offload_bytes` (0: off) sizes the offload tier: host
    memory that holds prefix blocks evicted from the pool until a later prompt
    hits them (it needs prefix caching). `seed` seeds requests that bring no seed of their own.
    `kv_cache_dtype` is what the KV pool stores: "auto" (the model `dtype`)
    or "float16"/"bfloat16" (half the bytes per token, so twice the blocks of a
    float32 model's budget; a numeric mode of its own: attention reads the
    rounded K/V).
    `tenant_max_live_blocks` caps the live blocks of a tenant, as
    ``(salt, max_blocks)`` pairs keyed by the request's prefix-cache salt
    (see `worker.tenant_quota`).
    `lora_adapters` names the PEFT LoRA adapters this engine serves, as a
    mapping or ``(name, directory)`` pairs (stored as sorted pairs); a
    request selects one by name. `max_loras` adapters are resident in device
    slots at once (loaded on first use, least recently used evicted);
    `max_lora_rank` is the largest rank accepted (see `worker.lora`).
    `enforce_eager` (vLLM's name) runs every CUDA step without CUDA graphs;
    by default a decode step is padded to a bucket and replayed from a graph
    captured for it (see `worker.cuda_graph`). The CPU never captures, so
    there it changes nothing.
    """

    # Read by pydantic when a cluster config embeds these settings in a pool:
    # strict types (no "16" for 16), unknown names refused.
    __pydantic_config__: ClassVar[dict[str, Any]] = {"strict": True, "extra": "forbid"}

    model: str | Path = "tiny"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_memory_bytes: ByteSize | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    preemption_mode: str = "recompute"
    swap_space_bytes: ByteSize = 1024 * 1024 * 1024
    kv_offload_bytes: ByteSize = 0
    dtype: str = DEFAULT_DTYPE
    kv_cache_dtype: str = "auto"
    device: str = "cpu"
    seed: int = 0
    gpu_memory_utilization: float = 0.9
    cpu_kv_memory_fraction: float = 0.1
    tenant_max_live_blocks: tuple[tuple[str, int], ...] = ()
    lora_adapters: Mapping[str, str | Path] | tuple[tuple[str, str | Path], ...] = ()
    max_loras: int = 4
    max_lora_rank: int = 16
    enforce_eager: bool = False

    @property
    def adapter_dirs(self) -> dict[str, str]:
        """The LoRA adapters' directories by name, in name order."""
        return dict(_adapter_pairs(self.lora_adapters))

    def __post_init__(self) -> None:
        object.__setattr__(self, "lora_adapters", _adapter_pairs(self.lora_adapters))
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if not is_valid_block_size(self.block_size):
            raise InvalidField("block_size", f"must be a power of two >= 1, got {self.block_size}")
        for name in ("num_kv_blocks", "kv_memory_bytes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise InvalidField(name, f"must be >= 1, got {value}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise InvalidField("max_model_len", f"must be >= 2, got {self.max_model_len}")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise InvalidField(name, f"must be >= 1, got {getattr(self, name)}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise InvalidField(
                "preemption_mode", f"must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}"
            )
        for name in ("swap_space_bytes", "kv_offload_bytes"):
            if getattr(self, name) < 0:
                raise InvalidField(name, f"must be >= 0, got {getattr(self, name)}")
        if self.kv_offload_bytes and not self.enable_prefix_caching:
            raise InvalidField(
                "kv_offload_bytes",
                "needs enable_prefix_caching: the offload tier holds prefix-cache blocks by their hash",
            )
        if self.dtype not in DTYPES:
            raise InvalidField("dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidField(
                "kv_cache_dtype", f"must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )
        for salt, cap in self.tenant_max_live_blocks:
            if cap < 1:
                raise InvalidField("tenant_max_live_blocks", f"for salt {salt!r} must be >= 1, got {cap}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise InvalidField(
                "gpu_memory_utilization", f"must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if not 0.0 < self.cpu_kv_memory_fraction <= 0.9:
            raise InvalidField(
                "cpu_kv_memory_fraction", f"must be in (0, 0.9], got {self.cpu_kv_memory_fraction}"
            )
        if not isinstance(self.enforce_eager, bool):
            value = self.enforce_eager
            raise InvalidField("enforce_eager", f"must be bool, got {type(value).__name__} {value!r}")


def _adapter_pairs(
    adapters: Mapping[str, str | Path] | tuple[tuple[str, str | Path], ...],
) -> tuple[tuple[str, str], ...]:
    """`lora_adapters` as sorted (name, directory) pairs, every name checked once."""
    pairs = list(adapters.items()) if isinstance(adapters, Mapping) else list(adapters)
    names: set[str] = set()
    out: list[tuple[str, str]] = []
    for pair in pairs:
        if not isinstance(pair, tuple) or len(pair) != 2:
            raise ValueError(f"lora_adapters entries must be (name, directory) pairs, got {pair!r}")
        name, path = pair
        if not isinstance(name, str) or not name or name != name.strip() or " " in name:
            raise ValueError(f"LoRA adapter name must be a non-empty string without spaces, got {name!r}")
        if name in names:
            raise ValueError(f"LoRA adapter name {name!r} is listed twice")
        if not isinstance(path, (str, Path)) or not str(path):
            raise ValueError(f"LoRA adapter {name!r} needs a directory, got {path!r}")
        names.add(name)
        out.append((name, str(path)))
    return tuple(sorted(out))
