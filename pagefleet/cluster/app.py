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

import contextlib
import logging
import math
import os
import signal
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import ray
from ray import serve

from pagefleet.cluster.config import ClusterConfig
from pagefleet.cluster.deployment import IngressDeployment, ingress_options
from pagefleet.cluster.gcs_watch import (
    GcsWatch,
    forget_usage_tags_of_past_rays,
    gcs_answers,
    gcs_storage,
)
from pagefleet.cluster.membership import (
    CPU_WORKER_NUM_CPUS,
    start_membership,
    withdraw_resource_request,
)
from pagefleet.cluster.names import APP_NAME, HEAD_NODE_RESOURCE, INGRESS_NAME, NAMESPACE
from pagefleet.scheduler.actor import start_scheduler

logger = logging.getLogger(__name__)

STOP_GRACE_S = 5.0  # how long a SIGKILLed process gets to be reaped
LOCAL_RAY_ATTEMPTS = 2


class StartError(RuntimeError):
    """The cluster could not start; the message (one line) names the pool and the cause."""


@dataclass
class RunningCluster:
    """Handles of a started cluster; `shutdown()` stops what `start_cluster` started."""

    config: ClusterConfig
    grpc_port: int
    metrics_port: int | None
    membership: Any  # the `Membership` actor: owns the workers, adds and removes them
    schedulers: tuple[Any, ...]  # one handle per scheduler shard (one by default)
    host: str = "127.0.0.1"
    started_ray: bool = False  # this process called ray.init (its own Ray or a joined one)
    local_ray: bool = False  # ... and started that Ray itself (address None)
    ingress: Any = field(default=None, repr=False)
    http_port: int | None = None
    _gcs_watch: GcsWatch | None = field(default=None, repr=False)
    _gcs_lost: bool = field(default=False, repr=False)

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

    def lost_gcs(self) -> str | None:
        """Why the cluster is gone for good (one line), else None; call it every
        `gcs_watch.PROBE_INTERVAL_S`. A Ray of our own is lost once its GCS process
        exits (nothing restarts it). A joined cluster's GCS is probed: without
        `server.gcs_fault_tolerance` it is lost after three unanswered probes, with it
        only once it has been away for nearly Ray's reconnect timeout (`gcs_watch`)."""
        if self.local_ray:
            gcs = _local_gcs_process()
            if gcs is None or gcs.poll() is None:
                return None
            self._gcs_lost = True
            return f"the Ray GCS this server started (pid {gcs.pid}) exited with code {gcs.returncode}"
        if self._gcs_watch is None:
            self._gcs_watch = GcsWatch(fault_tolerant=self.config.server.gcs_fault_tolerance)
        why = self._gcs_watch.observe(gcs_answers())
        if why is None:
            return None
        self._gcs_lost = True
        address = ray.get_runtime_context().gcs_address
        return f"lost the Ray GCS at {address} ({why})"

    def shutdown(self) -> None:
        """Delete the Serve app (and Serve, when no other app runs on it), the workers and the
        scheduler (and Ray, if we started it)."""
        _close_handle(self.ingress)
        if self.local_ray:
            # Ray stops every actor with it. Shutting Serve down first only makes the
            # killed controller's pending calls log "ServeController.graceful_shutdown
            # failed ... infinite retries remaining" on every clean exit.
            stop_local_ray()
            return
        if self._gcs_lost:
            if self.started_ray:
                ray.shutdown()  # nothing on the cluster can be reached to delete
            return
        _delete_serve_app(stop_serve_if_idle=True)
        for pool_workers in self.workers.values():
            for _, handle in pool_workers:
                ray.kill(handle, no_restart=True)
        ray.kill(self.membership, no_restart=True)
        try:
            withdraw_resource_request(self.config)
        except Exception:  # shutting down anyway
            logger.exception("withdrawing the autoscaler request failed")
        for scheduler in self.schedulers:
            ray.kill(scheduler, no_restart=True)


def _close_handle(handle: Any) -> None:
    """Stop this process's router of a Serve handle: its metrics tasks run on Serve's shared
    router thread and outlive Ray, each push failing (and logged) from then on. It waits
    for a push in flight (at most Serve's 10 s), which needs no GCS."""
    if handle is None:
        return
    try:
        handle.shutdown()
    except Exception:  # shutting down anyway
        logger.debug("closing the ingress handle failed", exc_info=True)


def _local_gcs_process() -> Any:
    """The `subprocess.Popen` of the GCS server this process's `ray.init` started, if any."""
    from ray._private import ray_constants, worker

    node = worker._global_node
    if node is None:
        return None
    infos: list[Any] = node.all_processes.get(ray_constants.PROCESS_TYPE_GCS_SERVER, [])
    return infos[0].process if infos else None


# The name of the thread `stop_local_ray` shuts Ray down in.
RAY_SHUTDOWN_THREAD = "pagefleet-ray-shutdown"


def stop_local_ray() -> None:
    """Disconnect this driver from the Ray it started, then SIGKILL every process of that
    Ray. Ray's own stop would send each one SIGTERM and wait a second for it, but they
    ignore SIGTERM (`RAY_SPARED_SIGNALS`); and after a lost GCS it leaves the raylet's
    agents (`ray::DashboardAgent`, `ray::RuntimeEnvAgent`) behind."""
    import psutil
    from ray._private import worker

    node = worker._global_node
    started: list[psutil.Process] = []
    groups: list[list[Any]] = [] if node is None else list(node.all_processes.values())
    for infos in groups:
        for info in infos:
            with contextlib.suppress(psutil.Error):
                root = psutil.Process(info.process.pid)
                started += [root, *root.children(recursive=True)]
    # Without its node, `ray.shutdown` only disconnects the driver; the processes are ended
    # here. In a thread: with the GCS gone, the disconnect may wait on it (Ray's reconnect
    # timeout). The thread's name lets a test wait for it before a next ray.init: Ray counts
    # itself uninitialized before its shutdown is done.
    worker._global_node = None
    stopping = threading.Thread(target=ray.shutdown, daemon=True, name=RAY_SHUTDOWN_THREAD)
    stopping.start()
    stopping.join(timeout=30.0)
    _kill(started)


def _kill(procs: list[Any]) -> None:
    """SIGKILL these `psutil.Process`es and wait for them (briefly)."""
    import psutil

    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(procs, timeout=STOP_GRACE_S)


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
    started_ray = joined_ray = False
    try:
        if not ray.is_initialized():
            on_sigterm = signal.getsignal(signal.SIGTERM)
            if address is None:
                needed = sum(p.workers for p in config.pools) * CPU_WORKER_NUM_CPUS + 1
                # address="local": a cluster of our own, whatever else runs on the host. A
                # bare ray.init() joins $RAY_ADDRESS or the cluster a past `ray start` left in
                # Ray's address file (and then refuses num_cpus), even when that cluster is gone.
                started_ray = True
                start_local_ray(num_cpus=max(os.cpu_count() or 1, math.ceil(needed)))
            else:
                use_cluster_token()
                joined_ray = True
                forget_usage_tags_of_past_rays()
                ray.init(address=address, namespace=NAMESPACE)
                check_gcs_storage(config)
            if threading.current_thread() is threading.main_thread():
                # ray.init replaces the caller's SIGTERM handler with a bare sys.exit, which
                # would skip the caller's drain.
                signal.signal(signal.SIGTERM, on_sigterm)
        cluster = _start_on_ray(config, grpc_port, http_port, metrics_port, ready_timeout_s)
        cluster.started_ray, cluster.local_ray = started_ray or joined_ray, started_ray
        return cluster
    except BaseException:
        # A failed or interrupted start leaves nothing running: a Ray of our own stops
        # (every actor with it); on a joined cluster the actors this driver owns end
        # with its disconnect, and the Serve app (detached) is deleted.
        if started_ray:
            stop_local_ray()
        elif joined_ray:
            _delete_serve_app()
            ray.shutdown()
        raise


# How long a stop during start-up on a joined cluster waits for Serve to delete the app.
ABANDON_TIMEOUT_S = 30.0


def abandon_joined_start(timeout_s: float = ABANDON_TIMEOUT_S) -> None:
    """Undo what a `start_cluster` on a joined cluster has created so far, for a stop signal
    that ends the process in the middle of it. The actors this driver owns (schedulers,
    membership, workers) end with its exit; the Serve app does not (Serve keeps it, and its
    ingress replicas on the ports, after the driver that deployed it is gone), so it is
    deleted here. In a thread, bounded: the signal may have come in the middle of a Serve call."""
    if not ray.is_initialized():
        return  # still connecting: nothing created yet
    deleting = threading.Thread(target=_delete_serve_app, daemon=True, name="pagefleet-abandon-start")
    deleting.start()
    deleting.join(timeout_s)


def _delete_serve_app(*, stop_serve_if_idle: bool = False) -> None:
    """Delete this deployment's Serve app and wait until Serve has (no Serve yet: nothing to
    do). `stop_serve_if_idle`: then shut Serve itself down unless other apps run on it (a
    joined cluster's Serve may carry apps that are not ours)."""
    with contextlib.suppress(Exception):
        serve.delete(APP_NAME)
        if stop_serve_if_idle and not serve.status().applications:
            serve.shutdown()


# What the head records as its GCS storage (`gcs_watch.gcs_storage`) when a restarted GCS
# gets its tables back.
FAULT_TOLERANT_STORAGE = ("redis", "rocksdb")


def check_gcs_storage(config: ClusterConfig) -> None:
    """On a joined cluster: refuse `server.gcs_fault_tolerance` when the head keeps the
    GCS's tables in memory (a restarted GCS would have lost the cluster), and say so when
    the head could survive a GCS restart but the config does not let the server wait."""
    storage = gcs_storage()
    address = ray.get_runtime_context().gcs_address
    if storage is None:
        if config.server.gcs_fault_tolerance:
            logger.warning("the Ray GCS at %s did not say where it keeps its tables: trusting "
                           "server.gcs_fault_tolerance", address)  # fmt: skip
        return
    if config.server.gcs_fault_tolerance and storage not in FAULT_TOLERANT_STORAGE:
        raise StartError(
            f"server.gcs_fault_tolerance is set, but the Ray GCS at {address} keeps its tables in "
            f"{storage}: start its head with RAY_REDIS_ADDRESS (an external Redis)"
        )
    if not config.server.gcs_fault_tolerance and storage in FAULT_TOLERANT_STORAGE:
        logger.warning(
            "the Ray GCS at %s keeps its tables in %s, but server.gcs_fault_tolerance is off: "
            "a lost GCS will still stop this server", address, storage,
        )  # fmt: skip


# Signals the local Ray's processes never act on: a closed terminal (SIGHUP) and systemd's
# default KillMode=control-group (SIGTERM) signal every process of the server, not only
# `pagefleet serve`, and Ray's GCS and raylet would end at once (Ray blocks only SIGINT in
# its processes), taking the drain's streams with them. Serve drains, then ends them by pid.
RAY_SPARED_SIGNALS = frozenset({signal.SIGTERM, signal.SIGHUP})


@contextlib.contextmanager
def signals_blocked(signals: frozenset[signal.Signals]) -> Iterator[None]:
    """Block `signals` in this thread meanwhile. Every process started meanwhile inherits
    the mask, and so do theirs (the raylet's workers and agents); one of these signals sent
    to this process meanwhile waits, and is handled once the block ends."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


# How Ray says its own start-up ran out of time: the raylet did not register within 30 s, or
# the GCS did not write its port within `RAY_gcs_server_port_wait_time_s`.
RAY_START_TIMEOUTS = ("timed out during startup", "Timed out waiting for file")
# The GCS's port wait (Ray's default 30 s) on a starved machine; an operator's value stands.
GCS_PORT_WAIT_S = "120"


def start_local_ray(num_cpus: int, attempts: int = LOCAL_RAY_ATTEMPTS, **options: Any) -> None:
    """`ray.init` of a local Ray of our own (more `ray.init` keywords in `options`); a
    start-up that times out (a starved machine can miss Ray's waits for its raylet and its
    GCS) is stopped and tried again."""
    import psutil

    os.environ.setdefault("RAY_gcs_server_port_wait_time_s", GCS_PORT_WAIT_S)
    for attempt in range(1, attempts + 1):
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        try:
            with signals_blocked(RAY_SPARED_SIGNALS):
                ray.init(
                    **{"namespace": NAMESPACE, "include_dashboard": False, **options},
                    address="local",
                    num_cpus=num_cpus,
                )
            return
        except Exception as exc:  # Ray's own start-up failed
            # Its half-started node is not Ray's to stop (ray.init raised before keeping
            # it): end the processes it had started (this driver's new children).
            _kill([p for p in psutil.Process().children(recursive=True) if p.pid not in before])
            if attempt == attempts or not any(t in str(exc) for t in RAY_START_TIMEOUTS):
                raise StartError(f"the local Ray did not start: {exc}") from exc
            logger.warning("the local Ray did not start in time (attempt %d of %d); again", attempt, attempts)


def _start_on_ray(
    config: ClusterConfig,
    grpc_port: int | None,
    http_port: int | None,
    metrics_port: int | None,
    ready_timeout_s: float,
) -> RunningCluster:
    namespace = ray.get_runtime_context().namespace
    schedulers = start_schedulers(config, namespace)
    membership = start_membership(config, namespace, schedulers)
    problem = ray.get(membership.wait_loaded.remote(ready_timeout_s), timeout=ready_timeout_s + 30)
    if problem is not None:
        _stop_started(membership, schedulers)
        raise StartError(problem)
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
        ingress=handle,
        http_port=ports["http_port"],
    )


def _stop_started(membership: Any, schedulers: tuple[Any, ...]) -> None:
    """Undo a start that failed before Serve: the workers, their owner, the schedulers."""
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
            session_pins=config.router.session_max_pins,
            # On the head node, with the ingress and membership: a worker node's loss
            # never takes the cluster's view with it.
            resources={HEAD_NODE_RESOURCE: 0.001},
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
