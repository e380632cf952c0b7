"""The decode step on CUDA at bucketed shapes, replayed from CUDA graphs.

A decode step of a small model on a GPU is hundreds of short kernels; the
host launching them one by one is slower than the device running them. A
CUDA graph records the launches once and replays them in one call. A graph
replays fixed shapes at fixed addresses, so a decode step is first padded to
a bucket (`step_inputs.decode_bucket`: batch size and block-table width) and
its inputs are written into fixed buffers (`StepInputs` with ``grow=False``);
each bucket's graph is captured the first time a step lands in it.

What a captured step may not do: synchronize with the host, allocate outside
the graph's memory pool, or take its shapes from device data. The Triton
attention gets its launch grid from host hints (`max_query_len` 1, and
`max_context_len` the bucket's width x block size, which fixes the KV split
count per bucket), so nothing in the step reads the device. Capture needs the
Triton kernels: float64 models and ``PAGEFLEET_ATTENTION=torch|cpu`` run the
same padded steps without graphs.

Graphs on or off (`EngineConfig.enforce_eager`), a CUDA decode step is padded
the same way, so the two run the same kernels on the same shapes and give the
same tokens: `benchmarks/gpu_engine.py` compares them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagefleet.worker.kv_cache import KVCache
from pagefleet.worker.step_inputs import (
    StepBatch,
    StepInputs,
    StepTensors,
    block_table_widths,
    decode_batch_sizes,
    decode_bucket,
    pad_decode_batch,
)

# The step itself: (tensors, max_query_len, max_context_len) -> logits [num_seqs, vocab].
StepForward = Callable[[StepTensors, int, int], torch.Tensor]


class DecodeGraphs:
    """Decode-only CUDA steps padded to buckets, replayed from one CUDA graph per bucket.

    `forward` runs a step on the bound `kv_cache` (`ModelRunner.forward`); the
    graphs hold that cache's addresses, so a runner bound to another cache
    makes a new `DecodeGraphs`. `capture` False runs the padded steps eagerly
    (on any device: the CPU tests drive it so).
    """

    def __init__(
        self,
        forward: StepForward,
        kv_cache: KVCache,
        max_num_seqs: int,
        max_model_len: int,
        capture: bool,
    ) -> None:
        if capture and kv_cache.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA KV cache, got {kv_cache.device}")
        self.kv_cache = kv_cache
        self.capture = capture
        self.max_model_len = max_model_len
        self.batch_sizes = decode_batch_sizes(max_num_seqs)
        self.widths = block_table_widths(-(-max_model_len // kv_cache.block_size))
        self.inputs = StepInputs(
            kv_cache.device, self.batch_sizes[-1], self.batch_sizes[-1], self.widths[-1], grow=False
        )
        self._forward = forward
        # bucket -> (graph, its static logits [bucket size, vocab])
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None

    def bucket(self, batch: StepBatch) -> tuple[int, int] | None:
        """(sequences, width) that `batch` runs padded to; None when it runs unpadded."""
        return decode_bucket(batch, self.batch_sizes, self.widths)

    def run(self, batch: StepBatch, bucket: tuple[int, int]) -> torch.Tensor:
        """Logits `[batch.num_seqs, vocab]` of the step, padded to `bucket` (from `self.bucket`).

        Replays the bucket's graph; the first step of a bucket runs eagerly and
        then captures it (a capture synchronizes the device once).
        """
        size, width = bucket
        tensors = self.inputs.load(pad_decode_batch(batch, size, width))
        captured = self.graphs.get(bucket)
        if captured is not None:
            graph, static_logits = captured
            graph.replay()
            # A copy: the next replay overwrites the static rows.
            return static_logits[: batch.num_seqs].clone()
        max_context_len = min(width * self.kv_cache.block_size, self.max_model_len)
        # Also the warm-up a capture needs: Triton compiles, cuBLAS picks its kernels.
        logits = self._forward(tensors, 1, max_context_len)
        if self.capture:
            graph = torch.cuda.CUDAGraph()
            # thread_local: another thread's CUDA calls (a Ray actor's, a tokenizer's)
            # must not invalidate the capture.
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                static_logits = self._forward(tensors, 1, max_context_len)
            self.graphs[bucket] = (graph, static_logits)
        return logits[: batch.num_seqs]
