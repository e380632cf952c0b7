"""Cluster configuration: pools, tenants, router and scheduler settings, from YAML.

Validated once, at load: every error names the field's path and the reason,
e.g. ``pools[0].workers: must be >= 1, got 0``, so `pagefleet serve` fails at
start instead of a worker failing later.

```yaml
server: {grpc_port: 50051, http_port: 8000}
router: {policy: prefix_affinity, w_prefill: 1.0, w_load: 1.0}
scheduler: {report_timeout_s: 3.0, wait_queue_size: 256, admission: full}
pools:
  - {name: chat, model: tiny, workers: 2, block_size: 16, num_kv_blocks: 512}
tenants:
  - {name: acme, pool: chat, api_key_env: ACME_API_KEY}
```
"""

from __future__ import annotations

import dataclasses
import hmac
import os
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

from pagefleet.cluster.router import RouterConfig
from pagefleet.scheduler.autoscale import AutoscalePolicy
from pagefleet.scheduler.policy import ADMISSION_MODES, EvictionWatermarks, MigrationPolicy
from pagefleet.worker.block_pool import is_valid_block_size
from pagefleet.worker.config import (
    DEFAULT_DTYPE,
    DTYPES,
    KV_CACHE_DTYPES,
    PREEMPTION_MODES,
    EngineConfig,
)

SCHEDULER_POLICIES = ("watermark", "none")
DEVICES = ("auto", "cpu", "cuda")

_T = TypeVar("_T")


class ConfigError(ValueError):
    """An invalid cluster config; the message starts with the field's path."""


def _fail(name: str, reason: str) -> typing.NoReturn:
    raise ConfigError(f"{name}: {reason}")


def _at_least(name: str, value: float | None, low: float) -> None:
    if value is not None and value < low:
        _fail(name, f"must be >= {low}, got {value}")


def _one_of(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        _fail(name, f"must be one of {', '.join(allowed)}, got {value!r}")


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip


def parse_bytes(value: int | str) -> int:
    """A byte count from an int or a string like ``512MiB`` / ``2GB``."""
    if isinstance(value, bool):
        raise ValueError(f"expected a byte size, got {value!r}")
    if isinstance(value, int):
        return value
    match = _SIZE.match(str(value))
    if match is None:
        raise ValueError(f"expected a byte size like 512MiB or 2GB, got {value!r}")
    number, unit = match.groups()
    return int(float(number) * _UNITS[(unit or "b").lower()])


@dataclass(frozen=True)
class PoolConfig:
    """A named group of identical workers serving one model."""

    name: str
    model: str = "tiny"
    workers: int = 1
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_memory_bytes: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    preemption_mode: str = "recompute"
    swap_space_bytes: int | None = None
    kv_offload_bytes: int | None = None  # YAML `kv_offload: 4GiB`: host tier per worker
    dtype: str = DEFAULT_DTYPE
    kv_cache_dtype: str = "auto"
    device: str = "auto"
    num_gpus_per_worker: float | None = None
    node_labels: dict[str, str] = field(default_factory=dict, hash=False)  # Ray labels its nodes need
    min_workers: int | None = None  # autoscaling bounds; None: `workers`
    max_workers: int | None = None

    def __post_init__(self) -> None:
        if not self.name:
            _fail("name", "must not be empty")
        _at_least("workers", self.workers, 1)
        low, high = self.worker_bounds()
        if not 1 <= low <= self.workers <= high:
            _fail("max_workers", f"need 1 <= min_workers <= workers <= max_workers, got {low}, {self.workers}, {high}")
        for key, value in self.node_labels.items():
            if not (isinstance(key, str) and key and isinstance(value, str) and value):
                _fail("node_labels", f"keys and values must be non-empty strings, got {key!r}: {value!r}")
        if not is_valid_block_size(self.block_size):
            _fail("block_size", f"must be a power of two >= 1, got {self.block_size}")
        for name in ("num_kv_blocks", "kv_memory_bytes", "max_num_seqs", "max_num_batched_tokens"):
            _at_least(name, getattr(self, name), 1)
        _at_least("max_model_len", self.max_model_len, 2)
        _at_least("swap_space_bytes", self.swap_space_bytes, 0)
        _at_least("kv_offload_bytes", self.kv_offload_bytes, 0)
        _at_least("num_gpus_per_worker", self.num_gpus_per_worker, 0)
        _one_of("preemption_mode", self.preemption_mode, PREEMPTION_MODES)
        _one_of("dtype", self.dtype, DTYPES)
        _one_of("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _one_of("device", self.device, DEVICES)
        # The engine's own checks are the final word (e.g. cross-field limits).
        try:
            EngineConfig(**self.engine_kwargs(device="cpu"))
        except ValueError as exc:
            raise ConfigError(f"engine: {exc}") from exc

    def worker_bounds(self) -> tuple[int, int]:
        """(min_workers, max_workers), each `workers` when unset: a fixed size."""
        low = self.workers if self.min_workers is None else self.min_workers
        return low, self.workers if self.max_workers is None else self.max_workers

    def engine_kwargs(self, *, device: str | None = None) -> dict[str, Any]:
        """Keyword arguments for ``EngineConfig``; unset limits keep the engine's defaults.

        ``device="auto"`` resolves to cuda when the calling process sees a GPU
        (call it on the worker), else cpu; `device` overrides.
        """
        if device is None:
            device = self.device
        if device == "auto":
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        kwargs: dict[str, Any] = {
            "model": self.model,
            "block_size": self.block_size,
            "num_kv_blocks": self.num_kv_blocks,
            "kv_memory_bytes": self.kv_memory_bytes,
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "enable_prefix_caching": self.enable_prefix_caching,
            "preemption_mode": self.preemption_mode,
            "swap_space_bytes": self.swap_space_bytes,
            "kv_offload_bytes": self.kv_offload_bytes,
            "dtype": self.dtype,
            "kv_cache_dtype": self.kv_cache_dtype,
            "device": device,
        }
        optional = ("max_num_seqs", "max_num_batched_tokens", "swap_space_bytes", "kv_offload_bytes")
        return {k: v for k, v in kwargs.items() if not (k in optional and v is None)}


@dataclass(frozen=True)
class TenantConfig:
    """A client identity: its pool, its prefix-cache salt and its API key.

    `weight` is the tenant's share of a shared pool's wait queue, relative to
    the other tenants of that pool: its part of `scheduler.wait_queue_size`
    and of the dispatch order (weighted fair queueing). `max_live_blocks`
    optionally caps the live KV blocks the tenant may hold on each worker.
    """

    name: str
    pool: str
    salt: str | None = None
    api_key: str | None = None
    api_key_env: str | None = None
    weight: float = 1.0
    max_live_blocks: int | None = None

    def __post_init__(self) -> None:
        if not self.name:
            _fail("name", "must not be empty")
        if self.salt == "":
            _fail("salt", "must not be empty (omit it to derive one from the name)")
        if self.api_key == "":
            _fail("api_key", "must not be empty (omit it for a tenant without a key)")
        if not 0 < self.weight < float("inf"):
            _fail("weight", f"must be a finite number > 0, got {self.weight}")
        _at_least("max_live_blocks", self.max_live_blocks, 1)

    def cache_salt(self) -> str:
        """The prefix-cache salt router and workers must both use for this tenant.

        Set by the server, never by the client, so one tenant cannot hit (or
        time) another tenant's cached blocks.
        """
        return self.salt if self.salt is not None else f"tenant:{self.name}"


@dataclass(frozen=True)
class SchedulerConfig:
    """Central scheduler settings: liveness, wait queue bound, eviction watermarks.

    `wait_queue_size` bounds, per pool, the requests waiting at the ingress for a
    worker with room. `admission` says what room means: "full" (the default)
    sends a request only where the blocks it takes up to its max_tokens fit
    beside what the requests already there will still take (up to
    `admission_overcommit` times the pool), so a full pool does not thrash in
    preemptions; "prompt" only asks room for the prompt (more requests run
    at once, and the engine preempts when their outputs outgrow the pool).
    Below `evict_low_watermark` free blocks (a fraction of a
    worker's pool) the scheduler asks the worker to evict cached blocks until
    `evict_high_watermark` are free; `evict_low_watermark: 0` turns that off.

    `shards`: how many scheduler actors share the pools. Each pool belongs to
    exactly one shard (`ClusterConfig.scheduler_shards`); its workers push
    there and every ingress replica follows all shards. 1 (the default) is the
    one central scheduler.

    `replica_aware_eviction`: workers evict cached blocks that another worker of
    the pool also holds before the last copies of a prefix (ahead of need and
    on allocation); false: plain LRU per worker. `policy: none` turns both off.

    A worker short of blocks hands a request to another worker of its pool
    with room for it plus `migration_margin_blocks` (`migration: false` turns
    that off); a request migrates at most once per `migration_cooldown_s`.
    `migration_transfer`: "auto" (the default) moves each request whichever
    way the target's measurements make cheaper (`policy.transfer_is_cheaper`:
    its seconds per imported block against its seconds per prefilled token;
    transfer until it has imported once); true: the KV blocks always go with
    it through the object store, so the target computes only the partial tail
    block (measured 19-63x cheaper than recomputing on CPU); false: the target
    always recomputes them.
    """

    policy: str = "watermark"
    report_interval_s: float = 0.5
    report_timeout_s: float = 3.0
    wait_queue_size: int = 256
    evict_low_watermark: float = 0.05
    evict_high_watermark: float = 0.10
    # A worker with work that streams nothing this long leaves routing (hung).
    stall_timeout_s: float = 3.0
    # How often each worker's index is compared with a snapshot (index drift metric).
    index_check_interval_s: float = 10.0
    shards: int = 1
    admission: str = "full"
    admission_overcommit: float = 1.0
    replica_aware_eviction: bool = True
    migration: bool = True
    migration_margin_blocks: int = 4
    migration_cooldown_s: float = 10.0
    migration_transfer: bool | str = "auto"
    # Pools with min_workers < max_workers: grow after this long short of blocks
    # (allocatable below the fraction) with requests waiting, shrink after this long idle.
    autoscale_free_fraction: float = 0.1
    autoscale_out_after_s: float = 10.0
    autoscale_in_after_s: float = 60.0
    autoscale_cooldown_s: float = 30.0

    def __post_init__(self) -> None:
        _one_of("policy", self.policy, SCHEDULER_POLICIES)
        try:
            self.autoscale_policy(1, 2)
        except ValueError as exc:  # "<field> must be ...": name the config field
            name, _, reason = str(exc).partition(" ")
            raise ConfigError(f"autoscale_{name}: {reason}") from exc
        _at_least("shards", self.shards, 1)
        _one_of("admission", self.admission, ADMISSION_MODES)
        if not 1.0 <= self.admission_overcommit <= 100.0:
            _fail(
                "admission_overcommit",
                f"must be a factor from 1.0 (never overcommit) to 100, got {self.admission_overcommit}",
            )
        _at_least("migration_margin_blocks", self.migration_margin_blocks, 0)
        if self.migration_transfer not in (True, False, "auto"):
            _fail(
                "migration_transfer",
                f"must be true, false or 'auto', got {self.migration_transfer!r}",
            )
        if not self.migration_cooldown_s >= 0:
            _fail("migration_cooldown_s", f"must be >= 0, got {self.migration_cooldown_s}")
        if not self.stall_timeout_s > 0:
            _fail("stall_timeout_s", f"must be > 0, got {self.stall_timeout_s}")
        if not self.index_check_interval_s > 0:
            _fail("index_check_interval_s", f"must be > 0, got {self.index_check_interval_s}")
        if not self.report_interval_s > 0:
            _fail("report_interval_s", f"must be > 0, got {self.report_interval_s}")
        if not self.report_timeout_s > self.report_interval_s:
            _fail(
                "report_timeout_s",
                f"must be > report_interval_s ({self.report_interval_s}), got {self.report_timeout_s}",
            )
        _at_least("wait_queue_size", self.wait_queue_size, 0)
        if not 0.0 <= self.evict_low_watermark <= self.evict_high_watermark <= 1.0:
            _fail(
                "evict_high_watermark",
                "need 0 <= evict_low_watermark <= evict_high_watermark <= 1, got "
                f"{self.evict_low_watermark} and {self.evict_high_watermark}",
            )

    def eviction_watermarks(self) -> EvictionWatermarks | None:
        """How the scheduler steers workers' eviction: watermarks and replica awareness.

        None (plain LRU on allocation only) with `policy: none`, or a low mark of 0
        without replica awareness. A low mark of 0 evicts nothing ahead of need.
        """
        if self.policy == "none" or (self.evict_low_watermark == 0 and not self.replica_aware_eviction):
            return None
        return EvictionWatermarks(
            self.evict_low_watermark, self.evict_high_watermark, self.replica_aware_eviction
        )

    def autoscale_policy(self, min_workers: int, max_workers: int) -> AutoscalePolicy:
        """How a pool with these bounds grows and shrinks on load."""
        return AutoscalePolicy(
            min_workers, max_workers, self.autoscale_free_fraction, self.autoscale_out_after_s,
            self.autoscale_in_after_s, self.autoscale_cooldown_s,
        )  # fmt: skip

    def migration_policy(self) -> MigrationPolicy | None:
        """When the scheduler moves a request off a worker short of blocks (None: never)."""
        if not self.migration:
            return None
        return MigrationPolicy(
            margin_blocks=self.migration_margin_blocks,
            cooldown_s=self.migration_cooldown_s,
            transfer=self.migration_transfer,
        )


DEFAULT_HTTP_PORT = 8000
# `pagefleet scale` / `Membership`: how long a new worker may take to be placed and load,
# and how long a removed worker's streams get to finish before they fail over.
DEFAULT_WORKER_ADD_TIMEOUT_S = 300.0
DEFAULT_WORKER_DRAIN_TIMEOUT_S = 60.0
DEFAULT_MAX_MESSAGE_BYTES = 4 * 2**20


@dataclass(frozen=True)
class ServerConfig:
    """Where the ingress listens, and the limits it enforces before doing any work.

    `grpc_port` serves `pagefleet.v1.Generation`; `http_port` the OpenAI HTTP
    API (`null` disables it). Port 0 picks a free port. `/metrics` listens on
    `metrics_host` (localhost by default: it names every pool and worker).

    Limits: `max_message_bytes` is gRPC's receive and send limit (a larger
    message gets RESOURCE_EXHAUSTED), `max_body_bytes` the HTTP request body
    limit (413). An HTTP connection must send its request headers within
    `header_timeout_s` and its body within `body_timeout_s` (408), and is
    closed after `idle_timeout_s` without a request.

    `drain_timeout_s`: on SIGINT/SIGTERM the server stops accepting and lets
    running streams finish for at most this long. `tls_cert_file` and
    `tls_key_file` (PEM, both or neither) turn on TLS for gRPC and HTTP.

    `ingress_replicas` Serve replicas of the ingress share these ports
    (SO_REUSEPORT). With `ingress_max_replicas` above it, Serve autoscales
    the ingress between the two on its open streams: about
    `ingress_target_streams` per replica, scaling up after
    `ingress_upscale_delay_s` and down after `ingress_downscale_delay_s`
    above or below target; a replica that goes drains first
    (`drain_timeout_s`).
    """

    host: str = "0.0.0.0"
    grpc_port: int = 50051
    http_port: int | None = DEFAULT_HTTP_PORT
    metrics_host: str = "127.0.0.1"
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    max_body_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    idle_timeout_s: float = 60.0
    drain_timeout_s: float = 30.0
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    ingress_replicas: int = 1
    ingress_max_replicas: int | None = None
    ingress_target_streams: int = 64
    ingress_upscale_delay_s: float = 10.0
    ingress_downscale_delay_s: float = 300.0

    def __post_init__(self) -> None:
        _at_least("ingress_replicas", self.ingress_replicas, 1)
        if self.ingress_max_replicas is not None and self.ingress_max_replicas < self.ingress_replicas:
            _fail(
                "ingress_max_replicas",
                f"must be >= ingress_replicas ({self.ingress_replicas}), got {self.ingress_max_replicas}",
            )
        _at_least("ingress_target_streams", self.ingress_target_streams, 1)
        _at_least("ingress_upscale_delay_s", self.ingress_upscale_delay_s, 0)
        _at_least("ingress_downscale_delay_s", self.ingress_downscale_delay_s, 0)
        for name in ("grpc_port", "http_port"):
            port = getattr(self, name)
            if port is not None and not 0 <= port <= 65535:
                _fail(name, f"must be in [0, 65535], got {port}")
        if self.http_port and self.http_port == self.grpc_port:
            _fail("http_port", f"must differ from grpc_port, both are {self.grpc_port}")
        for name in ("max_message_bytes", "max_body_bytes"):
            # Below 1 KiB not even a small request fits; gRPC takes a signed 32-bit limit.
            value = getattr(self, name)
            if not 1024 <= value < 2**31:
                _fail(name, f"must be in [1024, 2**31), got {value}")
        for name in ("header_timeout_s", "body_timeout_s", "idle_timeout_s"):
            if not getattr(self, name) > 0:
                _fail(name, f"must be > 0, got {getattr(self, name)}")
        _at_least("drain_timeout_s", self.drain_timeout_s, 0)
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            _fail("tls_key_file", "give both tls_cert_file and tls_key_file, or neither")
        for name in ("tls_cert_file", "tls_key_file"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                _fail(name, f"no such file: {path}")

    @property
    def tls(self) -> bool:
        """True when gRPC and HTTP serve TLS."""
        return self.tls_cert_file is not None


@dataclass(frozen=True)
class ClusterConfig:
    """The whole serving cluster: pools of workers, tenants, router and scheduler."""

    pools: tuple[PoolConfig, ...]
    tenants: tuple[TenantConfig, ...] = ()
    router: RouterConfig = field(default_factory=RouterConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    server: ServerConfig = field(default_factory=ServerConfig)

    def __post_init__(self) -> None:
        if not self.pools:
            _fail("pools", "must list at least one pool")
        seen: dict[str, int] = {}
        for i, pool in enumerate(self.pools):
            if pool.name in seen:
                _fail(f"pools[{i}].name", f"duplicate pool name {pool.name!r} (also pools[{seen[pool.name]}])")
            seen[pool.name] = i
        if not self.tenants:
            # No tenants configured: one open tenant on the first pool.
            object.__setattr__(self, "tenants", (TenantConfig("default", self.pools[0].name),))
        names: set[str] = set()
        keys: set[str] = set()
        keyless: list[str] = []
        for i, tenant in enumerate(self.tenants):
            if tenant.name in names:
                _fail(f"tenants[{i}].name", f"duplicate tenant name {tenant.name!r}")
            names.add(tenant.name)
            if tenant.pool not in seen:
                _fail(f"tenants[{i}].pool", f"unknown pool {tenant.pool!r} (pools: {', '.join(seen)})")
            if tenant.api_key is None:
                keyless.append(tenant.name)
            elif tenant.api_key in keys:
                _fail(f"tenants[{i}].api_key", "two tenants share this API key")
            else:
                keys.add(tenant.api_key)
        if len(keyless) > 1:
            _fail("tenants", f"at most one tenant may have no API key, got {', '.join(keyless)}")
        if self.scheduler.shards > len(self.pools):
            _fail(
                "scheduler.shards",
                f"must be <= the number of pools ({len(self.pools)}): a shard owns whole pools, "
                f"got {self.scheduler.shards}",
            )

    def scheduler_shards(self) -> dict[str, int]:
        """Pool name -> the scheduler shard that owns it (0 for every pool with one shard).

        Balanced by workers, since a shard's load is its workers' pushes: the
        largest pool first (config order on ties) goes to the shard with the
        fewest workers so far (the lowest index on ties). Deterministic, so the
        workers and every ingress replica agree without asking anyone.
        """
        load = [0] * self.scheduler.shards
        owner: dict[str, int] = {}
        for pool in sorted(self.pools, key=lambda p: -p.workers):  # stable: config order on ties
            shard = min(range(len(load)), key=lambda i: load[i])
            owner[pool.name] = shard
            load[shard] += pool.workers
        return {pool.name: owner[pool.name] for pool in self.pools}

    # loading ---------------------------------------------------------------------------

    @classmethod
    def from_yaml(cls, path: str | Path) -> ClusterConfig:
        """Load and validate a YAML file; raises ConfigError naming the bad field."""
        path = Path(path)
        try:
            data = yaml.safe_load(path.read_text())
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ClusterConfig:
        """Build from plain data (parsed YAML/JSON); raises ConfigError naming the bad field."""
        _check_keys(data, ("pools", "tenants", "router", "scheduler", "server"), "")
        raw_pools = data.get("pools")
        if not isinstance(raw_pools, list):
            _fail("pools", f"must be a list of pools, got {type(raw_pools).__name__}")
        pools = tuple(
            _build(PoolConfig, _with_bytes(p, f"pools[{i}]"), f"pools[{i}]")
            for i, p in enumerate(raw_pools)
        )
        raw_tenants = data.get("tenants") or []
        if not isinstance(raw_tenants, list):
            _fail("tenants", f"must be a list of tenants, got {type(raw_tenants).__name__}")
        tenants = tuple(
            _build(TenantConfig, _with_env_key(t, f"tenants[{i}]"), f"tenants[{i}]")
            for i, t in enumerate(raw_tenants)
        )
        return cls(
            pools=pools,
            tenants=tenants,
            router=_build(RouterConfig, data.get("router") or {}, "router"),
            scheduler=_build(SchedulerConfig, data.get("scheduler") or {}, "scheduler"),
            server=_build(ServerConfig, _with_bytes(data.get("server") or {}, "server"), "server"),
        )

    @classmethod
    def default(cls, model: str = "tiny", workers: int = 2) -> ClusterConfig:
        """One pool ``default`` of `workers` CPU-or-GPU workers and one open tenant."""
        try:
            return cls(pools=(PoolConfig("default", model=model, workers=workers),))
        except ConfigError as exc:
            raise ConfigError(f"pools[0].{exc}") from exc

    def with_overrides(self, *, model: str | None = None, workers: int | None = None) -> ClusterConfig:
        """Apply the CLI's --model / --workers to every pool (validated again)."""
        changes: dict[str, Any] = {}
        if model is not None:
            changes["model"] = model
        if workers is not None:
            changes["workers"] = workers
        if not changes:
            return self
        pools = []
        for i, pool in enumerate(self.pools):
            try:
                pools.append(dataclasses.replace(pool, **changes))
            except ConfigError as exc:
                raise ConfigError(f"pools[{i}].{exc}") from exc
        return dataclasses.replace(self, pools=tuple(pools))

    # lookups ---------------------------------------------------------------------------

    def pool(self, name: str) -> PoolConfig:
        """The pool called `name` (KeyError if none)."""
        for pool in self.pools:
            if pool.name == name:
                return pool
        raise KeyError(f"unknown pool {name!r}")

    def tenant(self, name: str) -> TenantConfig:
        """The tenant called `name` (KeyError if none)."""
        for tenant in self.tenants:
            if tenant.name == name:
                return tenant
        raise KeyError(f"unknown tenant {name!r}")

    def tenant_for_api_key(self, key: str | None) -> TenantConfig | None:
        """The tenant this key authenticates; no key means the keyless tenant, if any.

        With no keyed tenant at all, any key (or none) is the open tenant, so
        clients that must send some key (the `openai` package) work unchanged.
        """
        if not key or all(t.api_key is None for t in self.tenants):
            return next((t for t in self.tenants if t.api_key is None), None)
        encoded = key.encode()
        match = None
        for tenant in self.tenants:
            # Compare against every key in constant time: no early exit to time.
            if tenant.api_key is not None and hmac.compare_digest(tenant.api_key.encode(), encoded):
                match = tenant
        return match

    def tenant_block_caps(self) -> tuple[tuple[str, int], ...]:
        """``(salt, max_live_blocks)`` of each capped tenant (`EngineConfig.tenant_max_live_blocks`)."""
        return tuple(
            (t.cache_salt(), t.max_live_blocks) for t in self.tenants if t.max_live_blocks is not None
        )

    def visible_pools(self, tenant: TenantConfig | None) -> list[str]:
        """Pools a tenant may see and use: its own when keys are required, else all.

        Every lookup (GetStatus, /v1/models, a request's pool) answers a pool outside
        this list exactly like an unknown one.
        """
        if tenant is not None and self.auth_required:
            return [tenant.pool]
        return [p.name for p in self.pools]

    @property
    def auth_required(self) -> bool:
        """True when every tenant has an API key (requests without one are refused)."""
        return all(t.api_key is not None for t in self.tenants)


# building dataclasses from untrusted data -----------------------------------------------


def _check_keys(data: Mapping[str, Any], known: typing.Iterable[str], path: str) -> None:
    known = tuple(known)
    for key in data:
        if key not in known:
            where = f"{path}.{key}" if path else str(key)
            _fail(where, f"unknown field (known: {', '.join(known)})")


def _with_bytes(raw: Any, path: str) -> Any:
    if not isinstance(raw, Mapping):
        return raw
    data = dict(raw)
    if "kv_memory" in data:  # friendlier spelling in YAML
        if "kv_memory_bytes" in data:
            _fail(f"{path}.kv_memory", "give kv_memory or kv_memory_bytes, not both")
        data["kv_memory_bytes"] = data.pop("kv_memory")
    if "kv_offload" in data:
        if "kv_offload_bytes" in data:
            _fail(f"{path}.kv_offload", "give kv_offload or kv_offload_bytes, not both")
        data["kv_offload_bytes"] = data.pop("kv_offload")
    for name in (
        "kv_memory_bytes", "swap_space_bytes", "kv_offload_bytes", "max_message_bytes", "max_body_bytes"
    ):
        if isinstance(data.get(name), str):
            try:
                data[name] = parse_bytes(data[name])
            except ValueError as exc:
                _fail(f"{path}.{name}", str(exc))
    return data


def _with_env_key(raw: Any, path: str) -> Any:
    if not isinstance(raw, Mapping) or raw.get("api_key_env") is None:
        return raw
    data = dict(raw)
    env = data["api_key_env"]
    if data.get("api_key") is not None:
        _fail(f"{path}.api_key_env", "give api_key or api_key_env, not both")
    value = os.environ.get(str(env))
    if not value:
        _fail(f"{path}.api_key_env", f"environment variable {env} is not set")
    data["api_key"] = value
    return data


def _build(cls: type[_T], raw: Any, path: str) -> _T:
    """cls(**raw) with unknown keys, wrong types and validation errors reported at `path`."""
    if not isinstance(raw, Mapping):
        _fail(path, f"must be a mapping, got {type(raw).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    _check_keys(raw, fields, path)
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for key, value in raw.items():
        values[key] = _coerce(value, hints[key], f"{path}.{key}")
    missing = [
        name
        for name, f in fields.items()
        if name not in values
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        _fail(f"{path}.{missing[0]}", "is required")
    try:
        return cls(**values)
    except ConfigError as exc:
        raise ConfigError(f"{path}.{exc}") from exc
    except ValueError as exc:  # RouterConfig and others use "field: reason" ValueErrors
        raise ConfigError(f"{path}.{exc}") from exc


def _coerce(value: Any, hint: Any, path: str) -> Any:
    """Check a YAML scalar against a field's type; ints are accepted where floats are."""
    allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if value is None:
        if type(None) in allowed:
            return None
        _fail(path, "must not be null")
    for typ in allowed:
        if typing.get_origin(typ) is dict and isinstance(value, Mapping):
            return dict(value)  # node_labels: __post_init__ checks the entries
        if typ is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if typ is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if typ is bool and isinstance(value, bool):
            return value
        if typ is str and isinstance(value, str):
            return value
    names = " or ".join(getattr(t, "__name__", str(t)) for t in allowed if t is not type(None))
    _fail(path, f"must be {names}, got {type(value).__name__} {value!r}")
