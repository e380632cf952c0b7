"""Admission against the full request (prompt + max_tokens) against admission by prompt.

Workload: `--requests` requests sent at once over gRPC to a one-worker pool,
each a distinct prompt of about `--prompt-tokens` tokens generating
`--max-tokens` tokens greedily (ignore_eos), so every request reaches its
max_tokens. The pool holds far fewer of them to the end than max_num_seqs:
by prompt all are admitted and the engine preempts as their outputs outgrow
the pool; by the full request only as many run as fit, the rest wait at the
ingress.

Both modes run on one cluster (`Ingress.set_admission`), interleaved
(full, prompt, full, prompt...) for `--rounds` rounds; it prints per mode the
median throughput (completion tokens / wall second), preemptions per round
and per minute (the worker's counters), and full / prompt ratios.

    python benchmarks/admission.py            # 24 requests x 192 tokens, 2 rounds
    python benchmarks/admission.py --smoke    # seconds
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import ray

from pagefleet.cluster.app import RunningCluster, start_cluster
from pagefleet.cluster.config import ClusterConfig
from pagefleet.cluster.proto import pagefleet_pb2 as pb
from pagefleet.cluster.proto import pagefleet_pb2_grpc as pb_grpc

BLOCK_SIZE = 16
MODES = ("full", "prompt")


@dataclass(frozen=True)
class Round:
    mode: str
    tokens_per_s: float
    preemptions: int
    wall_s: float

    @property
    def preemptions_per_minute(self) -> float:
        return self.preemptions * 60.0 / self.wall_s


async def one_request(stub: pb_grpc.GenerationStub, prompt: list[int], max_tokens: int) -> int:
    """Completion tokens of one streamed request."""
    request = pb.GenerateRequest(
        prompt_token_ids=prompt,
        sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
    )
    last = None
    async for msg in stub.Generate(request, timeout=1200):
        last = msg
    assert last is not None and last.finish_reason == "length", "request did not reach max_tokens"
    return int(last.usage.completion_tokens)


async def send_all(target: str, prompts: list[list[int]], max_tokens: int) -> tuple[int, float]:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        start = time.perf_counter()
        done = await asyncio.gather(*(one_request(stub, p, max_tokens) for p in prompts))
        return sum(done), time.perf_counter() - start


def preemptions(cluster: RunningCluster, worker_id: str) -> int:
    stats = ray.get(cluster.worker_handle(worker_id).stats.remote(), timeout=60)
    return int(stats.preemptions_total)


def measure(cluster: RunningCluster, mode: str, prompts: list[list[int]], max_tokens: int) -> Round:
    cluster.ingress.set_admission.remote(mode).result()
    worker_id = cluster.workers["bench"][0][0]
    before = preemptions(cluster, worker_id)
    tokens, wall = asyncio.run(send_all(cluster.grpc_target, prompts, max_tokens))
    return Round(mode, tokens / wall, preemptions(cluster, worker_id) - before, wall)


def build_prompts(count: int, prompt_tokens: int, salt: int) -> list[list[int]]:
    """Distinct token prompts (no shared prefix, no reuse across rounds)."""
    return [
        [3 + (salt * 7919 + i * 131 + j * 17) % 250 for j in range(prompt_tokens)]
        for i in range(count)
    ]


def cluster_config(num_kv_blocks: int, max_num_seqs: int, requests: int) -> ClusterConfig:
    return ClusterConfig.from_dict(
        {
            "pools": [
                {
                    "name": "bench",
                    "model": "tiny",
                    "workers": 1,
                    "block_size": BLOCK_SIZE,
                    "num_kv_blocks": num_kv_blocks,
                    "max_num_seqs": max_num_seqs,
                    "max_model_len": 1024,
                    "device": "cpu",
                }
            ],
            "scheduler": {"wait_queue_size": requests},
            "server": {"host": "127.0.0.1", "grpc_port": 0, "http_port": None},
        }
    )


def format_table(rounds: list[Round]) -> str:
    def median(mode: str, value: str) -> float:
        return statistics.median(getattr(r, value) for r in rounds if r.mode == mode)

    lines = [f"{'mode':<8} {'tok/s':>8} {'preemptions':>12} {'per minute':>11}"]
    for mode in MODES:
        lines.append(
            f"{mode:<8} {median(mode, 'tokens_per_s'):8.1f} {median(mode, 'preemptions'):12.0f} "
            f"{median(mode, 'preemptions_per_minute'):11.1f}"
        )
    lines.append(
        "full / prompt: throughput "
        f"{median('full', 'tokens_per_s') / median('prompt', 'tokens_per_s'):.2f}x"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--num-kv-blocks", type=int, default=64, help="16 tokens each")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2, help="of each mode, interleaved")
    parser.add_argument("--smoke", action="store_true", help="a tiny workload: seconds")
    args = parser.parse_args(argv)
    if args.smoke:
        args.requests, args.max_tokens, args.num_kv_blocks, args.rounds = 6, 48, 16, 1
    print(
        f"admission benchmark: 1 CPU worker x {args.num_kv_blocks} blocks of {BLOCK_SIZE} tokens, "
        f"max_num_seqs {args.max_num_seqs}, {args.requests} requests at once of "
        f"{args.prompt_tokens} + {args.max_tokens} tokens, {args.rounds} rounds per mode; "
        f"load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    cluster = start_cluster(
        cluster_config(args.num_kv_blocks, args.max_num_seqs, args.requests),
        grpc_port=0,
        metrics_port=None,
    )
    rounds: list[Round] = []
    try:
        salt = 0
        for _ in range(args.rounds):
            for mode in MODES:
                salt += 1
                prompts = build_prompts(args.requests, args.prompt_tokens, salt)
                rounds.append(measure(cluster, mode, prompts, args.max_tokens))
                r = rounds[-1]
                print(
                    f"  {mode:<6} {r.tokens_per_s:7.1f} tok/s  {r.preemptions} preemptions "
                    f"in {r.wall_s:.1f} s",
                    flush=True,
                )
    finally:
        cluster.shutdown()
    print(format_table(rounds))
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
