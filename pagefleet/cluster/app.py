"""Build and start a pagefleet cluster from a `ClusterConfig`.

What runs where (one Ray cluster):

- `pagefleet-scheduler`: the central scheduler actor (restartable, no CPU);
  with `scheduler.shards: N` also `pagefleet-scheduler-1` ... `-<N-1>`, each
  owning whole pools (`ClusterConfig.scheduler_shards`).
- `pagefleet-worker-<pool>-<i>`: one `WorkerActor` per GPU (CPU workers on a
  machine without one), restartable, spread over the nodes; started and owned by
- `pagefleet-membership` (`membership.Membership`), which also adds and removes
  workers while serving (`pagefleet scale`).
- `pagefleet-ingress`: a Ray Serve deployment (`server.ingress_replicas`
  replicas, on the head node, sharing its ports through SO_REUSEPORT) whose
  every replica runs
  our own `grpc.aio` server (Generation + health + reflection), the OpenAI
  HTTP server (uvicorn) and the Prometheus endpoint, follows the scheduler's
  view (versioned deltas; every shard's, merged) and routes to the worker actors directly with its
  local `Router`.

`start_cluster` creates all of it and returns a `RunningCluster` that knows the
endpoints and shuts everything down again.
"""

from __future__ import annotations

import logging
import math
import os
import socket
from dataclasses import dataclass, field
from typing import Any

import ray
from ray import serve

from pagefleet.cluster.config import ClusterConfig
from pagefleet.cluster.deployment import IngressDeployment, ingress_options
from pagefleet.cluster.membership import CPU_WORKER_NUM_CPUS, start_membership
from pagefleet.cluster.names import APP_NAME, HEAD_NODE_RESOURCE, INGRESS_NAME, NAMESPACE
from pagefleet.scheduler.actor import start_scheduler

logger = logging.getLogger(__name__)


@dataclass
class RunningCluster:
    """Handles of a started cluster; `shutdown()` stops what `start_cluster` started."""

    config: ClusterConfig
    grpc_port: int
    metrics_port: int | None
    membership: Any  # the `Membership` actor: owns the workers, adds and removes them
    schedulers: tuple[Any, ...]  # one handle per scheduler shard (one by default)
    host: str = "127.0.0.1"
    started_ray: bool = False
    ingress: Any = field(default=None, repr=False)
    http_port: int | None = None

    @property
    def grpc_target(self) -> str:
        """`host:port` for gRPC clients on this machine."""
        return f"{self.host}:{self.grpc_port}"

    @property
    def http_url(self) -> str | None:
        """Base URL of the OpenAI HTTP API (`.../v1/completions`), None when disabled."""
        return None if self.http_port is None else f"http://{self.host}:{self.http_port}"

    @property
    def workers(self) -> dict[str, list[tuple[str, Any]]]:
        """`{pool: [(worker_id, actor handle), ...]}` now (workers added or being removed included)."""
        members: dict[str, list[tuple[str, Any]]] = ray.get(self.membership.members.remote(), timeout=60)
        return members

    @property
    def scheduler(self) -> Any:
        """Scheduler shard 0's handle: the only scheduler unless `scheduler.shards` > 1."""
        return self.schedulers[0]

    def worker_handle(self, worker_id: str) -> Any:
        for pool_workers in self.workers.values():
            for wid, handle in pool_workers:
                if wid == worker_id:
                    return handle
        raise KeyError(worker_id)

    def drain(self, timeout_s: float | None = None) -> int:
        """Let running streams finish (up to `timeout_s`, default `server.drain_timeout_s`)
        while refusing new ones, then stop the servers; call `shutdown()` after.
        Returns how many streams were aborted at the timeout."""
        timeout = self.config.server.drain_timeout_s if timeout_s is None else timeout_s
        return int(self.ingress.drain_and_stop.remote(timeout).result(timeout_s=timeout + 30))

    def shutdown(self) -> None:
        """Delete the Serve app, the workers and the scheduler (and Ray, if we started it)."""
        if self.started_ray:
            # Ray stops every actor with it. Shutting Serve down first only makes the
            # killed controller's pending calls log "ServeController.graceful_shutdown
            # failed ... infinite retries remaining" on every clean exit.
            ray.shutdown()
            return
        try:
            serve.shutdown()
        except Exception:  # shutting down anyway
            logger.exception("serve shutdown failed")
        for pool_workers in self.workers.values():
            for _, handle in pool_workers:
                ray.kill(handle, no_restart=True)
        ray.kill(self.membership, no_restart=True)
        for scheduler in self.schedulers:
            ray.kill(scheduler, no_restart=True)


def start_cluster(
    config: ClusterConfig,
    *,
    address: str | None = None,
    grpc_port: int | None = None,
    http_port: int | None = None,
    metrics_port: int | None = 0,
    ready_timeout_s: float = 300.0,
) -> RunningCluster:
    """Start (or join, with `address`) Ray, then the scheduler, the workers and the ingress.

    Returns once every worker has loaded its model and the servers listen.
    `grpc_port=None` uses `config.server.grpc_port`, `http_port=None`
    `config.server.http_port` (where None disables the OpenAI HTTP server);
    port 0 picks a free port.
    """
    started_ray = False
    if not ray.is_initialized():
        if address is None:
            needed = sum(p.workers for p in config.pools) * CPU_WORKER_NUM_CPUS + 1
            # address="local": a cluster of our own, whatever else runs on the host. A bare
            # ray.init() joins $RAY_ADDRESS or the cluster a past `ray start` left in Ray's
            # address file (and then refuses num_cpus), even when that cluster is gone.
            ray.init(
                address="local",
                namespace=NAMESPACE,
                num_cpus=max(os.cpu_count() or 1, math.ceil(needed)),
                include_dashboard=False,
            )
        else:
            use_cluster_token()
            ray.init(address=address, namespace=NAMESPACE)
        started_ray = True
    namespace = ray.get_runtime_context().namespace
    schedulers = start_schedulers(config, namespace)
    membership = start_membership(config, namespace, schedulers)
    workers = ray.get(membership.members.remote(), timeout=ready_timeout_s)
    serve.start(http_options={"location": "NoServer"})
    replicas = config.server.ingress_max_replicas or config.server.ingress_replicas
    deployment = serve.deployment(
        name=INGRESS_NAME,
        **ingress_options(config),
        # On the head node: the address clients dial is the cluster's entry point,
        # and losing a worker node must never take the ingress with it.
        ray_actor_options={"num_cpus": 0, "resources": {HEAD_NODE_RESOURCE: 0.001}},
        # Request streams are not Serve requests (they arrive over our own gRPC
        # server), so Serve's own concurrency limits do not apply to them.
        max_ongoing_requests=1000,
        # Our own servers carry the requests; Serve's access log would list only
        # the control calls (wait_ready, endpoints).
        logging_config={"enable_access_log": False},
    )(IngressDeployment)
    port = config.server.grpc_port if grpc_port is None else grpc_port
    if http_port is None:
        http_port = config.server.http_port
    reserved = []
    if replicas > 1:
        # Every replica must bind the same ports: choose "any free port" once, here,
        # and hold it (SO_REUSEPORT) until the replicas have bound it too.
        if port == 0:
            port, sock = _reserve_port(config.server.host)
            reserved.append(sock)
        if http_port == 0:
            http_port, sock = _reserve_port(config.server.host)
            reserved.append(sock)
    try:
        handle = serve.run(
            deployment.bind(config, workers, port, metrics_port, schedulers, http_port, namespace),
            name=APP_NAME,
            route_prefix=None,
        )
        handle.wait_ready.remote(ready_timeout_s).result(timeout_s=ready_timeout_s + 10)
    finally:
        for sock in reserved:
            sock.close()
    ports = handle.endpoints.remote().result()
    return RunningCluster(
        config=config,
        grpc_port=ports["grpc_port"],
        metrics_port=ports["metrics_port"],
        membership=membership,
        schedulers=schedulers,
        started_ray=started_ray,
        ingress=handle,
        http_port=ports["http_port"],
    )


def use_cluster_token(environ: dict[str, str] | None = None) -> bool:
    """Before connecting to a running Ray cluster: send its auth token when one is at hand.

    Ray (2.59 on) starts a local cluster with token authentication unless
    `RAY_AUTH_MODE` says otherwise, but a driver that connects by address with
    the mode unset sends no token and is refused (InvalidAuthToken). So when
    the mode is unset and a token is there (`RAY_AUTH_TOKEN`,
    `RAY_AUTH_TOKEN_PATH` or `~/.ray/auth_token`), set `RAY_AUTH_MODE=token`.
    Returns whether it did.
    """
    env = os.environ if environ is None else environ
    if "RAY_AUTH_MODE" in env:
        return False
    home_token = os.path.join(os.path.expanduser("~"), ".ray", "auth_token")
    if env.get("RAY_AUTH_TOKEN") or env.get("RAY_AUTH_TOKEN_PATH") or os.path.isfile(home_token):
        env["RAY_AUTH_MODE"] = "token"
        if environ is None:
            # Ray reads the mode into its config when imported: refresh it, as Ray's
            # own token setup does when it turns token mode on.
            from ray._raylet import Config  # type: ignore[attr-defined]  # compiled, no stub

            Config.initialize("")
        return True
    return False


def start_schedulers(config: ClusterConfig, namespace: str) -> tuple[Any, ...]:
    """The scheduler actors (one per `scheduler.shards`) with the config's timeouts, eviction
    watermarks and migration policy."""
    return tuple(
        start_scheduler(
            namespace=namespace,
            shard=shard,
            report_timeout_s=config.scheduler.report_timeout_s,
            eviction=config.scheduler.eviction_watermarks(),
            stall_timeout_s=config.scheduler.stall_timeout_s,
            index_check_interval_s=config.scheduler.index_check_interval_s,
            migration=config.scheduler.migration_policy(),
        )
        for shard in range(config.scheduler.shards)
    )


def _reserve_port(host: str) -> tuple[int, socket.socket]:
    """A free port, bound (not listening) with SO_REUSEPORT so the replicas can bind it too."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, 0))
    return int(sock.getsockname()[1]), sock
