"""Checks the CLI runs before it starts anything heavy (Ray, a model load).

A bad model path, a checkpoint without weights, a device this torch cannot use
or a port out of range is one `pagefleet <cmd>: error: ...` line and exit 2,
within a second or two, instead of worker tracebacks after Ray has started.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from pagefleet.cli import CommandError

if TYPE_CHECKING:
    from pagefleet.cluster.config import ClusterConfig, PoolConfig

WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf")


def model_problem(model: str) -> str | None:
    """Why `model` cannot be loaded, judged from its files alone; None when it looks loadable."""
    if str(model) == "tiny":
        return None
    path = Path(model).expanduser()
    if not path.exists():
        if "/" in str(model) or str(model).startswith((".", "~")):
            return (
                f"model {model!r}: no such file or directory (expected 'tiny', a checkpoint "
                "directory or a .gguf file; nothing is downloaded)"
            )
        from pagefleet.worker.model_files import resolve_model_path

        try:  # the engine's own resolver: it may know names that are not paths
            resolve_model_path(model)
        except (FileNotFoundError, ValueError) as exc:
            return str(exc)
        return None
    if path.is_file():
        return None if path.suffix == ".gguf" else (
            f"model {model!r} is a file; expected 'tiny', a checkpoint directory or a .gguf file"
        )
    config = path / "config.json"
    if not config.is_file():
        return f"model directory {model!r} has no config.json"
    try:
        data = json.loads(config.read_text("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return f"cannot read {config}: {exc}"
    if not isinstance(data, dict):
        return f"{config} does not hold a JSON object"
    if not any(next(path.glob(pattern), None) for pattern in WEIGHT_PATTERNS):
        return f"model directory {model!r} has no weights (*.safetensors or pytorch_model*.bin)"
    return None


def device_problem(device: str) -> str | None:
    """Why this process's torch cannot use `device` (cpu, cuda, cuda:N); None when it can."""
    if device == "cpu":
        return None
    name, _, index = device.partition(":")
    if name != "cuda" or (index and not index.isdigit()):
        return f"device {device!r}: expected cpu, cuda or cuda:N"
    import torch

    if torch.version.cuda is None:
        return f"device {device!r}: this torch ({torch.__version__}) is a CPU-only build"
    count = torch.cuda.device_count()
    if count == 0:
        return f"device {device!r}: torch sees no GPU (check the driver and CUDA_VISIBLE_DEVICES)"
    if index and int(index) >= count:
        return f"device {device!r}: only {count} GPU(s) visible (cuda:0 to cuda:{count - 1})"
    return None


def check_generate(model: str, device: str) -> None:
    """`pagefleet generate` offline: the device, then the model's files, before loading
    (the device first: resolving a packaged model may convert it, which takes a while)."""
    problem = device_problem(device)
    if problem is not None:
        raise CommandError(problem)
    problem = model_problem(model)
    if problem is not None:
        raise CommandError(f"bad model: {problem}")


def port_flag(flag: str, port: int, *, may_disable: bool = False) -> int | None:
    """`port` checked by the config's port rule; -1 is None (disabled) where `may_disable`.
    CommandError names the flag."""
    from pagefleet.cluster.config import check_port

    if may_disable and port == -1:
        return None
    try:
        return check_port(port)
    except ValueError as exc:
        disabled = " (or -1: disabled)" if may_disable else ""
        raise CommandError(f"{flag} {exc}{disabled}") from None


def check_serve(config: ClusterConfig, *, local: bool, metrics_port: int | None) -> None:
    """`pagefleet serve`: every pool's model and device, and the metrics port, before Ray starts.

    On a remote cluster (`local=False`) the models and GPUs are the nodes', not
    this machine's, so only what does not depend on the machine is checked.
    """
    if metrics_port is not None:
        port_flag("--metrics-port", metrics_port, may_disable=True)
    if not local:
        return
    if config.server.gcs_fault_tolerance:
        # Fault tolerance is a GCS that comes back; nothing restarts a local Ray's.
        raise CommandError(
            "server.gcs_fault_tolerance needs --address: a Ray head started with RAY_REDIS_ADDRESS "
            "and restarted by its supervisor (the GCS of the Ray serve starts itself is not restarted)"
        )
    for i, pool in enumerate(config.pools):
        problem = model_problem(str(pool.engine.model))
        if problem is None and pool.device == "cuda":
            problem = device_problem("cuda")
        if problem is not None:
            raise CommandError(f"pools[{i}] ({pool.name}): {problem}")
    check_kv_fits(config)


def kv_bytes_per_block(pool: PoolConfig) -> int:
    """KV bytes of one block of `pool`, from its model's config (layers, KV heads, head
    dim) and its KV cache dtype."""
    from pagefleet.commands.plan import load_model_config
    from pagefleet.worker.kv_cache import ModelShape

    engine = pool.engine
    _, model_config = load_model_config(str(engine.model))
    dtype = engine.dtype if engine.kv_cache_dtype == "auto" else engine.kv_cache_dtype
    return ModelShape.from_hf_config(model_config, dtype).bytes_per_block(engine.block_size)


def check_kv_fits(config: ClusterConfig) -> None:
    """Refuse a KV pool this machine cannot hold: the blocks of every CPU worker together
    against its memory, one GPU worker's against one GPU's. (Only explicit sizes:
    `num_kv_blocks` or `kv_memory_bytes`; a pool sized from free memory fits by design.)"""
    import psutil

    from pagefleet.worker.sizes import format_bytes

    memory = psutil.virtual_memory().total
    taken = 0  # by the CPU pools before this one
    for i, pool in enumerate(config.pools):
        num_kv_blocks, kv_memory_bytes = pool.engine.num_kv_blocks, pool.engine.kv_memory_bytes
        if num_kv_blocks is None and kv_memory_bytes is None:
            continue
        block = kv_bytes_per_block(pool)
        blocks = num_kv_blocks if num_kv_blocks is not None else (kv_memory_bytes or 0) // block
        on_gpu = pool.device == "cuda" or (pool.device == "auto" and _gpus() > 0)
        if on_gpu:  # one worker per GPU
            limit, what, workers = _gpu_memory(), "one GPU's memory", 1
        else:
            limit, what, workers = memory - taken, "this machine's memory", pool.workers
            if taken:
                what += " left by the pools before it"
        if blocks * block * workers > limit:
            together = "" if on_gpu else f", {format_bytes(blocks * block * workers)} for its {workers}"
            raise CommandError(
                f"pools[{i}] ({pool.name}): {blocks} KV blocks of {format_bytes(block)} need "
                f"{format_bytes(blocks * block)} per worker{together}, more than {what} "
                f"({format_bytes(limit)}): at most {limit // (block * workers)} blocks per worker fit"
            )
        if not on_gpu:
            taken += blocks * block * workers


# Where a GPU driver lists its devices on Linux: NVIDIA's, and ROCm's kernel driver.
GPU_DRIVER_PATHS = (Path("/proc/driver/nvidia/gpus"), Path("/dev/kfd"))


def _gpus() -> int:
    """The GPUs torch sees; 0 without importing torch (a second or more of a start)
    on a Linux machine where no GPU driver is loaded."""
    if sys.platform.startswith("linux") and not any(p.exists() for p in GPU_DRIVER_PATHS):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _gpu_memory() -> int:
    import torch

    return int(torch.cuda.get_device_properties(0).total_memory)
