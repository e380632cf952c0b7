"""The decoder's elementwise layers in C for float32 on the CPU (`cpu_layers.c`): RMSNorm, the
MLP's SiLU and gated product, and RoPE with the step's K/V write, each one pass over the
step's rows instead of torch's several; and the sampler's greedy picks over a step's logits.

Each gives torch's bits exactly (RMSNorm adds its squares in the order of torch's CPU
reduction, SiLU takes torch's own exp), and a row's result does not depend on its batch.
Both come from the library `cpu_decode` builds; `layer_kernels()` is None where it cannot be
built, and the callers keep torch's operations there.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from pagefleet.kernels.cpu_decode import library

# The widest head RoPE's C pass takes (MAX_HEAD_DIM in cpu_layers.c: a stack row).
ROPE_MAX_HEAD_DIM = 1024
# The cache dtypes RoPE's C pass writes, and its function for each.
_ROPE_WRITE = {torch.float32: "pf_rope_write_f32", torch.float16: "pf_rope_write_f32_f16"}


@dataclass(frozen=True)
class LayerKernels:
    """The C functions of `cpu_layers.c`, with tensor arguments."""

    lib: ctypes.CDLL

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """transformers' RMSNorm of the float32 rows `x` `[rows, width]` (unit stride along
        the width), scaled by `weight` `[width]`; a new contiguous tensor."""
        rows, width = x.shape
        out = torch.empty(rows, width, dtype=torch.float32)
        self.lib.pf_rms_norm_f32(
            x.data_ptr(), x.stride(0), weight.data_ptr(), rows, width, eps,
            out.data_ptr(), width, torch.get_num_threads(),
        )  # fmt: skip
        return out

    def silu_mul(self, gate_up: torch.Tensor, inner: int) -> torch.Tensor:
        """`F.silu(gate) * up` of one fused gate/up projection's float32 rows `gate_up`
        `[rows, 2 * inner]` (gate, then up; unit stride along a row): a new contiguous
        `[rows, inner]`, torch's bits."""
        rows = gate_up.shape[0]
        if gate_up.shape[1] != 2 * inner:
            raise ValueError(f"gate/up rows of {gate_up.shape[1]} are not twice {inner}")
        out = torch.empty(rows, inner, dtype=torch.float32)
        self.lib.pf_silu_mul_f32(gate_up.data_ptr(), gate_up.stride(0), rows, inner,
                                 out.data_ptr(), torch.get_num_threads())  # fmt: skip
        return out

    def greedy(self, logits: torch.Tensor) -> list[int]:
        """Each row's greedy token of the float32 `logits` `[rows, vocab]` (unit stride along
        a row): the index of its first maximum, or -1 for a row holding a NaN or +inf; what
        `logits.max(dim=-1)` says, in one pass (about 6x faster than torch's on a step's
        logits)."""
        rows, vocab = logits.shape
        index = torch.empty(rows, dtype=torch.int64)
        status = self.lib.pf_greedy_f32(logits.data_ptr(), logits.stride(0), rows, vocab,
                                        index.data_ptr(), torch.get_num_threads())  # fmt: skip
        if status != 0:
            raise ValueError(f"greedy picks in C take 1 to 2**31 - 1 columns, got {vocab}")
        return index.tolist()  # type: ignore[no-any-return]

    def writes(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
        """True when `rope_write` takes this layer's caches: contiguous, float32 or float16,
        an even head_dim of at most `ROPE_MAX_HEAD_DIM`."""
        head_dim = k_cache.shape[-1]
        return (
            k_cache.dtype in _ROPE_WRITE
            and head_dim % 2 == 0
            and head_dim <= ROPE_MAX_HEAD_DIM
            and v_cache.dtype == k_cache.dtype
            and k_cache.is_contiguous()
            and v_cache.is_contiguous()
        )

    def rope_write(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        q_heads: int,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> torch.Tensor:
        """One step's q/k/v from one fused projection, `qkv` `[rows, heads, head_dim]` (q heads,
        then k, then v; unit stride within a row), with each row's `cos`/`sin` `[rows, 1,
        head_dim]`: RoPE of q into a new contiguous `[rows, q_heads, head_dim]` (returned),
        RoPE of k and v as it is written into the caches `[num_blocks, block_size, kv_heads,
        head_dim]` at `slot_mapping` (int64 `[rows]`, -1 = skipped). The bits of `llama.rotate`
        and `write_kv`."""
        rows, heads, head_dim = qkv.shape
        kv_heads = k_cache.shape[2]
        if heads != q_heads + 2 * kv_heads or k_cache.shape[3] != head_dim:
            raise ValueError(
                f"{heads} projected heads of {head_dim} do not split into {q_heads} q heads and "
                f"the cache's k and v heads, {kv_heads} of {k_cache.shape[3]}"
            )
        slots = slot_mapping.to(torch.int64).contiguous()
        q = torch.empty(rows, q_heads, head_dim, dtype=torch.float32)
        status = getattr(self.lib, _ROPE_WRITE[k_cache.dtype])(
            qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), sin.data_ptr(), cos.stride(0),
            rows, q_heads, kv_heads, head_dim, q.data_ptr(), k_cache.data_ptr(),
            v_cache.data_ptr(), slots.data_ptr(), k_cache.shape[0] * k_cache.shape[1],
            torch.get_num_threads(),
        )  # fmt: skip
        if status == 2:
            raise IndexError(f"a slot of {slot_mapping.tolist()} is outside the cache's "
                             f"{k_cache.shape[0] * k_cache.shape[1]} slots")  # fmt: skip
        if status != 0:
            raise ValueError(
                f"RoPE in C takes an even head_dim of at most {ROPE_MAX_HEAD_DIM}, got {head_dim}"
            )
        return q


def layer_kernels() -> LayerKernels | None:
    """The C layers, or None where no library builds (no C compiler)."""
    lib = library()
    return None if lib is None else LayerKernels(lib)


def fits_rows(x: torch.Tensor) -> bool:
    """True for a float32 CPU tensor whose last dimension is dense and every other one
    collapses into one row stride (`[rows, ...]` rows the kernels can walk)."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() < 2:
        return False
    if x.is_contiguous():
        return True
    expected = 1
    for size, stride in zip(reversed(x.shape[1:]), reversed(x.stride()[1:]), strict=True):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True
