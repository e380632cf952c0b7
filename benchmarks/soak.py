"""Soak: many requests with random faults against a real local cluster; counts what is lost.

The cluster: one pool of `--workers` CPU workers on the tiny model, shared by
two tenants ("a" and "b", API keys, weight 1 each). `--concurrency` client
tasks send `--requests` gRPC requests in all (tenant, prompt and length drawn
from `--seed`). Each request is one of:

- **normal**: streams to its end;
- **abort**: the client calls `Abort` (same tenant) after the first token;
- **disconnect**: the client cancels the call after a few tokens;
- **poison**: sampling with `temperature` 1e-39 (random sampling, overflows a
  naive `logits / temperature`): whatever comes back is counted.

Halfway through, one worker is killed (SIGKILL via `ray.kill`; Ray restarts
it). Before the soak, a fault-free peer run of normal requests at the same
concurrency gives the latency to compare with.

Reported: outcomes per kind; **lost** requests (a normal request that did
not end with its full output, or any request that ended with an error other
than its expected one; RESOURCE_EXHAUSTED refusals are counted apart);
**leaked blocks** after everything ends (live blocks, and total - free -
cached, on every worker; goal 0) and each worker's `check_integrity`; worker
restarts seen (one is the planned kill); e2e latency p50/p99 of normal
requests, soak against the peer run.

    python benchmarks/soak.py                    # 10,000 requests
    python benchmarks/soak.py --requests 2000    # a few minutes on 2 CPU cores
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import ray

from pagefleet.cluster.app import RunningCluster, start_cluster
from pagefleet.cluster.client import auth_metadata, build_request
from pagefleet.cluster.config import ClusterConfig
from pagefleet.cluster.proto import pagefleet_pb2 as pb
from pagefleet.cluster.proto import pagefleet_pb2_grpc as pb_grpc
from pagefleet.worker import progress

POOL = "soak"
KEYS = {"a": "soak-key-a", "b": "soak-key-b"}
KINDS = ("normal", "abort", "disconnect", "poison")
POISON_TEMPERATURE = 1e-39
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "wizards", "quietly", "judge", "boxing"]


@dataclass(frozen=True)
class Options:
    requests: int
    concurrency: int
    workers: int
    weights: tuple[float, ...]  # normal, abort, disconnect, poison
    seed: int
    kill: bool
    timeout_s: float


@dataclass
class Outcome:
    kind: str
    result: str  # "length", "stop", "abort", "cancelled", or a gRPC status code name
    tokens: int
    wanted: int
    seconds: float
    detail: str = ""


@dataclass
class Tally:
    outcomes: list[Outcome] = field(default_factory=list)

    def lost(self) -> list[Outcome]:
        return [o for o in self.outcomes if _is_lost(o)]


def _is_lost(o: Outcome) -> bool:
    if o.result == "RESOURCE_EXHAUSTED":
        return False  # an explicit, retryable refusal: counted apart
    if o.kind == "normal":
        return not (o.result == "stop" or (o.result == "length" and o.tokens == o.wanted))
    if o.kind == "abort":
        return o.result not in ("abort", "length", "stop")  # it may finish before the abort lands
    if o.kind == "disconnect":
        return o.result not in ("cancelled", "length", "stop")
    return False  # poison: every answer is reported, none is "expected"


def cluster_config(workers: int) -> ClusterConfig:
    return ClusterConfig.from_dict(
        {
            "pools": [
                {
                    "name": POOL,
                    "model": "tiny",
                    "workers": workers,
                    "block_size": 16,
                    "num_kv_blocks": 128,
                    "max_model_len": 256,
                    "max_num_seqs": 8,
                    "max_num_batched_tokens": 512,
                    "device": "cpu",
                }
            ],
            "tenants": [{"name": t, "pool": POOL, "api_key": k} for t, k in KEYS.items()],
            "scheduler": {"report_interval_s": 0.2, "report_timeout_s": 2.0, "wait_queue_size": 64},
            "server": {"host": "127.0.0.1", "grpc_port": 0, "http_port": None},
        }
    )


async def one_request(
    stub: pb_grpc.GenerationStub, rng: random.Random, kind: str, request_id: str, timeout_s: float
) -> Outcome:
    tenant = rng.choice(("a", "b"))
    metadata = auth_metadata(KEYS[tenant])
    wanted = rng.randint(2, 24)
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40)))
    sampling: dict[str, Any] = {"max_tokens": wanted, "ignore_eos": True}
    if kind == "poison":
        sampling.update(temperature=POISON_TEMPERATURE, seed=rng.randint(0, 2**31))
    cut_after = rng.randint(1, 4)
    req = build_request(prompt, sampling, request_id=request_id)
    started = time.monotonic()
    call = stub.Generate(req, timeout=timeout_s, metadata=metadata)
    tokens = 0
    result = ""
    try:
        async for msg in call:
            tokens += len(msg.token_ids)
            if msg.finish_reason:
                result = msg.finish_reason
                break
            if kind == "abort" and tokens >= 1 and cut_after > 0:
                cut_after = 0  # abort once
                await stub.Abort(pb.AbortRequest(request_id=request_id), timeout=30, metadata=metadata)
            elif kind == "disconnect" and tokens >= cut_after:
                call.cancel()
                result = "cancelled"
                break
        else:
            result = result or "NO_FINISH_REASON"
    except asyncio.CancelledError:
        result = "cancelled"
    except grpc.aio.AioRpcError as err:
        code = err.code()
        result = "cancelled" if code == grpc.StatusCode.CANCELLED else code.name
        return Outcome(kind, result, tokens, wanted, time.monotonic() - started, err.details() or "")
    return Outcome(kind, result, tokens, wanted, time.monotonic() - started)


async def run_phase(
    target: str,
    opts: Options,
    count: int,
    weights: Sequence[float],
    *,
    prefix: str,
    on_half: Any = None,
) -> Tally:
    """`count` requests over `opts.concurrency` client tasks; `on_half()` runs once halfway."""
    tally = Tally()
    rng = random.Random(f"{opts.seed}-{prefix}")
    kinds = rng.choices(KINDS, weights=weights, k=count)
    next_index = 0
    half_done = asyncio.Event()

    async with (
        grpc.aio.insecure_channel(target) as channel,
        progress.bar(desc=prefix, total=count, unit="req") as done,
    ):
        stub = pb_grpc.GenerationStub(channel)

        async def client(worker: int) -> None:
            nonlocal next_index
            local = random.Random(f"{opts.seed}-{prefix}-{worker}")
            while next_index < count:
                i = next_index
                next_index += 1
                if i == count // 2:
                    half_done.set()
                outcome = await one_request(stub, local, kinds[i], f"{prefix}-{i}", opts.timeout_s)
                tally.outcomes.append(outcome)
                done.update(1)

        async def fault() -> None:
            await half_done.wait()
            if on_half is not None:
                await asyncio.get_running_loop().run_in_executor(None, on_half)

        fault_task = asyncio.create_task(fault())
        await asyncio.gather(*(client(w) for w in range(opts.concurrency)))
        fault_task.cancel()
    return tally


def incarnations(cluster: RunningCluster) -> dict[str, str]:
    out = {}
    for worker_id, handle in cluster.workers[POOL]:
        try:
            out[worker_id] = ray.get(handle.info.remote(), timeout=30)["incarnation"]
        except Exception:  # restarting right now
            out[worker_id] = "?"
    return out


def leaks(cluster: RunningCluster, timeout_s: float = 120.0) -> tuple[int, int, list[str]]:
    """(live blocks, total - free - cached, integrity failures) once every worker is idle."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:  # a worker still restarting answers later
            stats = [ray.get(h.stats.remote(), timeout=30) for _, h in cluster.workers[POOL]]
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)
            continue
        live = sum(int(s.live) for s in stats)
        unaccounted = sum(int(s.total) - int(s.free) - int(s.cached) for s in stats)
        if (live == 0 and unaccounted == 0) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    failures = []
    for worker_id, handle in cluster.workers[POOL]:
        try:
            ray.get(handle.check_integrity.remote(), timeout=30)
        except AssertionError as exc:
            failures.append(f"{worker_id}: {exc}")
    return live, unaccounted, failures


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def latencies(tally: Tally) -> list[float]:
    return [o.seconds for o in tally.outcomes if o.kind == "normal" and not _is_lost(o)
            and o.result != "RESOURCE_EXHAUSTED"]


def report(opts: Options, peer: Tally, soak: Tally, seconds: float, restarts: int,
           leak: tuple[int, int, list[str]]) -> None:
    print(f"\nsoak: {len(soak.outcomes)} requests, concurrency {opts.concurrency}, "
          f"{opts.workers} workers, {seconds:.0f} s, seed {opts.seed}\n")
    by_kind: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for o in soak.outcomes:
        by_kind[o.kind][o.result] += 1
    print("| kind | requests | outcomes |")
    print("|---|---|---|")
    for kind in KINDS:
        counts = by_kind.get(kind, collections.Counter())
        text = ", ".join(f"{r} {n}" for r, n in counts.most_common())
        print(f"| {kind} | {sum(counts.values())} | {text or '-'} |")
    lost = soak.lost()
    refused = sum(o.result == "RESOURCE_EXHAUSTED" for o in soak.outcomes)
    live, unaccounted, failures = leak
    peer_lat, soak_lat = latencies(peer), latencies(soak)
    p99_peer, p99_soak = percentile(peer_lat, 0.99), percentile(soak_lat, 0.99)
    print("\n| measure | result | goal |")
    print("|---|---|---|")
    print(f"| requests lost | {len(lost)} | 0 |")
    print(f"| refused (RESOURCE_EXHAUSTED) | {refused} | - |")
    print(f"| leaked blocks (live / total - free - cached) | {live} / {unaccounted} | 0 / 0 |")
    print(f"| check_integrity failures | {len(failures)} | 0 |")
    print(f"| worker restarts (1 planned kill) | {restarts} | {1 if opts.kill else 0} |")
    print(f"| e2e p50 normal, peer -> soak (s) | {percentile(peer_lat, 0.5):.3f} -> "
          f"{percentile(soak_lat, 0.5):.3f} | - |")
    print(f"| e2e p99 normal, peer -> soak (s) | {p99_peer:.3f} -> {p99_soak:.3f} | - |")
    print(f"| p99 soak / peer | {p99_soak / p99_peer:.2f}x | - |")
    for o in lost[:10]:
        print(f"lost: {o.kind} -> {o.result} ({o.tokens}/{o.wanted} tokens) {o.detail[:160]}")
    for f in failures:
        print(f"integrity: {f}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=24)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--peer-requests", type=int, default=None,
                        help="fault-free peer run size (default: requests / 10, at most 1000)")
    parser.add_argument("--mix", default="70,10,12,8",
                        help="percent normal,abort,disconnect,poison (default 70,10,12,8)")
    parser.add_argument("--no-kill", action="store_true", help="skip the worker kill")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="per-request deadline in seconds; a request past it counts as lost")
    args = parser.parse_args(argv)
    weights = tuple(float(x) for x in args.mix.split(","))
    if len(weights) != 4 or min(weights) < 0 or sum(weights) <= 0:
        parser.error(f"--mix needs 4 non-negative percentages, got {args.mix!r}")
    if args.requests < 2 or args.concurrency < 1:
        parser.error("need --requests >= 2 and --concurrency >= 1")
    opts = Options(args.requests, args.concurrency, args.workers, weights, args.seed,
                   not args.no_kill, args.timeout)
    peer_count = args.peer_requests or max(1, min(1000, args.requests // 10))

    cluster = start_cluster(cluster_config(args.workers), grpc_port=0)
    try:
        target = cluster.grpc_target
        peer = asyncio.run(run_phase(target, opts, peer_count, (1, 0, 0, 0), prefix="peer"))
        known = incarnations(cluster)
        restarts = 0

        def kill_one() -> None:
            if opts.kill:
                victim = random.Random(opts.seed).choice(cluster.workers[POOL])
                print(f"killing worker {victim[0]} halfway through", flush=True)
                ray.kill(victim[1], no_restart=False)

        stop_watch = threading.Event()

        def look() -> None:  # a worker restart shows as a new incarnation
            nonlocal restarts
            for worker_id, incarnation in incarnations(cluster).items():
                if incarnation == "?":
                    continue  # restarting now: counted once its new incarnation answers
                if known.get(worker_id, "?") not in ("?", incarnation):
                    restarts += 1
                known[worker_id] = incarnation

        def watch() -> None:
            while not stop_watch.wait(0.5):
                look()

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        started = time.monotonic()
        soak = asyncio.run(run_phase(target, opts, args.requests, weights, prefix="soak",
                                     on_half=kill_one))
        seconds = time.monotonic() - started
        leak = leaks(cluster)
        stop_watch.set()
        watcher.join(timeout=60)
        look()
        report(opts, peer, soak, seconds, restarts, leak)
    finally:
        cluster.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
