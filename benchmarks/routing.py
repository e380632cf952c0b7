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
measured on the same cluster.

`--ingress-replicas 1,2,4` starts one cluster per count; the client opens one
connection per ingress replica (new connections until the kernel's
SO_REUSEPORT spread has reached each) and sends the arrivals to the replicas
in turn, and each row also gives its hit rate against the same policy's
single-replica run; `--share-routes on,off` runs each count above 1 with and
without the replicas telling each other their routing decisions
(`router.share_routes`). `--eviction lru,replica_aware` starts one cluster per
mode (`scheduler.replica_aware_eviction` false / true) and adds the workers'
evictions and how many of them took blocks another worker also held.

    python benchmarks/routing.py            # 4 workers, 8 groups x 16 requests
    python benchmarks/routing.py --ingress-replicas 1,2,4 --share-routes on,off
    python benchmarks/routing.py --eviction lru,replica_aware --groups 12 --policies prefix_affinity,round_robin
    python benchmarks/routing.py --smoke    # 2 workers, tiny workload (a test runs this)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
import ray

from pagefleet.cluster.app import NAMESPACE, RunningCluster, start_cluster
from pagefleet.cluster.config import ClusterConfig
from pagefleet.cluster.proto import pagefleet_pb2 as pb
from pagefleet.cluster.proto import pagefleet_pb2_grpc as pb_grpc
from pagefleet.scheduler.actor import SCHEDULER_NAME

if TYPE_CHECKING:
    from pagefleet.worker.engine import EngineStats

BLOCK_SIZE = 16
POLICIES = ("prefix_affinity", "round_robin", "least_loaded")
EVICTION_MODES = {"lru": False, "replica_aware": True}  # -> scheduler.replica_aware_eviction
REPLICA_KEY = "x-pagefleet-replica"  # initial metadata naming the ingress replica of a stream


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
    replicas: int = 1
    eviction: str = "replica_aware"
    evictions: int = 0
    duplicate_evictions: int = 0
    share_routes: bool = True  # replicas tell each other their decisions (moot with one)


# What `one_request` returns: TTFT seconds, prompt, cached and completion tokens, worker id.
Answer = tuple[float, int, int, int, str]


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def group_prefixes(tokenizer: object, groups: int, prefix_tokens: int, run: str) -> list[list[int]]:
    """One shared system prompt of `prefix_tokens` tokens per group, from the tiny corpus."""
    from pagefleet.worker.tiny_model import corpus_text

    words = corpus_text().split()
    encode = tokenizer.encode  # type: ignore[attr-defined]
    prefixes = []
    for g in range(groups):
        # A distinct opening per (run, group) so hashes differ from the first block on.
        start = (g * 97 + len(run) * 31) % max(1, len(words) - 400)
        text = f"[{run} system {g}] " + " ".join(words[start : start + 400])
        prefixes.append(encode(text)[:prefix_tokens])
    return prefixes


def requests_in_order(
    tokenizer: object, prefixes: Sequence[list[int]], order: Sequence[tuple[int, int]]
) -> list[tuple[list[int], int]]:
    """(prompt token ids, ideal cached tokens) per (group, index) of `order`: the group's
    prefix and a short unique question."""
    encode = tokenizer.encode  # type: ignore[attr-defined]
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


def build_prompts(
    tokenizer: object, workload: Workload, run: str, seed: int = 0
) -> list[tuple[list[int], int]]:
    """(prompt token ids, ideal cached tokens) per request, groups mixed in a fixed random order."""
    prefixes = group_prefixes(tokenizer, workload.groups, workload.prefix_tokens, run)
    order = [(g, i) for i in range(workload.per_group) for g in range(workload.groups)]
    # A fixed shuffle: a regular interleave would let round robin land every request
    # of a group on the same worker whenever the worker count divides the group count.
    random.Random(seed).shuffle(order)
    return requests_in_order(tokenizer, prefixes, order)


async def one_request(
    stub: pb_grpc.GenerationStub, prompt: list[int], max_tokens: int, adapter: str = ""
) -> Answer:
    """(TTFT seconds, prompt tokens, cached tokens, completion tokens, worker id) of one
    streamed request, on the pool's LoRA `adapter` ("": the base model)."""
    start = time.perf_counter()
    ttft = None
    last = None
    request = pb.GenerateRequest(
        prompt_token_ids=prompt,
        sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        adapter=adapter,
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
        last.worker_id,
    )


async def replica_channels(target: str, replicas: int) -> list[grpc.aio.Channel]:
    """One channel per ingress replica: new connections (a local subchannel pool each)
    until the kernel has handed one to every replica listening on the port."""
    found: dict[str, grpc.aio.Channel] = {}
    probe = pb.GenerateRequest(prompt="probe", sampling=pb.SamplingParams(max_tokens=1))
    for _ in range(20 * replicas):
        if len(found) == replicas:
            break
        channel = grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
        call = pb_grpc.GenerationStub(channel).Generate(probe, timeout=600)
        replica = dict(await call.initial_metadata())[REPLICA_KEY]
        async for _ in call:
            pass
        if replica in found:
            await channel.close()
        else:
            found[replica] = channel
    if len(found) < replicas:
        raise RuntimeError(f"reached {len(found)} of {replicas} ingress replicas in {20 * replicas} connections")
    return list(found.values())


async def set_policy(cluster: RunningCluster, channels: list[grpc.aio.Channel], policy: str) -> None:
    """Switch every replica's router: Serve spreads the calls, GetStatus on each replica's
    channel confirms."""
    for _ in range(50):
        for _ in channels:
            await cluster.ingress.set_router_policy.remote(policy)
        statuses = [await pb_grpc.GenerationStub(c).GetStatus(pb.StatusRequest()) for c in channels]
        if all(p.router_policy == policy for s in statuses for p in s.pools):
            return
    raise RuntimeError(f"not every ingress replica switched to {policy}")


async def run_policy(
    channels: list[grpc.aio.Channel], prompts: list[tuple[list[int], int]], workload: Workload,
    adapters: Sequence[str] = (),
) -> tuple[list[Answer], float]:  # fmt: skip
    """Send `prompts` open loop (request i on `adapters[i]`, if given) and return each one's
    `one_request` tuple and the wall seconds of the whole run."""
    stubs = [pb_grpc.GenerationStub(c) for c in channels]
    tasks = []
    start = time.perf_counter()
    for i, (prompt, _) in enumerate(prompts):
        adapter = adapters[i] if adapters else ""
        # Arrivals go to the replicas in turn, as a load balancer in front would spread them.
        stub = stubs[i % len(stubs)]
        tasks.append(asyncio.create_task(one_request(stub, prompt, workload.max_tokens, adapter)))
        await asyncio.sleep(workload.interval_s)
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start


def wait_until_gone(config: ClusterConfig, timeout_s: float = 120.0) -> None:
    """Until the killed scheduler and workers have let go of their names: the next
    cluster must not find (get_if_exists) the dying scheduler."""
    names = [SCHEDULER_NAME] + [f"pagefleet-worker-{p.name}-{i}" for p in config.pools for i in range(p.workers)]
    deadline = time.monotonic() + timeout_s
    for name in names:
        while True:
            try:
                ray.get_actor(name)
            except ValueError:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"actor {name} still alive {timeout_s:.0f} s after the shutdown")
            time.sleep(0.5)


@contextmanager
def shared_ray(workers: int, several: bool) -> Iterator[None]:
    """One Ray for every cluster of a run of `several`; with one, `start_cluster` starts its own.

    Starting Ray again in this process after a shutdown times out on a loaded machine,
    and each start costs tens of seconds.
    """
    if not several:
        yield
        return
    ray.init(address="local", namespace=NAMESPACE, num_cpus=max(os.cpu_count() or 1, workers),
             include_dashboard=False)  # fmt: skip
    try:
        yield
    finally:
        ray.shutdown()


@contextmanager
def one_cluster(config: ClusterConfig, several: bool) -> Iterator[RunningCluster]:
    """A cluster on `config` (gRPC on a free port, no metrics server), shut down after; with
    `several`, also gone from the shared Ray before the next one starts."""
    cluster = start_cluster(config, grpc_port=0, metrics_port=None)
    try:
        yield cluster
    finally:
        cluster.shutdown()
        if several:
            wait_until_gone(config)


def worker_stats(cluster: RunningCluster) -> list[EngineStats]:
    """Every worker's engine counters (`WorkerActor.stats`)."""
    handles = [h for pool in cluster.workers.values() for _, h in pool]
    return list(ray.get([h.stats.remote() for h in handles]))


def worker_evictions(cluster: RunningCluster) -> tuple[int, int]:
    """(evictions, of them blocks duplicated elsewhere) summed over the cluster's workers."""
    stats = worker_stats(cluster)
    return sum(int(s.evictions) for s in stats), sum(int(s.duplicate_evictions) for s in stats)


def hit_rates(
    results: Sequence[Answer], prompts: Sequence[tuple[list[int], int]]
) -> tuple[float, float]:
    """(prefix hit rate, ideal hit rate): cached prompt tokens over prompt tokens, from the
    responses' usage, and what one shared cache would have hit (`requests_in_order`)."""
    prompt_tokens = sum(r[1] for r in results)
    return sum(r[2] for r in results) / prompt_tokens, sum(i for _, i in prompts) / prompt_tokens


async def measure_cluster(
    cluster: RunningCluster, tokenizer: object, policies: Sequence[str], workload: Workload,
    replicas: int, eviction: str, share_routes: bool = True,
) -> list[Result]:  # fmt: skip
    """Every policy on one cluster, arrivals spread over its `replicas` ingress replicas."""
    channels = await replica_channels(cluster.grpc_target, replicas)
    out = []
    try:
        for policy in policies:
            await set_policy(cluster, channels, policy)
            prompts = build_prompts(tokenizer, workload, policy)
            before = worker_evictions(cluster)
            results, wall = await run_policy(channels, prompts, workload)
            after = worker_evictions(cluster)
            hit_rate, ideal_hit_rate = hit_rates(results, prompts)
            ttfts = [r[0] for r in results]
            out.append(
                Result(
                    policy=policy,
                    hit_rate=hit_rate,
                    ideal_hit_rate=ideal_hit_rate,
                    ttft_p50=percentile(ttfts, 0.5),
                    ttft_p99=percentile(ttfts, 0.99),
                    tokens_per_s=sum(r[3] for r in results) / wall,
                    requests=len(results),
                    replicas=replicas,
                    eviction=eviction,
                    evictions=after[0] - before[0],
                    duplicate_evictions=after[1] - before[1],
                    share_routes=share_routes,
                )
            )
    finally:
        for channel in channels:
            await channel.close()
    return out


def cluster_config(
    workers: int, num_kv_blocks: int, max_num_seqs: int, replicas: int = 1, replica_aware: bool = True,
    share_routes: bool = True, pool: Mapping[str, object] | None = None,
    router: Mapping[str, object] | None = None,
) -> ClusterConfig:  # fmt: skip
    """One CPU pool `bench` of tiny-model workers; `pool` and `router` add or override keys
    of the pool's and the router's sections."""
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
                    **(pool or {}),
                }
            ],
            "server": {"host": "127.0.0.1", "grpc_port": 0, "http_port": None, "ingress_replicas": replicas},
            "scheduler": {"replica_aware_eviction": replica_aware},
            "router": {"share_routes": share_routes, **(router or {})},
        }
    )


def format_table(results: list[Result]) -> str:
    """One row per run; ratios against round robin on the same cluster, hit rate against
    the same policy and eviction with one ingress replica."""
    lines = [
        f"{'policy':<16} {'hit rate':>8} {'of ideal':>8} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'tok/s':>7} {'p99 vs RR':>9} {'tok/s vs RR':>11} {'replicas':>8} {'hit vs 1':>8} "
        f"{'eviction':>13} {'evictions':>9} {'duplicates':>10} {'shared':>6}"
    ]
    for r in results:
        key = (r.replicas, r.eviction, r.share_routes)
        same_cluster = [x for x in results if (x.replicas, x.eviction, x.share_routes) == key]
        base = next((x for x in same_cluster if x.policy == "round_robin"), same_cluster[0])
        single = next(
            (x for x in results if (x.policy, x.eviction, x.replicas) == (r.policy, r.eviction, 1)), None
        )
        vs_single = f"{100 * r.hit_rate / single.hit_rate:7.1f}%" if single and single.hit_rate else "      - "
        lines.append(
            f"{r.policy:<16} {100 * r.hit_rate:7.1f}% {100 * r.hit_rate / r.ideal_hit_rate:7.1f}% "
            f"{1000 * r.ttft_p50:7.0f}ms {1000 * r.ttft_p99:7.0f}ms {r.tokens_per_s:7.1f} "
            f"{base.ttft_p99 / r.ttft_p99:8.2f}x {r.tokens_per_s / base.tokens_per_s:10.2f}x "
            f"{r.replicas:>8} {vs_single} {r.eviction:>13} {r.evictions:>9} {r.duplicate_evictions:>10} "
            f"{('yes' if r.share_routes else 'no') if r.replicas > 1 else '-':>6}"
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
    parser.add_argument("--ingress-replicas", default="1", metavar="N[,N...]",
                        help="ingress replicas, one cluster per count, e.g. 1,2,4")
    parser.add_argument("--eviction", default="replica_aware", metavar="MODE[,MODE...]",
                        help=f"worker eviction, one cluster per mode: {', '.join(EVICTION_MODES)}")
    parser.add_argument("--share-routes", default="on", metavar="on|off|on,off",
                        help="replicas share their routing decisions (router.share_routes); "
                        "on,off runs a cluster per mode for every count above 1")
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
    counts = [int(x) for x in args.ingress_replicas.split(",") if x]
    modes = [m for m in args.eviction.split(",") if m]
    if not counts or min(counts) < 1:
        parser.error(f"--ingress-replicas: counts must be >= 1, got {args.ingress_replicas!r}")
    unknown = [m for m in modes if m not in EVICTION_MODES]
    if unknown or not modes:
        parser.error(f"--eviction: one or more of {', '.join(EVICTION_MODES)}, got {args.eviction!r}")
    sharing = [{"on": True, "off": False}.get(m) for m in args.share_routes.split(",") if m]
    if not sharing or None in sharing:
        parser.error(f"--share-routes: on, off or on,off, got {args.share_routes!r}")
    runs = [
        (mode, replicas, share)
        for mode in modes
        for replicas in counts
        for share in (sharing if replicas > 1 else sharing[:1])
    ]
    print(
        f"routing benchmark: {args.workers} CPU workers x {args.num_kv_blocks} blocks of {BLOCK_SIZE} tokens, "
        f"{workload.groups} groups x {workload.per_group} requests, shared prefix {workload.prefix_tokens} "
        f"tokens, {workload.max_tokens} new tokens, one request every {args.interval_ms:g} ms",
        flush=True,
    )
    from pagefleet.cluster.prompts import load_tokenizer

    tokenizer = load_tokenizer("tiny")
    results: list[Result] = []
    several = len(runs) > 1
    with shared_ray(args.workers, several):
        for mode, replicas, share in runs:
            config = cluster_config(
                args.workers, args.num_kv_blocks, args.max_num_seqs, replicas, EVICTION_MODES[mode], share
            )
            with one_cluster(config, several) as cluster:
                results += asyncio.run(
                    measure_cluster(cluster, tokenizer, policies, workload, replicas, mode, share)
                )
            if several:
                print(format_table(results), flush=True)  # so far: a long run shows progress
    print(format_table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
