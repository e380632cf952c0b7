"""Routing decision latency of each policy with many simulated workers and full KV indexes.

Builds a Router with `--workers` workers, each indexing `--index-blocks` cached
block hashes (a share of `--groups` shared system prompts plus private blocks),
then times `route_hashes` for a stream of prompts (a group's system prompt plus
a unique suffix). Load reports arrive between decisions, outside the timing.
Prints p50/p99 per policy and the ratio against round_robin measured in the
same run; hashing the prompt (`hash_token_blocks`) is timed on its own row.
Both wall time and the thread's CPU time are measured: on a shared, loaded
machine the wall-clock tail is the OS descheduling the process (every row,
round_robin included, shows the same tail), while the CPU-time tail is the
router's own cost.

    python benchmarks/router_latency.py            # 64 workers, 8192 blocks each
    python benchmarks/router_latency.py --smoke    # seconds
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Sequence

from pagefleet.cluster.router import ROUTING_POLICIES, Router, RouterConfig
from pagefleet.scheduler.messages import WorkerDelta
from pagefleet.worker.events import LoadReport, WorkerInfo
from pagefleet.worker.prefix_hash import hash_token_blocks

POOL = "bench"
BLOCK_SIZE = 16


def build_router(
    num_workers: int, index_blocks: int, systems: list[list[int]], groups_per_worker: int, seed: int
) -> Router:
    rng = random.Random(seed)
    router = Router(RouterConfig(), seed=seed)
    system_hashes = [hash_token_blocks(s, BLOCK_SIZE) for s in systems]
    for w in range(num_workers):
        wid = f"w{w}"
        router.add_worker(wid, POOL, block_size=BLOCK_SIZE)
        hashes: list[bytes] = []
        for g in rng.sample(range(len(systems)), groups_per_worker):
            hashes.extend(system_hashes[g])
        # Private blocks (finished requests' suffixes) fill the rest of the index.
        hashes.extend(rng.randbytes(32) for _ in range(max(0, index_blocks - len(hashes))))
        router.apply_delta(WorkerDelta(WorkerInfo(wid, POOL, 0, BLOCK_SIZE), True, None, tuple(hashes)))
    return router


def load_reports(router: Router, rng: random.Random, seq: int) -> None:
    for wid in router.workers(POOL):
        live = rng.randrange(0, 4096)
        router.apply_load_report(
            LoadReport(wid, POOL, seq, 0.0, 16384, 16384 - live, live, 0, live, num_waiting=rng.randrange(4))
        )


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Router decision latency per policy.")
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--index-blocks", type=int, default=8192, help="cached hashes per worker")
    parser.add_argument("--groups", type=int, default=32, help="shared system prompts")
    parser.add_argument("--groups-per-worker", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=1024)
    parser.add_argument("--suffix-tokens", type=int, default=1024)
    parser.add_argument("--requests", type=int, default=5000, help="timed decisions per policy")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, runs in seconds")
    args = parser.parse_args(argv)
    if args.smoke:
        args.workers, args.index_blocks, args.groups, args.requests = 8, 256, 4, 200
        args.groups_per_worker = 2

    rng = random.Random(args.seed)
    systems = [[rng.randrange(32000) for _ in range(args.system_tokens)] for _ in range(args.groups)]
    prompts = [
        rng.choice(systems) + [rng.randrange(32000) for _ in range(args.suffix_tokens)]
        for _ in range(min(args.requests, 500))
    ]
    t0 = time.perf_counter()
    hash_wall: list[float] = []
    hash_cpu: list[float] = []
    prompt_hashes = []
    for p in prompts:
        start, start_cpu = time.perf_counter(), time.thread_time()
        prompt_hashes.append(hash_token_blocks(p, BLOCK_SIZE))
        hash_cpu.append(time.thread_time() - start_cpu)
        hash_wall.append(time.perf_counter() - start)

    print(
        f"# {args.workers} workers x {args.index_blocks} indexed blocks, {args.groups} groups, "
        f"prompts of {args.system_tokens}+{args.suffix_tokens} tokens "
        f"({len(prompt_hashes[0])} blocks), {args.requests} decisions per policy"
    )
    results: dict[str, tuple[list[float], list[float], float]] = {}
    for policy in ROUTING_POLICIES:
        router = build_router(args.workers, args.index_blocks, systems, args.groups_per_worker, args.seed)
        report_rng = random.Random(args.seed)
        wall: list[float] = []
        cpu: list[float] = []
        matched = 0
        for i in range(args.requests):
            if i % 64 == 0:
                load_reports(router, report_rng, i + 1)
            hashes = prompt_hashes[i % len(prompt_hashes)]
            start, start_cpu = time.perf_counter(), time.thread_time()
            decision = router.route_hashes(POOL, hashes, policy=policy)
            cpu.append(time.thread_time() - start_cpu)
            wall.append(time.perf_counter() - start)
            matched += decision.matched_blocks
        results[policy] = (wall, cpu, matched / args.requests)

    _, base_cpu, _ = results["round_robin"]
    print(
        "| policy | wall p50 (us) | wall p99 (us) | CPU p50 (us) | CPU p99 (us) "
        "| CPU p50 vs round_robin | CPU p99 vs round_robin | mean matched blocks |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for policy, (wall, cpu, mean_matched) in results.items():
        print(
            f"| {policy} | {percentile(wall, 0.5) * 1e6:.1f} | {percentile(wall, 0.99) * 1e6:.1f} "
            f"| {percentile(cpu, 0.5) * 1e6:.1f} | {percentile(cpu, 0.99) * 1e6:.1f} "
            f"| {percentile(cpu, 0.5) / percentile(base_cpu, 0.5):.2f}x "
            f"| {percentile(cpu, 0.99) / percentile(base_cpu, 0.99):.2f}x | {mean_matched:.1f} |"
        )
    print(
        f"| hash_token_blocks ({len(prompts[0])} tokens) | {percentile(hash_wall, 0.5) * 1e6:.1f} "
        f"| {percentile(hash_wall, 0.99) * 1e6:.1f} | {percentile(hash_cpu, 0.5) * 1e6:.1f} "
        f"| {percentile(hash_cpu, 0.99) * 1e6:.1f} | - | - | - |"
    )
    wall, cpu, _ = results["prefix_affinity"]
    verdict = "meets" if percentile(cpu, 0.99) < 1e-3 else "MISSES"
    print(
        f"# prefix_affinity decision p99: {percentile(cpu, 0.99) * 1e3:.3f} ms CPU "
        f"({verdict} the < 1 ms target), {percentile(wall, 0.99) * 1e3:.3f} ms wall"
    )
    print(f"# total {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
