"""Cluster configuration: pools, tenants, router and scheduler settings, from YAML.

One pydantic model per section, frozen, unknown fields refused, validated
once at load: every error names the field's path and the reason, e.g.
``pools[0].workers: must be >= 1, got 0``, so `pagefleet serve` fails at start
instead of a worker failing later (`pagefleet serve --config F --check` stops
there). Byte fields read any `ByteSize` spelling ("512MiB", "8G", "2GB", 4096).

```yaml
server: {grpc_port: 50051, http_port: 8000}
router: {policy: prefix_affinity, w_prefill: 1.0, w_load: 1.0}
scheduler: {report_timeout_s: 3.0, wait_queue_size: 256, admission: full}
pools:
  - {name: chat, model: tiny, workers: 2, block_size: 16, kv_memory: 512MiB}
tenants:
  - {name: acme, pool: chat, api_key_env: ACME_API_KEY}
```

A pool's engine settings (everything of `EngineConfig` but the device and the
tenant caps, which the cluster sets per worker) sit flat beside the pool's own
fields and are held as its `engine`; `EngineConfig` checks them, and its
errors are reported at the pool's path.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    TypeAdapter,
    ValidationError,
    field_serializer,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import ErrorDetails
from typing_extensions import Self

from pagefleet.scheduler.autoscale import AutoscalePolicy
from pagefleet.scheduler.policy import AdmissionMode, EvictionWatermarks, MigrationPolicy
from pagefleet.scheduler.session_pins import DEFAULT_MAX_PER_POOL
from pagefleet.worker.config import EngineConfig, InvalidField
from pagefleet.worker.sizes import ByteSize

MIN_API_KEY_CHARS = 16  # a shorter key is guessable

RoutingPolicy = Literal["prefix_affinity", "round_robin", "least_loaded", "power_of_two"]
ROUTING_POLICIES: tuple[str, ...] = get_args(RoutingPolicy)

DEFAULT_HTTP_PORT = 8000
# `pagefleet scale` / `Membership`: how long a new worker may take to be placed and load,
# and how long a removed worker's streams get to finish before they fail over.
DEFAULT_WORKER_ADD_TIMEOUT_S = 300.0
DEFAULT_WORKER_DRAIN_TIMEOUT_S = 60.0
DEFAULT_MAX_MESSAGE_BYTES = 4 * 2**20
# Completions per request (`n`): each is a sequence decoding in the worker's batch, so
# one request must not take the batch over. `server.max_n` may raise it up to MAX_N.
DEFAULT_MAX_N = 16
MAX_N = 128


class ConfigError(ValueError):
    """An invalid cluster config; the message starts with the field's path."""


# field types ------------------------------------------------------------------------------


def check_port(value: int) -> int:
    """The rule of every port in the config (`Port`), also the CLI's port flags': 0 (a free
    port) to 65535; ValueError otherwise."""
    if not 0 <= value <= 65535:
        raise ValueError(f"must be in [0, 65535], got {value}")
    return value


def _message_limit(value: int) -> int:
    # Below 1 KiB not even a small request fits; gRPC takes a signed 32-bit limit.
    if not 1024 <= value < 2**31:
        raise ValueError(f"must be in [1024, 2**31), got {value}")
    return value


def _header_name(value: str) -> str:
    # gRPC metadata keys are lowercase tokens, and "-bin" ones carry bytes, not text.
    name = value.lower()
    if not name or not all(c.isascii() and (c.isalnum() or c in "-_.") for c in name):
        raise ValueError(f"must be a header name (letters, digits, '-', '_', '.'), got {value!r}")
    if name.endswith("-bin") or name.startswith("grpc-"):
        raise ValueError(f"must not end in '-bin' nor start with 'grpc-' (gRPC reserves them), got {value!r}")
    return name


NonEmptyStr = Annotated[str, Field(min_length=1)]
Port = Annotated[int, AfterValidator(check_port)]
PoolSize = Annotated[int, Field(ge=1)]  # workers of a pool: it keeps at least one
MessageBytes = Annotated[ByteSize, AfterValidator(_message_limit)]
# Non-negative seconds, and seconds that must pass at all.
Seconds = Annotated[float, Field(ge=0)]
PositiveSeconds = Annotated[float, Field(gt=0)]


# the sections' common ground -------------------------------------------------------------


class Section(BaseModel):
    """A config section: typed fields, frozen, unknown fields refused.

    `from_data` (and every loader built on it) raises ConfigError whose
    message starts with the bad field's path; the constructor raises
    pydantic's ValidationError (a ValueError too).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    @classmethod
    def from_data(cls, data: Any, *, noun: str = "field") -> Self:
        """Validate plain data (parsed YAML/JSON); ConfigError names the bad field."""
        try:
            return cls.model_validate(dict(data) if isinstance(data, Mapping) else data)
        except ValidationError as exc:
            raise ConfigError(describe(exc, cls, noun)) from None

    @classmethod
    def yaml_fields(cls) -> tuple[str, ...]:
        """The names this section takes in YAML."""
        return tuple(cls.model_fields)

    def field_values(self) -> dict[str, Any]:
        """`{field: value}` of this section, as held (nested sections as objects)."""
        return {name: getattr(self, name) for name in type(self).model_fields}

    def replace(self, **changes: Any) -> Self:
        """A copy with `changes`, validated like the original (`model_copy` is not).

        A mapping given for a nested section updates that section's fields:
        ``config.replace(server={"http_port": None})``.
        """
        values = self.field_values()
        for name, change in changes.items():
            current = values.get(name)
            if isinstance(change, Mapping) and isinstance(current, Section):
                change = {**current.field_values(), **change}
            values[name] = change
        return self.from_data(values)


def describe(exc: ValidationError, root: type[Section] | None = None, noun: str = "field") -> str:
    """The first error of `exc` as one line: the YAML path, a colon, the reason.

    ``("pools", 0, "workers")`` reads ``pools[0].workers``. A rule that names
    another field than the one it ran on (`InvalidField`, e.g. the engine's
    checks or a cross-field rule) is reported at that field.
    """
    error = exc.errors()[0]
    loc = [part for part in error["loc"] if not _is_union_tag(part)]
    cause = (error.get("ctx") or {}).get("error")
    if isinstance(cause, InvalidField):
        loc.append(cause.field)
        reason = cause.reason
    else:
        reason = _reason(error, root, loc, noun)
    path = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".")
    return f"{path}: {reason}" if path else reason


def _is_union_tag(part: str | int) -> bool:
    # pydantic names the member of a union it tried (`str`, `is-instance[Path]`) in the loc.
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool"))


_TYPE_NAMES = {
    "int_type": "int", "float_type": "float", "bool_type": "bool", "string_type": "str",
    "tuple_type": "a list", "list_type": "a list", "model_type": "a mapping",
    "dict_type": "a mapping", "dataclass_type": "a mapping", "model_attributes_type": "a mapping",
}  # fmt: skip
_BOUNDS = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}
_BOUND_KEYS = {">=": "ge", ">": "gt", "<=": "le", "<": "lt"}


def _reason(error: ErrorDetails, root: type[Section] | None, loc: list[Any], noun: str) -> str:
    kind, value, ctx = error["type"], error.get("input"), error.get("ctx") or {}
    if kind == "missing":
        return "is required"
    if kind in ("extra_forbidden", "unexpected_keyword_argument"):
        known = _known_fields(root, loc)
        return f"unknown {noun}" + (f" (known: {', '.join(known)})" if known else "")
    if kind in _BOUNDS:
        op = _BOUNDS[kind]
        bound = ctx[_BOUND_KEYS[op]]
        if isinstance(bound, float) and bound.is_integer():
            bound = int(bound)  # `>= 0` for a float field's `ge=0`, as written
        return f"must be {op} {bound}, got {value}"
    if kind == "literal_error":
        expected = str(ctx["expected"]).replace("'", "").replace(" or ", ", ")
        return f"must be one of {expected}, got {value!r}"
    if kind == "string_too_short":
        return "must not be empty"
    if kind == "finite_number":
        return f"must be a finite number, got {value}"
    if kind in _TYPE_NAMES:
        if value is None:
            return f"must be {_TYPE_NAMES[kind]}, not null"
        got = type(value).__name__
        if isinstance(value, (str, int, float, bool)):
            got += f" {value!r}"
        return f"must be {_TYPE_NAMES[kind]}, got {got}"
    if kind in ("value_error", "assertion_error") and "error" in ctx:
        return str(ctx["error"])
    return str(error["msg"])


def _known_fields(root: type[Section] | None, loc: list[Any]) -> tuple[str, ...]:
    """The YAML fields of the section that holds `loc`'s last part."""
    model = root
    for part in loc[:-1]:
        if isinstance(part, int) or model is None:
            continue
        field = model.model_fields.get(part)
        if field is None:
            return ()
        types = (field.annotation, *get_args(field.annotation))
        model = next((t for t in types if isinstance(t, type) and issubclass(t, Section)), None)
    return () if model is None else model.yaml_fields()


# sections ----------------------------------------------------------------------------------


class RouterConfig(Section):
    """Routing policy and cost weights (see `pagefleet.cluster.router`)."""

    policy: RoutingPolicy = "prefix_affinity"
    w_prefill: Annotated[float, Field(ge=0)] = 1.0
    w_load: Annotated[float, Field(ge=0)] = 0.25
    w_queue: Annotated[float, Field(ge=0)] = 8.0
    # The guard is per candidate: only the overloaded worker loses its affinity,
    # the rest of the fleet keeps routing by prefix.
    imbalance_ratio: Annotated[float, Field(ge=1.0)] = 1.5
    imbalance_slack_blocks: Annotated[int, Field(ge=0)] = 64
    speculative_ttl_s: Seconds = 2.0
    # Share of a prefill that a hit in a worker's offload tier saves (0: none, 1: a pool hit).
    offload_credit: Annotated[float, Field(ge=0, le=1)] = 0.5
    # What loading a LoRA adapter into a worker's slot costs, in prefilled blocks.
    w_adapter_load: Annotated[float, Field(ge=0)] = 8.0
    # Tell the other ingress replicas of every routing decision (see the router's docstring).
    share_routes: bool = True
    # Session affinity: the request header (HTTP) / metadata key (gRPC) naming a session,
    # how long a session's pin to its worker lasts unused, and how many pins a pool keeps.
    session_header: Annotated[str, AfterValidator(_header_name)] = "x-session-id"
    session_ttl_s: PositiveSeconds = 600.0
    session_max_pins: Annotated[int, Field(ge=1)] = DEFAULT_MAX_PER_POOL


# The engine settings a pool's YAML may set: all of EngineConfig's but those the
# cluster sets for each worker (its device from the pool's, the tenants' caps).
_SET_PER_WORKER = ("device", "tenant_max_live_blocks")
ENGINE_FIELDS = tuple(f.name for f in dataclasses.fields(EngineConfig) if f.name not in _SET_PER_WORKER)
# JSON mode: strict types where YAML gives lists and mappings (python mode would want tuples
# and EngineConfig instances).
_ENGINE = TypeAdapter(EngineConfig)
# Friendlier YAML spellings of byte fields.
_SHORT_NAMES = {"kv_memory": "kv_memory_bytes", "kv_offload": "kv_offload_bytes"}


class PoolConfig(Section):
    """A named group of identical workers serving one model.

    The pool's own fields are `name`, `workers`, `device` (auto: cuda where
    the worker gets a GPU) and `num_gpus_per_worker`; every other field is an
    engine setting (`EngineConfig`: model, block_size, num_kv_blocks,
    kv_memory, max_model_len, ...), held as `engine`.
    """

    name: NonEmptyStr
    workers: PoolSize = 1
    device: Literal["auto", "cpu", "cuda"] = "auto"
    num_gpus_per_worker: Annotated[float | None, Field(ge=0)] = None
    # Ray labels a node must carry to host this pool's workers (`ray start --labels`).
    node_labels: Annotated[dict[str, str], Field(strict=False)] = Field(default_factory=dict)
    # Autoscaling bounds (None: `workers`, a fixed size).
    min_workers: PoolSize | None = None
    max_workers: PoolSize | None = None
    engine: EngineConfig = EngineConfig()

    @field_validator("node_labels", mode="before")
    @classmethod
    def _label_entries(cls, labels: Any) -> Any:
        if not isinstance(labels, Mapping):
            raise ValueError(f"must be dict, got {type(labels).__name__} {labels!r}")
        for key, value in labels.items():
            if not (isinstance(key, str) and key and isinstance(value, str) and value):
                raise ValueError(f"keys and values must be non-empty strings, got {key!r}: {value!r}")
        return dict(labels)

    @model_validator(mode="after")
    def _bounds_around_workers(self) -> Self:
        low, high = self.worker_bounds()
        if not low <= self.workers <= high:
            raise InvalidField(
                "max_workers",
                f"need 1 <= min_workers <= workers <= max_workers, got {low}, {self.workers}, {high}",
            )
        return self

    def worker_bounds(self) -> tuple[int, int]:
        """(min_workers, max_workers), each `workers` when unset: a fixed size."""
        low = self.workers if self.min_workers is None else self.min_workers
        return low, self.workers if self.max_workers is None else self.max_workers

    @model_validator(mode="before")
    @classmethod
    def _gather_engine_settings(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        data = dict(data)
        for short, name in _SHORT_NAMES.items():
            if short in data:
                if name in data:
                    raise InvalidField(short, f"give {short} or {name}, not both")
                data[name] = data.pop(short)
        engine = data.pop("engine", None)  # an EngineConfig when a pool is copied (`replace`)
        if engine is not None and not isinstance(engine, EngineConfig):
            raise InvalidField("engine", "unknown field: engine settings sit flat in the pool")
        settings = {} if engine is None else {k: getattr(engine, k) for k in ENGINE_FIELDS}
        settings.update({k: data.pop(k) for k in ENGINE_FIELDS if k in data})
        data["engine"] = _ENGINE.validate_json(json.dumps(settings, default=str))
        return data

    @model_serializer(mode="wrap")
    def _flat(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        engine = data.pop("engine")
        return {"name": data.pop("name"), **{k: engine[k] for k in ENGINE_FIELDS}, **data}

    @classmethod
    def yaml_fields(cls) -> tuple[str, ...]:
        own = tuple(name for name in cls.model_fields if name != "engine")
        return own + ENGINE_FIELDS + tuple(_SHORT_NAMES)


class TenantConfig(Section):
    """A client identity: its pool, its prefix-cache salt and its API key.

    `weight` is the tenant's share of a shared pool's wait queue, relative to
    the other tenants of that pool: its part of `scheduler.wait_queue_size`
    and of the dispatch order (weighted fair queueing). `max_live_blocks`
    optionally caps the live KV blocks the tenant may hold on each worker.
    `api_key_env` names the environment variable that holds the key (read
    at load). `adapters` limits the tenant to these LoRA adapters of the pools
    it may use (None: all of them); another adapter answers like an unknown one.
    """

    name: NonEmptyStr
    pool: str
    salt: NonEmptyStr | None = None
    api_key: str | None = None
    api_key_env: str | None = None
    weight: float = 1.0
    max_live_blocks: Annotated[int | None, Field(ge=1)] = None
    adapters: Annotated[tuple[NonEmptyStr, ...] | None, Field(strict=False)] = None

    def may_use_adapter(self, name: str) -> bool:
        """Whether this tenant may select the LoRA adapter `name` (of a pool it may use)."""
        return self.adapters is None or name in self.adapters

    @model_validator(mode="before")
    @classmethod
    def _read_api_key_env(cls, data: Any) -> Any:
        if not isinstance(data, Mapping) or data.get("api_key_env") is None:
            return data
        if data.get("api_key") is not None:
            raise InvalidField("api_key_env", "give api_key or api_key_env, not both")
        env = data["api_key_env"]
        value = os.environ.get(str(env))
        if not value:
            raise InvalidField("api_key_env", f"environment variable {env} is not set")
        return {**data, "api_key": value}

    @field_validator("weight")
    @classmethod
    def _finite_and_positive(cls, weight: float) -> float:
        if not 0 < weight < float("inf"):
            raise ValueError(f"must be a finite number > 0, got {weight}")
        return weight

    @field_serializer("api_key")
    def _hidden(self, api_key: str | None) -> str | None:
        return None if api_key is None else "<hidden>"

    @field_validator("api_key")
    @classmethod
    def _long_enough(cls, api_key: str | None) -> str | None:
        if api_key is not None and len(api_key.strip()) < MIN_API_KEY_CHARS:
            raise ValueError(
                f"must be at least {MIN_API_KEY_CHARS} characters besides spaces, got "
                f"{len(api_key.strip())} (omit it for a tenant without a key)"
            )
        return api_key

    def cache_salt(self) -> str:
        """The prefix-cache salt router and workers must both use for this tenant.

        Set by the server, never by the client, so one tenant cannot hit (or
        time) another tenant's cached blocks.
        """
        return self.salt if self.salt is not None else f"tenant:{self.name}"


class SchedulerConfig(Section):
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

    policy: Literal["watermark", "none"] = "watermark"
    report_interval_s: PositiveSeconds = 0.5
    report_timeout_s: float = 3.0
    wait_queue_size: Annotated[int, Field(ge=0)] = 256
    evict_low_watermark: float = 0.05
    evict_high_watermark: float = 0.10
    # A worker with work that computes no token this long leaves routing (hung), unless it
    # still reports from inside a step that has run less than 20 times this.
    stall_timeout_s: PositiveSeconds = 3.0
    # How often each worker's index is compared with a snapshot (index drift metric).
    index_check_interval_s: PositiveSeconds = 10.0
    shards: Annotated[int, Field(ge=1)] = 1
    admission: AdmissionMode = "full"
    admission_overcommit: float = 1.0
    replica_aware_eviction: bool = True
    migration: bool = True
    migration_margin_blocks: Annotated[int, Field(ge=0)] = 4
    migration_cooldown_s: Seconds = 10.0
    migration_transfer: bool | Literal["auto"] = "auto"
    # Pools with min_workers < max_workers: grow after this long short of blocks
    # (allocatable below the fraction) with requests waiting, shrink after this long idle.
    autoscale_free_fraction: Annotated[float, Field(ge=0, le=1)] = 0.1
    autoscale_out_after_s: Seconds = 10.0
    autoscale_in_after_s: Seconds = 60.0
    autoscale_cooldown_s: Seconds = 30.0

    @field_validator("admission_overcommit")
    @classmethod
    def _overcommit_factor(cls, factor: float) -> float:
        if not 1.0 <= factor <= 100.0:
            raise ValueError(f"must be a factor from 1.0 (never overcommit) to 100, got {factor}")
        return factor

    @field_validator("migration_transfer", mode="before")
    @classmethod
    def _transfer_choice(cls, value: Any) -> Any:
        if value is not True and value is not False and value != "auto":
            raise ValueError(f"must be true, false or 'auto', got {value!r}")
        return value

    @model_validator(mode="after")
    def _timeouts_and_watermarks(self) -> Self:
        if not self.report_timeout_s > self.report_interval_s:
            raise InvalidField(
                "report_timeout_s",
                f"must be > report_interval_s ({self.report_interval_s}), got {self.report_timeout_s}",
            )
        if not 0.0 <= self.evict_low_watermark <= self.evict_high_watermark <= 1.0:
            raise InvalidField(
                "evict_high_watermark",
                "need 0 <= evict_low_watermark <= evict_high_watermark <= 1, got "
                f"{self.evict_low_watermark} and {self.evict_high_watermark}",
            )
        return self

    @property
    def heartbeat_s(self) -> float:
        """How often an idle worker pushes when nothing changed: a third of
        `report_timeout_s`, and never more often than `report_interval_s`."""
        return max(self.report_interval_s, self.report_timeout_s / 3)

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


class ServerConfig(Section):
    """Where the ingress listens, and the limits it enforces before doing any work.

    `grpc_port` serves `pagefleet.v1.Generation`; `http_port` the OpenAI HTTP
    API (`null` disables it). Port 0 picks a free port. `/metrics` listens on
    `metrics_host` (localhost by default: it names every pool and worker).

    Limits: `max_message_bytes` is gRPC's receive and send limit (a larger
    message gets RESOURCE_EXHAUSTED), `max_body_bytes` the HTTP request body
    limit (413). An HTTP connection must send its request headers within
    `header_timeout_s` and its body within `body_timeout_s` (408), and is
    closed after `idle_timeout_s` without a request. `max_n`: the most completions
    one request may ask for (`n`, HTTP `best_of`; INVALID_ARGUMENT above it).

    `drain_timeout_s`: on SIGINT/SIGTERM/SIGHUP the server stops accepting and lets
    running streams finish for at most this long. `health_details`: HTTP
    `/health` lists live workers per pool to anyone (default: only to a tenant's
    key, its own pools; without a key it says serving or not). `tls_cert_file` and
    `tls_key_file` (PEM, both or neither) turn on TLS for gRPC and HTTP.

    `gcs_fault_tolerance`: the Ray cluster's GCS keeps its tables in an external
    Redis (its head started with `RAY_REDIS_ADDRESS`; KubeRay's
    `gcsFaultToleranceOptions`) and is restarted when it dies, so a lost GCS is a
    pause: the ingress and `pagefleet serve` serve on for up to Ray's reconnect
    timeout less 5 s (`RAY_gcs_rpc_server_reconnect_timeout_s`, default 60 s).
    Without it (the default) a lost GCS is the cluster's end: health turns
    NOT_SERVING within seconds and `pagefleet serve` exits 1. Needs a joined
    cluster (`--address`, or a Serve application): nothing restarts the GCS of a
    Ray that `pagefleet serve` starts itself.

    `ingress_replicas` Serve replicas of the ingress share these ports
    (SO_REUSEPORT). With `ingress_max_replicas` above it, Serve autoscales
    the ingress between the two on its open streams: about
    `ingress_target_streams` per replica, scaling up after
    `ingress_upscale_delay_s` and down after `ingress_downscale_delay_s`
    above or below target; a replica that goes drains first
    (`drain_timeout_s`).
    """

    host: str = "0.0.0.0"
    grpc_port: Port = 50051
    http_port: Port | None = DEFAULT_HTTP_PORT
    metrics_host: str = "127.0.0.1"
    max_message_bytes: MessageBytes = DEFAULT_MAX_MESSAGE_BYTES
    max_body_bytes: MessageBytes = DEFAULT_MAX_MESSAGE_BYTES
    header_timeout_s: PositiveSeconds = 10.0
    body_timeout_s: PositiveSeconds = 30.0
    idle_timeout_s: PositiveSeconds = 60.0
    drain_timeout_s: Seconds = 30.0
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    ingress_replicas: Annotated[int, Field(ge=1)] = 1
    ingress_max_replicas: int | None = None
    ingress_target_streams: Annotated[int, Field(ge=1)] = 64
    ingress_upscale_delay_s: Seconds = 10.0
    ingress_downscale_delay_s: Seconds = 300.0
    health_details: bool = False
    gcs_fault_tolerance: bool = False
    max_n: Annotated[int, Field(ge=1, le=MAX_N)] = DEFAULT_MAX_N

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.ingress_max_replicas is not None and self.ingress_max_replicas < self.ingress_replicas:
            raise InvalidField(
                "ingress_max_replicas",
                f"must be >= ingress_replicas ({self.ingress_replicas}), got {self.ingress_max_replicas}",
            )
        if self.http_port and self.http_port == self.grpc_port:
            raise InvalidField("http_port", f"must differ from grpc_port, both are {self.grpc_port}")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise InvalidField("tls_key_file", "give both tls_cert_file and tls_key_file, or neither")
        for name in ("tls_cert_file", "tls_key_file"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise InvalidField(name, f"no such file: {path}")
        return self

    @property
    def tls(self) -> bool:
        """True when gRPC and HTTP serve TLS."""
        return self.tls_cert_file is not None


_SECTIONS = ("tenants", "router", "scheduler", "server")


class ClusterConfig(Section):
    """The whole serving cluster: pools of workers, tenants, router and scheduler."""

    # Lists in YAML, tuples here (strict=False: a list is accepted for the tuple).
    pools: Annotated[tuple[PoolConfig, ...], Field(strict=False)]
    tenants: Annotated[tuple[TenantConfig, ...], Field(strict=False)] = ()
    router: RouterConfig = RouterConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    server: ServerConfig = ServerConfig()

    @model_validator(mode="before")
    @classmethod
    def _fill_defaults(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        # An empty section (`router:` with nothing under it) is the default one.
        data = {k: v for k, v in data.items() if not (k in _SECTIONS and v is None)}
        pools = data.get("pools")
        if not isinstance(pools, (list, tuple)):
            got = "nothing" if pools is None else type(pools).__name__
            raise InvalidField("pools", f"must be a list of pools, got {got}")
        if not pools:
            raise InvalidField("pools", "must list at least one pool")
        if not data.get("tenants"):
            # No tenants configured: one open tenant on the first pool.
            first = pools[0]
            name = first.name if isinstance(first, PoolConfig) else (
                first.get("name") if isinstance(first, Mapping) else None
            )
            if isinstance(name, str):
                data["tenants"] = ({"name": "default", "pool": name},)
        return data

    @model_validator(mode="after")
    def _names_keys_and_shards(self) -> Self:
        seen: dict[str, int] = {}
        for i, pool in enumerate(self.pools):
            if pool.name in seen:
                raise InvalidField(
                    f"pools[{i}].name", f"duplicate pool name {pool.name!r} (also pools[{seen[pool.name]}])"
                )
            seen[pool.name] = i
        adapters = {name for pool in self.pools for name in pool.engine.adapter_dirs}
        for i, pool in enumerate(self.pools):
            for name in pool.engine.adapter_dirs:
                if name in seen:
                    # A request's `model` names a pool or an adapter: never both.
                    raise InvalidField(
                        f"pools[{i}].lora_adapters", f"adapter {name!r} has the name of a pool"
                    )
        names: set[str] = set()
        keys: set[str] = set()
        keyless: list[str] = []
        for i, tenant in enumerate(self.tenants):
            if tenant.name in names:
                raise InvalidField(f"tenants[{i}].name", f"duplicate tenant name {tenant.name!r}")
            names.add(tenant.name)
            if tenant.pool not in seen:
                raise InvalidField(
                    f"tenants[{i}].pool", f"unknown pool {tenant.pool!r} (pools: {', '.join(seen)})"
                )
            for name in tenant.adapters or ():
                if name not in adapters:
                    known = ", ".join(sorted(adapters)) or "none"
                    raise InvalidField(
                        f"tenants[{i}].adapters", f"unknown LoRA adapter {name!r} (pools serve: {known})"
                    )
            if tenant.api_key is None:
                keyless.append(tenant.name)
            elif tenant.api_key in keys:
                raise InvalidField(f"tenants[{i}].api_key", "two tenants share this API key")
            else:
                keys.add(tenant.api_key)
        if len(keyless) > 1:
            raise InvalidField("tenants", f"at most one tenant may have no API key, got {', '.join(keyless)}")
        if self.scheduler.shards > len(self.pools):
            raise InvalidField(
                "scheduler.shards",
                f"must be <= the number of pools ({len(self.pools)}): a shard owns whole pools, "
                f"got {self.scheduler.shards}",
            )
        return self

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
            mark = getattr(exc, "problem_mark", None)
            where = "" if mark is None else f" (line {mark.line + 1}, column {mark.column + 1})"
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise ConfigError(f"{path}: not valid YAML{where}: {problem}") from exc
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ClusterConfig:
        """Build from plain data (parsed YAML/JSON); raises ConfigError naming the bad field."""
        return cls.from_data(data)

    @classmethod
    def default(cls, model: str = "tiny", workers: int = 2) -> ClusterConfig:
        """One pool ``default`` of `workers` CPU-or-GPU workers and one open tenant."""
        return cls.from_data({"pools": [{"name": "default", "model": model, "workers": workers}]})

    def with_overrides(self, *, model: str | None = None, workers: int | None = None) -> ClusterConfig:
        """Apply the CLI's --model / --workers to every pool (validated again)."""
        changes = {name: value for name, value in (("model", model), ("workers", workers)) if value is not None}
        if not changes:
            return self
        return self.replace(pools=[{**pool.field_values(), **changes} for pool in self.pools])

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

    def tenant_block_caps(self) -> tuple[tuple[str, int], ...]:
        """``(salt, max_live_blocks)`` of each capped tenant (`EngineConfig.tenant_max_live_blocks`)."""
        return tuple(
            (t.cache_salt(), t.max_live_blocks) for t in self.tenants if t.max_live_blocks is not None
        )

