"""What one engine step feeds the model: `StepBatch` (host lists), its decode buckets, and the
buffers that carry it to the device.

The engine builds a `StepBatch` per step; `StepInputs` turns it into device
tensors through buffers allocated once, one flat buffer per index dtype, so
a step is two host-to-device copies. On CUDA the host side is pinned and
the copies are queued with ``non_blocking=True``: building a step's inputs
never waits for the device. On the CPU the host buffers are the tensors the
model reads (pinning needs CUDA).

Decode buckets (CUDA only): a decode-only step (one new token per sequence)
is padded to the next of `decode_batch_sizes` sequences and its block
tables to the next of `block_table_widths` blocks, so that its shapes come
from a short list a CUDA graph can be captured for (`cuda_graph`). The
padding rows are dummy sequences that write nothing (slot -1) and whose
logits are dropped. On the CPU nothing is padded: it would only cost time.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# View starts are rounded up to 16 bytes: Triton specializes a kernel on its pointers'
# 16-byte alignment, so unaligned views would compile a second variant of each kernel.
_ALIGN_BYTES = 16


@dataclass
class StepBatch:
    """One engine step, sequences in order; host lists (the runner moves them to the device)."""

    input_ids: list[int]  # packed new tokens of every sequence
    positions: list[int]  # absolute position of each packed token
    slot_mapping: list[int]  # KV slot of each packed token (-1: write nothing)
    query_start_loc: list[int]  # [num_seqs + 1], cumulative new-token counts
    context_lens: list[int]  # per sequence: cached + new tokens
    block_tables: list[list[int]]  # per sequence: physical block ids
    # per sequence: its adapter's LoRA slot, -1 for the base model (None: all base)
    lora_slots: list[int] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def width(self) -> int:
        """Entries of the widest block table (at least 1: the kernels take a rectangle)."""
        return max(1, max((len(t) for t in self.block_tables), default=1))

    def validate(self) -> None:
        """Raise ValueError when the lists do not describe one consistent packed step."""
        n, s = self.num_tokens, self.num_seqs
        if len(self.positions) != n or len(self.slot_mapping) != n:
            raise ValueError(
                f"input_ids, positions and slot_mapping must have one entry per token: "
                f"{n}, {len(self.positions)}, {len(self.slot_mapping)}"
            )
        if self.lora_slots is not None and len(self.lora_slots) != s:
            raise ValueError(f"lora_slots needs one entry per sequence: {s}, got {len(self.lora_slots)}")
        if len(self.query_start_loc) != s + 1 or len(self.block_tables) != s:
            raise ValueError(
                f"query_start_loc needs num_seqs + 1 = {s + 1} entries (got "
                f"{len(self.query_start_loc)}) and block_tables {s} (got {len(self.block_tables)})"
            )
        if self.query_start_loc[0] != 0 or self.query_start_loc[-1] != n:
            raise ValueError(f"query_start_loc must run from 0 to num_tokens={n}")
        for i in range(s):
            q_len = self.query_start_loc[i + 1] - self.query_start_loc[i]
            if q_len < 1 or q_len > self.context_lens[i]:
                raise ValueError(
                    f"sequence {i}: {q_len} new tokens with context_len {self.context_lens[i]}; "
                    f"need 1 <= new tokens <= context_len"
                )


def decode_batch_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The batch sizes a decode step is padded to: 1, 2, 4, 8, then multiples of 8, up to
    `max_num_seqs`, which is always one (vLLM's CUDA graph capture sizes, capped)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    small = [s for s in (1, 2, 4) if s < max_num_seqs]
    return (*small, *range(8, max_num_seqs, 8), max_num_seqs)


def block_table_widths(max_blocks: int) -> tuple[int, ...]:
    """The block-table widths a decode step is padded to: the powers of two below
    `max_blocks` (the blocks of a `max_model_len` sequence), then `max_blocks` itself.

    A short-context step thus copies a narrow table, and attention's KV split
    count, chosen from the width, is fixed per bucket (a captured graph needs it).
    """
    if max_blocks < 1:
        raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
    widths: list[int] = []
    width = 1
    while width < max_blocks:
        widths.append(width)
        width *= 2
    return (*widths, max_blocks)


def bucket_of(value: int, buckets: Sequence[int]) -> int | None:
    """The smallest of the ascending `buckets` that holds `value`; None when none does."""
    index = bisect.bisect_left(buckets, value)
    return buckets[index] if index < len(buckets) else None


def decode_bucket(
    batch: StepBatch, batch_sizes: Sequence[int], widths: Sequence[int]
) -> tuple[int, int] | None:
    """(sequences, block-table width) that `batch` pads to, or None: a step with a prefill
    chunk, one with a LoRA adapter in it, or one beyond the largest bucket."""
    if batch.num_tokens != batch.num_seqs or batch.num_seqs == 0:
        return None
    if batch.lora_slots is not None and any(slot >= 0 for slot in batch.lora_slots):
        return None
    size = bucket_of(batch.num_seqs, batch_sizes)
    width = bucket_of(batch.width, widths)
    if size is None or width is None:
        return None
    return size, width


def pad_decode_batch(batch: StepBatch, num_seqs: int, width: int) -> StepBatch:
    """`batch` (decode only) padded to `num_seqs` sequences and every block table to `width`.

    A padding sequence has input id 0 at position 0, slot -1 (`write_kv` skips
    it: the KV pool is untouched), context_len 1 and a block table of zeros: it
    attends to position 0 of block 0, whatever that holds, and its logits row
    is dropped by the caller. Table entries past a sequence's blocks are never read.
    """
    real = batch.num_seqs
    if batch.num_tokens != real:
        raise ValueError(f"only a decode-only batch pads: {batch.num_tokens} tokens, {real} sequences")
    if num_seqs < real or width < batch.width:
        raise ValueError(
            f"cannot pad {real} sequences of {batch.width} blocks to {num_seqs} of {width}"
        )
    extra = num_seqs - real
    return StepBatch(
        input_ids=batch.input_ids + [0] * extra,
        positions=batch.positions + [0] * extra,
        slot_mapping=batch.slot_mapping + [-1] * extra,
        query_start_loc=batch.query_start_loc + list(range(real + 1, num_seqs + 1)),
        context_lens=batch.context_lens + [1] * extra,
        block_tables=[t + [0] * (width - len(t)) for t in batch.block_tables]
        + [[0] * width for _ in range(extra)],
        lora_slots=None if batch.lora_slots is None else batch.lora_slots + [-1] * extra,
    )


@dataclass(frozen=True)
class StepTensors:
    """One step's inputs on the device: views into `StepInputs`' buffers, valid until its next load."""

    input_ids: torch.Tensor  # [tokens] int64
    positions: torch.Tensor  # [tokens] int64
    slot_mapping: torch.Tensor  # [tokens] int64
    last_rows: torch.Tensor  # [seqs] int64: each sequence's last packed token
    query_start_loc: torch.Tensor  # [seqs + 1] int32
    context_lens: torch.Tensor  # [seqs] int32
    block_tables: torch.Tensor  # [seqs, width] int32


class StepInputs:
    """The device tensors of a step, through buffers allocated once.

    One flat buffer per index dtype: int64 for input ids, positions, slots
    and last rows, int32 for query starts, context lengths and block tables.
    A step's tensors are consecutive views, so steps of the same shapes get the
    same addresses (what a captured graph replays on). On CUDA each buffer has
    a pinned host twin; `load` fills it and queues one non-blocking copy per
    buffer. Before refilling the host side it waits for the previous step's
    copies out of it (`_copied`): queued ahead of that step's forward, they
    have long finished when the engine builds the next step, so the wait
    returns at once.

    `grow`: a step beyond the buffers reallocates them (the eager path: its
    first step may be the profiling forward); without it such a step is a
    ValueError (the buffers a captured graph reads must never move).
    """

    def __init__(
        self,
        device: torch.device,
        max_tokens: int,
        max_seqs: int,
        max_width: int,
        grow: bool = True,
    ) -> None:
        self.device = device
        self.grow = grow
        self._cuda = device.type == "cuda"
        self._copied: torch.cuda.Event | None = None
        self._allocate(_long_layout(max_tokens, max_seqs)[1], _int_layout(max_seqs, max_width)[1])

    def _allocate(self, num_longs: int, num_ints: int) -> None:
        self._host_longs = torch.zeros(num_longs, dtype=torch.long, pin_memory=self._cuda)
        self._host_ints = torch.zeros(num_ints, dtype=torch.int32, pin_memory=self._cuda)
        if self._cuda:
            self._longs = torch.zeros(num_longs, dtype=torch.long, device=self.device)
            self._ints = torch.zeros(num_ints, dtype=torch.int32, device=self.device)
        else:
            self._longs, self._ints = self._host_longs, self._host_ints

    @property
    def capacity(self) -> tuple[int, int]:
        """Elements of the int64 and int32 buffers."""
        return self._longs.numel(), self._ints.numel()

    def load(self, batch: StepBatch) -> StepTensors:
        """`batch` as device tensors; block tables padded with zeros to `batch.width`."""
        tokens, seqs, width = batch.num_tokens, batch.num_seqs, batch.width
        long_at, num_longs = _long_layout(tokens, seqs)
        int_at, num_ints = _int_layout(seqs, width)
        self._wait_for_copies()
        if num_longs > self.capacity[0] or num_ints > self.capacity[1]:
            if not self.grow:
                raise ValueError(
                    f"a step of {tokens} tokens, {seqs} sequences and {width} blocks per table "
                    f"does not fit these fixed step buffers"
                )
            self._allocate(max(num_longs, 2 * self.capacity[0]), max(num_ints, 2 * self.capacity[1]))
        last_rows = [q - 1 for q in batch.query_start_loc[1:]]
        longs = (batch.input_ids, batch.positions, batch.slot_mapping, last_rows)
        for start, values in zip(long_at, longs, strict=True):
            self._host_longs[start : start + len(values)] = torch.tensor(values, dtype=torch.long)
        ints = (batch.query_start_loc, batch.context_lens)
        for start, values in zip(int_at[:2], ints, strict=True):
            self._host_ints[start : start + len(values)] = torch.tensor(values, dtype=torch.int32)
        tables = [t + [0] * (width - len(t)) for t in batch.block_tables]
        table_at = int_at[2]
        self._host_ints[table_at : table_at + seqs * width].view(seqs, width)[:] = torch.tensor(
            tables, dtype=torch.int32
        )
        if self._cuda:
            self._longs[:num_longs].copy_(self._host_longs[:num_longs], non_blocking=True)
            self._ints[:num_ints].copy_(self._host_ints[:num_ints], non_blocking=True)
            if self._copied is None:
                self._copied = torch.cuda.Event()
            self._copied.record(torch.cuda.current_stream(self.device))
        ids, pos, slots, last = (
            self._longs[start : start + n]
            for start, n in zip(long_at, (tokens, tokens, tokens, seqs), strict=True)
        )
        return StepTensors(
            input_ids=ids,
            positions=pos,
            slot_mapping=slots,
            last_rows=last,
            query_start_loc=self._ints[int_at[0] : int_at[0] + seqs + 1],
            context_lens=self._ints[int_at[1] : int_at[1] + seqs],
            block_tables=self._ints[table_at : table_at + seqs * width].view(seqs, width),
        )

    def _wait_for_copies(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()


def _layout(sizes: Sequence[int], itemsize: int) -> tuple[list[int], int]:
    """Start of each part in a flat buffer (aligned to `_ALIGN_BYTES`), and its total length."""
    align = _ALIGN_BYTES // itemsize
    starts, end = [], 0
    for size in sizes:
        starts.append(end)
        end += -(-size // align) * align
    return starts, end


def _long_layout(tokens: int, seqs: int) -> tuple[list[int], int]:
    return _layout((tokens, tokens, tokens, seqs), 8)


def _int_layout(seqs: int, width: int) -> tuple[list[int], int]:
    return _layout((seqs + 1, seqs, seqs * width), 4)
