"""Adapter-aware routing against adapter-blind prefix routing, several tenants' LoRA adapters,
on a real local cluster.

Workload: `--adapters` random PEFT adapters of the tiny model (rank 8 on q/k/v/o and
the MLP projections, built offline by `tests/lora_adapters.py`), one per tenant, with
skewed popularity: the `--hot` first ones share `--hot-share` of the requests, the
rest share what is left. Each request draws its adapter (seeded) and runs on it,
its prompt the adapter's own system prompt of `--prefix-tokens` tokens (from the
tiny corpus) and a short unique question; requests go over gRPC every
`--interval-ms` (open loop), `--max-tokens` greedy tokens each. The cluster:
`--workers` CPU workers of `--num-kv-blocks` blocks of 16 tokens, `max_loras:
--max-loras` adapter slots each (fewer slots in all than adapters, or as many).

Rows, each on a cluster of its own (started cold, stopped before the next), all
sending the same requests in the same order:

- adapter-aware: `prefix_affinity` with `router.w_adapter_load` = `--w-adapter-load`
  (default: the config's): a worker that does not hold the adapter costs one load,
  two where no slot is free (loading it evicts one).
- adapter-blind: `prefix_affinity` with `w_adapter_load: 0`. What it keeps: the
  prefix hashes carry the adapter's identity, so a request is credited only with
  blocks cached for its own adapter, and the load and queue terms; what it drops:
  which adapters a worker holds and whether it has a free slot.
- round_robin: no prefix, no adapter.

Printed per row: prefix hit rate (cached prompt tokens over prompt tokens, from the
responses' usage) and its share of the ideal of one shared cache, adapter loads
into slots and evictions from them (summed over the workers' engine counters),
TTFT p50/p90, output tokens/s, the busiest worker's share of the requests and the
host's load average as the row ended (the rows run one after the other); then
the hit rate, loads, evictions and TTFT p50/p90 as ratios to adapter-blind's.

    python benchmarks/lora_routing.py           # 3 workers x 2 slots, 6 adapters, 2 hot
    python benchmarks/lora_routing.py --smoke   # 2 workers x 1 slot, 3 adapters, no round robin
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import routing
from routing import Workload

from pagefleet.cluster.app import RunningCluster
from pagefleet.cluster.config import RouterConfig

# The adapters come from the tests' builder: one recipe for tests and benchmarks.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

BLIND = "adapter-blind"


@dataclass(frozen=True)
class Policy:
    """One row: a routing policy and the adapter-load weight its router scores with."""

    label: str
    policy: str
    w_adapter_load: float


@dataclass(frozen=True)
class Row:
    label: str
    hit_rate: float
    ideal_hit_rate: float
    adapter_loads: int
    adapter_evictions: int
    ttft_p50: float
    ttft_p90: float
    tokens_per_s: float
    busiest: float  # the share of the requests that the busiest worker served
    load: float  # the host's 1-minute load average when the row ended (rows run in turn)


def adapter_names(count: int) -> list[str]:
    return [f"tenant{i}" for i in range(count)]


def adapter_order(
    requests: int, adapters: int, hot: int, hot_share: float, seed: int = 0
) -> list[tuple[int, int]]:
    """(adapter index, its request number) per request: the `hot` first adapters draw
    `hot_share` of the requests between them, the others the rest, evenly within each."""
    cold = adapters - hot
    weights = [hot_share / hot] * hot if hot else []
    weights += [(1.0 - hot_share) / cold] * cold if cold else []
    rng = random.Random(seed)
    counts = [0] * adapters
    order = []
    for g in rng.choices(range(adapters), weights=weights, k=requests):
        order.append((g, counts[g]))
        counts[g] += 1
    return order


def worker_lora_counts(cluster: RunningCluster) -> tuple[int, int]:
    """(adapter loads into a slot, adapter evictions from one) summed over the workers."""
    stats = routing.worker_stats(cluster)
    return sum(s.lora_loads for s in stats), sum(s.lora_evictions for s in stats)


async def measure(
    cluster: RunningCluster, label: str, prompts: list[tuple[list[int], int]], names: list[str],
    workload: Workload,
) -> Row:  # fmt: skip
    channels = await routing.replica_channels(cluster.grpc_target, 1)
    try:
        before = worker_lora_counts(cluster)
        results, wall = await routing.run_policy(channels, prompts, workload, names)
        after = worker_lora_counts(cluster)
    finally:
        for channel in channels:
            await channel.close()
    hit_rate, ideal = routing.hit_rates(results, prompts)
    ttfts = [r[0] for r in results]
    return Row(
        label=label,
        hit_rate=hit_rate,
        ideal_hit_rate=ideal,
        adapter_loads=after[0] - before[0],
        adapter_evictions=after[1] - before[1],
        ttft_p50=routing.percentile(ttfts, 0.5),
        ttft_p90=routing.percentile(ttfts, 0.9),
        tokens_per_s=sum(r[3] for r in results) / wall,
        busiest=max(Counter(r[4] for r in results).values()) / len(results),
        load=os.getloadavg()[0],
    )


def _ratio(value: float, base: float) -> str:
    if base == 0:
        return "-" if value else "1.00x"
    return f"{value / base:.2f}x"


def format_table(rows: Sequence[Row]) -> str:
    """One line per row; the ratio columns divide each row's figure by adapter-blind's."""
    header = (
        "| policy | hit rate | of ideal | adapter loads | evictions | TTFT p50 | TTFT p90 | tok/s "
        "| busiest worker | load "
        "| hit vs blind | loads vs blind | evictions vs blind | p50 vs blind | p90 vs blind |"
    )
    lines = [header, "|" + "---|" * header.count(" | ") + "---|"]
    blind = next((r for r in rows if r.label == BLIND), rows[0])
    for r in rows:
        lines.append(
            f"| {r.label} | {100 * r.hit_rate:.1f}% | {100 * r.hit_rate / r.ideal_hit_rate:.1f}% "
            f"| {r.adapter_loads} | {r.adapter_evictions} | {1000 * r.ttft_p50:.0f} ms "
            f"| {1000 * r.ttft_p90:.0f} ms | {r.tokens_per_s:.1f} | {100 * r.busiest:.0f}% | {r.load:.1f} "
            f"| {_ratio(r.hit_rate, blind.hit_rate)} | {_ratio(r.adapter_loads, blind.adapter_loads)} "
            f"| {_ratio(r.adapter_evictions, blind.adapter_evictions)} "
            f"| {_ratio(r.ttft_p50, blind.ttft_p50)} | {_ratio(r.ttft_p90, blind.ttft_p90)} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--max-loras", type=int, default=2, help="adapter slots per worker")
    parser.add_argument("--adapters", type=int, default=6)
    parser.add_argument("--hot", type=int, default=2, help="how many adapters are hot")
    parser.add_argument("--hot-share", type=float, default=0.6, help="share of requests on the hot ones")
    parser.add_argument("--requests", type=int, default=240)
    parser.add_argument("--prefix-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--interval-ms", type=float, default=40.0)
    parser.add_argument("--num-kv-blocks", type=int, default=64, help="per worker, 16 tokens each")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--w-adapter-load", type=float, default=RouterConfig().w_adapter_load,
                        help="the adapter-aware row's router.w_adapter_load")
    parser.add_argument("--no-round-robin", action="store_true", help="only the two prefix rows")
    parser.add_argument("--smoke", action="store_true",
                        help="2 workers x 1 slot, 3 adapters, the two prefix rows: under a minute")
    args = parser.parse_args(argv)
    if args.smoke:
        args.workers, args.max_loras, args.adapters, args.hot, args.requests = 2, 1, 3, 1, 12
        args.prefix_tokens, args.max_tokens, args.interval_ms = 32, 2, 0.0
        args.no_round_robin = True  # a third cluster start, on the same code path
    if not 0 <= args.hot <= args.adapters or not 0.0 <= args.hot_share <= 1.0:
        parser.error("--hot must be within 0..--adapters and --hot-share within 0..1")
    workload = Workload(
        groups=args.adapters, per_group=0, prefix_tokens=args.prefix_tokens,
        max_tokens=args.max_tokens, interval_s=args.interval_ms / 1000,
    )  # fmt: skip
    policies = [
        Policy("adapter-aware", "prefix_affinity", args.w_adapter_load),
        Policy(BLIND, "prefix_affinity", 0.0),
    ]
    if not args.no_round_robin:
        policies.append(Policy("round_robin", "round_robin", args.w_adapter_load))
    print(
        f"LoRA routing benchmark: {args.workers} CPU workers x {args.max_loras} adapter slots x "
        f"{args.num_kv_blocks} blocks of {routing.BLOCK_SIZE} tokens; {args.adapters} adapters, "
        f"{args.hot} hot with {100 * args.hot_share:.0f}% of {args.requests} requests; system prompt "
        f"{args.prefix_tokens} tokens per adapter, {args.max_tokens} new tokens, one request every "
        f"{args.interval_ms:g} ms; adapter-aware w_adapter_load {args.w_adapter_load:g}",
        flush=True,
    )
    from lora_adapters import build_lora_adapter

    from pagefleet.cluster.prompts import load_tokenizer
    from pagefleet.worker.tiny_model import ensure_tiny_model

    tokenizer = load_tokenizer("tiny")
    names = adapter_names(args.adapters)
    order = adapter_order(args.requests, args.adapters, args.hot, args.hot_share)
    # The same requests for every row: each row starts a cold cluster.
    prompts = routing.requests_in_order(
        tokenizer, routing.group_prefixes(tokenizer, args.adapters, args.prefix_tokens, "lora"), order
    )
    per_request = [names[g] for g, _ in order]
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="pagefleet-lora-routing-") as root:
        model_dir = ensure_tiny_model()
        adapters = {
            name: str(build_lora_adapter(model_dir, Path(root) / name, seed=200 + i, std=0.05))
            for i, name in enumerate(names)
        }
        with routing.shared_ray(args.workers, several=True):
            for p in policies:
                config = routing.cluster_config(
                    args.workers, args.num_kv_blocks, args.max_num_seqs,
                    pool={"lora_adapters": adapters, "max_loras": args.max_loras},
                    router={"policy": p.policy, "w_adapter_load": p.w_adapter_load},
                )  # fmt: skip
                with routing.one_cluster(config, several=True) as cluster:
                    rows.append(asyncio.run(measure(cluster, p.label, prompts, per_request, workload)))
                print(format_table(rows), flush=True)  # so far: a long run shows progress
    print()
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
