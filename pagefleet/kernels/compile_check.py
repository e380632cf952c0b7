"""Compile the Triton kernels for a GPU target on a machine without a GPU.

``python -m pagefleet.kernels.compile_check`` compiles every kernel at the
launch configurations ``paged_attention_triton`` picks on a GPU, for sm_90
(H100/H200), with the specialisation a real launch gets (16-byte aligned
pointers, strides divisible by 16). Triton's wheel bundles ptxas, so this runs
anywhere triton does. The Triton interpreter accepts code the compiler
rejects; this catches it before a GPU session. Exit 0 when all compile, 1 on
a failure, 3 when this triton build has no NVIDIA backend.
Run it without TRITON_INTERPRET set.
"""

from __future__ import annotations

import sys
from typing import Any

GPU_ARCH = 90

# (label, dtype, GQA group, max query length, head dim, KV splits, sliding window)
ATTENTION_CASES = [
    ("decode bf16", "bf16", 4, 1, 128, 1, False),
    ("split-KV decode bf16", "bf16", 4, 1, 128, 8, False),
    ("prefill fp16 + window", "fp16", 4, 512, 128, 1, True),
    ("decode bf16 head dim 80", "bf16", 8, 1, 80, 1, False),
]


def compile_kernel(
    kernel: Any, types: dict[str, str], constexprs: dict[str, Any], num_warps: int
) -> set[str]:
    """Compile one kernel for sm_90; returns the names of the stages produced."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    # Interpreted wrappers (TRITON_INTERPRET) keep the raw function in .fn.
    fn = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn)
    names = fn.arg_names
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, n in enumerate(names)
        if n not in constexprs and (n.endswith("_ptr") or n.startswith("stride_"))
    }
    src = ASTSource(
        fn, signature, {(names.index(n),): v for n, v in constexprs.items()}, attrs=attrs
    )
    compiled = triton.compile(
        src, target=GPUTarget("cuda", GPU_ARCH, 32), options={"num_warps": num_warps}
    )
    return set(compiled.asm)


def attention_types(dtype: str) -> dict[str, str]:
    types = {n: f"*{dtype}" for n in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr")}
    for n in ("block_tables_ptr", "query_start_loc_ptr", "context_lens_ptr"):
        types[n] = "*i32"
    types.update({"partial_out_ptr": "*fp32", "partial_lse_ptr": "*fp32", "scale_log2": "fp32"})
    return types


def main() -> int:
    import triton
    from triton.backends import backends

    if "nvidia" not in backends:
        print("this triton build has no NVIDIA backend")
        return 3
    from pagefleet.kernels.triton_attention import (
        _paged_attention_kernel,
        _reduce_splits_kernel,
        tile_sizes,
    )
    from pagefleet.kernels.triton_write_kv import _write_kv_kernel

    jobs: list[tuple[str, Any, dict[str, str], dict[str, Any], int]] = []
    for label, dtype, group, max_q, head_dim, splits, window in ATTENTION_CASES:
        block_m, block_n, num_warps = tile_sizes(True, group, max_q, head_dim)
        constexprs = {
            "HEAD_DIM": head_dim,
            "PAGE_SIZE": 16,
            "GROUP": group,
            "BLOCK_M": block_m,
            "BLOCK_Q": block_m // group,
            "BLOCK_N": block_n,
            "BLOCK_D": triton.next_power_of_2(head_dim),
            "NUM_SPLITS": splits,
            "USE_WINDOW": window,
            "DOT_PRECISION": "tf32",
        }
        jobs.append((label, _paged_attention_kernel, attention_types(dtype), constexprs, num_warps))
    reduce_types = {"partial_out_ptr": "*fp32", "partial_lse_ptr": "*fp32", "out_ptr": "*bf16"}
    reduce_constexprs = {"HEAD_DIM": 128, "NUM_SPLITS": 8, "SPLITS_PAD": 8, "BLOCK_D": 128}
    jobs.append(("split reduce", _reduce_splits_kernel, reduce_types, reduce_constexprs, 4))
    write_types = {n: "*bf16" for n in ("key_ptr", "value_ptr", "k_cache_ptr", "v_cache_ptr")}
    write_types["slot_ptr"] = "*i64"
    jobs.append(("write_kv", _write_kv_kernel, write_types, {"BLOCK": 1024}, 4))

    failed = 0
    for label, kernel, types, constexprs, num_warps in jobs:
        try:
            stages = compile_kernel(kernel, types, constexprs, num_warps)
        except Exception as exc:  # report every failure, not only the first
            failed += 1
            print(f"{label}: FAILED: {exc}")
            continue
        ok = "cubin" in stages
        failed += not ok
        print(f"{label}: {'compiled' if ok else 'no cubin'} for sm_{GPU_ARCH} (warps {num_warps})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
