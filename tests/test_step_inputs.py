"""The decode step's buckets, padding and input buffers: the GPU path's shapes, checked on the CPU.

On CUDA a decode-only step is padded to a bucket (batch size x block-table
width) and replayed from a CUDA graph captured for it. The CPU never pads or
captures; here the padding is driven through the real model by hand to show
that it changes nothing the engine keeps: the real rows' logits and the KV
pool. Graph capture itself needs a GPU (`benchmarks/gpu_check.sh`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
from smollm2 import smollm2_dir

from pagefleet import LLM, SamplingParams
from pagefleet.worker.config import EngineConfig, InvalidField
from pagefleet.worker.cpu_linear import ONEDNN, SWITCH_ENV, available_backends
from pagefleet.worker.cuda_graph import DecodeGraphs
from pagefleet.worker.kv_cache import KVCache
from pagefleet.worker.model_runner import ModelRunner
from pagefleet.worker.step_inputs import (
    StepBatch,
    StepInputs,
    block_table_widths,
    bucket_of,
    decode_batch_sizes,
    decode_bucket,
    pad_decode_batch,
)

BLOCK_SIZE = 16
CPU = torch.device("cpu")


def decode_batch(num_seqs: int, blocks: int = 1, lora_slots: list[int] | None = None) -> StepBatch:
    """`num_seqs` decode tokens, sequence i at position 10 + i in blocks of its own."""
    return StepBatch(
        input_ids=[100 + i for i in range(num_seqs)],
        positions=[10 + i for i in range(num_seqs)],
        slot_mapping=[(blocks * i) * BLOCK_SIZE + 10 + i for i in range(num_seqs)],
        query_start_loc=list(range(num_seqs + 1)),
        context_lens=[11 + i for i in range(num_seqs)],
        block_tables=[list(range(blocks * i, blocks * (i + 1))) for i in range(num_seqs)],
        lora_slots=lora_slots,
    )


# ----- buckets ---------------------------------------------------------------------------


def test_decode_batch_sizes_are_1_2_4_8_then_multiples_of_8_up_to_max_num_seqs() -> None:
    assert decode_batch_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert decode_batch_sizes(20) == (1, 2, 4, 8, 16, 20)  # the largest is always a bucket
    assert decode_batch_sizes(8) == (1, 2, 4, 8)
    assert decode_batch_sizes(3) == (1, 2, 3)
    assert decode_batch_sizes(1) == (1,)
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1"):
        decode_batch_sizes(0)


def test_block_table_widths_are_powers_of_two_then_the_widest_table() -> None:
    assert block_table_widths(128) == (1, 2, 4, 8, 16, 32, 64, 128)
    assert block_table_widths(100) == (1, 2, 4, 8, 16, 32, 64, 100)
    assert block_table_widths(1) == (1,)


def test_a_value_goes_to_the_smallest_bucket_that_holds_it() -> None:
    sizes = decode_batch_sizes(20)
    assert [bucket_of(n, sizes) for n in (1, 3, 4, 5, 9, 17, 20)] == [1, 4, 4, 8, 16, 20, 20]
    assert bucket_of(21, sizes) is None


def test_only_a_decode_step_without_lora_within_the_largest_buckets_has_a_bucket() -> None:
    sizes, widths = decode_batch_sizes(8), block_table_widths(8)
    assert decode_bucket(decode_batch(3, blocks=3), sizes, widths) == (4, 4)
    assert decode_bucket(decode_batch(8, blocks=8), sizes, widths) == (8, 8)
    assert decode_bucket(decode_batch(9), sizes, widths) is None  # more sequences than any bucket
    assert decode_bucket(decode_batch(2, blocks=9), sizes, widths) is None  # a table too wide
    base_only = decode_batch(2, lora_slots=[-1, -1])
    assert decode_bucket(base_only, sizes, widths) == (2, 1)
    assert decode_bucket(decode_batch(2, lora_slots=[-1, 0]), sizes, widths) is None
    prefill = StepBatch([1, 2, 3], [0, 1, 2], [0, 1, 2], [0, 3], [3], [[0]])
    assert decode_bucket(prefill, sizes, widths) is None


# ----- padding ---------------------------------------------------------------------------


def test_padding_rows_follow_the_real_ones_write_nothing_and_read_block_0() -> None:
    batch = decode_batch(3, blocks=2, lora_slots=[-1, 1, -1])
    padded = pad_decode_batch(batch, 4, 4)
    padded.validate()
    assert padded.input_ids == [*batch.input_ids, 0]
    assert padded.positions == [*batch.positions, 0]
    assert padded.slot_mapping == [*batch.slot_mapping, -1]  # write_kv skips slot -1
    assert padded.query_start_loc == [0, 1, 2, 3, 4]
    assert padded.context_lens == [*batch.context_lens, 1]
    assert padded.block_tables == [[0, 1, 0, 0], [2, 3, 0, 0], [4, 5, 0, 0], [0, 0, 0, 0]]
    assert padded.lora_slots == [-1, 1, -1, -1]
    assert batch.num_seqs == 3 and batch.block_tables[0] == [0, 1]  # the input is not changed


def test_only_a_decode_batch_pads_and_never_to_fewer_rows_or_narrower_tables() -> None:
    prefill = StepBatch([1, 2, 3], [0, 1, 2], [0, 1, 2], [0, 3], [3], [[0]])
    with pytest.raises(ValueError, match="only a decode-only batch pads"):
        pad_decode_batch(prefill, 4, 1)
    with pytest.raises(ValueError, match="cannot pad 3 sequences of 2 blocks to 2 of 2"):
        pad_decode_batch(decode_batch(3, blocks=2), 2, 2)
    with pytest.raises(ValueError, match="cannot pad 3 sequences of 2 blocks to 4 of 1"):
        pad_decode_batch(decode_batch(3, blocks=2), 4, 1)


# ----- step input buffers -----------------------------------------------------------------


def test_step_inputs_hold_the_batch_with_tables_padded_by_zeros() -> None:
    batch = StepBatch([5, 6, 7, 8], [0, 1, 2, 9], [32, 33, 34, 41], [0, 3, 4], [3, 10], [[2], [1, 4]])
    tensors = StepInputs(CPU, max_tokens=8, max_seqs=4, max_width=4).load(batch)
    assert tensors.input_ids.tolist() == [5, 6, 7, 8]
    assert tensors.positions.tolist() == [0, 1, 2, 9]
    assert tensors.slot_mapping.tolist() == [32, 33, 34, 41]
    assert tensors.last_rows.tolist() == [2, 3]
    assert tensors.query_start_loc.tolist() == [0, 3, 4]
    assert tensors.context_lens.tolist() == [3, 10]
    assert tensors.block_tables.tolist() == [[2, 0], [1, 4]]
    assert tensors.block_tables.dtype == torch.int32 and tensors.block_tables.is_contiguous()
    assert tensors.input_ids.dtype == tensors.slot_mapping.dtype == torch.int64


def test_steps_of_one_bucket_load_at_the_same_addresses_as_a_graph_replays_them() -> None:
    inputs = StepInputs(CPU, max_tokens=8, max_seqs=8, max_width=8, grow=False)
    first = inputs.load(pad_decode_batch(decode_batch(3, blocks=2), 4, 4))
    pointers = [t.data_ptr() for t in vars(first).values()]
    other = inputs.load(pad_decode_batch(decode_batch(4, blocks=3), 4, 4))
    assert [t.data_ptr() for t in vars(other).values()] == pointers
    assert other.input_ids.tolist() == [100, 101, 102, 103]
    for tensor in vars(other).values():  # 16-byte aligned: one Triton specialization per kernel
        assert tensor.data_ptr() % 16 == 0


def test_fixed_step_buffers_refuse_a_larger_step_and_growing_ones_grow() -> None:
    fixed = StepInputs(CPU, max_tokens=4, max_seqs=4, max_width=2, grow=False)
    with pytest.raises(ValueError, match="5 tokens, 5 sequences and 1 blocks per table does not fit"):
        fixed.load(decode_batch(5))
    growing = StepInputs(CPU, max_tokens=4, max_seqs=4, max_width=2)
    assert growing.load(decode_batch(5, blocks=3)).block_tables.shape == (5, 3)
    longs, ints = growing.capacity
    assert longs >= 5 * 3 + 5 and ints >= 6 + 5 + 5 * 3


# ----- the real model, padded by hand ------------------------------------------------------


@dataclass
class Decode:
    """A SmolLM2 runner with three prompts prefilled and their first decode step ready."""

    runner: ModelRunner
    kv: KVCache
    step: StepBatch


@pytest.fixture(scope="module")
def smollm2_decode() -> Iterator[Decode]:
    # oneDNN's GEMM gives each row the same sums whatever the rows around it; MKL's (the
    # default on Intel CPUs, and F.linear's) takes other kernels for 1-3 rows and for the
    # rows past a multiple of 4, so there padding 3 rows to 4 moves the logits by float
    # rounding (5e-5 on these three).
    if ONEDNN not in available_backends():
        pytest.skip("torch has no oneDNN packed GEMM here")
    with pytest.MonkeyPatch.context() as env:
        env.setenv(SWITCH_ENV, ONEDNN)  # read at load
        runner = ModelRunner(smollm2_dir(), dtype="float32")
    assert runner.cpu_gemm == ONEDNN
    kv = KVCache(runner.model_shape, 16, BLOCK_SIZE)
    runner.bind_kv_cache(kv)
    tables = [[3, 7], [1, 12], [5, 9]]  # non-contiguous, the second block reached by decode
    lens = [9, 16, 31]
    gen = torch.Generator().manual_seed(18)
    prompts = [torch.randint(100, 40_000, (n,), generator=gen).tolist() for n in lens]

    def slot(table: list[int], position: int) -> int:
        return table[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE

    prefill = StepBatch([], [], [], [0], [], [])
    for prompt, table in zip(prompts, tables, strict=True):
        n = len(prompt)
        prefill.input_ids += prompt
        prefill.positions += range(n)
        prefill.slot_mapping += [slot(table, p) for p in range(n)]
        prefill.query_start_loc.append(prefill.query_start_loc[-1] + n)
        prefill.context_lens.append(n)
        prefill.block_tables.append(table[: -(-n // BLOCK_SIZE)])
    first_tokens = runner.execute(prefill).argmax(dim=-1).tolist()
    step = StepBatch(
        input_ids=first_tokens,
        positions=lens,
        slot_mapping=[slot(t, n) for t, n in zip(tables, lens, strict=True)],
        query_start_loc=[0, 1, 2, 3],
        context_lens=[n + 1 for n in lens],
        block_tables=[t[: -(-(n + 1) // BLOCK_SIZE)] for t, n in zip(tables, lens, strict=True)],
    )
    yield Decode(runner, kv, step)


@pytest.mark.parametrize(("num_seqs", "width"), [(3, 2), (4, 2), (4, 4), (8, 8), (64, 128)])
def test_a_padded_decode_step_gives_the_real_rows_bit_identical_logits(
    smollm2_decode: Decode, num_seqs: int, width: int
) -> None:
    runner, kv, step = smollm2_decode.runner, smollm2_decode.kv, smollm2_decode.step
    before = kv.tensor.clone()
    unpadded = runner.execute(step)
    kv.tensor.copy_(before)  # the padded step writes the same slots again, from the same pool
    padded = runner.execute(pad_decode_batch(step, num_seqs, width))
    assert padded.shape == (num_seqs, runner.vocab_size)
    assert torch.equal(padded[: step.num_seqs], unpadded)
    assert padded[: step.num_seqs].argmax(dim=-1).tolist() == unpadded.argmax(dim=-1).tolist()


def test_padding_rows_leave_the_kv_pool_untouched(smollm2_decode: Decode) -> None:
    runner, kv, step = smollm2_decode.runner, smollm2_decode.kv, smollm2_decode.step
    saved = kv.tensor.clone()
    try:
        kv.tensor.fill_(0.25)  # block 0, which the padding rows read, holds something
        runner.execute(pad_decode_batch(step, 8, 4))
        # [layers, 2, blocks, block_size, heads, dim] -> which slots changed, in any layer
        changed = (kv.tensor != 0.25).flatten(4).any(dim=4).any(dim=1).any(dim=0).flatten()
        assert changed.nonzero().flatten().tolist() == sorted(step.slot_mapping)
    finally:
        kv.tensor.copy_(saved)


def test_the_gpu_paths_padded_step_without_capture_gives_the_runners_logits(
    smollm2_decode: Decode,
) -> None:
    # DecodeGraphs as a CUDA runner drives it, minus the capture (which needs a GPU).
    runner, kv, step = smollm2_decode.runner, smollm2_decode.kv, smollm2_decode.step
    graphs = DecodeGraphs(runner.forward, kv, max_num_seqs=8, max_model_len=256, capture=False)
    assert graphs.bucket(step) == (4, 2)
    before = kv.tensor.clone()
    unpadded = runner.execute(step)
    kv.tensor.copy_(before)
    assert torch.equal(graphs.run(step, (4, 2)), unpadded)
    assert torch.equal(graphs.run(step, (8, 16)), unpadded)  # the widest bucket: 256 / 16
    assert graphs.graphs == {}
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA KV cache"):
        DecodeGraphs(runner.forward, kv, max_num_seqs=8, max_model_len=256, capture=True)


# ----- the engine on the CPU -----------------------------------------------------------


def test_the_cpu_neither_pads_nor_captures_with_graphs_enabled() -> None:
    prompts = [[5, 9, 33, 12], [7, 7, 100, 4, 18], [250, 3, 8]]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    graphs_on = LLM(model="tiny", num_kv_blocks=32, max_num_seqs=8, enforce_eager=False)
    runner = graphs_on.engine.runner
    tokens_per_forward: list[int] = []
    runner.model.model.register_forward_pre_hook(
        lambda _module, args: tokens_per_forward.append(args[0].shape[0])
    )
    outputs = graphs_on.generate(prompts, params)
    # One prefill of all three prompts, then five decode steps of three tokens, not four.
    assert tokens_per_forward == [12, 3, 3, 3, 3, 3]
    assert runner.num_cuda_graphs == 0
    eager = LLM(model="tiny", num_kv_blocks=32, max_num_seqs=8, enforce_eager=True)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in eager.generate(prompts, params)]


def test_enforce_eager_must_be_a_bool() -> None:
    assert EngineConfig().enforce_eager is False
    for value in ("yes", 1):
        with pytest.raises(InvalidField) as info:
            EngineConfig(enforce_eager=value)  # type: ignore[arg-type]
        assert info.value.field == "enforce_eager"
        assert str(info.value) == f"enforce_eager must be bool, got {type(value).__name__} {value!r}"
