"""`pagefleet status --target HOST:PORT`: a per-worker table of a running cluster."""

from __future__ import annotations

import argparse
import os
from typing import Any


def register(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "status",
        help="show per-worker KV blocks and queues of a running cluster",
        description="Print each pool's workers: KV blocks (total/free/live/cached/peak), "
        "running and waiting requests, prefix-cache hit rate.",
    )
    parser.add_argument("--target", default="127.0.0.1:50051", help="gRPC HOST:PORT of the ingress")
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
        status = get_status(args.target, args.pool, timeout=args.timeout, api_key=args.api_key)
    except grpc.RpcError as exc:
        raise CommandError(f"{args.target}: {exc.code().name}: {exc.details()}") from exc
    print(format_status(status))
    return 0
