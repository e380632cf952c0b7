"""`pagefleet scale`: add or remove workers of a pool of a running deployment while it serves."""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any


def register(subparsers: Any) -> argparse.ArgumentParser:
    from pagefleet.cluster.config import (
        DEFAULT_WORKER_ADD_TIMEOUT_S,
        DEFAULT_WORKER_DRAIN_TIMEOUT_S,
    )

    parser: argparse.ArgumentParser = subparsers.add_parser(
        "scale",
        help="add or remove workers of a pool while serving",
        description="Connect to the Ray cluster of a running deployment (`pagefleet serve` or "
        "`serve run`/`serve deploy`) and bring a pool to N workers, or remove one worker. New "
        "workers join routing once loaded; a removed worker first drains (no new requests; its "
        "streams finish), streams still running at --drain-timeout move to other workers.",
    )
    parser.add_argument("--pool", metavar="NAME", help="the pool to resize (with --workers)")
    parser.add_argument("--workers", type=int, metavar="N", help="bring the pool to N workers (N >= 1)")
    parser.add_argument("--remove", metavar="WORKER_ID",
                        help="drain and remove this worker (e.g. default-1; `pagefleet status` lists them)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_WORKER_ADD_TIMEOUT_S, metavar="S",
                        help="seconds a new worker may take to be placed by Ray and load its model")
    parser.add_argument("--drain-timeout", type=float, default=DEFAULT_WORKER_DRAIN_TIMEOUT_S, metavar="S",
                        help="seconds a removed worker's streams get to finish before they fail over")
    parser.add_argument("--wait-for-nodes", action="store_true",
                        help="start the new workers even when no node has room for them now (an "
                        "autoscaler is adding nodes) and wait up to --timeout; without it such a "
                        "scale is refused before anything starts")
    parser.add_argument("--address", default=os.environ.get("RAY_ADDRESS", "auto"), metavar="ADDR",
                        help="the Ray cluster (auto: the one on this machine; HOST:6379; "
                        "default: $RAY_ADDRESS or auto)")
    parser.set_defaults(func=run)
    return parser


def check_args(args: argparse.Namespace) -> None:
    """CommandError for flags that cannot work, before connecting to anything."""
    from pagefleet.cli import CommandError

    if (args.workers is None) == (args.remove is None):
        raise CommandError("give exactly one of --workers N (with --pool) and --remove WORKER_ID")
    if args.workers is not None:
        if not args.pool:
            raise CommandError("--workers needs --pool NAME (the pool to resize)")
        if args.workers < 1:
            raise CommandError(f"--workers must be >= 1 (a pool keeps at least one worker), got {args.workers}")
    elif args.pool:
        raise CommandError("--remove names the worker; --pool goes with --workers")
    for flag, value in (("--timeout", args.timeout), ("--drain-timeout", args.drain_timeout)):
        if not value > 0:
            raise CommandError(f"{flag} must be > 0 seconds, got {value:g}")


def run(args: argparse.Namespace) -> int:
    from pagefleet.cli import CommandError

    check_args(args)
    import ray

    from pagefleet.cluster.app import use_cluster_token
    from pagefleet.cluster.membership import MembershipError, describe_change, get_membership
    from pagefleet.cluster.names import NAMESPACE

    if not ray.is_initialized():
        use_cluster_token()
        try:
            ray.init(address=args.address, namespace=NAMESPACE, log_to_driver=False, logging_level=logging.ERROR)
        except Exception as exc:  # no cluster there: one line, not Ray's traceback
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise CommandError(f"cannot connect to the Ray cluster at {args.address}: {first}") from exc
    try:
        membership = get_membership()
        if args.workers is not None:
            call = membership.scale.remote(
                args.pool, args.workers, args.timeout, args.drain_timeout, args.wait_for_nodes
            )
        else:
            call = membership.remove.remote(args.remove, args.drain_timeout)
        result = ray.get(call)
    except ray.exceptions.RayTaskError as exc:
        # The actor's MembershipError (its message, without Ray's traceback), or a failure.
        cause = getattr(exc, "cause", None)
        raise CommandError(str(cause) if cause is not None else str(exc).splitlines()[0]) from exc
    except MembershipError as exc:  # no deployment on this cluster
        raise CommandError(str(exc)) from exc
    print(describe_change(result))
    return 0
