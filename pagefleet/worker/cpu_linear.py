"""The CPU float32 fast path of the decoder layers: fewer GEMMs, over prepacked weights.

`accelerate_cpu_layers(model)` rewrites a loaded model (`pagefleet.worker.llama`)
in place, once, at load, for a float32 model on the CPU:

- each attention module's q/k/v projections become one GEMM
  (`FusedQKVAttention`);
- each MLP's gate/up projections become one GEMM (`FusedGateUpMLP`), the
  activation's product taken in place;
- every linear layer left (the fused ones, o/down, the LM head) holds its
  weight packed once here, instead of inside every call, for the GEMM of
  this CPU (`PackedLinear`, `gemm_backend`): MKL's on Intel CPUs, oneDNN's
  elsewhere (MKL runs its slow generic kernels on AMD's: 2.2-4x slower than
  oneDNN's on the same shapes, benchmarks/cpu_gemm.py);
- RMSNorm, the fused MLP's SiLU and product, and the fused attention's RoPE
  with its K/V write, run in C, one pass each (`pagefleet.kernels.cpu_layers`:
  `CPURMSNorm`, `FusedGateUpMLP`, `FusedQKVAttention`), where the C library
  builds.

Elementwise, everything gives torch's bits (the C layers compute torch's
operations in torch's order); only the GEMM kernel differs (see `PackedLinear`).
Projections a LoRA adapter wraps (`LoRALinear`) are not fused: their layer
keeps its module and the wrapped base layer is packed in place, so the LoRA
delta still adds onto the base projection's output.
`PAGEFLEET_CPU_PACKED` (read at load): `auto` (or unset) the CPU's default,
`off` the plain modules and `F.linear`, `mkl` or `onednn` that GEMM (where
torch has it); any other value is refused.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagefleet.kernels.cpu_layers import LayerKernels, fits_rows, layer_kernels
from pagefleet.worker.llama import (
    Attention,
    GatedMLP,
    PagedAttentionMetadata,
    RMSNorm,
    attend,
    attend_written,
    rotate,
)

# MKL chooses its blocking for this many rows when it packs a weight. Packs for 256 to
# 2,048 rows run every batch from 8 to 2,048 rows at the same speed; packs for 16 or 64
# rows slow down batches larger than that (benchmarks/cpu_gemm.py, docs/benchmarks.md 14).
PACK_ROWS = 2048
SWITCH_ENV = "PAGEFLEET_CPU_PACKED"
MKL, ONEDNN = "mkl", "onednn"
SWITCH_VALUES = ("", "auto", "off", MKL, ONEDNN)


def _has_op(namespace: str, name: str) -> bool:
    try:
        getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):  # a build without that library's packed GEMM
        return False
    return True


def available_backends() -> list[str]:
    """The packed float32 GEMMs this torch build has."""
    found = []
    if torch.backends.mkl.is_available() and _has_op("mkl", "_mkl_linear"):
        found.append(MKL)
    if torch.backends.mkldnn.is_available() and _has_op("mkldnn", "_linear_pointwise"):
        found.append(ONEDNN)
    return found


@functools.cache
def _intel_cpu() -> bool:
    try:
        return "GenuineIntel" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def gemm_backend(device: torch.device, dtype: torch.dtype) -> str | None:
    """The packed GEMM `accelerate_cpu_layers` uses for float32 weights on the CPU
    (`MKL` on an Intel CPU, else `ONEDNN`; `PAGEFLEET_CPU_PACKED` may name either), or
    None: another device or dtype, `PAGEFLEET_CPU_PACKED=off`, or no packed GEMM in torch."""
    switch = os.environ.get(SWITCH_ENV, "").strip().lower()
    if switch not in SWITCH_VALUES:
        raise ValueError(
            f"{SWITCH_ENV} must be one of {', '.join(v for v in SWITCH_VALUES if v)} "
            f"(or unset), got {os.environ[SWITCH_ENV]!r}"
        )
    if switch == "off" or device.type != "cpu" or dtype != torch.float32:
        return None
    found = available_backends()
    preferred = [switch] if switch in (MKL, ONEDNN) else []
    preferred += [MKL, ONEDNN] if _intel_cpu() else [ONEDNN, MKL]
    return next((b for b in preferred if b in found), None)


class PackedLinear(nn.Module):
    """A float32 linear layer on the CPU whose weight is held packed for one GEMM.

    oneDNN (`ONEDNN`): `torch.ops.mkldnn._linear_pointwise` over a weight reordered
    once by `torch.ops.mkldnn._reorder_linear_weight`, what inductor and vLLM's CPU
    backend run for a float32 linear layer. Each row's output is the same whatever
    the batch around it; it agrees with `F.linear` to float32 round-off.

    MKL (`MKL`): `torch.ops.mkl._mkl_linear` over a weight packed once by
    `torch.ops.mkl._mkl_reorder_linear_weight` (`cblas_sgemm_pack`), as
    inductor compiles a float32 linear layer with weight prepacking on: the
    GEMM (`cblas_sgemm_compute`) no longer packs the weight on every call.
    Same sums as `F.linear` from 16 rows up (bit-identical on the machines
    measured); below that MKL's unpacked path takes another kernel, and the
    two agree to float32 round-off.

    No dense copy of the weight is kept: the op falls back to `F.linear` on
    its dense weight only when its `batch_size` argument differs from the
    rows, and `forward` always passes the rows, so the dense argument is a
    broadcast stand-in that carries the shape alone.
    """

    def __init__(self, linear: nn.Linear, backend: str = MKL) -> None:
        super().__init__()
        if backend not in (MKL, ONEDNN):
            raise ValueError(f"packed GEMM backend must be {MKL!r} or {ONEDNN!r}, got {backend!r}")
        self.backend = backend
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        # Plain attributes, not buffers: an opaque packed tensor cannot be moved or saved.
        if backend == ONEDNN:
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS)
        else:
            self.packed_weight = torch.ops.mkl._mkl_reorder_linear_weight(weight, PACK_ROWS)
        self._shape_only = weight.new_zeros(1, 1).expand(self.out_features, self.in_features)
        self.bias: torch.Tensor | None = (
            None if linear.bias is None else linear.bias.detach().clone()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor
        if self.backend == ONEDNN:
            out = torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
            return out
        rows = x.numel() // self.in_features
        out = torch.ops.mkl._mkl_linear(x, self.packed_weight, self._shape_only, self.bias, rows)
        return out

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"packed={self.backend}"
        )


def fuse_linears(layers: Sequence[Any]) -> nn.Linear:
    """One `nn.Linear` whose output is the outputs of `layers` side by side (same input)."""
    first = layers[0]
    has_bias = [m.bias is not None for m in layers]
    if any(m.in_features != first.in_features for m in layers) or len(set(has_bias)) != 1:
        raise ValueError("fused projections need the same input width and all or no biases")
    out = sum(m.out_features for m in layers)
    # Made on the meta device (no random init to overwrite), then given the weights.
    fused = nn.Linear(first.in_features, out, bias=has_bias[0], device="meta")
    fused.weight = nn.Parameter(torch.cat([m.weight.detach() for m in layers]), requires_grad=False)
    if has_bias[0]:
        fused.bias = nn.Parameter(
            torch.cat([m.bias.detach() for m in layers]), requires_grad=False
        )
    return fused


class CPURMSNorm(RMSNorm):
    """An `RMSNorm` whose float32 rows `[tokens, width]` are normalized in one pass by the
    C layers (torch's bits); any other input takes `RMSNorm`'s operations."""

    def __init__(self, norm: RMSNorm, kernels: LayerKernels) -> None:
        super().__init__(norm.weight.shape[0], norm.variance_epsilon)
        self.weight = norm.weight
        self.kernels = kernels

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if (
            hidden.dim() == 2
            and fits_rows(hidden)
            and weight.is_contiguous()
            and weight.dtype == hidden.dtype
        ):
            return self.kernels.rms_norm(hidden, weight, self.variance_epsilon)
        return super().forward(hidden)


class FusedQKVAttention(nn.Module):
    """An `Attention` whose q/k/v come out of one projection; called as the module it replaces.

    With `kernels`, RoPE of q and k and the K/V write into the pool are one C pass over the
    projection's rows (the bits of `llama.rotate` and `write_kv`), which leaves q contiguous
    for the attention."""

    def __init__(
        self, attn: Attention, qkv_proj: nn.Module, kernels: LayerKernels | None = None
    ) -> None:
        super().__init__()
        self.kernels = kernels
        self.layer_idx = attn.layer_idx
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        q_proj: Any = attn.q_proj
        k_proj: Any = attn.k_proj
        self.split_heads = (
            q_proj.out_features // self.head_dim,
            k_proj.out_features // self.head_dim,
            k_proj.out_features // self.head_dim,
        )
        self.qkv_proj = qkv_proj
        self.o_proj: nn.Module = attn.o_proj

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        metadata: PagedAttentionMetadata,
    ) -> torch.Tensor:
        tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden).view(tokens, -1, self.head_dim)
        caches = metadata.kv_cache.layer(self.layer_idx)
        if (
            self.kernels is not None
            and self.kernels.writes(*caches)
            and fits_rows(qkv)
            and fits_rows(cos)
            and sin.stride() == cos.stride()
        ):
            q = self.kernels.rope_write(qkv, cos, sin, self.split_heads[0], *caches,
                                        metadata.slot_mapping)  # fmt: skip
            out = attend_written(q, metadata, self.layer_idx, self.scaling)
        else:
            q, k, v = qkv.split(self.split_heads, dim=-2)  # [tokens, heads, dim]
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            out = attend(q, k, v, metadata, self.layer_idx, self.scaling)
        result: torch.Tensor = self.o_proj(out.reshape(tokens, -1))
        return result


class FusedGateUpMLP(nn.Module):
    """A `GatedMLP`, `down(act(gate(x)) * up(x))`, with gate/up computed by one projection;
    with `kernels` and SiLU, the activation and product are one C pass (torch's bits)."""

    def __init__(
        self, mlp: GatedMLP, gate_up_proj: nn.Module, kernels: LayerKernels | None = None
    ) -> None:
        super().__init__()
        self.kernels = kernels
        gate_proj: Any = mlp.gate_proj
        self.intermediate_size: int = gate_proj.out_features
        self.gate_up_proj = gate_up_proj
        self.down_proj: nn.Module = mlp.down_proj
        self.act_fn = mlp.act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if (
            self.kernels is not None
            and self.act_fn is F.silu
            and gate_up.dim() == 2
            and fits_rows(gate_up)
        ):
            hidden = self.kernels.silu_mul(gate_up, self.intermediate_size)
        else:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            hidden = self.act_fn(gate)
            hidden.mul_(up)  # act(gate) is a fresh tensor: the product needs no second one
        out: torch.Tensor = self.down_proj(hidden)
        return out


def _plain(module: Any) -> bool:
    return type(module) is nn.Linear


def accelerate_cpu_layers(model: Any, backend: str) -> None:
    """Fuse the decoder layers of a float32 CPU model and pack them for `backend`, in place.

    A layer whose attention or MLP projections a LoRA adapter wraps
    (`LoRALinear`) keeps that module; every plain `nn.Linear` left, a
    `LoRALinear`'s base included, is packed. Every RMSNorm, the fused MLPs' SiLU and
    product, and the fused attentions' RoPE and K/V write run in C where the library builds.
    """
    kernels = layer_kernels()

    def _pack(module: Any) -> nn.Module:
        return PackedLinear(module, backend) if _plain(module) else module  # type: ignore[no-any-return]

    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if isinstance(attn, Attention) and all(
            _plain(m) for m in (attn.q_proj, attn.k_proj, attn.v_proj)
        ):
            qkv = _pack(fuse_linears([attn.q_proj, attn.k_proj, attn.v_proj]))
            attn.o_proj = _pack(attn.o_proj)
            layer.self_attn = FusedQKVAttention(attn, qkv, kernels)
        if isinstance(mlp, GatedMLP) and _plain(mlp.gate_proj) and _plain(mlp.up_proj):
            gate_up = _pack(fuse_linears([mlp.gate_proj, mlp.up_proj]))
            mlp.down_proj = _pack(mlp.down_proj)
            layer.mlp = FusedGateUpMLP(mlp, gate_up, kernels)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if _plain(child):
                setattr(module, name, PackedLinear(child, backend))
            elif kernels is not None and type(child) is RMSNorm:
                setattr(module, name, CPURMSNorm(child, kernels))
