"""The Serve deployment of the ingress: what every `pagefleet-ingress` replica runs.

One `Ingress` behind our own gRPC server, the OpenAI HTTP server and
/metrics. `pagefleet serve` (`app.start_cluster`) deploys it with the
workers' handles; the Serve application (`serve_app`) deploys a subclass that
asks the `pagefleet-workers` deployment for them.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import ray
from ray import serve

from pagefleet.cluster.autoscaling import STREAMS_METRIC, ingress_replica_options
from pagefleet.cluster.config import ClusterConfig
from pagefleet.cluster.drain import ABORT_GRACE_S, Drain
from pagefleet.cluster.gcs_watch import GcsWatch, watch_gcs
from pagefleet.cluster.grpc_server import start_grpc_server
from pagefleet.cluster.ingress import Ingress
from pagefleet.cluster.membership import get_membership
from pagefleet.cluster.metrics import IngressMetrics
from pagefleet.cluster.names import worker_actor_name
from pagefleet.cluster.openai import HttpServer, start_http_server

SCALING_POLL_S = 2.0  # how often a replica reads each pool's target and actual size

logger = logging.getLogger(__name__)


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
        # Without GCS fault tolerance a lost GCS is the cluster's end: stop accepting at
        # once (health NOT_SERVING) rather than answer "ok" while completions hang. With
        # it, serve on while the GCS restarts, up to just before Ray gives up on it.
        watch = GcsWatch(fault_tolerant=config.server.gcs_fault_tolerance)
        self._gcs_watch = asyncio.ensure_future(watch_gcs(self.drain.start, watch))

    async def _follow_scaling(self) -> None:
        """Every SCALING_POLL_S: each pool's target and actual size from `pagefleet-membership`
        (GetStatus `target_workers`, `scale_reason`; metric `pool_workers`). Off the
        routing path; a missing owner leaves the last answer."""
        while True:
            try:
                membership = await asyncio.to_thread(get_membership)
                scaling = await membership.autoscale_status.remote()
                self.ingress.pool_scaling = scaling
                self.metrics.observe_pool_sizes(scaling)
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
            # Calls gRPC accepted before its stop took effect still reach the handler:
            # served, not refused (the clients' next calls go to a replica still listening).
            self.drain.hand_off()
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
        self._gcs_watch.cancel()
        self._scaling.cancel()
        # Serve stops a replica (scaling down, a redeploy, `serve delete`) through here,
        # within graceful_shutdown_timeout_s: drain as on SIGTERM, so its streams finish.
        if not self.drain.draining:
            await self.drain_and_stop(self._drain_timeout_s, hand_off=True)
        await self.ingress.close()


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


def _replica_rank() -> int:
    """This Serve replica's rank in its deployment (0 outside Serve)."""
    try:
        return int(serve.get_replica_context().rank.rank)
    except Exception:  # not in a replica, or an older Serve without ranks
        return 0
