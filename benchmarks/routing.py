"""Prefix-affinity routing against cache-blind routing on a real local cluster.

Workload: `--groups` groups of `--per-group` requests. Every request of a group
starts with the group's shared system prompt of `--prefix-tokens` tokens
(text from the tiny model's corpus, different per group and per policy run, so
no run profits from another's cache) followed by a short unique question; the
requests of all groups are mixed in a fixed random order and sent over gRPC every
`--interval-ms` (open loop, so many are in flight at once), each generating
`--max-tokens` tokens greedily. The cluster: `--workers` CPU workers on the
tiny model, each with a small pool of `--num-kv-blocks` blocks of 16 tokens.

For each policy it prints the prefix hit rate (cached prompt tokens / prompt
tokens, from the responses' usage), that rate as a share of the ideal of one
shared cache (every request but the first of its group hits the whole shared
prefix), TTFT p50/p99 and throughput, then ratios against round_robin
measured in the same run.

    python benchmarks/routing.py            # 4 workers, 8 groups x 16 requests
    python benchmarks/routing.py --smoke    # 2 workers, tiny workload (a test runs this)
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from pagefleet.cluster.app import RunningCluster, start_cluster
from pagefleet.cluster.config import ClusterConfig
from pagefleet.cluster.proto import pagefleet_pb2 as pb
from pagefleet.cluster.proto import pagefleet_pb2_grpc as pb_grpc

BLOCK_SIZE = 16
POLICIES = ("prefix_affinity", "round_robin", "least_loaded")


@dataclass(frozen=True)
class Workload:
    groups: int
    per_group: int
    prefix_tokens: int
    max_tokens: int
    interval_s: float


@dataclass(frozen=True)
class Result:
    policy: str
    hit_rate: float
    ideal_hit_rate: float
    ttft_p50: float
    ttft_p99: float
    tokens_per_s: float
    requests: int


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def build_prompts(
    tokenizer: object, workload: Workload, run: str, seed: int = 0
) -> list[tuple[list[int], int]]:
    """(prompt token ids, ideal cached tokens) per request, groups mixed in a fixed random order."""
    from pagefleet.worker.tiny_model import corpus_text

    words = corpus_text().split()
    encode = tokenizer.encode  # type: ignore[attr-defined]
    prefixes = []
    for g in range(workload.groups):
        # A distinct opening per (run, group) so hashes differ from the first block on.
        start = (g * 97 + len(run) * 31) % max(1, len(words) - 400)
        text = f"[{run} system {g}] " + " ".join(words[start : start + 400])
        prefixes.append(encode(text)[: workload.prefix_tokens])
    order = [(g, i) for i in range(workload.per_group) for g in range(workload.groups)]
    # A fixed shuffle: a regular interleave would let round robin land every request
    # of a group on the same worker whenever the worker count divides the group count.
    random.Random(seed).shuffle(order)
    prompts = []
    seen: set[int] = set()
    for g, i in order:
        question = encode(f" Question {i} for group {g}: what next?", add_special_tokens=False)
        # One shared cache would miss only the group's first request, then hit every
        # full block of the shared prefix.
        ideal = (len(prefixes[g]) // BLOCK_SIZE) * BLOCK_SIZE if g in seen else 0
        seen.add(g)
        prompts.append(([*prefixes[g], *question], ideal))
    return prompts


async def one_request(
    stub: pb_grpc.GenerationStub, prompt: list[int], max_tokens: int
) -> tuple[float, int, int, int]:
    """(TTFT seconds, prompt tokens, cached tokens, completion tokens) of one streamed request."""
    start = time.perf_counter()
    ttft = None
    last = None
    request = pb.GenerateRequest(
        prompt_token_ids=prompt,
        sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
    )
    async for msg in stub.Generate(request, timeout=600):
        if ttft is None and msg.token_ids:
            ttft = time.perf_counter() - start
        last = msg
    assert last is not None and last.finish_reason, "stream ended without a finish reason"
    return (
        ttft if ttft is not None else time.perf_counter() - start,
        last.usage.prompt_tokens,
        last.usage.cached_tokens,
        last.usage.completion_tokens,
    )


async def run_policy(target: str, prompts: list[tuple[list[int], int]], workload: Workload) -> tuple[list[tuple[float, int, int, int]], float]:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        tasks = []
        start = time.perf_counter()
        for prompt, _ in prompts:
            tasks.append(asyncio.create_task(one_request(stub, prompt, workload.max_tokens)))
            await asyncio.sleep(workload.interval_s)
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


def measure(cluster: RunningCluster, tokenizer: object, policy: str, workload: Workload) -> Result:
    cluster.ingress.set_router_policy.remote(policy).result()
    prompts = build_prompts(tokenizer, workload, policy)
    results, wall = asyncio.run(run_policy(cluster.grpc_target, prompts, workload))
    prompt_tokens = sum(r[1] for r in results)
    ttfts = [r[0] for r in results]
    return Result(
        policy=policy,
        hit_rate=sum(r[2] for r in results) / prompt_tokens,
        ideal_hit_rate=sum(ideal for _, ideal in prompts) / prompt_tokens,
        ttft_p50=percentile(ttfts, 0.5),
        ttft_p99=percentile(ttfts, 0.99),
        tokens_per_s=sum(r[3] for r in results) / wall,
        requests=len(results),
    )


def cluster_config(workers: int, num_kv_blocks: int, max_num_seqs: int) -> ClusterConfig:
    return ClusterConfig.from_dict(
        {
            "pools": [
                {
                    "name": "bench",
                    "model": "tiny",
                    "workers": workers,
                    "block_size": BLOCK_SIZE,
                    "num_kv_blocks": num_kv_blocks,
                    "max_num_seqs": max_num_seqs,
                    "max_model_len": 1024,
                    "device": "cpu",
                }
            ],
            "server": {"host": "127.0.0.1", "grpc_port": 0, "http_port": None},
        }
    )


def format_table(results: list[Result]) -> str:
    base = next((r for r in results if r.policy == "round_robin"), results[0])
    lines = [
        f"{'policy':<16} {'hit rate':>8} {'of ideal':>8} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'tok/s':>7} {'p99 vs RR':>9} {'tok/s vs RR':>11}"
    ]
    for r in results:
        lines.append(
            f"{r.policy:<16} {100 * r.hit_rate:7.1f}% {100 * r.hit_rate / r.ideal_hit_rate:7.1f}% "
            f"{1000 * r.ttft_p50:7.0f}ms {1000 * r.ttft_p99:7.0f}ms {r.tokens_per_s:7.1f} "
            f"{base.ttft_p99 / r.ttft_p99:8.2f}x {r.tokens_per_s / base.tokens_per_s:10.2f}x"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--per-group", type=int, default=16)
    parser.add_argument("--prefix-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--interval-ms", type=float, default=40.0)
    parser.add_argument("--num-kv-blocks", type=int, default=64, help="per worker, 16 tokens each")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--smoke", action="store_true", help="2 workers, a tiny workload: seconds")
    args = parser.parse_args(argv)
    if args.smoke:
        args.workers, args.groups, args.per_group = 2, 2, 3
        args.prefix_tokens, args.max_tokens, args.interval_ms, args.num_kv_blocks = 48, 2, 0.0, 32
    workload = Workload(
        groups=args.groups,
        per_group=args.per_group,
        prefix_tokens=args.prefix_tokens,
        max_tokens=args.max_tokens,
        interval_s=args.interval_ms / 1000,
    )
    policies = [p for p in args.policies.split(",") if p]
    print(
        f"routing benchmark: {args.workers} CPU workers x {args.num_kv_blocks} blocks of {BLOCK_SIZE} tokens, "
        f"{workload.groups} groups x {workload.per_group} requests, shared prefix {workload.prefix_tokens} "
        f"tokens, {workload.max_tokens} new tokens, one request every {args.interval_ms:g} ms",
        flush=True,
    )
    from pagefleet.cluster.prompts import load_tokenizer

    tokenizer = load_tokenizer("tiny")
    cluster = start_cluster(
        cluster_config(args.workers, args.num_kv_blocks, args.max_num_seqs), grpc_port=0, metrics_port=None
    )
    try:
        results = [measure(cluster, tokenizer, policy, workload) for policy in policies]
    finally:
        cluster.shutdown()
    print(format_table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
