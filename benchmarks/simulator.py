"""Discrete-event simulator: N workers with real block pools behind the real scheduler and router.

Compares routing policies offline on a shared-prefix workload: groups of
requests share a long system prompt, each request adds a unique suffix.
Each simulated worker owns a real `BlockPool` (prefix cache, LRU eviction,
KV events) and a simple service model: prefills are serialized on the
worker (compute-bound, cost per uncached token), decodes run batched (a fixed
time per output token), at most `max_num_seqs` requests run at once, and a
request is admitted only when its prompt plus output blocks can be allocated.
The cluster state travels as it does in the cluster, through the same code:
each worker pushes its KV events (after `kv_event_delay_s`, or with its next
report under `kv_events_with_reports`, as real workers do) and its load
report (every `report_interval_s`) to a real `ClusterState`; each of
`num_ingress_replicas` replicas follows it with a real `FleetView` and routes
with its own real `Router`, whose decisions reach the other replicas through
the same `ClusterState` after `route_note_delay_s` (`share_routes`); arrivals
go to the replicas in turn. A `ChatWorkload` runs multi-turn sessions instead,
each turn's request naming its session when `sessions` is on (session
affinity, the pins shared between replicas through the same `ClusterState`
after `route_note_delay_s`). With
`eviction` set, each push's answer steers the worker's pool as a worker's
ack does: evict ahead of need below the watermark, and (replica-aware) mark
the hashes another worker keeps so they are evicted before last copies.

    python benchmarks/simulator.py --workers 4 --groups 8 --ingress-replicas 1,2,4
    python benchmarks/simulator.py --groups 16 --hot-share 0.4 --eviction lru,replica_aware
"""

from __future__ import annotations

import argparse
import functools
import heapq
import random
import statistics
import sys
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

# Runnable from a checkout without installing: the repository root goes on the path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagefleet.cluster.fleet_view import FleetView
from pagefleet.cluster.router import ROUTING_POLICIES, Router, RouterConfig
from pagefleet.scheduler.policy import EvictionWatermarks
from pagefleet.scheduler.session_pins import SessionKey, SessionPin
from pagefleet.scheduler.state import ClusterState, PushResult
from pagefleet.worker.block_pool import BlockPool, NoFreeBlocks
from pagefleet.worker.events import KVEventBatch, LoadReport, WorkerInfo
from pagefleet.worker.prefix_hash import hash_token_blocks

_POOL = "sim"
# The eviction policies `--eviction` compares: the real cluster's watermarks with
# plain LRU per worker, or with duplicates evicted before last copies.
EVICTION_MODES = {
    "lru": EvictionWatermarks(replica_aware=False),
    "replica_aware": EvictionWatermarks(replica_aware=True),
}


@dataclass(frozen=True)
class Workload:
    """A shared-prefix workload: `num_groups` system prompts, Poisson arrivals.

    `hot_share` of the requests use group 0 (a hot prefix); the rest pick a
    group uniformly (0: all uniform).
    """

    num_requests: int = 400
    num_groups: int = 8
    system_prompt_tokens: int = 512
    suffix_tokens: int = 64
    output_tokens: int = 32
    arrival_rate: float = 40.0  # requests per second
    vocab_size: int = 32000
    seed: int = 0
    hot_share: float = 0.0

    def __post_init__(self) -> None:
        for name in ("num_requests", "num_groups", "suffix_tokens", "output_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.system_prompt_tokens < 0:
            raise ValueError(f"system_prompt_tokens must be >= 0, got {self.system_prompt_tokens}")
        if not self.arrival_rate > 0:
            raise ValueError(f"arrival_rate must be > 0, got {self.arrival_rate}")
        if not 0.0 <= self.hot_share <= 1.0:
            raise ValueError(f"hot_share must be in [0, 1], got {self.hot_share}")


@dataclass(frozen=True)
class ChatWorkload:
    """Multi-turn chat: `num_sessions` sessions of `turns` turns each; a turn's prompt is
    the previous turn's prompt and answer plus a new message of `message_tokens`.

    Sessions start as a Poisson process (`session_rate` a second), each with one
    of `num_system_prompts` system prompts; a session's next turn arrives a
    think time (exponential, mean `think_s`) after its previous answer ended.
    With `sessions`, every request names its session; without, only its
    prompt routes it. Both ways send the same requests, sessions starting at the same
    times and each turn the same think time after its previous answer.
    """

    num_sessions: int = 96
    turns: int = 6
    num_system_prompts: int = 4
    system_prompt_tokens: int = 256
    message_tokens: int = 48
    output_tokens: int = 32
    session_rate: float = 4.0  # new sessions per second
    think_s: float = 1.0
    sessions: bool = True
    vocab_size: int = 32000
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_sessions", "turns", "num_system_prompts", "message_tokens", "output_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.system_prompt_tokens < 0:
            raise ValueError(f"system_prompt_tokens must be >= 0, got {self.system_prompt_tokens}")
        for name in ("session_rate", "think_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class SimConfig:
    """The simulated fleet: its size, pools and service model.

    `eviction`: how the scheduler steers eviction (None: workers evict LRU on
    allocation only, nothing ahead of need).
    """

    num_workers: int = 4
    num_blocks: int = 192
    block_size: int = 16
    max_num_seqs: int = 16
    prefill_s_per_token: float = 2e-4
    decode_s_per_token: float = 0.02
    report_interval_s: float = 0.25
    kv_event_delay_s: float = 0.02
    # True: KV events wait for the next report (as real workers push them); False:
    # each is pushed at once and arrives after `kv_event_delay_s`.
    kv_events_with_reports: bool = False
    # Replica -> scheduler -> other replicas, for a routing decision (`share_routes`).
    route_note_delay_s: float = 0.02
    num_ingress_replicas: int = 1
    eviction: EvictionWatermarks | None = None

    def __post_init__(self) -> None:
        for name in ("num_workers", "num_blocks", "block_size", "max_num_seqs", "num_ingress_replicas"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in (
            "prefill_s_per_token", "decode_s_per_token", "report_interval_s", "kv_event_delay_s",
            "route_note_delay_s",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class SimResult:
    """What one policy achieved on one workload."""

    policy: str
    num_ingress_replicas: int
    num_requests: int
    hit_rate: float  # prompt tokens served from a worker's prefix cache
    ideal_hit_rate: float  # the same with one shared, unbounded cache
    ttft_p50_s: float
    ttft_p99_s: float
    throughput_rps: float
    evictions: int
    max_worker_share: float  # the busiest worker's share of requests
    eviction: str = "lazy_lru"  # lazy_lru (on allocation only), lru or replica_aware
    duplicate_evictions: int = 0  # of `evictions`, blocks another worker also held

    @property
    def hit_rate_vs_ideal(self) -> float:
        return self.hit_rate / self.ideal_hit_rate if self.ideal_hit_rate else 0.0


@dataclass
class _Request:
    index: int
    arrival: float
    prompt: list[int]
    hashes: list[bytes]
    output_tokens: int
    blocks: list[int] = field(default_factory=list)
    ttft: float = 0.0
    session: SessionKey | None = None
    next_turn: _Request | None = None  # the session's next request, sent think_s after this one
    think_s: float = 0.0


class _Worker:
    def __init__(self, worker_id: str, cfg: SimConfig) -> None:
        self.worker_id = worker_id
        self.pool = BlockPool(cfg.num_blocks, cfg.block_size)
        self.waiting: deque[_Request] = deque()
        self.running = 0
        self.prefill_free_at = 0.0
        self.report_seq = 0
        self.kv_seq = 0
        self.served = 0
        self.hit_tokens = 0
        self.prompt_tokens = 0
        self.progress = 0  # prefills and finishes so far: the scheduler's sign of progress

    def report(self, now: float) -> LoadReport:
        s = self.pool.stats()
        self.report_seq += 1
        return LoadReport(
            self.worker_id, _POOL, self.report_seq, now, s.total, s.free, s.live, s.cached,
            s.peak_live, num_running=self.running, num_waiting=len(self.waiting),
            evictions=s.evictions, prefix_query_tokens=self.prompt_tokens,
            prefix_hit_tokens=self.hit_tokens, incarnation="sim", progress=self.progress,
        )  # fmt: skip

    def kv_batch(self, events: list[tuple[str, bytes]]) -> KVEventBatch:
        self.kv_seq += 1
        return KVEventBatch.from_engine(self.worker_id, self.kv_seq, events, incarnation="sim")


class Simulation:
    """One run of a workload through the router and the simulated workers."""

    def __init__(
        self,
        workload: Workload | ChatWorkload,
        cfg: SimConfig,
        policy: str,
        router_config: RouterConfig | None = None,
    ) -> None:
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"policy must be one of {ROUTING_POLICIES}, got {policy!r}")
        self.workload = workload
        self.cfg = cfg
        self.policy = policy
        self.now = 0.0
        # The simulation models no hangs: only routing and caching are under study.
        self.state = ClusterState(
            report_timeout_s=1e9, stall_timeout_s=1e9, clock=lambda: self.now, generation=1,
            eviction=cfg.eviction,
        )  # fmt: skip
        self.replicas = [
            FleetView(
                Router(
                    (router_config or RouterConfig()).replace(policy=policy),
                    seed=workload.seed + i,
                    clock=lambda: self.now,
                    on_routed=functools.partial(self._routed, f"r{i}"),
                    on_pinned=self._pinned,
                ),
                lambda _delta: None,
                f"r{i}",
            )
            for i in range(cfg.num_ingress_replicas)
        ]
        self.workers = {f"w{i}": _Worker(f"w{i}", cfg) for i in range(cfg.num_workers)}
        for wid, worker in self.workers.items():
            self.state.register_worker(WorkerInfo(wid, _POOL, cfg.num_blocks, cfg.block_size))
            self.state.push(worker.report(0.0), replace(worker.kv_batch([]), reset=True))
        self._sync()
        self._next_replica = 0
        self._events: list[tuple[float, int, str, Any]] = []
        self._tie = 0
        self._finished: list[_Request] = []

    # event queue ------------------------------------------------------------------

    def _at(self, t: float, kind: str, payload: Any) -> None:
        self._tie += 1
        heapq.heappush(self._events, (t, self._tie, kind, payload))

    def run(self) -> SimResult:
        """Simulate until every request has finished."""
        bs = self.cfg.block_size
        if isinstance(self.workload, ChatWorkload):
            requests = make_chat_requests(self.workload, bs)
        else:
            requests = make_requests(self.workload, bs)
        need = max(-(-(len(r.prompt) + r.output_tokens) // bs) for r in requests)
        if need > self.cfg.num_blocks:
            raise ValueError(f"a request needs {need} blocks, a worker has only {self.cfg.num_blocks}")
        for req in requests:
            if req.arrival >= 0:  # a session's later turns arrive after its previous one
                self._at(req.arrival, "arrival", req)
        self._at(0.0, "report", None)
        while self._events and len(self._finished) < len(requests):
            self.now, _, kind, payload = heapq.heappop(self._events)
            getattr(self, f"_on_{kind}")(payload)
        return self._result(requests)

    @property
    def router(self) -> Router:
        """The first replica's router."""
        return self.replicas[0].router

    def _sync(self) -> None:
        # What each replica's long poll would bring back now.
        for view in self.replicas:
            view.apply(self.state.updates_since(view.generation, view.version))

    def _on_arrival(self, req: _Request) -> None:
        view = self.replicas[self._next_replica % len(self.replicas)]
        self._next_replica += 1
        decision = view.router.route_hashes(_POOL, req.hashes, session=req.session)
        worker = self.workers[decision.worker_id]
        worker.waiting.append(req)
        self._admit(worker)

    def _routed(self, replica_id: str, _pool: str, worker_id: str, hashes: Sequence[bytes]) -> None:
        if len(self.replicas) > 1:
            self._at(self.now + self.cfg.route_note_delay_s, "route_note", (replica_id, worker_id, hashes))

    def _pinned(self, pin: SessionPin) -> None:
        if len(self.replicas) > 1:
            self._at(self.now + self.cfg.route_note_delay_s, "pin", pin)

    def _on_pin(self, pin: SessionPin) -> None:
        self.state.note_pins((pin,))
        self._sync()

    def _on_route_note(self, item: tuple[str, str, Sequence[bytes]]) -> None:
        replica_id, worker_id, hashes = item
        self.state.note_routed(replica_id, worker_id, tuple(hashes))
        self._sync()

    def _on_report(self, _: None) -> None:
        for worker in self.workers.values():
            report = worker.report(self.now)
            self._follow(worker, self.state.push(report, worker.kv_batch(worker.pool.drain_events())))
        self._sync()
        self._at(self.now + self.cfg.report_interval_s, "report", None)

    def _on_kv(self, item: tuple[LoadReport, KVEventBatch]) -> None:
        self._follow(self.workers[item[0].worker_id], self.state.push(*item))
        self._sync()

    def _follow(self, worker: _Worker, result: PushResult) -> None:
        """What a worker does with its push's ack: mark duplicates, evict ahead of need."""
        if result.duplicated is not None:
            worker.pool.mark_duplicated(result.duplicated)
        if result.evict_blocks:
            worker.pool.evict_cached(result.evict_blocks)
            self._publish(worker)

    def _on_prefilled(self, item: tuple[_Worker, _Request]) -> None:
        worker, req = item
        worker.progress += 1
        for i, h in enumerate(req.hashes):
            worker.pool.register(req.blocks[i], h)
        self._publish(worker)
        decode = req.output_tokens * self.cfg.decode_s_per_token
        self._at(self.now + decode, "finished", item)

    def _on_finished(self, item: tuple[_Worker, _Request]) -> None:
        worker, req = item
        worker.pool.free(reversed(req.blocks))
        worker.running -= 1
        worker.progress += 1
        self._finished.append(req)
        self._publish(worker)
        self._admit(worker)
        if req.next_turn is not None:
            req.next_turn.arrival = self.now + req.think_s
            self._at(req.next_turn.arrival, "arrival", req.next_turn)

    # worker behaviour -------------------------------------------------------------

    def _admit(self, worker: _Worker) -> None:
        """Admit waiting requests in order while sequences and blocks allow."""
        bs = self.cfg.block_size
        pool = worker.pool
        while worker.waiting and worker.running < self.cfg.max_num_seqs:
            req = worker.waiting[0]
            total = -(-(len(req.prompt) + req.output_tokens) // bs)
            # The last prompt token is always computed, so its block is never a hit.
            reusable = req.hashes[: (len(req.prompt) - 1) // bs]
            cached = pool.lookup(reusable)
            try:
                fresh = pool.allocate(total - len(cached))
            except NoFreeBlocks:
                pool.free(reversed(cached))
                break  # FIFO: the head waits for blocks, the rest wait behind it
            worker.waiting.popleft()
            req.blocks = cached + fresh
            worker.running += 1
            worker.served += 1
            worker.hit_tokens += len(cached) * bs
            worker.prompt_tokens += len(req.prompt)
            start = max(self.now, worker.prefill_free_at)
            done = start + (len(req.prompt) - len(cached) * bs) * self.cfg.prefill_s_per_token
            worker.prefill_free_at = done
            req.ttft = done - req.arrival
            self._at(done, "prefilled", (worker, req))
        self._publish(worker)

    def _publish(self, worker: _Worker) -> None:
        if self.cfg.kv_events_with_reports:
            return  # the next report carries them
        events = worker.pool.drain_events()
        if events:
            # Pushed at once (like a report), delivered after the network delay.
            item = (worker.report(self.now), worker.kv_batch(events))
            self._at(self.now + self.cfg.kv_event_delay_s, "kv", item)

    # results ------------------------------------------------------------------------

    def _result(self, requests: Sequence[_Request]) -> SimResult:
        hit = sum(w.hit_tokens for w in self.workers.values())
        prompt = sum(w.prompt_tokens for w in self.workers.values())
        ttfts = sorted(r.ttft for r in requests)
        makespan = max(self.now, 1e-9)
        pools = [w.pool.stats() for w in self.workers.values()]
        marks = self.cfg.eviction
        eviction = "lazy_lru" if marks is None else "replica_aware" if marks.replica_aware else "lru"
        return SimResult(
            policy=self.policy,
            num_ingress_replicas=self.cfg.num_ingress_replicas,
            num_requests=len(requests),
            hit_rate=hit / prompt if prompt else 0.0,
            ideal_hit_rate=ideal_hit_rate(requests, self.cfg.block_size),
            ttft_p50_s=_percentile(ttfts, 0.50),
            ttft_p99_s=_percentile(ttfts, 0.99),
            throughput_rps=len(requests) / makespan,
            evictions=sum(p.evictions for p in pools),
            max_worker_share=max(w.served for w in self.workers.values()) / len(requests),
            eviction=eviction,
            duplicate_evictions=sum(p.duplicate_evictions for p in pools),
        )


def make_requests(workload: Workload, block_size: int) -> list[_Request]:
    """The workload's requests, deterministic in its seed."""
    rng = random.Random(workload.seed)
    systems = [
        [rng.randrange(workload.vocab_size) for _ in range(workload.system_prompt_tokens)]
        for _ in range(workload.num_groups)
    ]
    t = 0.0
    out = []
    for i in range(workload.num_requests):
        t += rng.expovariate(workload.arrival_rate)
        suffix = [rng.randrange(workload.vocab_size) for _ in range(workload.suffix_tokens)]
        hot = workload.hot_share and rng.random() < workload.hot_share
        prompt = systems[0 if hot else rng.randrange(workload.num_groups)] + suffix
        out.append(_Request(i, t, prompt, hash_token_blocks(prompt, block_size), workload.output_tokens))
    return out


def make_chat_requests(workload: ChatWorkload, block_size: int) -> list[_Request]:
    """Every turn of every session, deterministic in the seed; only first turns have an
    arrival time (the others get theirs when the turn before them ends)."""
    rng = random.Random(workload.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(workload.vocab_size) for _ in range(n)]

    systems = [tokens(workload.system_prompt_tokens) for _ in range(workload.num_system_prompts)]
    out: list[_Request] = []
    t = 0.0
    for s in range(workload.num_sessions):
        t += rng.expovariate(workload.session_rate)
        history = list(systems[rng.randrange(workload.num_system_prompts)])
        session = ("sim", f"s{s}") if workload.sessions else None
        previous: _Request | None = None
        for turn in range(workload.turns):
            history += tokens(workload.message_tokens)
            req = _Request(
                len(out), t if turn == 0 else -1.0, list(history), hash_token_blocks(history, block_size),
                workload.output_tokens, session=session, think_s=rng.expovariate(1 / workload.think_s),
            )  # fmt: skip
            if previous is not None:
                previous.next_turn = req
            previous = req
            history += tokens(workload.output_tokens)  # the answer, part of the next prompt
            out.append(req)
    return out


def ideal_hit_rate(requests: Sequence[_Request], block_size: int) -> float:
    """Hit rate of one shared cache that never evicts, in arrival order."""
    seen: set[bytes] = set()
    hit = prompt = 0
    for req in sorted(requests, key=lambda r: r.arrival):
        reusable = req.hashes[: (len(req.prompt) - 1) // block_size]
        for h in reusable:
            if h not in seen:
                break
            hit += block_size
        seen.update(req.hashes)
        prompt += len(req.prompt)
    return hit / prompt if prompt else 0.0


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def simulate(
    policy: str,
    workload: Workload | ChatWorkload | None = None,
    cfg: SimConfig | None = None,
    router_config: RouterConfig | None = None,
) -> SimResult:
    """Run one policy on a workload."""
    return Simulation(workload or Workload(), cfg or SimConfig(), policy, router_config).run()


def compare_policies(
    workload: Workload | None = None,
    cfg: SimConfig | None = None,
    policies: Sequence[str] = ROUTING_POLICIES,
    router_config: RouterConfig | None = None,
) -> list[SimResult]:
    """Every policy on the same workload and fleet."""
    return [simulate(p, workload, cfg, router_config) for p in policies]


def format_table(results: Sequence[SimResult]) -> str:
    """A markdown table of results, with hit rate relative to the ideal shared cache."""
    lines = [
        "| policy | eviction | ingress replicas | hit rate | vs ideal | TTFT p50 (s) | TTFT p99 (s) | req/s "
        "| evictions | of them duplicates | busiest worker |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.policy} | {r.eviction} | {r.num_ingress_replicas} | {r.hit_rate:.1%} | {r.hit_rate_vs_ideal:.1%} "
            f"| {r.ttft_p50_s:.3f} | {r.ttft_p99_s:.3f} | {r.throughput_rps:.1f} | {r.evictions} "
            f"| {r.duplicate_evictions} | {r.max_worker_share:.0%} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: print the policy comparison table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=SimConfig.num_workers)
    parser.add_argument("--blocks", type=int, default=SimConfig.num_blocks, help="KV blocks per worker")
    parser.add_argument("--groups", type=int, default=Workload.num_groups)
    parser.add_argument("--requests", type=int, default=Workload.num_requests)
    parser.add_argument("--system-tokens", type=int, default=Workload.system_prompt_tokens)
    parser.add_argument("--suffix-tokens", type=int, default=Workload.suffix_tokens)
    parser.add_argument("--rate", type=float, default=Workload.arrival_rate, help="requests per second")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seeds", type=int, default=1,
                        help="run seeds seed..seed+N-1 and print medians over them, with each "
                        "run's hit rate against the single-replica run of its seed")
    parser.add_argument("--hot-share", type=float, default=0.0,
                        help="share of requests on one hot prefix (group 0)")
    parser.add_argument("--eviction", default="", metavar="MODE[,MODE...]",
                        help=f"scheduler-steered eviction to compare: {', '.join(EVICTION_MODES)} "
                        "(default: none, LRU on allocation only)")
    parser.add_argument("--policies", default=",".join(ROUTING_POLICIES))
    parser.add_argument("--ingress-replicas", default="1", metavar="N[,N...]",
                        help="ingress replicas following one scheduler view, e.g. 1,2,4")
    parser.add_argument("--report-interval", type=float, default=SimConfig.report_interval_s,
                        help="seconds between two load reports of a worker")
    parser.add_argument("--no-share-routes", action="store_true",
                        help="replicas do not tell each other their routing decisions")
    parser.add_argument("--kv-events-with-reports", action="store_true",
                        help="KV events travel with the next report, as real workers push them "
                        f"(default: at once, arriving after {SimConfig.kv_event_delay_s} s)")
    args = parser.parse_args(argv)
    workload = Workload(
        num_requests=args.requests, num_groups=args.groups, system_prompt_tokens=args.system_tokens,
        suffix_tokens=args.suffix_tokens, arrival_rate=args.rate, seed=args.seed,
        hot_share=args.hot_share,
    )  # fmt: skip
    modes = [m for m in args.eviction.split(",") if m]
    unknown = [m for m in modes if m not in EVICTION_MODES]
    if unknown:
        parser.error(f"--eviction: unknown {', '.join(unknown)}; one of {', '.join(EVICTION_MODES)}")
    if args.seeds < 1:
        parser.error(f"--seeds: must be >= 1, got {args.seeds}")
    policies = [p for p in args.policies.split(",") if p]
    counts = [int(x) for x in args.ingress_replicas.split(",")]
    steering: list[EvictionWatermarks | None] = [EVICTION_MODES[m] for m in modes] or [None]
    router = RouterConfig(share_routes=not args.no_share_routes)
    by_seed: list[list[SimResult]] = []
    for seed in range(args.seed, args.seed + args.seeds):
        results = []
        for n in counts:
            for marks in steering:
                cfg = SimConfig(
                    num_workers=args.workers, num_blocks=args.blocks, num_ingress_replicas=n,
                    eviction=marks, report_interval_s=args.report_interval,
                    kv_events_with_reports=args.kv_events_with_reports,
                )  # fmt: skip
                results += compare_policies(replace(workload, seed=seed), cfg, policies, router)
        by_seed.append(results)
    print(workload)
    if args.seeds == 1:
        print(format_table(by_seed[0]))
    else:
        print(format_medians(by_seed))
    return 0


def format_medians(by_seed: Sequence[Sequence[SimResult]]) -> str:
    """Per policy, eviction and replica count: medians over seeds of the hit rate, of it
    against the single-replica run of the same seed, and of TTFT p99."""
    lines = [
        "| policy | eviction | ingress replicas | hit rate (median) | vs 1 replica (median) "
        "| vs 1 replica (worst) | TTFT p99 (s, median) |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(by_seed[0]):
        runs = [results[i] for results in by_seed]
        ratios = []
        for results, run in zip(by_seed, runs, strict=True):
            single = next(
                (x for x in results
                 if (x.policy, x.eviction, x.num_ingress_replicas) == (run.policy, run.eviction, 1)),
                None,
            )  # fmt: skip
            if single is not None and single.hit_rate:
                ratios.append(run.hit_rate / single.hit_rate)
        vs = f"{statistics.median(ratios):.1%} | {min(ratios):.1%}" if ratios else "- | -"
        lines.append(
            f"| {r.policy} | {r.eviction} | {r.num_ingress_replicas} "
            f"| {statistics.median(x.hit_rate for x in runs):.1%} | {vs} "
            f"| {statistics.median(x.ttft_p99_s for x in runs):.3f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
