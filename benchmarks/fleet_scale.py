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

Costs are CPU seconds of this process (`time.process_time`): on a shared
machine wall time mostly measures the other processes. Routing shows both.
The fleet is built, then frozen out of the garbage collector (`gc.freeze`):
all shards share this process's heap, and a full collection of it would
land on whichever shard happened to trigger it.

`--shards 1,2,5,10` repeats all of it with the scheduler sharded per pool
(`scheduler.shards`, pools assigned by the real `ClusterConfig.scheduler_shards`):
one `ClusterState` per shard, each absorbing only its pools' pushes (each
shard is its own actor, so its own core), and two replicas: one following
every shard (a merged `FleetView`) and one following only shard 0's pools.
Repetitions interleave the shard counts (1, 2, 5, 10, 1, 2, ...); the table
shows medians.

`--hash-ranges 1,2,4` splits one pool's prefix index by hash range over K
`ClusterState` instances (each worker's KV events go to the instance owning
the hash's range; the load report is decoded by the pool's owner, range 0,
only) and reports what each instance absorbs.

`--route-notes 2000 --replicas 8` measures what the replicas' route notes
(`router.share_routes`) cost the scheduler and each replica at that many
routing decisions per second.

`--ray-pushes 3000` sends one pool's pushes through a real `SchedulerActor`
on a local Ray and reads the actor process's CPU time, against
`ClusterState.push` in this process: what Ray's per-call cost adds.

    python benchmarks/fleet_scale.py --workers 1000 --pools 10 --shards 1,2,5,10 --hash-ranges 1,2,4
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import time
import tracemalloc
from collections.abc import Callable, Sequence

from pagefleet.cluster.config import ClusterConfig
from pagefleet.cluster.fleet_view import ROUTE_NOTE_INTERVAL_S, FleetView
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
    """CPU seconds of `fn`: on a shared machine, wall time mostly measures the other processes."""
    start = time.process_time()
    fn()
    return time.process_time() - start


def build_state(fleet: Fleet, workers: Sequence[tuple[str, str]] | None = None) -> ClusterState:
    state = ClusterState(report_timeout_s=1e9, stall_timeout_s=1e9, generation=1)
    for wid, pool in fleet.workers if workers is None else workers:
        state.register_worker(WorkerInfo(wid, pool, 4096, BLOCK_SIZE))
        state.push(LoadReport.decode(fleet.report(wid, pool)), KVEventBatch.decode(fleet.snapshot(wid)))
    return state


def route_latencies(fleet: Fleet, view: FleetView, n: int) -> tuple[list[float], list[float]]:
    """Sorted (wall, CPU) seconds of `n` routing decisions."""
    wall, cpu = [], []
    rng = random.Random(1)
    for _ in range(n):
        pool = rng.choice(fleet.pools)
        prompt = rng.choice(fleet.prompts[pool]) + [rng.randrange(32000) for _ in range(64)]
        hashes = hash_token_blocks(prompt, BLOCK_SIZE)
        start, start_cpu = time.perf_counter(), time.thread_time()
        view.router.route_hashes(pool, hashes)
        cpu.append(time.thread_time() - start_cpu)
        wall.append(time.perf_counter() - start)
    return sorted(wall), sorted(cpu)


def pct(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))]


def _new_view(shards: int = 1) -> FleetView:
    return FleetView(Router(RouterConfig(speculative_ttl_s=0.0), seed=0), lambda _d: None, shards=shards)


class Sharded:
    """One configuration: the fleet's pools over `shards` scheduler states, and two replicas."""

    def __init__(self, args: argparse.Namespace, shards: int) -> None:
        self.args = args
        self.shards = shards
        self.fleet = Fleet(args.workers, args.pools, args.cached)  # same seed: the same fleet
        config = ClusterConfig.from_dict({
            "pools": [{"name": p, "workers": args.workers // args.pools} for p in self.fleet.pools],
            "scheduler": {"shards": shards},
        })  # fmt: skip
        owner = config.scheduler_shards()
        self.members = [[w for w in self.fleet.workers if owner[w[1]] == s] for s in range(shards)]
        tracemalloc.start()
        self.state_mem: list[int] = []
        self.states: list[ClusterState] = []
        for members in self.members:
            base = tracemalloc.get_traced_memory()[0]
            self.states.append(build_state(self.fleet, members))
            self.state_mem.append(tracemalloc.get_traced_memory()[0] - base)
        base = tracemalloc.get_traced_memory()[0]
        self.view = _new_view(shards)  # follows every shard
        for s, state in enumerate(self.states):
            self.view.apply(state.updates_since(None, 0), s)
        self.view_mem = tracemalloc.get_traced_memory()[0] - base
        base = tracemalloc.get_traced_memory()[0]
        self.own_view = _new_view()  # follows only shard 0 (its replica serves only those pools)
        self.own_view.apply(self.states[0].updates_since(None, 0))
        self.own_view_mem = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.stop()
        self.samples: dict[str, list[float]] = {}
        self.produced_max = 0.0

    def _note(self, name: str, value: float) -> None:
        self.samples.setdefault(name, []).append(value)

    def measure(self) -> None:
        """One repetition: `--rounds` pushes of every worker, fan-out of their deltas, routing."""
        args, fleet = self.args, self.fleet
        cursors = [state.version for state in self.states]
        rates = []
        for members, state in zip(self.members, self.states, strict=True):
            messages = [
                (fleet.report(wid, pool), fleet.churn(wid, pool, args.events))
                for _ in range(args.rounds)
                for wid, pool in members
            ]

            def absorb(messages: list[tuple[bytes, bytes]] = messages, state: ClusterState = state) -> None:
                for report, batch in messages:
                    state.push(LoadReport.decode(report), KVEventBatch.decode(batch))

            rates.append(len(messages) / _timed(absorb))
        produced = [len(m) / args.interval for m in self.members]
        for s, rate in enumerate(rates):
            self._note(f"absorb{s}", rate)
            self._note(f"headroom{s}", rate / produced[s])
        self.produced_max = max(produced)
        # Fan-out: the merged replica catches up on every shard's deltas, the other on shard 0's.
        n_all = 0
        fan_s = 0.0
        for s, state in enumerate(self.states):
            update = state.updates_since(self.view.cursor(s)[0], cursors[s])
            n_all += len(update.deltas)
            start = time.process_time()
            self.view.apply(update, s)
            fan_s += time.process_time() - start
        own = self.states[0].updates_since(self.own_view.generation, cursors[0])
        own_s = _timed(lambda: self.own_view.apply(own))
        total_rate = args.workers / args.interval
        self._note("fan_us", fan_s / max(n_all, 1) * 1e6)
        self._note("fan_share_all", fan_s / max(n_all, 1) * total_rate)
        self._note("fan_share_own", own_s / max(len(own.deltas), 1) * produced[0])
        wall, cpu = route_latencies(fleet, self.view, args.routes)
        self._note("route_p50", pct(cpu, 0.5))
        self._note("route_p99", pct(cpu, 0.99))
        self._note("route_wall_p99", pct(wall, 0.99))

    def median(self, name: str) -> float:
        return statistics.median(self.samples[name])

    def per_shard(self, name: str) -> list[float]:
        """Each shard's median over the repetitions (so one preempted run does not decide)."""
        return [self.median(f"{name}{s}") for s in range(self.shards)]


def sharded_table(args: argparse.Namespace, counts: list[int]) -> None:
    if not counts:
        return
    configs = [Sharded(args, n) for n in counts]
    # All shards share this process's heap; each real shard has its own. Freeze what
    # is built so a full collection does not land on whichever shard triggers it.
    gc.collect()
    gc.freeze()
    for _ in range(args.reps):
        for c in configs:  # interleaved: 1, 2, 5, 10, 1, 2, ...
            c.measure()
    gc.unfreeze()
    head = "| measure | " + " | ".join(f"{n} shard{'s' if n > 1 else ''}" for n in counts) + " |"
    print(head)
    print("|---" * (len(counts) + 1) + "|")

    def row(label: str, fmt: Callable[[Sharded], str]) -> None:
        print(f"| {label} | " + " | ".join(fmt(c) for c in configs) + " |")

    row("workers per shard (max)", lambda c: f"{max(len(m) for m in c.members)}")
    # Each shard is its own actor: the fleet keeps up while its slowest shard does.
    row("pushes absorbed per second, median shard", lambda c: f"{statistics.median(c.per_shard('absorb')):,.0f}")
    row("pushes absorbed per second, slowest shard", lambda c: f"{min(c.per_shard('absorb')):,.0f}")
    row("pushes its pools produce per second (largest shard)", lambda c: f"{c.produced_max:,.0f}")
    row("headroom: absorbed / produced, median shard", lambda c: f"{statistics.median(c.per_shard('headroom')):.1f}x")
    row("headroom: absorbed / produced, slowest shard", lambda c: f"**{min(c.per_shard('headroom')):.1f}x**")
    row("fan-out: us per delta (merged view)", lambda c: f"{c.median('fan_us'):.0f}")
    row("fan-out: core share, replica following every shard", lambda c: f"{c.median('fan_share_all'):.0%}")
    row("fan-out: core share, replica following shard 0 only", lambda c: f"{c.median('fan_share_own'):.0%}")
    row("routing p50 / p99 on the merged view, CPU (us)",
        lambda c: f"{c.median('route_p50') * 1e6:.0f} / {c.median('route_p99') * 1e6:,.0f}")  # fmt: skip
    row("routing p99 on the merged view, wall (us)", lambda c: f"{c.median('route_wall_p99') * 1e6:,.0f}")
    row("index memory, largest shard (MiB)", lambda c: f"{max(c.state_mem) / 2**20:.0f}")
    row("index memory, all shards (MiB)", lambda c: f"{sum(c.state_mem) / 2**20:.0f}")
    row("index memory, replica following every shard (MiB)", lambda c: f"{c.view_mem / 2**20:.0f}")
    row("index memory, replica following shard 0 (MiB)", lambda c: f"{c.own_view_mem / 2**20:.0f}")


def hash_range_table(args: argparse.Namespace, counts: list[int]) -> None:
    """One pool's index split by hash range over K states; each state's absorb rate."""
    workers = args.workers // args.pools
    rows: dict[int, list[float]] = {k: [] for k in counts}
    fleets = {k: Fleet(workers, 1, args.cached) for k in counts}
    setups = {k: _range_setup(fleets[k], k) for k in counts}
    gc.collect()
    gc.freeze()
    for _ in range(args.reps):
        for k in counts:
            rows[k].append(_range_absorb(fleets[k], setups[k], k, args))
    gc.unfreeze()
    produced = workers / args.interval
    base = statistics.median(rows[counts[0]])
    print(f"one pool of {workers} workers, {args.events} events per push")
    print("| hash ranges | pushes absorbed per second, slowest range | headroom vs the pool's pushes | vs 1 range |")
    print("|---|---|---|---|")
    for k in counts:
        rate = statistics.median(rows[k])
        print(f"| {k} | {rate:,.0f} | {rate / produced:.1f}x | {rate / base:.2f}x |")


def _range_of(block_hash: bytes, k: int) -> int:
    return block_hash[0] * k // 256  # contiguous ranges of the hash space


def _range_setup(fleet: Fleet, k: int) -> tuple[list[ClusterState], dict[tuple[str, int], int]]:
    states = [ClusterState(report_timeout_s=1e9, stall_timeout_s=1e9, generation=1) for _ in range(k)]
    seqs: dict[tuple[str, int], int] = {}
    for wid, pool in fleet.workers:
        report = LoadReport.decode(fleet.report(wid, pool))
        for r, state in enumerate(states):
            state.register_worker(WorkerInfo(wid, pool, 4096, BLOCK_SIZE))
            held = tuple(("stored", h) for h in fleet.held[wid] if _range_of(h, k) == r)
            seqs[wid, r] = 1
            state.push(report, KVEventBatch(wid, 1, held, reset=True, incarnation="i"))
    return states, seqs


def _range_absorb(
    fleet: Fleet, setup: tuple[list[ClusterState], dict[tuple[str, int], int]], k: int, args: argparse.Namespace
) -> float:
    states, seqs = setup
    per_range: list[list[tuple[bytes, bytes | LoadReport]]] = [[] for _ in range(k)]
    for _ in range(args.rounds):
        for wid, pool in fleet.workers:
            report = fleet.report(wid, pool)
            events = KVEventBatch.decode(fleet.churn(wid, pool, args.events)).events
            for r in range(k):
                seqs[wid, r] += 1
                mine = tuple(e for e in events if _range_of(e[1], k) == r)
                batch = KVEventBatch(wid, seqs[wid, r], mine, incarnation="i").encode()
                # Only the owner (range 0) decodes the report; the others hold just the index.
                per_range[r].append((batch, report if r == 0 else LoadReport.decode(report)))
    rates = []
    for state, messages in zip(states, per_range, strict=True):

        def absorb(state: ClusterState = state, messages: list[tuple[bytes, bytes | LoadReport]] = messages) -> None:
            for batch, report in messages:
                load = LoadReport.decode(report) if isinstance(report, bytes) else report
                state.push(load, KVEventBatch.decode(batch))

        rates.append(len(messages) / _timed(absorb))
    return min(rates)


def ray_actor_table(args: argparse.Namespace) -> None:
    """One pool's pushes through a real `SchedulerActor` on a local Ray, against `ClusterState` in process.

    The actor's cost is read from its process: CPU seconds of all its threads,
    and of its busiest thread (the one that bounds it). Pushes go out 100 at
    a time, one per worker, as a fleet's pushes arrive.
    """
    import psutil
    import ray

    from pagefleet.scheduler.actor import start_scheduler

    workers = args.workers // args.pools
    rounds = max(1, args.ray_pushes // workers)
    ray.init(address="local", num_cpus=2, include_dashboard=False, namespace=f"fleet-scale-{os.getpid()}")
    try:
        actor = start_scheduler(namespace=f"fleet-scale-{os.getpid()}", report_timeout_s=1e9,
                                stall_timeout_s=1e9, index_check_interval_s=1e9)  # fmt: skip
        fleet, peer_fleet = Fleet(workers, 1, args.cached), Fleet(workers, 1, args.cached)
        for wid, pool in fleet.workers:
            ray.get(actor.register_worker.remote(WorkerInfo(wid, pool, 4096, BLOCK_SIZE)))
            ray.get(actor.push.remote(wid, fleet.report(wid, pool), fleet.snapshot(wid)))
        peer = build_state(peer_fleet)
        procs = psutil.Process(os.getpid()).children(recursive=True)
        proc = next(q for q in procs if any("SchedulerActor" in part for part in q.cmdline()))
        samples: dict[str, list[float]] = {"peer": [], "all": [], "busiest": [], "wall": []}
        for _ in range(args.reps):  # interleaved: actor, in process, actor, ...
            messages = [(wid, fleet.report(wid, pool), fleet.churn(wid, pool, args.events))
                        for _ in range(rounds) for wid, pool in fleet.workers]  # fmt: skip
            before = {t.id: t.user_time + t.system_time for t in proc.threads()}
            start = time.perf_counter()
            for i in range(0, len(messages), workers):
                ray.get([actor.push.remote(*m) for m in messages[i : i + workers]])
            wall = time.perf_counter() - start
            spent = {t.id: t.user_time + t.system_time - before.get(t.id, 0.0) for t in proc.threads()}
            samples["wall"].append(len(messages) / wall)
            samples["all"].append(len(messages) / sum(spent.values()))
            samples["busiest"].append(len(messages) / max(spent.values()))
            local = [(peer_fleet.report(wid, pool), peer_fleet.churn(wid, pool, args.events))
                     for _ in range(rounds) for wid, pool in peer_fleet.workers]  # fmt: skip

            def absorb(local: list[tuple[bytes, bytes]] = local) -> None:
                for report, batch in local:
                    peer.push(LoadReport.decode(report), KVEventBatch.decode(batch))

            samples["peer"].append(len(local) / _timed(absorb))
    finally:
        ray.shutdown()
    med = {k: statistics.median(v) for k, v in samples.items()}
    print(f"one pool of {workers} workers through a real SchedulerActor ({rounds * workers} pushes per repetition)")
    print("| measure | pushes per second | vs in process |")
    print("|---|---|---|")
    print(f"| `ClusterState.push` in process, CPU | {med['peer']:,.0f} | 1.00x |")
    print(f"| actor, per CPU second of its busiest thread | {med['busiest']:,.0f} | {med['busiest'] / med['peer']:.2f}x |")
    print(f"| actor, per CPU second of all its threads | {med['all']:,.0f} | {med['all'] / med['peer']:.2f}x |")
    print(f"| actor, per wall second (this machine) | {med['wall']:,.0f} | {med['wall'] / med['peer']:.2f}x |")


def route_notes_table(args: argparse.Namespace) -> None:
    """What route notes cost (`router.share_routes`): `--route-notes` requests per second,
    each of a 32-block system prompt plus 4 blocks, routed by one of `--replicas`
    ingress replicas and relayed by the scheduler to the others.

    Scheduler: `ClusterState.note_routed` per decision plus `updates_since` once
    per replica per batch (the long-poll answer). Replica: `FleetView.apply` of
    the other replicas' notes (`Router.note_routed_elsewhere`). CPU seconds,
    against one second of the rate: the share of one core each spends.
    """
    fleet = Fleet(args.workers, args.pools, args.cached)
    state = build_state(fleet)
    # The default router: speculative entries on, which is what the notes feed.
    replicas = [FleetView(Router(seed=0), lambda _d: None, f"r{i}") for i in range(args.replicas)]
    for view in replicas:
        view.apply(state.updates_since(None, 0))
    rng = random.Random(2)
    decisions = []
    for _ in range(args.route_notes):
        wid, pool = rng.choice(fleet.workers)
        prompt = rng.choice(fleet.prompts[pool]) + [rng.randrange(32000) for _ in range(4 * BLOCK_SIZE)]
        decisions.append((f"r{rng.randrange(args.replicas)}", wid, tuple(hash_token_blocks(prompt, BLOCK_SIZE))))
    # Each replica sends what it routed in ROUTE_NOTE_INTERVAL_S in one call, and each
    # long poll brings every replica the notes of that interval: 1/interval rounds a second.
    rounds = round(1 / ROUTE_NOTE_INTERVAL_S)
    batch = max(1, args.route_notes // rounds)
    scheduler_s = replica_s = 0.0
    for start in range(0, len(decisions), batch):
        chunk = decisions[start : start + batch]

        def publish(chunk: list[tuple[str, str, tuple[bytes, ...]]] = chunk) -> None:
            for rid, wid, hashes in chunk:
                state.note_routed(rid, wid, hashes)

        scheduler_s += _timed(publish)
        for view in replicas:
            start_cpu = time.process_time()
            update = state.updates_since(view.generation, view.version)
            answered = time.process_time()
            view.apply(update)
            scheduler_s += answered - start_cpu
            replica_s += time.process_time() - answered
    per_replica = replica_s / len(replicas)
    print(f"route notes: {args.route_notes} decisions/s over {args.replicas} replicas, 36 blocks each: "
          f"scheduler {scheduler_s:.3f} s CPU per second of traffic ({1 / scheduler_s:.1f}x headroom, "
          f"before Ray's cost of {rounds * args.replicas} calls/s in and answers out), "
          f"each replica {per_replica:.3f} s ({100 * per_replica:.1f}% of a core)")


def _counts(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=1000)
    parser.add_argument("--pools", type=int, default=10)
    parser.add_argument("--cached", type=int, default=1000, help="hashes each worker holds")
    parser.add_argument("--events", type=int, default=32, help="KV events per push")
    parser.add_argument("--interval", type=float, default=0.5, help="push interval (s)")
    parser.add_argument("--rounds", type=int, default=5, help="push rounds of the whole fleet per repetition")
    parser.add_argument("--routes", type=int, default=5000)
    parser.add_argument("--shards", default="1", help="scheduler shard counts, e.g. 1,2,5,10")
    parser.add_argument("--hash-ranges", default="", help="hash ranges of one pool's index, e.g. 1,2,4")
    parser.add_argument("--reps", type=int, default=3, help="interleaved repetitions (medians shown)")
    parser.add_argument("--ray-pushes", type=int, default=0,
                        help="also push this many through a real scheduler actor on a local Ray")  # fmt: skip
    parser.add_argument("--route-notes", type=int, default=0,
                        help="also measure route notes at this many routing decisions per second")
    parser.add_argument("--replicas", type=int, default=8, help="ingress replicas, for --route-notes")
    args = parser.parse_args(argv)

    print(f"fleet: {args.workers} workers, {args.pools} pools, {args.cached} cached hashes each, "
          f"{args.events} events per push every {args.interval}s; {args.reps} interleaved repetitions")
    print(f"load average at start: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    sharded_table(args, _counts(args.shards))
    small = Fleet(max(args.workers // 100, args.pools), args.pools, args.cached)
    small_view = _new_view()
    small_view.apply(build_state(small).updates_since(None, 0))
    _, lat = route_latencies(small, small_view, args.routes)
    print(f"routing p50 / p99 CPU on a 1/100 fleet ({len(small.workers)} workers): "
          f"{pct(lat, 0.5) * 1e6:.0f} / {pct(lat, 0.99) * 1e6:.0f} us")
    if args.hash_ranges:
        print()
        hash_range_table(args, _counts(args.hash_ranges))
    if args.ray_pushes:
        print()
        ray_actor_table(args)
    if args.route_notes:
        print()
        route_notes_table(args)
    print(f"load average at end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
