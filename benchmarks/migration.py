"""Migrating a request to another worker: recompute its context there, or move its KV blocks?

Two ways to continue a request of `L` context tokens on another worker:

- **recompute** (what pagefleet does): the target prefills the `L` tokens
  (prompt + generated) through the model; timed as one engine prefill of `L`
  fresh tokens (prefix caching off, one chunk);
- **transfer**: the source gathers the request's `L / block_size` blocks from
  its KV pool (every layer, K and V), `ray.put`s them into the object store,
  and a Ray actor in another process (the target) `ray.get`s them and writes
  them into its own pool of the same shape; timed end to end from the
  driver.

Both run on this machine in one run, interleaved (recompute, transfer,
recompute, ...), and the medians are printed with their ratio and the load
average. Model: the packaged SmolLM2-135M by default (`--model`), float32,
block size 16; `--smoke` uses the tiny test model and short lengths.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings
from typing import Any

import _engine_bench as common
import numpy as np
import ray
import torch

from pagefleet.worker.config import EngineConfig
from pagefleet.worker.engine import LLMEngine
from pagefleet.worker.sampling_params import SamplingParams

BLOCK_SIZE = 16


class Target:
    """The receiving worker's KV pool: writes blocks that arrive through the object store."""

    def __init__(self, shape: tuple[int, ...], dtype: str) -> None:
        torch.set_num_threads(1)
        self.tensor = torch.zeros(shape, dtype=getattr(torch, dtype))

    def receive(self, refs: list[Any], block_ids: list[int]) -> float:
        """Fetch the blocks (`refs[0]`, bytes of a [layers, 2, n, ...] tensor) and write them."""
        start = time.perf_counter()
        raw = ray.get(refs[0])  # read-only (shared memory): only read from, never written
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            blocks = torch.from_numpy(raw).view(self.tensor.dtype).view(
                self.tensor.shape[0], self.tensor.shape[1], len(block_ids), *self.tensor.shape[3:]
            )
        self.tensor.index_copy_(2, torch.tensor(block_ids, dtype=torch.long), blocks)
        return time.perf_counter() - start


def recompute_s(engine: LLMEngine, length: int, seed: int) -> float:
    """Seconds for one prefill of `length` fresh tokens (the recompute of a moved request)."""
    vocab = min(engine.vocab_size, 30000)
    ids = common.prompt(length, seed=seed, vocab=vocab)
    start = time.perf_counter()
    engine.add_request(f"r{seed}", ids, SamplingParams(max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def transfer_s(engine: LLMEngine, target: Any, length: int) -> float:
    """Seconds to gather `length` tokens' blocks, put them in the object store, and write them
    into the target's pool (another process)."""
    n = -(-length // BLOCK_SIZE)
    block_ids = list(range(n))
    start = time.perf_counter()
    blocks = engine.kv.tensor.index_select(2, torch.tensor(block_ids, dtype=torch.long)).contiguous()
    # As bytes: numpy arrays travel through the object store without a pickle copy.
    ref = ray.put(blocks.view(torch.uint8).numpy())
    ray.get(target.receive.remote([ref], block_ids))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1024, 2048])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="tiny model, short lengths, 1 rep")
    args = parser.parse_args()
    if args.smoke:
        args.model, args.lengths, args.reps = "tiny", [32, 64], 1
    torch.set_num_threads(args.threads)
    longest = max(args.lengths)
    engine = LLMEngine(
        EngineConfig(
            model=args.model, block_size=BLOCK_SIZE, num_kv_blocks=-(-longest // BLOCK_SIZE) + 4,
            max_num_batched_tokens=longest, max_model_len=longest + 16,
            enable_prefix_caching=False, device="cpu",
        )
    )
    kv = engine.kv.tensor
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    try:
        target = ray.remote(Target).options(num_cpus=0).remote(tuple(kv.shape), str(kv.dtype).removeprefix("torch."))
        ray.get(target.receive.remote([ray.put(np.zeros(0, np.uint8))], []))  # started
        recompute_s(engine, 16, seed=999)  # warm-up
        bytes_per_token = kv.nbytes // (kv.shape[2] * BLOCK_SIZE)
        rows = []
        for length in args.lengths:
            rec: list[float] = []
            tra: list[float] = []
            for rep in range(args.reps):  # ABAB: both see the same load
                rec.append(recompute_s(engine, length, seed=length * 10 + rep))
                tra.append(transfer_s(engine, target, length))
            r, t = statistics.median(rec), statistics.median(tra)
            rows.append([
                str(length), f"{length * bytes_per_token / 2**20:.1f}", f"{r * 1000:.0f}",
                f"{t * 1000:.1f}", f"{r / t:.1f}x",
            ])
            print("  ".join(rows[-1]), f"(load {os.getloadavg()[0]:.1f})", flush=True)
    finally:
        ray.shutdown()
    common.print_table(
        f"Migration of one request, {args.model} ({kv.shape[0]} layers, float32, block {BLOCK_SIZE}), "
        f"medians of {args.reps}; load average {os.getloadavg()[0]:.1f}",
        ["context tokens", "KV MiB", "recompute ms", "transfer ms", "recompute / transfer"],
        rows,
    )


if __name__ == "__main__":
    main()
