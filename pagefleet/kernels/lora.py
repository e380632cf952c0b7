"""Multi-LoRA deltas over a packed batch (punica SGMV semantics).

One step packs every sequence's tokens into one row; each token carries the
device slot of its sequence's adapter (-1: the base model). `lora_segments`
sorts the LoRA tokens by slot once per step, and `add_lora` then adds, for each
segment (the tokens of one slot), ``scale[s] * (x @ A[s]^T) @ B[s]^T`` to the
projection's output rows: two gathered matmuls per segment, however many
sequences share the adapter.

Slot weights are stacked per projection: ``A [slots, rank, in]`` and
``B [slots, out, rank]`` (ranks below the stack's are zero-padded, which adds
nothing). CUDA tensors run the Triton kernel (`triton_lora`); everything else
the torch path here, which is also the kernel's test oracle.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagefleet.kernels.dispatch import choose_backend
from pagefleet.kernels.transfer import host_to_device


@dataclass(frozen=True)
class LoRASegments:
    """The LoRA tokens of one step grouped by slot.

    `token_order` lists the tokens with a slot, segment after segment; segment
    `i` is ``token_order[starts[i] : starts[i] + lens[i]]``, all of slot
    `slots[i]`. The host lists drive the torch path; the device tensors the kernel.
    """

    token_order: torch.Tensor  # [num_lora_tokens] int64
    starts: list[int]
    lens: list[int]
    slots: list[int]
    starts_t: torch.Tensor  # [num_segments] int32
    lens_t: torch.Tensor
    slots_t: torch.Tensor
    num_tokens: int  # tokens in the whole batch, LoRA or not

    @property
    def max_len(self) -> int:
        return max(self.lens)


def lora_segments(token_slots: list[int], device: torch.device | str) -> LoRASegments | None:
    """Group the packed batch's tokens by adapter slot; None when no token has one."""
    order = sorted((s, t) for t, s in enumerate(token_slots) if s >= 0)
    if not order:
        return None
    starts: list[int] = []
    lens: list[int] = []
    slots: list[int] = []
    for i, (slot, _) in enumerate(order):
        if not slots or slots[-1] != slot:
            starts.append(i)
            lens.append(0)
            slots.append(slot)
        lens[-1] += 1

    def as_tensor(values: list[int], dtype: torch.dtype) -> torch.Tensor:
        return host_to_device(torch.tensor(values, dtype=dtype), device)

    return LoRASegments(
        token_order=as_tensor([t for _, t in order], torch.int64),
        starts=starts,
        lens=lens,
        slots=slots,
        starts_t=as_tensor(starts, torch.int32),
        lens_t=as_tensor(lens, torch.int32),
        slots_t=as_tensor(slots, torch.int32),
        num_tokens=len(token_slots),
    )


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scale: torch.Tensor,
    segments: LoRASegments,
) -> None:
    """In place: ``y[t] += scale[s] * (x[t] @ lora_a[s]^T) @ lora_b[s]^T`` for each LoRA token.

    `y` ``[num_tokens, out]``, `x` ``[num_tokens, in]``, `lora_a`
    ``[slots, rank, in]``, `lora_b` ``[slots, out, rank]``, `scale` ``[slots]``
    (0 for a slot whose adapter does not target this projection). Tokens
    without a slot are untouched.
    """
    if choose_backend(x) == "triton":
        from pagefleet.kernels.triton_lora import add_lora_triton

        add_lora_triton(y, x, lora_a, lora_b, scale, segments)
    else:
        add_lora_reference(y, x, lora_a, lora_b, scale, segments)


def add_lora_reference(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scale: torch.Tensor,
    segments: LoRASegments,
) -> None:
    """The torch path of `add_lora`: two matmuls per segment, gathered and scattered."""
    whole = len(segments.slots) == 1 and segments.lens[0] == segments.num_tokens
    host_scale = scale.tolist()  # one sync, then plain floats per segment
    for start, length, slot in zip(segments.starts, segments.lens, segments.slots, strict=True):
        s = host_scale[slot]
        if s == 0.0:
            continue  # this slot's adapter does not target the projection
        if whole:  # one adapter for the whole batch: no gather, no scatter
            y.add_((x @ lora_a[slot].T) @ lora_b[slot].T, alpha=s)
            return
        rows = segments.token_order[start : start + length]
        delta = (x.index_select(0, rows) @ lora_a[slot].T) @ lora_b[slot].T
        y.index_add_(0, rows, delta, alpha=s)
