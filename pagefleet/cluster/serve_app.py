"""The pagefleet cluster as a Ray Serve application, for `serve run` / `serve deploy` / KubeRay.

`pagefleet.cluster.serve_app:build_application` is the application builder
named in `manifests/serve.yaml`; Serve calls it with the config file's `args`
(validated as `BuildArgs`):

```yaml
applications:
  - name: pagefleet
    import_path: pagefleet.cluster.serve_app:build_application
    args:
      config: {pools: [{name: default, model: tiny, workers: 2}]}   # or a YAML path
      metrics_port: 9400                                           # null disables /metrics
```

It starts what `pagefleet serve` starts, with the ports of the config's
`server` section, as two deployments of one application:

- `pagefleet-workers` (one replica): starts the scheduler actor(s) and the
  `Membership` actor, which starts the worker actors (the same helpers as
  `start_cluster`), and owns them, so `serve delete` / `serve shutdown` ends
  them with the application (and withdraws an autoscaled pool's request of Ray's
  autoscaler). Its `user_config` may set pool sizes:
  `{pool_workers: {default: 3}}`; changing it and running `serve deploy`
  again adds or removes workers while serving (Serve calls `reconfigure`, a
  lightweight update that restarts nothing), as `pagefleet scale` does.
- `pagefleet-ingress`: the same `IngressDeployment` as `pagefleet serve`
  (gRPC, OpenAI HTTP, /metrics), given the workers' handles by the owner.
  Its constructor returns once every worker has loaded its model, so Serve
  reports the application RUNNING only when it can answer.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ray
from pydantic import field_validator, model_validator
from ray import serve
from ray.serve import Application
from typing_extensions import Self

from pagefleet.cluster.app import start_schedulers
from pagefleet.cluster.config import (
    ClusterConfig,
    ConfigError,
    NonEmptyStr,
    PoolSize,
    Port,
    PositiveSeconds,
    Section,
)
from pagefleet.cluster.deployment import IngressDeployment, ingress_options
from pagefleet.cluster.membership import (
    DEFAULT_ADD_TIMEOUT_S,
    MembershipError,
    describe_change,
    start_membership,
    withdraw_resource_request,
)
from pagefleet.cluster.names import HEAD_NODE_RESOURCE, INGRESS_NAME, WORKERS_NAME
from pagefleet.worker.config import InvalidField

logger = logging.getLogger(__name__)

DEFAULT_METRICS_PORT = 9400
DEFAULT_READY_TIMEOUT_S = 600.0


class WorkerOwner:
    """Serve replica that starts the scheduler and the workers, and owns them.

    Ray ends actors with their owner: deleting the application (which stops
    this replica) stops the workers and the scheduler too.
    """

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.namespace = ray.get_runtime_context().namespace
        self.schedulers = start_schedulers(config, self.namespace)
        self.membership = start_membership(config, self.namespace, self.schedulers)

    async def get_workers(self) -> dict[str, list[tuple[str, Any]]]:
        """`{pool: [(worker_id, actor handle), ...]}` now (an ingress replica starting later
        gets the workers added since)."""
        workers: dict[str, list[tuple[str, Any]]] = await self.membership.members.remote()
        return workers

    async def wait_loaded(self, timeout_s: float) -> None:
        """Return once every worker is placed and loaded; MembershipError saying why a pool
        cannot start (a load failure, or what it asks Ray for against what the cluster has)."""
        problem = await self.membership.wait_loaded.remote(timeout_s)
        if problem is not None:
            raise MembershipError(problem)

    def get_schedulers(self) -> tuple[Any, ...]:
        """The scheduler shards' actor handles (the ingress follows their views)."""
        return self.schedulers

    def get_namespace(self) -> str:
        """The Ray namespace of the worker actors (an ingress finds added workers there)."""
        return self.namespace

    async def reconfigure(self, user_config: Mapping[str, Any]) -> None:
        """Serve's lightweight update: bring each pool named in `user_config["pool_workers"]`
        to its size, adding workers or draining and removing the newest ones."""
        sizes = parse_user_config(user_config, self.config)
        for pool, workers in sizes.items():
            try:
                result = await self.membership.scale.remote(
                    pool, workers, timeout_s=DEFAULT_ADD_TIMEOUT_S,
                    drain_timeout_s=self.config.server.drain_timeout_s,
                )
            except Exception as exc:
                # Not raised to Serve: a failed reconfigure may restart this replica, and
                # every worker ends with it. The pool keeps the workers it has.
                cause = getattr(exc, "cause", None) or exc
                logger.error("pagefleet-workers: pool %s not brought to %d workers: %s", pool, workers, cause)
                continue
            logger.warning("pagefleet-workers: %s", describe_change(result))

    def __del__(self) -> None:
        # Serve stops this replica when the app is deleted (the actors it owns end with it):
        # an autoscaled pool's standing request of Ray's autoscaler goes too, or it would
        # keep the nodes launched for the workers up with no worker on them.
        try:
            withdraw_resource_request(self.config)
        except Exception:  # stopping anyway
            logger.exception("pagefleet-workers: withdrawing the autoscaler request failed")


class ServeIngress(IngressDeployment):
    """`IngressDeployment` whose workers come from the `WorkerOwner` deployment."""

    async def __init__(  # type: ignore[misc]  # Serve awaits an async constructor
        self,
        config: ClusterConfig,
        owner: Any,
        metrics_port: int | None,
        ready_timeout_s: float,
    ) -> None:
        await owner.wait_loaded.remote(ready_timeout_s)
        workers = await owner.get_workers.remote()
        schedulers = await owner.get_schedulers.remote()
        namespace = await owner.get_namespace.remote()
        await super().__init__(
            config,
            workers,
            config.server.grpc_port,
            metrics_port,
            schedulers,
            http_port=config.server.http_port,
            namespace=namespace,
        )
        await self.wait_ready(ready_timeout_s)


class BuildArgs(Section):
    """The builder's `args`, validated (`parse_args`)."""

    # A cluster config mapping, a YAML file path (read on the head node), or none: the default.
    config: ClusterConfig = ClusterConfig.default()
    metrics_port: Port | None = DEFAULT_METRICS_PORT  # null disables /metrics
    ready_timeout_s: PositiveSeconds = DEFAULT_READY_TIMEOUT_S  # longest model load a worker may take
    # A custom Ray resource of the nodes that may run the ingress (KubeRay: its own
    # worker group, whose pods can then be probed for readiness); None: the head node.
    ingress_resource: NonEmptyStr | None = None
    # At most this many ingress replicas per node (Serve's max_replicas_per_node), e.g.
    # 1: one per ingress pod; None: Serve's default placement. Needs ingress_resource.
    ingress_replicas_per_node: int | None = None

    @field_validator("config", mode="before")
    @classmethod
    def _load_config(cls, raw: Any) -> Any:
        try:
            if isinstance(raw, Mapping):
                return ClusterConfig.from_dict(raw)
            if isinstance(raw, str):
                return ClusterConfig.from_yaml(Path(raw).expanduser())
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        if raw is None:
            return ClusterConfig.default()
        if isinstance(raw, ClusterConfig):
            return raw
        raise ValueError(f"must be a mapping or a YAML file path, got {type(raw).__name__}")

    @field_validator("ingress_replicas_per_node")
    @classmethod
    def _at_least_one(cls, per_node: int | None) -> int | None:
        if per_node is not None and per_node < 1:
            raise ValueError(f"must be an integer >= 1 or null, got {per_node}")
        return per_node

    @model_validator(mode="after")
    def _spread_needs_a_resource(self) -> Self:
        if self.ingress_replicas_per_node is not None and self.ingress_resource is None:
            raise InvalidField(
                "ingress_replicas_per_node",
                "needs ingress_resource (without it every ingress replica runs on the head node, "
                "so the cap would only leave replicas unplaced)",
            )
        return self


def parse_args(args: Mapping[str, Any]) -> BuildArgs:
    """`BuildArgs` from the builder's args; ValueError (a ConfigError) names the bad one."""
    if not isinstance(args, Mapping):
        raise ConfigError(f"pagefleet args must be a mapping, got {type(args).__name__}")
    try:
        return BuildArgs.from_data(args, noun="argument")
    except ConfigError as exc:
        raise ConfigError(f"pagefleet args.{exc}") from None


class WorkersUserConfig(Section):
    """The `pagefleet-workers` deployment's `user_config` (`parse_user_config`)."""

    pool_workers: dict[str, PoolSize] | None = None  # pool -> workers to bring it to


def parse_user_config(user_config: Any, config: ClusterConfig) -> dict[str, int]:
    """`{pool: workers}` from the `pagefleet-workers` deployment's `user_config`;
    ValueError (a ConfigError) names the bad field."""
    if user_config is None:
        return {}
    if not isinstance(user_config, Mapping):
        raise ConfigError(f"pagefleet-workers user_config must be a mapping, got {type(user_config).__name__}")
    try:
        sizes = WorkersUserConfig.from_data(user_config).pool_workers or {}
    except ConfigError as exc:
        raise ConfigError(f"pagefleet-workers user_config.{exc}") from None
    known = [p.name for p in config.pools]
    for pool in sizes:
        if pool not in known:
            raise ConfigError(
                f"pagefleet-workers user_config.pool_workers.{pool}: unknown pool (pools: {', '.join(known)})"
            )
    return dict(sizes)


def build_application(args: Mapping[str, Any]) -> Application:
    """The Serve application of a pagefleet cluster (see the module docstring); Serve's
    application builder, named in `manifests/serve.yaml`."""
    parsed = parse_args(args)
    # On the head node, like `pagefleet serve`: clients dial the head, and losing a
    # GPU node must never take the ingress or the workers' owner with it.
    on_head = {"num_cpus": 0, "resources": {HEAD_NODE_RESOURCE: 0.001}}
    on_ingress_node = on_head
    if parsed.ingress_resource is not None:
        on_ingress_node = {"num_cpus": 0, "resources": {parsed.ingress_resource: 0.001}}
    per_node = parsed.ingress_replicas_per_node
    spread: dict[str, Any] = {} if per_node is None else {"max_replicas_per_node": per_node}
    quiet = {"enable_access_log": False}  # only control calls pass through Serve
    owner = serve.deployment(
        name=WORKERS_NAME, num_replicas=1, ray_actor_options=on_head, logging_config=quiet
    )(WorkerOwner)
    ingress = serve.deployment(
        name=INGRESS_NAME,
        # Replicas on one node share the config's ports (SO_REUSEPORT); a fixed count
        # or autoscaled on their streams (`server.ingress_max_replicas`).
        **ingress_options(parsed.config),
        ray_actor_options=on_ingress_node,
        **spread,
        logging_config=quiet,
        # Streams arrive over our own gRPC/HTTP servers, not as Serve requests.
        max_ongoing_requests=1000,
    )(ServeIngress)
    return ingress.bind(
        parsed.config, owner.bind(parsed.config), parsed.metrics_port, parsed.ready_timeout_s
    )
