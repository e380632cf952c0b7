"""The C attention kernel (`cpu_decode.c`): built on first use, called through ctypes.

The library holds the elementwise layers of `cpu_layers.c` too (`pagefleet.kernels.cpu_layers`).

`cpu_attention` hands it every token of a step in one call per layer (a
prefill token is one query row over the positions up to its own);
it shares the sequences out over `torch.get_num_threads()` OpenMP threads,
torch's own (see cpu_decode.c).
`pagefleet.c_library` compiles it once per node and source version. Where no
compiler works, `decode_kernel` returns None once the build has failed (logged
once) and decode tokens take the per-sequence SDPA path.
``PAGEFLEET_CPU_DECODE=off`` turns the kernel off (the benchmarks' comparison).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import torch

from pagefleet import c_library

logger = logging.getLogger(__name__)

SWITCH_ENV = "PAGEFLEET_CPU_DECODE"

# (query dtype, cache dtype) -> the C function for them.
_FUNCTIONS = {
    (torch.float32, torch.float32): "pf_decode_f32",
    (torch.float32, torch.float16): "pf_decode_f32_f16",
    (torch.float32, torch.bfloat16): "pf_decode_f32_bf16",
    (torch.float64, torch.float64): "pf_decode_f64",
}
_ARGTYPES = [
    ctypes.c_void_p, ctypes.c_int64,  # q, q_row_stride
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,  # k, v, slot_stride
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,  # rows, tables, table_stride
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,  # seq, start, ctx
    ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,  # n_seqs, block_size, kv_heads
    ctypes.c_int64, ctypes.c_int64, ctypes.c_double,  # group, head_dim, scale
    ctypes.c_void_p, ctypes.c_int64,  # out, out_row_stride
    ctypes.c_int64, ctypes.c_int64,  # threads, prefetch_l1
]  # fmt: skip

DecodeKernel = Callable[..., None]


# The elementwise layers' C functions (`cpu_layers.c`) and their arguments.
LAYER_ARGTYPES = {
    "pf_silu_mul_f32": [
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,  # gate_up, stride, rows
        ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,  # inner, out, threads
    ],
    "pf_greedy_f32": [
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,  # logits, stride, rows
        ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,  # vocab, index_out, threads
    ],
    "pf_rms_norm_f32": [
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,  # x, x_stride, weight
        ctypes.c_int64, ctypes.c_int64, ctypes.c_double,  # rows, width, eps
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,  # out, out_stride, threads
    ],
    **{
        name: [
            ctypes.c_void_p, ctypes.c_int64,  # qkv, qkv_stride
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,  # cos, sin, trig_stride
            ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,  # rows, q/kv heads, head_dim
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,  # q_out, k_cache, v_cache
            ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,  # slots, num_slots, threads
        ]
        for name in ("pf_rope_write_f32", "pf_rope_write_f32_f16")
    },
}  # fmt: skip


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built library (attention and elementwise layers), or None where it cannot be built."""
    compiler = c_library.compiler()
    if compiler is None:
        logger.warning(
            "no C compiler (%s) found: CPU decode attention runs one SDPA call per sequence "
            "(slower); install one (e.g. gcc) for the fused kernel",
            os.environ.get("CC", "cc"),
        )
        return None
    try:
        lib = ctypes.CDLL(str(c_library.build(compiler)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning(
            "building the CPU decode kernel failed, decode attention runs one SDPA call per "
            "sequence (slower): %s", exc,
        )  # fmt: skip
        return None
    for name in _FUNCTIONS.values():
        fn = getattr(lib, name)
        fn.argtypes = _ARGTYPES
        fn.restype = ctypes.c_int
    for name, argtypes in LAYER_ARGTYPES.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int
    return lib


def l1_data_cache_bytes(cpu_caches: Path) -> int | None:
    """The size of a CPU's L1 data cache in bytes, from its directory of Linux's sysfs
    (`.../cpu0/cache`); None where it is not known."""
    units = {"K": 1 << 10, "M": 1 << 20}
    for index in sorted(cpu_caches.glob("index*")):
        try:
            level, kind = ((index / name).read_text().strip() for name in ("level", "type"))
            if level == "1" and kind in ("Data", "Unified"):
                size = (index / "size").read_text().strip()
                return int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
        except (OSError, ValueError):
            continue
    return None


@functools.cache
def this_cpu_l1_data_cache_bytes() -> int | None:
    """`l1_data_cache_bytes` of this machine's first CPU, read once."""
    return l1_data_cache_bytes(Path("/sys/devices/system/cpu/cpu0/cache"))


# The L1 data cache from which the kernel prefetches into L1 rather than L2.
L1_PREFETCH_MIN_BYTES = 48 * 1024


def prefetch_into_l1(l1_bytes: int | None) -> bool:
    """Whether the kernel prefetches the next K/V block into L1 rather than L2: on a CPU
    whose L1 data cache is at least `L1_PREFETCH_MIN_BYTES`. A proxy from two CPUs
    (docs/benchmarks.md 14.9): on a Zen 5 (48 KiB) L1 was 1.3x faster a decode step on
    SmolLM2's 12 KiB blocks and no slower on 32 and 64 KiB ones; on an earlier AVX-512
    EPYC (L1 size not recorded, likely a Zen 4's 32 KiB) it was 1.6x slower. Unknown: L2."""
    return l1_bytes is not None and l1_bytes >= L1_PREFETCH_MIN_BYTES


def enabled() -> bool:
    """False when ``PAGEFLEET_CPU_DECODE`` is off/0/false."""
    return os.environ.get(SWITCH_ENV, "on").strip().lower() not in ("off", "0", "false", "no")


def decode_kernel(query_dtype: torch.dtype, cache_dtype: torch.dtype) -> DecodeKernel | None:
    """The kernel for this query and cache dtype, or None (no compiler, switched off,
    or a pair it does not do: half-precision queries)."""
    name = _FUNCTIONS.get((query_dtype, cache_dtype))
    if name is None or not enabled():
        return None
    lib = library()
    if lib is None:
        return None
    fn = getattr(lib, name)

    def run(
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        rows: torch.Tensor,
        seq: torch.Tensor,
        start: torch.Tensor,
        ctx: torch.Tensor,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        """Decode rows `rows` of `query` into the same rows of `out` (see `cpu_decode.c`)."""
        _, num_q_heads, head_dim = query.shape
        block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
        into_l1 = prefetch_into_l1(this_cpu_l1_data_cache_bytes())
        status = fn(
            query.data_ptr(), query.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
            num_kv_heads * head_dim, rows.data_ptr(), block_tables.data_ptr(),
            block_tables.stride(0), seq.data_ptr(), start.data_ptr(), ctx.data_ptr(),
            rows.shape[0], block_size, num_kv_heads, num_q_heads // num_kv_heads, head_dim,
            scale, out.data_ptr(), out.stride(0), torch.get_num_threads(), int(into_l1),
        )  # fmt: skip
        if status == -1:
            raise MemoryError("the CPU decode kernel could not allocate its scratch rows")
        if status != 0:
            raise ValueError(f"the CPU decode kernel refused head shape {tuple(query.shape[1:])}")

    return run


# Bound of the kernel's stack arrays (`MAX_CHUNKS` vectors of a head, in cpu_decode.c).
MAX_HEAD_DIM = 256


def fits(tensor: torch.Tensor) -> bool:
    """True when `tensor` ``[rows, heads, head_dim]`` has dense heads (any row stride)."""
    return tensor.stride(2) == 1 and tensor.stride(1) == tensor.shape[2]


def shape_fits(num_kv_heads: int, head_dim: int) -> bool:
    """True for the head shapes the kernel takes: head_dim a multiple of 8 (its vector
    lanes) and at most `MAX_HEAD_DIM` (any number of KV heads)."""
    return head_dim % 8 == 0 and head_dim <= MAX_HEAD_DIM
