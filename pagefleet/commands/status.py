"""`pagefleet status --target HOST:PORT`: a per-worker table of a running cluster."""

from __future__ import annotations

import argparse
import os
from typing import Any

from pagefleet.commands.target import TARGET_HELP, describe_rpc_error, parse_target


def register(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "status",
        help="show per-worker KV blocks and queues of a running cluster",
        description="Print each pool's workers: KV blocks (total/free/live/cached/peak), "
        "running and waiting requests, prefix-cache hit rate.",
    )
    parser.add_argument("--target", default="127.0.0.1:50051", metavar="HOST:PORT", help=TARGET_HELP)
    parser.add_argument("--pool", default="", help="only this pool (default: all)")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the answer")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("PAGEFLEET_API_KEY"),
        help="a tenant's API key, when the server requires one (default: $PAGEFLEET_API_KEY)",
    )
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    import grpc

    from pagefleet.cli import CommandError
    from pagefleet.cluster.client import format_status, get_status

    try:
        target = parse_target(args.target)
    except ValueError as exc:
        raise CommandError(str(exc)) from exc
    try:
        status = get_status(target, args.pool, timeout=args.timeout, api_key=args.api_key)
    except grpc.RpcError as exc:
        raise CommandError(describe_rpc_error(target, exc)) from exc
    print(format_status(status))
    return 0
