"""Checks shared by the Triton kernel launchers."""

from __future__ import annotations

import torch


def ensure_launchable(kernel: object, tensor: torch.Tensor) -> None:
    """Fail clearly when a compiled Triton kernel is handed CPU tensors.

    Triton reads ``TRITON_INTERPRET`` when ``@triton.jit`` decorates a kernel,
    i.e. when its module is first imported; after that, CPU tensors only work
    with interpreted kernels.
    """
    if tensor.is_cuda or type(kernel).__name__ == "InterpretedFunction":
        return
    raise RuntimeError(
        "Triton kernels got CPU tensors but were compiled for a GPU; set TRITON_INTERPRET=1 "
        "before pagefleet.kernels' Triton modules are first imported, or use "
        "PAGEFLEET_ATTENTION=torch"
    )
