"""The central scheduler's view at fleet scale: the real ClusterState, FleetView and Router code.

A synthetic fleet of `--workers` workers in `--pools` pools pushes what real
workers push (a msgpack load report and a KV event batch of `--events`
stored/removed hashes, every `--interval` seconds). Measured, in one process:

- pushes and KV events per second the scheduler state absorbs (decode +
  `ClusterState.push`, what `SchedulerActor.push` does), against the rate the
  fleet produces (ratio > 1: headroom for one scheduler actor);
- delta fan-out per ingress replica: `updates_since` + `FleetView.apply` per
  delta (what every replica's long poll costs), and the replicas one core
  could feed at the fleet's delta rate;
- routing decision latency p50/p99 on a replica's router holding the whole
  index, against the same router with 1/100 of the fleet (ratio);
- memory of the index in the scheduler and in one replica (tracemalloc).

    python benchmarks/fleet_scale.py --workers 1000 --pools 10
"""

from __future__ import annotations

import argparse
import random
import time
import tracemalloc
from collections.abc import Callable

from pagefleet.cluster.fleet_view import FleetView
from pagefleet.cluster.router import Router, RouterConfig
from pagefleet.scheduler.state import ClusterState
from pagefleet.worker.events import KVEventBatch, LoadReport, WorkerInfo
from pagefleet.worker.prefix_hash import hash_token_blocks

BLOCK_SIZE = 16


class Fleet:
    """Synthetic workers: each caches prefixes of its pool's system prompts and churns them."""

    def __init__(self, workers: int, pools: int, cached_per_worker: int, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.pools = [f"pool{p}" for p in range(pools)]
        self.workers = [(f"w{i}", self.pools[i % pools]) for i in range(workers)]
        # Per pool, 64 system prompts of 32 blocks: the hashes workers store and drop.
        self.prompts = {
            pool: [
                [self.rng.randrange(32000) for _ in range(32 * BLOCK_SIZE)] for _ in range(64)
            ]
            for pool in self.pools
        }
        self.hashes = {
            pool: [h for p in prompts for h in hash_token_blocks(p, BLOCK_SIZE)]
            for pool, prompts in self.prompts.items()
        }
        self.held: dict[str, set[bytes]] = {}
        self.seq: dict[str, int] = {}
        for wid, pool in self.workers:
            self.held[wid] = set(self.rng.sample(self.hashes[pool], cached_per_worker))
            self.seq[wid] = 0

    def snapshot(self, wid: str) -> bytes:
        self.seq[wid] += 1
        events = tuple(("stored", h) for h in self.held[wid])
        return KVEventBatch(wid, self.seq[wid], events, reset=True, incarnation="i").encode()

    def report(self, wid: str, pool: str) -> bytes:
        free = self.rng.randrange(1000)
        return LoadReport(
            wid, pool, self.seq[wid] + 1, 0.0, 4096, free, 4096 - free - 500, 500, 3000,
            num_running=self.rng.randrange(32), incarnation="i", progress=self.seq[wid],
        ).encode()  # fmt: skip

    def churn(self, wid: str, pool: str, n: int) -> bytes:
        """A batch of n events: half drop held hashes, half store new ones."""
        held = self.held[wid]
        events: list[tuple[str, bytes]] = []
        for h in self.rng.sample(sorted(held), min(n // 2, len(held))):
            held.discard(h)
            events.append(("removed", h))
        for h in self.rng.sample(self.hashes[pool], n - len(events)):
            if h not in held:
                held.add(h)
                events.append(("stored", h))
        self.seq[wid] += 1
        return KVEventBatch(wid, self.seq[wid], tuple(events), incarnation="i").encode()


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def build_state(fleet: Fleet) -> ClusterState:
    state = ClusterState(report_timeout_s=1e9, stall_timeout_s=1e9, generation=1)
    for wid, pool in fleet.workers:
        state.register_worker(WorkerInfo(wid, pool, 4096, BLOCK_SIZE))
        state.push(LoadReport.decode(fleet.report(wid, pool)), KVEventBatch.decode(fleet.snapshot(wid)))
    return state


def route_latencies(fleet: Fleet, view: FleetView, n: int) -> list[float]:
    out = []
    rng = random.Random(1)
    for _ in range(n):
        pool = rng.choice(fleet.pools)
        prompt = rng.choice(fleet.prompts[pool]) + [rng.randrange(32000) for _ in range(64)]
        hashes = hash_token_blocks(prompt, BLOCK_SIZE)
        start = time.perf_counter()
        view.router.route_hashes(pool, hashes)
        out.append(time.perf_counter() - start)
    return sorted(out)


def pct(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=1000)
    parser.add_argument("--pools", type=int, default=10)
    parser.add_argument("--cached", type=int, default=1000, help="hashes each worker holds")
    parser.add_argument("--events", type=int, default=32, help="KV events per push")
    parser.add_argument("--interval", type=float, default=0.5, help="push interval (s)")
    parser.add_argument("--rounds", type=int, default=5, help="push rounds of the whole fleet")
    parser.add_argument("--routes", type=int, default=5000)
    args = parser.parse_args(argv)

    fleet = Fleet(args.workers, args.pools, args.cached)
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    state = build_state(fleet)
    state_mem = tracemalloc.get_traced_memory()[0] - base
    base = tracemalloc.get_traced_memory()[0]
    view = FleetView(Router(RouterConfig(speculative_ttl_s=0.0), seed=0), lambda _d: None)
    view.apply(state.updates_since(None, 0))
    view_mem = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()

    # Absorb: what the actor's push does per message (decode both, apply), whole fleet rounds.
    messages = [
        (wid, fleet.report(wid, pool), fleet.churn(wid, pool, args.events))
        for _ in range(args.rounds)
        for wid, pool in fleet.workers
    ]
    cursor = state.version

    def absorb() -> None:
        for _wid, report, batch in messages:
            state.push(LoadReport.decode(report), KVEventBatch.decode(batch))

    absorb_s = _timed(absorb)
    pushes = len(messages)
    events = pushes * args.events
    produced = args.workers / args.interval  # pushes per second the fleet makes

    # Fan-out: one replica catching up on every delta of those rounds.
    update = state.updates_since(view.generation, cursor)
    fan_s = _timed(lambda: view.apply(update))
    per_delta_us = fan_s / max(len(update.deltas), 1) * 1e6

    big = route_latencies(fleet, view, args.routes)
    small_fleet = Fleet(max(args.workers // 100, args.pools), args.pools, args.cached)
    small_view = FleetView(Router(RouterConfig(speculative_ttl_s=0.0), seed=0), lambda _d: None)
    small_view.apply(build_state(small_fleet).updates_since(None, 0))
    small = route_latencies(small_fleet, small_view, args.routes)

    print(f"fleet: {args.workers} workers, {args.pools} pools, {args.cached} cached hashes each, "
          f"{args.events} events per push every {args.interval}s")
    print("| measure | value |")
    print("|---|---|")
    print(f"| pushes absorbed per second (one core) | {pushes / absorb_s:,.0f} |")
    print(f"| KV events absorbed per second | {events / absorb_s:,.0f} |")
    print(f"| pushes the fleet produces per second | {produced:,.0f} |")
    print(f"| headroom: absorbed / produced | {pushes / absorb_s / produced:.1f}x |")
    print(f"| fan-out per replica: us per delta | {per_delta_us:.1f} |")
    print(f"| fan-out per replica: share of one core at the fleet's rate | {per_delta_us * produced / 1e6:.1%} |")
    print(f"| routing p50 / p99, {args.workers} workers (us) | {pct(big, 0.5) * 1e6:.0f} / {pct(big, 0.99) * 1e6:.0f} |")
    print(f"| routing p50 / p99, {len(small_fleet.workers)} workers (us) | {pct(small, 0.5) * 1e6:.0f} / {pct(small, 0.99) * 1e6:.0f} |")
    print(f"| routing p99 ratio, large / small fleet | {pct(big, 0.99) / pct(small, 0.99):.2f}x |")
    print(f"| index memory, scheduler (MiB) | {state_mem / 2**20:.0f} |")
    print(f"| index memory, one ingress replica (MiB) | {view_mem / 2**20:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
