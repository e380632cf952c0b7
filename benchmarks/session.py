"""Session affinity against prefix affinity alone on a multi-turn chat workload, in-process.

The discrete-event simulator (`benchmarks/simulator.py`: real block pools,
the real `ClusterState`, `FleetView`s and `Router`s, a service model of
serialized prefills and batched decodes) runs a `ChatWorkload`: sessions of
`--turns` turns, each turn's prompt the previous prompt and answer plus a new
message, the next turn sent a think time after the answer. Each run sends
the same requests twice (sessions starting at the same times, each turn the
same think time after its previous answer): naming their session (session
affinity on top of the prefix-affinity router) and not (prefix affinity
alone), over `--ingress-replicas` replicas sharing the scheduler's view, KV
events travelling with the workers' reports as in the cluster. It prints the
prefix hit rate, TTFT p50/p99 and the busiest worker's share per way and
replica count (medians over `--seeds` seeds), then session / prefix-only
ratios of hit rate and TTFT p50.

    python benchmarks/session.py                      # 4 workers, 96 sessions x 6 turns, 3 seeds
    python benchmarks/session.py --ingress-replicas 1,2,4 --seeds 5
    python benchmarks/session.py --smoke              # a tiny run (seconds)
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

# The simulator beside this script, also when a test loads this file by path.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from simulator import ChatWorkload, SimConfig, SimResult, simulate

from pagefleet.cluster.router import RouterConfig

WAYS = {"session": True, "prefix only": False}  # -> ChatWorkload.sessions


def run(
    workload: ChatWorkload, cfg: SimConfig, replicas: Sequence[int], seeds: Sequence[int]
) -> dict[tuple[str, int], list[SimResult]]:
    """Per (way, replica count), one result per seed."""
    out: dict[tuple[str, int], list[SimResult]] = {}
    for n in replicas:
        for way, sessions in WAYS.items():
            fleet = replace(cfg, num_ingress_replicas=n)
            out[(way, n)] = [
                simulate("prefix_affinity", replace(workload, sessions=sessions, seed=seed), fleet, RouterConfig())
                for seed in seeds
            ]
    return out


def format_table(results: dict[tuple[str, int], list[SimResult]]) -> str:
    """Medians over seeds per way and replica count, then the session / prefix-only ratios."""

    def median(runs: list[SimResult], field: str) -> float:
        return statistics.median(getattr(r, field) for r in runs)

    lines = [
        "| routing | ingress replicas | hit rate | TTFT p50 (s) | TTFT p99 (s) | busiest worker |",
        "|---|---|---|---|---|---|",
    ]
    for (way, n), runs in results.items():
        lines.append(
            f"| {way} | {n} | {median(runs, 'hit_rate'):.1%} | {median(runs, 'ttft_p50_s'):.3f} "
            f"| {median(runs, 'ttft_p99_s'):.3f} | {median(runs, 'max_worker_share'):.0%} |"
        )
    lines += ["", "| ingress replicas | hit rate, session / prefix only | TTFT p50, session / prefix only |",
              "|---|---|---|"]  # fmt: skip
    for n in dict.fromkeys(n for _, n in results):
        on, off = results[("session", n)], results[("prefix only", n)]
        hit = median(on, "hit_rate") / max(median(off, "hit_rate"), 1e-9)
        ttft = median(on, "ttft_p50_s") / max(median(off, "ttft_p50_s"), 1e-9)
        lines.append(f"| {n} | {hit:.2f}x | {ttft:.2f}x |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=SimConfig.num_workers)
    parser.add_argument("--blocks", type=int, default=SimConfig.num_blocks, help="KV blocks per worker")
    parser.add_argument("--sessions", type=int, default=ChatWorkload.num_sessions)
    parser.add_argument("--turns", type=int, default=ChatWorkload.turns)
    parser.add_argument("--rate", type=float, default=ChatWorkload.session_rate, help="new sessions per second")
    parser.add_argument("--think", type=float, default=ChatWorkload.think_s, help="mean think time (s)")
    parser.add_argument("--ingress-replicas", default="1,2", metavar="N[,N...]")
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1; medians are printed")
    parser.add_argument("--smoke", action="store_true", help="8 sessions x 3 turns, 2 workers, one seed")
    args = parser.parse_args(argv)
    workload = ChatWorkload(
        num_sessions=args.sessions, turns=args.turns, session_rate=args.rate, think_s=args.think
    )
    cfg = SimConfig(num_workers=args.workers, num_blocks=args.blocks, kv_events_with_reports=True)
    seeds = range(args.seeds)
    if args.smoke:
        workload = replace(workload, num_sessions=8, turns=3)
        cfg, seeds = replace(cfg, num_workers=2), range(1)
    replicas = [int(x) for x in args.ingress_replicas.split(",")]
    print(workload)
    print(format_table(run(workload, cfg, replicas, seeds)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
