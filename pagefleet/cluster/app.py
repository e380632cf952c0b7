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

import asyncio
import logging
import math
import os
import socket
from dataclasses import dataclass, field
from typing import Any

import ray
from ray import serve

from pagefleet.cluster.autoscaling import STREAMS_METRIC, ingress_replica_options
from pagefleet.cluster.config import ClusterConfig
from pagefleet.cluster.drain import ABORT_GRACE_S, Drain
from pagefleet.cluster.grpc_server import start_grpc_server
from pagefleet.cluster.ingress import Ingress
from pagefleet.cluster.membership import (
    CPU_WORKER_NUM_CPUS,
    MembershipError,
    get_membership,
    start_membership,
    worker_actor_name,
)
from pagefleet.cluster.metrics import IngressMetrics
from pagefleet.cluster.openai_http import HttpServer, start_http_server

logger = logging.getLogger(__name__)

NAMESPACE = "pagefleet"
APP_NAME = "pagefleet"
INGRESS_NAME = "pagefleet-ingress"
HEAD_NODE_RESOURCE = "node:__internal_head__"  # Ray's marker resource of the head node
SCALING_POLL_S = 2.0


class IngressDeployment:
    """The Serve replica: one `Ingress` behind a gRPC server, the OpenAI HTTP server and /metrics.

    Serve runs this class's async constructor on the replica's event loop, so the
    gRPC and HTTP servers, the view subscription and the Ray streaming calls share one loop.
    """

    async def __init__(  # type: ignore[misc]  # Serve awaits an async constructor
        self,
        config: ClusterConfig,
        workers: dict[str, list[tuple[str, Any]]],
        grpc_port: int,
        metrics_port: int | None,
        schedulers: tuple[Any, ...],
        http_port: int | None = None,
        namespace: str | None = None,
    ) -> None:
        self.metrics = IngressMetrics()
        self._drain_timeout_s = config.server.drain_timeout_s

        def resolve_worker(worker_id: str) -> Any:
            # A worker added while serving: its named actor, in the workers' namespace.
            return ray.get_actor(worker_actor_name(worker_id), namespace=namespace)

        # The shards' handles: the ingress's fleet view follows each and merges them.
        self.ingress = Ingress(
            config, workers, scheduler=schedulers, metrics=self.metrics, resolve_worker=resolve_worker
        )
        self.ingress.start()
        self._scaling = asyncio.get_running_loop().create_task(self._follow_scaling())
        self.drain = Drain(self.ingress)  # shared by both fronts: one in-flight count
        self.server, self.grpc_port = await start_grpc_server(
            self.ingress, config.server.host, grpc_port, drain=self.drain
        )
        self.http: HttpServer | None = None
        if http_port is not None:
            try:
                self.http = await start_http_server(
                    self.ingress, config.server.host, http_port, drain=self.drain
                )
            except BaseException:
                # Free the gRPC port before Serve retries the constructor.
                await self.server.stop(grace=None)
                await self.ingress.close()
                raise
        # Metrics are per replica, so each needs its own port: the configured one plus
        # the replica's rank (0 stays "any free port").
        if metrics_port:
            metrics_port += _replica_rank()
        self.metrics_port = (
            None if metrics_port is None else self.metrics.serve(metrics_port, config.server.metrics_host)
        )

    async def _follow_scaling(self) -> None:
        """Every SCALING_POLL_S: each pool's target and actual size from `pagefleet-membership`
        (GetStatus `target_workers`, `scale_reason`; metric `pool_workers`). Off the
        routing path; a missing owner leaves the last answer."""
        while True:
            try:
                membership = await asyncio.to_thread(get_membership)
                scaling = await membership.autoscale_status.remote()
                self.ingress.pool_scaling = scaling
                for pool, entry in scaling.items():
                    self.metrics.pool_workers.labels(pool, "target").set(entry["target"])
                    self.metrics.pool_workers.labels(pool, "actual").set(entry["workers"])
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                logger.debug("pool sizes not read from membership: %s", exc)
            await asyncio.sleep(SCALING_POLL_S)

    async def endpoints(self) -> dict[str, Any]:
        """The ports this replica bound (useful when asked for port 0) and its replica id."""
        return {
            "grpc_port": self.grpc_port,
            "metrics_port": self.metrics_port,
            "http_port": None if self.http is None else self.http.port,
            "replica_id": self.ingress.replica_id,
        }

    async def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Return once every worker answered (engines loaded)."""
        await self.ingress.wait_ready(timeout_s)

    async def set_router_policy(self, policy: str) -> None:
        """Switch the routing policy (prefix_affinity, round_robin, least_loaded, power_of_two)."""
        self.ingress.set_router_policy(policy)

    async def set_admission(self, mode: str) -> None:
        """Switch what a worker must have room for (full: prompt + max_tokens; prompt)."""
        self.ingress.set_admission(mode)

    async def drain_and_stop(self, timeout_s: float, *, hand_off: bool = False) -> int:
        """Graceful shutdown: stop accepting (health NOT_SERVING, new requests UNAVAILABLE),
        let running streams finish for up to `timeout_s` (then abort them), stop the servers.
        Returns how many streams had to be aborted.

        `hand_off`: other replicas go on serving on the same port (Serve scales this one
        down). The gRPC server then stops at once, which closes its listening socket and
        sends GOAWAY on every connection: running streams go on, and each client's next
        call opens a new connection, which the kernel gives to a replica still listening,
        instead of getting UNAVAILABLE here until the drain ends."""
        stopping = None
        if hand_off:
            stopping = asyncio.ensure_future(self.server.stop(grace=timeout_s + ABORT_GRACE_S + 2.0))
            # Let the stop begin (GOAWAY, no new calls) before the drain refuses calls here.
            await asyncio.sleep(0)
        aborted = await self.drain.wait(timeout_s)
        if self.http is not None:
            await self.http.stop(timeout_s=2.0)
        if stopping is not None:
            await stopping
        else:
            await self.server.stop(grace=2.0)
        return aborted

    async def check_health(self) -> None:
        """Serve's health probe: the ingress is healthy while its gRPC (and HTTP) servers run."""
        if self.drain.draining:
            return  # stopped on purpose: a restart would open the ports again
        if self.server is None:
            raise RuntimeError("gRPC server stopped")
        if self.http is not None and not self.http.running:
            raise RuntimeError("OpenAI HTTP server stopped")

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's autoscaling signal: this replica's streams (`autoscaling.StreamsPolicy`)."""
        return {STREAMS_METRIC: float(self.drain.in_flight)}

    async def __del__(self) -> None:
        # Serve stops a replica (scaling down, a redeploy, `serve delete`) through here,
        # within graceful_shutdown_timeout_s: drain as on SIGTERM, so its streams finish.
        if not self.drain.draining:
            await self.drain_and_stop(self._drain_timeout_s, hand_off=True)
        self._scaling.cancel()
        await self.ingress.close()


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

    def scheduler_of(self, pool: str) -> Any:
        """The handle of the scheduler shard that owns `pool`."""
        return self.schedulers[self.config.scheduler_shards()[pool]]

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
        if self.started_ray:
            ray.shutdown()


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
    schedulers = _start_schedulers(config, namespace)
    membership = start_membership(config, namespace, schedulers)
    try:
        ray.get(membership.wait_placed.remote(ready_timeout_s), timeout=ready_timeout_s + 60)
    except MembershipError as exc:
        # A pool Ray cannot place (or whose workers die loading) fails the start, saying why.
        _stop_started(membership, schedulers, started_ray)
        raise MembershipError(str(getattr(exc, "cause", None) or exc)) from None
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


def _stop_started(membership: Any, schedulers: tuple[Any, ...], started_ray: bool) -> None:
    """Undo a start that failed before Serve: the workers, their owner, the schedulers."""
    if started_ray:
        ray.shutdown()
        return
    for pool_workers in ray.get(membership.members.remote(), timeout=60).values():
        for _, handle in pool_workers:
            ray.kill(handle, no_restart=True)
    for actor in (membership, *schedulers):
        ray.kill(actor, no_restart=True)


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


def ingress_options(config: ClusterConfig) -> dict[str, Any]:
    """Replica count (fixed or autoscaled on streams) and shutdown budget of the ingress."""
    server = config.server
    return ingress_replica_options(
        server.ingress_replicas,
        server.ingress_max_replicas,
        server.ingress_target_streams,
        server.ingress_upscale_delay_s,
        server.ingress_downscale_delay_s,
        server.drain_timeout_s,
    )


def _start_schedulers(config: ClusterConfig, namespace: str) -> tuple[Any, ...]:
    """The scheduler actors (one per `scheduler.shards`) with the config's timeouts, eviction
    watermarks and migration policy."""
    from pagefleet.scheduler.actor import start_scheduler

    return tuple(
        start_scheduler(
            namespace=namespace,
            shard=shard,
            report_timeout_s=config.scheduler.report_timeout_s,
            eviction=config.scheduler.eviction_watermarks(),
            stall_timeout_s=config.scheduler.stall_timeout_s,
            index_check_interval_s=config.scheduler.index_check_interval_s,
            migration=config.scheduler.migration_policy(),
            # On the head node, with the ingress and membership: a worker node's loss
            # never takes the cluster's view with it.
            resources={HEAD_NODE_RESOURCE: 0.001},
        )
        for shard in range(config.scheduler.shards)
    )


def _replica_rank() -> int:
    """This Serve replica's rank in its deployment (0 outside Serve)."""
    try:
        return int(serve.get_replica_context().rank.rank)
    except Exception:  # not in a replica, or an older Serve without ranks
        return 0


def _reserve_port(host: str) -> tuple[int, socket.socket]:
    """A free port, bound (not listening) with SO_REUSEPORT so the replicas can bind it too."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, 0))
    return int(sock.getsockname()[1]), sock


def build(args: dict[str, Any]) -> Any:
    """Serve application builder: `serve run` / `serve deploy` of `manifests/serve.yaml`.

    `args` are the Serve config's application `args`: `config` (a cluster config
    mapping or a YAML path), `metrics_port` (default 9400, null disables) and
    `ready_timeout_s`. See `pagefleet.cluster.serve_app`.
    """
    from pagefleet.cluster.serve_app import build_application

    return build_application(args)
