"""Many nodes: what a node's death costs its streams, migration between nodes, scale-out time.

On a local multi-node Ray cluster (one `ray start` raylet per node, as the
multi-node tests run it: `tests/ray_nodes.py`): the head runs the scheduler,
membership and ingress; every other node advertises one GPU, and the pool's
workers ask for one each (computing on CPU), so they land one per node.

1. **Node loss** (`--rounds` times): `--streams` greedy streams spread over
   the pool's two workers; one worker's node is killed (SIGKILL of its raylet
   and of every process it started) while they stream. Per moved stream: the
   time from the kill to its next token, which the surviving worker serves
   after recomputing the stream's context (the lost node's KV is gone), p50
   and p99, and whether its output equals the no-fault run. Also: kill ->
   the pool reports the worker lost, and node join -> the replacement worker
   serving a request.
2. **Migration between nodes**: the end-to-end rounds of `migration.py`
   with its two workers on two nodes: the scheduler moves a stream off a
   worker whose pool runs short, by KV transfer (through the two raylets'
   object stores) or by recompute; the hand-off gap the client sees,
   medians and their ratio.
3. **Scale-out** (`--rounds` times): the pool autoscales 2 -> 3 workers onto a
   spare node: from the start of a load that fills the pool to the
   autoscaler's decision (it waits `autoscale_out_after_s`), to the third
   worker loaded and counted live, and to its first token; then, after the
   load, back to two workers (`autoscale_in_after_s` idle).

Model: the packaged SmolLM2-135M (float32) by default; `--smoke` uses the
tiny test model, fewer streams and one round.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import _engine_bench as common
import migration

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import cluster_fixtures as fixtures
from cluster_fixtures import pool_status
from ray_nodes import RayNodes, ray_nodes

from pagefleet.cluster.app import NAMESPACE, RunningCluster, start_cluster
from pagefleet.cluster.config import ClusterConfig
from pagefleet.worker.llm import LLM
from pagefleet.worker.sampling_params import SamplingParams

BLOCK_SIZE = migration.BLOCK_SIZE
# The kill comes once a stream has streamed this many tokens from the doomed node's worker.
TOKENS_BEFORE_KILL = 8


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.05) -> float:
    """`cluster_fixtures.wait_for`, returning the monotonic time the predicate first held."""
    fixtures.wait_for(predicate, timeout_s, what, interval_s)
    return time.monotonic()


def percentile(values: list[float], q: float) -> str:
    """The `q` quantile (0..1) by nearest rank, in seconds: with few samples, p99 is the largest."""
    if not values:
        return "n/a"
    ordered = sorted(values)
    return f"{ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]:.2f} s"


def pool_config(model: str, *, workers: int, num_kv_blocks: int, max_model_len: int, max_num_seqs: int,
                autoscale: tuple[int, int] | None = None) -> ClusterConfig:  # fmt: skip
    """One pool `default` of CPU workers that each hold one (advertised) GPU."""
    pool: dict[str, object] = {
        "name": "default", "model": model, "workers": workers, "block_size": BLOCK_SIZE,
        "num_kv_blocks": num_kv_blocks, "max_model_len": max_model_len, "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": 256, "device": "cpu", "num_gpus_per_worker": 1,
    }  # fmt: skip
    scheduler: dict[str, object] = {"report_interval_s": 0.2, "report_timeout_s": 5.0, "stall_timeout_s": 120.0}
    if autoscale is not None:
        pool["min_workers"], pool["max_workers"] = autoscale
        # Full admission: streams claim blocks to their max_tokens, so the load's extra
        # clients wait at the ingress and the pool stays short for as long as it lasts.
        scheduler.update(admission="full", wait_queue_size=32, autoscale_free_fraction=0.3,
                         autoscale_out_after_s=1.0, autoscale_in_after_s=5.0, autoscale_cooldown_s=2.0)  # fmt: skip
    return ClusterConfig.from_dict(
        {
            "pools": [pool],
            "router": {"policy": "round_robin"},
            "scheduler": scheduler,
            "server": {"host": "127.0.0.1", "grpc_port": 0, "http_port": None},
        }
    )


# ----- 1. node loss ------------------------------------------------------------------


@dataclass(frozen=True)
class NodeLoss:
    """One round: per moved stream, kill -> next token; and the pool's recovery."""

    next_token_s: list[float]
    exact: bool  # every stream's output equals the no-fault run
    reported_s: float  # kill -> the pool counts one live worker
    refill_s: float  # node join -> the replacement serves a request


def _worker_nodes(target: str) -> dict[str, str]:
    return {w.worker_id: w.node_id for w in pool_status(target).workers if w.alive}


def node_loss_round(nodes: RayNodes, cluster: RunningCluster, prompts: list[list[int]], want: list[list[int]],
                    max_tokens: int) -> NodeLoss:  # fmt: skip
    target = cluster.grpc_target
    placed = _worker_nodes(target)
    victim, victim_node_id = sorted(placed.items())[0]
    doomed = next(n for n in nodes.nodes if n.node_id == victim_node_id)
    progress = [0] * len(prompts)
    on_victim = threading.Event()
    killed_at: list[float] = []

    def stream(i: int) -> list[tuple[float, str, list[int]]]:
        out = []
        for msg in migration.timed_stream(target, prompts[i], max_tokens):
            out.append(msg)
            if msg[1] == victim:
                progress[i] += len(msg[2])
                if progress[i] >= TOKENS_BEFORE_KILL:
                    on_victim.set()
        return out

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as clients:
        streams = [clients.submit(stream, i) for i in range(len(prompts))]
        if not on_victim.wait(600):
            raise TimeoutError(f"no stream reached {victim}")
        nodes.kill(doomed)
        killed_at.append(time.monotonic())
        reported = wait_for(lambda: pool_status(target).live_workers == 1, 60, "the lost worker reported", 0.1)
        results = [f.result(timeout=900) for f in streams]
    lost_at = killed_at[0]
    next_token = []
    for messages in results:
        with_tokens = [m for m in messages if m[2]]
        after = [m for m in with_tokens if m[0] > lost_at]
        before = [m for m in with_tokens if m[0] <= lost_at]
        if before and before[-1][1] == victim and after:
            next_token.append(after[0][0] - lost_at)
        elif before and before[-1][1] == victim:
            print(f"  (a stream on {victim} streamed {sum(len(m[2]) for m in before)} tokens, none after the kill)")
    exact = [[t for m in messages for t in m[2]] for messages in results] == want
    # The replacement waits for a node with a free GPU: one joins.
    joined = nodes.add_node(num_cpus=1, num_gpus=1)
    joined_at = time.monotonic()

    def new_worker_serves() -> bool:
        fresh = {w: n for w, n in _worker_nodes(target).items() if w not in placed}
        if joined.node_id not in fresh.values():
            return False
        # Round robin: of two requests, one goes to each worker.
        served = [migration.timed_stream(target, prompts[0][:8], 1) for _ in range(2)]
        return any(worker in fresh for messages in served for _, worker, _ in messages)

    served_at = wait_for(new_worker_serves, 600, "the replacement serving", 0.5)
    return NodeLoss(next_token, exact, reported - lost_at, served_at - joined_at)


def node_loss(nodes: RayNodes, args: argparse.Namespace, offline: LLM) -> list[NodeLoss]:
    vocab = min(offline.engine.vocab_size, 30000)
    config = pool_config(args.model, workers=2, num_kv_blocks=args.kv_blocks, max_model_len=args.max_model_len,
                         max_num_seqs=args.streams)  # fmt: skip
    cluster = start_cluster(config, grpc_port=0, metrics_port=None)
    rounds = []
    try:
        for r in range(args.rounds):
            prompts = [common.prompt(args.context, seed=5000 + 31 * r + j, vocab=vocab) for j in range(args.streams)]
            params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
            want = [o.token_ids for o in offline.generate(prompts, params)]
            got = node_loss_round(nodes, cluster, prompts, want, args.max_tokens)
            rounds.append(got)
            moved = ", ".join(f"{s * 1000:.0f}" for s in got.next_token_s)
            print(f"  round {r + 1}: moved streams' next token after {moved} ms; exact={got.exact}; "
                  f"reported lost after {got.reported_s:.1f} s; refilled {got.refill_s:.1f} s after the join "
                  f"(load {os.getloadavg()[0]:.1f})", flush=True)  # fmt: skip
    finally:
        cluster.shutdown()
    return rounds


# ----- 3. scale-out ------------------------------------------------------------------


@dataclass(frozen=True)
class ScaleOut:
    decided_s: float  # load start -> target 3
    live_s: float  # load start -> 3 live workers
    first_token_s: float  # load start -> the third worker's first token
    scaled_in_s: float  # load end -> back to 2 workers
    complete: bool  # every stream of the load finished with all its tokens


def scale_out_round(target: str, args: argparse.Namespace, vocab: int, clients: int, seed: int) -> ScaleOut:
    """`clients` clients stream one request after another until the pool has grown."""
    before = set(_worker_nodes(target))
    stop = threading.Event()
    first_new: list[float] = []

    def client(c: int) -> bool:
        ok, k = True, 0
        while k == 0 or not stop.is_set():
            prompt = common.prompt(args.context, seed=seed + 97 * c + k, vocab=vocab)
            messages = migration.timed_stream(target, prompt, args.max_tokens)
            ok &= sum(len(m[2]) for m in messages) == args.max_tokens
            new = [m[0] for m in messages if m[2] and m[1] not in before]
            if new and not first_new:
                first_new.append(new[0])
            k += 1
        return ok

    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        load = [pool.submit(client, c) for c in range(clients)]
        try:
            decided = wait_for(lambda: pool_status(target).target_workers == 3, 600, "target 3", 0.2)
            live = wait_for(lambda: pool_status(target).live_workers == 3, 600, "3 live workers", 0.2)
            wait_for(lambda: bool(first_new), 600, "the new worker's first token", 0.2)
        finally:
            stop.set()
        complete = all(f.result(timeout=900) for f in load)
    ended = time.monotonic()
    shrunk = wait_for(lambda: len(pool_status(target).workers) == 2, 600, "back to 2 workers", 0.5)
    return ScaleOut(decided - started, live - started, first_new[0] - started, shrunk - ended, complete)


def scale_out(nodes: RayNodes, args: argparse.Namespace, vocab: int) -> list[ScaleOut]:
    # Each stream claims its prompt and max_tokens whole: `per_worker` of them fill a
    # worker, so two workers run 2 x per_worker and the rest of the clients wait.
    per_worker = 3
    claim = -(-(args.context + args.max_tokens) // BLOCK_SIZE)
    config = pool_config(args.model, workers=2, num_kv_blocks=per_worker * claim + 2, max_model_len=args.max_model_len,
                         max_num_seqs=per_worker, autoscale=(2, 3))  # fmt: skip
    clients = 2 * per_worker + 2
    nodes.add_node(num_cpus=1, num_gpus=1)  # the spare the pool grows onto
    cluster = start_cluster(config, grpc_port=0, metrics_port=None)
    rounds = []
    try:
        for r in range(args.rounds):
            got = scale_out_round(cluster.grpc_target, args, vocab, clients, seed=9000 + 1000 * r)
            rounds.append(got)
            print(f"  round {r + 1}: target 3 after {got.decided_s:.1f} s, live {got.live_s:.1f} s, first token "
                  f"{got.first_token_s:.1f} s; back to 2 workers {got.scaled_in_s:.1f} s after the load; "
                  f"complete={got.complete} (load {os.getloadavg()[0]:.1f})", flush=True)  # fmt: skip
    finally:
        cluster.shutdown()
    return rounds


# ----- 2. migration between nodes ------------------------------------------------------


def migration_between_nodes(args: argparse.Namespace, offline: LLM) -> list[migration.Handoff]:
    """`migration.py --end-to-end`'s rounds, its two workers on two nodes."""
    context, shared, streams, max_tokens = args.context, args.shared, args.streams, args.max_tokens
    num_kv_blocks, max_model_len = migration.shortage_blocks(context, shared, streams, max_tokens)
    config = migration.e2e_config(args.model, num_kv_blocks, max_model_len, streams)
    config = config.replace(pools=(config.pools[0].replace(num_gpus_per_worker=1),))
    cluster = start_cluster(config, grpc_port=0, metrics_port=None)
    vocab = min(offline.engine.vocab_size, 30000)
    nodes_of = _worker_nodes(cluster.grpc_target)
    assert len(set(nodes_of.values())) == 2, f"the two workers share a node: {nodes_of}"
    handoffs: list[migration.Handoff] = []
    try:
        round_no = 0
        for _ in range(args.rounds):
            for mode in ("recompute", "transfer"):  # ABAB: both see the same load
                round_no += 1
                prompts = migration.pinned_prompts(round_no, shared, context, streams, vocab)
                got = migration.one_round(cluster, offline, mode, prompts, max_tokens, shared)
                handoffs += got
                for h in got:
                    print(f"  {mode:<9} gap {h.gap_s * 1000:8.1f} ms at {h.context_tokens} tokens exact={h.exact}"
                          f" (load {os.getloadavg()[0]:.1f})", flush=True)  # fmt: skip
                if not got:
                    print(f"  {mode:<9} no stream moved this round", flush=True)
    finally:
        cluster.shutdown()
    return handoffs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--streams", type=int, default=6, help="streams per node-loss round")
    parser.add_argument("--context", type=int, default=192, help="prompt tokens per stream")
    parser.add_argument("--shared", type=int, default=64, help="migration: shared prefix tokens")
    parser.add_argument("--max-tokens", type=int, default=96, help="tokens out per stream")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="tiny model, short streams, one round")
    args = parser.parse_args()
    if args.smoke:
        args.model, args.streams, args.context, args.shared, args.max_tokens, args.rounds = "tiny", 4, 64, 32, 256, 1
    args.max_model_len = args.context + args.max_tokens + BLOCK_SIZE
    args.kv_blocks = 2 * args.streams * -(-args.max_model_len // BLOCK_SIZE)  # room for every stream on one worker
    print(f"{args.model}: {args.streams} streams of {args.context} + {args.max_tokens} tokens, {args.rounds} "
          f"round(s); load average {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
    offline = LLM(model=args.model, block_size=BLOCK_SIZE, num_kv_blocks=args.kv_blocks,
                  max_model_len=args.max_model_len, device="cpu")  # fmt: skip
    vocab = min(offline.engine.vocab_size, 30000)
    with ray_nodes() as nodes:
        nodes.start_head(num_cpus=2)
        for _ in range(2):
            nodes.add_node(num_cpus=1, num_gpus=1)
        nodes.init(NAMESPACE)
        print("1. node loss", flush=True)
        losses = node_loss(nodes, args, offline)
        print("2. migration between nodes", flush=True)
        handoffs = migration_between_nodes(args, offline)
        print("3. scale-out", flush=True)
        scales = scale_out(nodes, args, vocab)
    report(args, losses, handoffs, scales)


def report(args: argparse.Namespace, losses: list[NodeLoss], handoffs: list[migration.Handoff],
           scales: list[ScaleOut]) -> None:  # fmt: skip
    moved = [s for r in losses for s in r.next_token_s]
    rows = [
        ["node loss: kill -> moved stream's next token, p50", percentile(moved, 0.5), f"{len(moved)} streams"],
        ["node loss: kill -> moved stream's next token, p99", percentile(moved, 0.99), ""],
        ["node loss: outputs equal the no-fault run", str(all(r.exact for r in losses)), f"{len(losses)} rounds"],
        ["node loss: kill -> pool reports the lost worker",
         f"{statistics.median(r.reported_s for r in losses):.2f} s", "median"],
        ["node join -> replacement serving", f"{statistics.median(r.refill_s for r in losses):.1f} s", "median"],
    ]  # fmt: skip
    medians = {}
    for mode in ("recompute", "transfer"):
        mine = [h for h in handoffs if h.mode == mode]
        if mine:
            medians[mode] = statistics.median(h.gap_s for h in mine)
            rows.append([f"migration between nodes by {mode}: hand-off gap", f"{medians[mode] * 1000:.0f} ms",
                         f"{len(mine)} hand-offs at {statistics.median(h.context_tokens for h in mine):.0f} tokens, "
                         f"exact={all(h.exact for h in mine)}"])  # fmt: skip
    for name, field in (("autoscaler decides (target 3)", "decided_s"), ("third worker live", "live_s"),
                        ("third worker's first token", "first_token_s")):  # fmt: skip
        rows.append([f"scale-out: load start -> {name}", f"{statistics.median(getattr(s, field) for s in scales):.1f} s",
                     "median"])  # fmt: skip
    rows.append(["scale-in: load end -> 2 workers", f"{statistics.median(s.scaled_in_s for s in scales):.1f} s",
                 f"complete={all(s.complete for s in scales)}"])  # fmt: skip
    common.print_table(f"Many nodes, {args.model}; load average {os.getloadavg()[0]:.1f}",
                       ["measure", "value", "note"], rows)  # fmt: skip
    if len(medians) == 2:
        print(f"migration between nodes, recompute / transfer gap: {medians['recompute'] / medians['transfer']:.1f}x")


if __name__ == "__main__":
    main()
