"""Idle cost: the CPU an idle pagefleet cluster burns, against the Ray and Serve under it.

Starts a cluster of `pagefleet serve`'s shape on a local Ray (one pool of
`--workers` CPU workers on the tiny model by default, `--model`; the
scheduler's defaults unless `--report-interval` / `--report-timeout` say
otherwise), answers one request, waits `--settle` seconds, then reads every
process's CPU time over `--seconds` of idleness. It prints, per process, CPU
as a percentage of one core, and the totals of pagefleet's own actors (the
workers, the scheduler, the membership actor, the ingress replica) against
those of the platform it runs on (Ray's GCS, raylet, agents, monitor and
dashboard; Serve's controller): the peer is the platform's own idle cost, in
the same run.

What an idle worker sends: a push per heartbeat (`report_timeout_s` / 3, at
least `report_interval_s`); a push that changes nothing wakes no ingress
replica (docs/architecture.md, "One channel, one source of truth").
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import grpc
import psutil

from pagefleet.cluster.app import start_cluster
from pagefleet.cluster.client import build_request
from pagefleet.cluster.config import ClusterConfig
from pagefleet.cluster.proto import pagefleet_pb2_grpc as pb_grpc

OURS = ("ray::WorkerActor", "ray::SchedulerActor", "ray::Membership", "ray::ServeReplica")


def cpu_seconds() -> dict[int, tuple[float, str]]:
    """CPU seconds (user + system) and a short name of this process and every descendant."""
    out = {}
    me = psutil.Process()
    for proc in [me, *me.children(recursive=True)]:
        try:
            times = proc.cpu_times()
            cmd = proc.cmdline()
        except psutil.Error:
            continue
        name = "this driver" if proc.pid == me.pid else _short(cmd)
        out[proc.pid] = (times.user + times.system, name)
    return out


def _short(cmd: list[str]) -> str:
    if cmd and cmd[0].startswith("ray::"):
        return cmd[0].split(".")[0].split(":pagefleet")[0]
    for part in cmd:
        base = Path(part).name
        if base.endswith(".py") or base in ("gcs_server", "raylet"):
            return base
    return " ".join(cmd)[:40]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--report-interval", type=float, default=None, help="scheduler.report_interval_s")
    parser.add_argument("--report-timeout", type=float, default=None, help="scheduler.report_timeout_s")
    parser.add_argument("--settle", type=float, default=10.0, help="seconds idle before measuring")
    parser.add_argument("--seconds", type=float, default=60.0, help="seconds measured")
    args = parser.parse_args(argv)

    scheduler = {}
    if args.report_interval is not None:
        scheduler["report_interval_s"] = args.report_interval
    if args.report_timeout is not None:
        scheduler["report_timeout_s"] = args.report_timeout
    config = ClusterConfig.from_dict({
        "pools": [{"name": "default", "workers": args.workers, "model": args.model, "device": "cpu"}],
        "scheduler": scheduler,
        "server": {"host": "127.0.0.1", "grpc_port": 0, "http_port": None},
    })  # fmt: skip
    print(f"model {args.model}, {args.workers} workers, report_interval_s "
          f"{config.scheduler.report_interval_s}, report_timeout_s {config.scheduler.report_timeout_s} "
          f"(heartbeat {config.scheduler.heartbeat_s:g} s)")  # fmt: skip
    cluster = start_cluster(config, grpc_port=0, metrics_port=None)
    try:
        with grpc.insecure_channel(cluster.grpc_target) as channel:
            request = build_request("Hello", {"max_tokens": 8})
            tokens = sum(len(m.token_ids) for m in pb_grpc.GenerationStub(channel).Generate(request, timeout=120))
        print(f"one request answered ({tokens} tokens); idle for {args.settle:g} s, then measured for "
              f"{args.seconds:g} s")  # fmt: skip
        time.sleep(args.settle)
        before = cpu_seconds()
        time.sleep(args.seconds)
        after = cpu_seconds()
    finally:
        cluster.shutdown()

    rows = sorted(
        ((after[pid][0] - before[pid][0], after[pid][1]) for pid in after if pid in before), reverse=True
    )
    ours = sum(cpu for cpu, name in rows if name.startswith(OURS))
    driver = sum(cpu for cpu, name in rows if name == "this driver")
    platform = sum(cpu for cpu, _ in rows) - ours - driver
    pct = 100.0 / args.seconds
    print(f"\n{'process':<28} {'CPU % of a core':>16}")
    for cpu, name in rows:
        if cpu * pct >= 0.05:
            print(f"{name:<28} {cpu * pct:>16.2f}")
    print(f"\npagefleet's actors   {ours * pct:6.2f}% of a core")
    print(f"Ray and Serve        {platform * pct:6.2f}% of a core (the peer)")
    print(f"this driver          {driver * pct:6.2f}% of a core")
    print(f"pagefleet / platform {ours / platform:6.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
