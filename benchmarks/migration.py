"""Migrating a request to another worker: recompute its context there, or move its KV blocks?

Two measurements, each comparing both ways in one run, interleaved
(recompute, transfer, recompute, ...), medians printed with their ratio and
the load average.

The parts (default): for one request of `L` context tokens,

- **recompute**: the target prefills the `L` tokens (prompt + generated)
  through the model; timed as one engine prefill of `L` fresh tokens (prefix
  caching off, one chunk);
- **transfer**: the source gathers the request's `L / block_size` blocks from
  its KV pool (every layer, K and V), `ray.put`s them into the object store,
  and a Ray actor in another process (the target) `ray.get`s them and writes
  them into its own pool of the same shape; timed end to end from the
  driver.

`--end-to-end`: a real migration on a local cluster (one pool of two CPU
workers, admission by prompt). Each round pins `--streams` streams to one
worker by a shared prefix (its own per round) with a pool too small for all
of them, so the scheduler moves one to the idle worker mid-stream, by
`scheduler.migration_transfer` true or false (switched at run time on the
one cluster, `SchedulerActor.set_migration_transfer`). Measured at the
client: the hand-off gap, from the last token the source streamed to the
first one from the target, and the moved stream's context length then.
The moved streams' tokens are checked against the same prompts run without
migration on an offline engine.

Model: the packaged SmolLM2-135M by default (`--model`), float32, block size
16; `--smoke` uses the tiny test model and short lengths.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import os
import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Any

import _engine_bench as common
import grpc
import numpy as np
import ray
import torch

from pagefleet.cluster.app import RunningCluster, start_cluster
from pagefleet.cluster.client import build_request
from pagefleet.cluster.config import ClusterConfig
from pagefleet.cluster.proto import pagefleet_pb2_grpc as pb_grpc
from pagefleet.worker.config import EngineConfig
from pagefleet.worker.engine import LLMEngine
from pagefleet.worker.llm import LLM
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
    blocks = engine.kv.cache.tensor.index_select(2, torch.tensor(block_ids, dtype=torch.long)).contiguous()
    # As bytes: numpy arrays travel through the object store without a pickle copy.
    ref = ray.put(blocks.view(torch.uint8).numpy())
    ray.get(target.receive.remote([ref], block_ids))
    return time.perf_counter() - start


# ----- end to end: a real migration on a local cluster ------------------------------------


@dataclass(frozen=True)
class Handoff:
    """One stream the scheduler moved, as its client saw it."""

    mode: str
    gap_s: float  # last token from the source -> first token from the target
    context_tokens: int  # prompt + tokens streamed when it moved
    exact: bool  # its tokens equal the run without migration


def e2e_config(model: str, num_kv_blocks: int, max_model_len: int, streams: int) -> ClusterConfig:
    return ClusterConfig.from_dict(
        {
            "pools": [
                {
                    "name": "default", "model": model, "workers": 2, "block_size": BLOCK_SIZE,
                    "num_kv_blocks": num_kv_blocks, "max_model_len": max_model_len,
                    "max_num_seqs": streams, "max_num_batched_tokens": 256, "device": "cpu",
                }
            ],
            # Prefix affinity without the load terms: every stream goes to the pinned worker.
            "router": {"policy": "prefix_affinity", "imbalance_slack_blocks": 100_000,
                       "w_load": 0.0, "w_queue": 0.0},
            # A loaded CPU takes seconds per prefill step: no worker may look dead or hung
            # for that (a hung worker's streams would move by recompute).
            "scheduler": {"report_interval_s": 0.2, "report_timeout_s": 60.0, "stall_timeout_s": 120.0,
                          "admission": "prompt", "wait_queue_size": 2 * streams},
            "server": {"host": "127.0.0.1", "grpc_port": 0, "http_port": None},
        }
    )


def timed_stream(target: str, prompt: list[int], max_tokens: int) -> list[tuple[float, str, list[int]]]:
    """(arrival time, worker id, token ids) of each message of one greedy stream."""
    with grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
        stub = pb_grpc.GenerationStub(channel)
        request = build_request(prompt, {"max_tokens": max_tokens, "ignore_eos": True})
        return [
            (time.monotonic(), msg.worker_id, list(msg.token_ids))
            for msg in stub.Generate(request, timeout=1800)
        ]


def pinned_prompts(round_no: int, shared: int, context: int, streams: int, vocab: int) -> list[list[int]]:
    """`streams` prompts of `context` tokens sharing their first `shared` (this round's own)."""
    prefix = common.prompt(shared, seed=1000 + round_no, vocab=vocab)
    return [
        prefix + common.prompt(context - shared, seed=2000 + 97 * round_no + j, vocab=vocab)
        for j in range(streams)
    ]


def one_round(
    cluster: RunningCluster, offline: LLM, mode: str, prompts: list[list[int]], max_tokens: int,
    shared: int,
) -> list[Handoff]:
    """Run the streams once with `mode`; the hand-offs they saw."""
    for scheduler in cluster.schedulers:
        ray.get(scheduler.set_migration_transfer.remote(mode == "transfer"), timeout=60)
    target = cluster.grpc_target
    # Pin the prefix to one worker first: the streams then all go there.
    warm = timed_stream(target, [*prompts[0][:shared], 1, 2, 3], 1)
    pinned = warm[-1][1]
    want_blocks = shared // BLOCK_SIZE
    deadline = time.monotonic() + 60
    while len(ray.get(cluster.scheduler.cached_hashes.remote(pinned), timeout=60)) < want_blocks:
        if time.monotonic() > deadline:
            raise TimeoutError("the shared prefix never reached the scheduler's index")
        time.sleep(0.1)
    time.sleep(1.0)  # every replica's view has it
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        done = list(pool.map(lambda p: timed_stream(target, p, max_tokens), prompts))
    started = [next(m[1] for m in messages if m[2]) for messages in done]
    if started != [pinned] * len(prompts):
        print(f"  (streams started on {started}, not all on {pinned})", flush=True)
    want = [o.token_ids for o in offline.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))]
    out = []
    for prompt, messages, expected in zip(prompts, done, want, strict=True):
        with_tokens = [m for m in messages if m[2]]
        streamed = 0
        for before, after in itertools.pairwise(with_tokens):
            streamed += len(before[2])
            if after[1] != before[1]:
                exact = [t for m in messages for t in m[2]] == expected
                out.append(Handoff(mode, after[0] - before[0], len(prompt) + streamed, exact))
                break
    return out


def shortage_blocks(context: int, shared: int, streams: int, max_tokens: int) -> tuple[int, int]:
    """(num_kv_blocks, max_model_len) of a worker that takes every stream's prompt (the
    router counts each one whole) but not every stream to its end: it runs short as they
    grow, and the scheduler moves one."""
    prompts_claim = streams * -(-context // BLOCK_SIZE)
    full = shared // BLOCK_SIZE + streams * (-(-(context + max_tokens) // BLOCK_SIZE) - shared // BLOCK_SIZE)
    if full <= prompts_claim:
        raise SystemExit("--max-tokens too small for a shortage: raise it or lower --shared")
    return prompts_claim + (full - prompts_claim) // 2, context + max_tokens + BLOCK_SIZE


def end_to_end(args: argparse.Namespace) -> None:
    context, shared, streams = args.context, args.shared, args.streams
    num_kv_blocks, max_model_len = shortage_blocks(context, shared, streams, args.max_tokens)
    print(
        f"end to end: {args.model}, 2 CPU workers x {num_kv_blocks} blocks of {BLOCK_SIZE}, "
        f"{streams} streams of {context} + {args.max_tokens} tokens ({shared} shared), "
        f"{args.rounds} rounds per mode; load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    offline = LLM(model=args.model, block_size=BLOCK_SIZE, num_kv_blocks=num_kv_blocks * 2,
                  max_model_len=max_model_len, device="cpu")
    vocab = min(offline.engine.vocab_size, 30000)
    cluster = start_cluster(
        e2e_config(args.model, num_kv_blocks, max_model_len, streams), grpc_port=0, metrics_port=None
    )
    handoffs: list[Handoff] = []
    try:
        round_no = 0
        for _ in range(args.rounds):
            for mode in ("recompute", "transfer"):  # ABAB: both see the same load
                round_no += 1
                prompts = pinned_prompts(round_no, shared, context, streams, vocab)
                got = one_round(cluster, offline, mode, prompts, args.max_tokens, shared)
                handoffs += got
                for h in got:
                    print(f"  {mode:<9} gap {h.gap_s * 1000:8.1f} ms at {h.context_tokens} tokens"
                          f" exact={h.exact} (load {os.getloadavg()[0]:.1f})", flush=True)
                if not got:
                    print(f"  {mode:<9} no stream moved this round", flush=True)
    finally:
        cluster.shutdown()
    rows = []
    medians = {}
    for mode in ("recompute", "transfer"):
        mine = [h for h in handoffs if h.mode == mode]
        if not mine:
            continue
        medians[mode] = statistics.median(h.gap_s for h in mine)
        rows.append([
            mode, str(len(mine)), f"{statistics.median(h.context_tokens for h in mine):.0f}",
            f"{medians[mode] * 1000:.1f}", str(all(h.exact for h in mine)),
        ])
    common.print_table(
        f"Hand-off gap seen by the client, {args.model}, medians; load average {os.getloadavg()[0]:.1f}",
        ["mode", "hand-offs", "context tokens", "gap ms", "output exact"],
        rows,
    )
    if len(medians) == 2:
        print(f"recompute / transfer: {medians['recompute'] / medians['transfer']:.1f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1024, 2048])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--end-to-end", action="store_true", help="a real migration on a local cluster")
    parser.add_argument("--context", type=int, default=384, help="end to end: prompt tokens per stream")
    parser.add_argument("--shared", type=int, default=128, help="end to end: shared prefix tokens")
    parser.add_argument("--streams", type=int, default=4, help="end to end: streams per round")
    parser.add_argument("--max-tokens", type=int, default=192, help="end to end: tokens out per stream")
    parser.add_argument("--rounds", type=int, default=3, help="end to end: rounds per mode")
    parser.add_argument("--smoke", action="store_true", help="tiny model, short lengths, 1 rep")
    args = parser.parse_args()
    if args.smoke:
        args.model, args.lengths, args.reps = "tiny", [32, 64], 1
        args.context, args.shared, args.max_tokens, args.rounds = 128, 64, 128, 1
    if args.end_to_end:
        end_to_end(args)
        return
    torch.set_num_threads(args.threads)
    longest = max(args.lengths)
    engine = LLMEngine(
        EngineConfig(
            model=args.model, block_size=BLOCK_SIZE, num_kv_blocks=-(-longest // BLOCK_SIZE) + 4,
            max_num_batched_tokens=longest, max_model_len=longest + 16,
            enable_prefix_caching=False, device="cpu",
        )
    )
    kv = engine.kv.cache.tensor
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")
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
