"""Wire formats that workers publish: load reports and KV events (msgpack, versioned).

Both messages are msgpack maps carrying ``v`` (the wire version) and ``kind``,
so one channel can carry either and a receiver can tell a peer of another
version from garbage. Decoding never trusts the bytes: any malformed input
raises :class:`EventDecodeError` (a ``ValueError``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, NamedTuple

import msgpack

if TYPE_CHECKING:  # the engine imports torch; this module stays light for the router
    from pagefleet.worker.engine import EngineStats

WIRE_VERSION = 1

_LOAD_KIND = "load"
_KV_KIND = "kv"
_KV_EVENT_TYPES = frozenset({"stored", "removed", "offload_stored", "offload_removed"})
# Wire op codes: the pool's events keep their original bytes; the offload tier's follow.
_KV_OPS = {"removed": 0, "stored": 1, "offload_removed": 2, "offload_stored": 3}
_KV_KINDS = {op: kind for kind, op in _KV_OPS.items()}
# LoadReport counters of the offload tier and of migration, by their field names.
_OFFLOAD_FIELDS = ("offload_blocks", "offload_hit_tokens", "offload_bytes_in", "offload_bytes_out")
_MIGRATION_FIELDS = ("kv_blocks_exported", "kv_blocks_imported", "kv_import_failures")
_TIER_INT_FIELDS = _OFFLOAD_FIELDS + _MIGRATION_FIELDS


class EventDecodeError(ValueError):
    """The bytes are not a valid message of this wire version."""


def _unpack(data: bytes, kind: str | None) -> dict[str, Any]:
    """The message's map after checking version and (unless None) kind."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise EventDecodeError(f"expected bytes, got {type(data).__name__}")
    try:
        obj = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise EventDecodeError(f"not a msgpack message: {exc}") from exc
    if not isinstance(obj, dict):
        raise EventDecodeError(f"expected a msgpack map, got {type(obj).__name__}")
    version = obj.get("v")
    if version != WIRE_VERSION:
        raise EventDecodeError(f"unsupported wire version {version!r}, expected {WIRE_VERSION}")
    if kind is not None and obj.get("kind") != kind:
        raise EventDecodeError(f"expected a {kind!r} message, got kind {obj.get('kind')!r}")
    return obj


def _get(obj: Mapping[str, Any], name: str, typ: type | tuple[type, ...]) -> Any:
    if name not in obj:
        raise EventDecodeError(f"missing field {name!r}")
    value = obj[name]
    # bool is an int subclass; a flag where a count belongs is still garbage
    if isinstance(value, bool) and typ is not bool:
        raise EventDecodeError(f"field {name!r} has type bool")
    if not isinstance(value, typ):
        raise EventDecodeError(f"field {name!r} has type {type(value).__name__}")
    return value


def _strings(obj: Mapping[str, Any], name: str) -> tuple[str, ...]:
    items = _get(obj, name, list)
    if not all(isinstance(item, str) for item in items):
        raise EventDecodeError(f"field {name!r} must hold strings")
    return tuple(items)


def _cost(obj: Mapping[str, Any], name: str) -> float:
    """A measured cost or duration: finite and >= 0."""
    value = float(_get(obj, name, (int, float)))
    if not value >= 0 or value == float("inf"):
        raise EventDecodeError(f"field {name!r} must be finite and >= 0, got {value}")
    return value


def _count_map(obj: Mapping[str, Any], name: str) -> dict[str, int]:
    raw = _get(obj, name, dict)
    for key, value in raw.items():
        if not isinstance(key, str) or isinstance(value, bool) or not isinstance(value, int):
            raise EventDecodeError(f"field {name!r} must map str to int")
    return dict(raw)


def _priority_claims(obj: Mapping[str, Any]) -> dict[int, tuple[int, int]]:
    raw = _get(obj, "priority_claims", dict)
    out: dict[int, tuple[int, int]] = {}
    for key, value in raw.items():
        try:
            priority = int(key)
        except (TypeError, ValueError):
            raise EventDecodeError(f"priority_claims key {key!r} is not an integer") from None
        if (
            not isinstance(value, list)
            or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        ):
            raise EventDecodeError("priority_claims must map a priority to [sequences, blocks]")
        out[priority] = (value[0], value[1])
    return out


class RequestLoad(NamedTuple):
    """One request of a worker short of blocks, as the scheduler weighs it for migration.

    `admitted_seq` orders admissions (larger: admitted later; a request never
    admitted yet counts as the latest); `num_tokens` is prompt + generated,
    what a recompute elsewhere has to hold.
    """

    request_id: str
    priority: int
    admitted_seq: int
    num_tokens: int


def _request_loads(obj: Mapping[str, Any]) -> tuple[RequestLoad, ...]:
    raw = _get(obj, "requests", list)
    out = []
    for item in raw:
        if (
            not isinstance(item, list) or len(item) != 4 or not isinstance(item[0], str)
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in item[1:])
        ):
            raise EventDecodeError("field 'requests' must hold [str, int, int, int] entries")
        out.append(RequestLoad(*item))
    return tuple(out)


@dataclass(frozen=True)
class LoadReport:
    """One worker's KV pool counters and queue lengths at one moment.

    Block counts are the current state; preemptions, evictions and prefix
    token counts are cumulative since the worker started.
    """

    worker_id: str
    pool: str
    seq: int
    timestamp: float
    total_blocks: int
    free_blocks: int
    live_blocks: int
    cached_blocks: int
    peak_live_blocks: int
    num_running: int = 0
    num_waiting: int = 0
    tenant_live_blocks: Mapping[str, int] = field(default_factory=dict)
    # Cumulative per salt: waits and preemptions caused by a tenant's max_live_blocks.
    tenant_cap_refusals: Mapping[str, int] = field(default_factory=dict)
    preemptions: Mapping[str, int] = field(default_factory=dict)
    evictions: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    # Identifies the worker process; `seq` restarts from 1 with each incarnation, so
    # receivers compare seq only within one incarnation.
    incarnation: str = ""
    # The offload tier: blocks held now; hit tokens and bytes copied in/out, cumulative.
    offload_blocks: int = 0
    offload_hit_tokens: int = 0
    offload_bytes_in: int = 0
    offload_bytes_out: int = 0
    # Migration by KV transfer, cumulative: blocks handed off to other workers, blocks
    # imported from them, and hand-offs whose blocks could not be fetched (recomputed).
    kv_blocks_exported: int = 0
    kv_blocks_imported: int = 0
    kv_import_failures: int = 0
    # Per LoRA adapter: its loads into a device slot, and its evictions from one, cumulative.
    lora_loads: Mapping[str, int] = field(default_factory=dict)
    lora_evictions: Mapping[str, int] = field(default_factory=dict)
    # Cumulative tokens this worker incarnation has run through its model (prefill and
    # decode): the scheduler's sign of progress (a worker with work whose count stands
    # still is hung, unless it reports that a step is running: `step_s`).
    progress: int = 0
    # How long the engine's current step had run when the report was taken (0.0 between
    # steps). A report taken during a long step repeats the state read after the one before.
    step_s: float = 0.0
    # Admission against the full request: blocks the requests here will still take to
    # reach their max_tokens, and per priority (sequences, blocks they claim in all);
    # the lowest priority is the one a more important arrival could preempt.
    committed_blocks: int = 0
    priority_claims: Mapping[int, tuple[int, int]] = field(default_factory=dict)
    # Per ingress replica: the blocks its requests here claim in all, so a replica can
    # swap its own part of the report for its exact, never stale, account.
    origin_claims: Mapping[str, int] = field(default_factory=dict)
    # Short of blocks: what its waiting sequences lack beyond free + cached (at least 1
    # after a preemption for want of a block since the previous report); 0 when
    # everything fits. Only then does the report list `requests`, the candidates the
    # scheduler may migrate.
    blocks_short: int = 0
    requests: tuple[RequestLoad, ...] = ()
    # Cumulative: requests this incarnation handed to another worker on the scheduler's order.
    migrations_out: int = 0
    # What moving a request here costs, as estimated here: seconds per token of a
    # prefill-dominated step (recomputing its KV; the engine's prior until it has run
    # one), and seconds per KV block of an import by transfer (the fetch through the
    # object store and the write; 0.0 until the first import).
    recompute_s_per_token: float = 0.0
    kv_import_s_per_block: float = 0.0
    # The LoRA adapters in the worker's device slots now (routing prefers a worker that
    # holds a request's adapter: loading one costs time), and how many slots it has
    # (`max_loras`; 0: it serves no adapters). A cold adapter goes preferably where a
    # slot is free, so that loading it evicts no resident adapter.
    resident_adapters: tuple[str, ...] = ()
    lora_slots: int = 0

    def supersedes(self, previous: LoadReport | None) -> bool:
        """Whether this report is newer than `previous` from the same worker."""
        if previous is None or self.incarnation != previous.incarnation:
            return True
        return self.seq > previous.seq

    def same_load(self, other: LoadReport | None) -> bool:
        """Whether `other` says the same as this report but for its `seq` and `timestamp`."""
        return other is not None and replace(self, seq=other.seq, timestamp=other.timestamp) == other

    @property
    def hit_rate(self) -> float:
        """Prefix-cache hit rate in tokens; 0.0 before the first query."""
        if self.prefix_query_tokens <= 0:
            return 0.0
        return self.prefix_hit_tokens / self.prefix_query_tokens

    @property
    def num_allocatable(self) -> int:
        """Blocks a new request could get now: free plus evictable cached ones."""
        return self.free_blocks + self.cached_blocks

    @property
    def lowest_priority(self) -> int | None:
        """The lowest priority of a request here (None when there is none)."""
        return min((p for p, (n, _) in self.priority_claims.items() if n > 0), default=None)

    def claimed_below(self, priority: int) -> int:
        """Blocks claimed by requests of lower priority than `priority` (what preempting frees)."""
        return sum(blocks for p, (_, blocks) in self.priority_claims.items() if p < priority)

    def encode(self) -> bytes:
        """msgpack bytes of this report."""
        return msgpack.packb(
            {
                "v": WIRE_VERSION,
                "kind": _LOAD_KIND,
                "worker_id": self.worker_id,
                "pool": self.pool,
                "seq": self.seq,
                "ts": float(self.timestamp),
                "total": self.total_blocks,
                "free": self.free_blocks,
                "live": self.live_blocks,
                "cached": self.cached_blocks,
                "peak_live": self.peak_live_blocks,
                "running": self.num_running,
                "waiting": self.num_waiting,
                "tenant_live": dict(self.tenant_live_blocks),
                "tenant_cap_refusals": dict(self.tenant_cap_refusals),
                "preemptions": dict(self.preemptions),
                "evictions": self.evictions,
                "prefix_query_tokens": self.prefix_query_tokens,
                "prefix_hit_tokens": self.prefix_hit_tokens,
                "incarnation": self.incarnation,
                **{name: getattr(self, name) for name in _TIER_INT_FIELDS},
                "progress": self.progress,
                "step_s": float(self.step_s),
                "committed": self.committed_blocks,
                # msgpack map keys must be strings here (strict_map_key)
                "priority_claims": {str(p): list(c) for p, c in self.priority_claims.items()},
                "origin_claims": dict(self.origin_claims),
                "blocks_short": self.blocks_short,
                "requests": [list(r) for r in self.requests],
                "migrations_out": self.migrations_out,
                "recompute_s_per_token": float(self.recompute_s_per_token),
                "kv_import_s_per_block": float(self.kv_import_s_per_block),
                "resident_adapters": list(self.resident_adapters),
                "lora_slots": self.lora_slots,
                "lora_loads": dict(self.lora_loads),
                "lora_evictions": dict(self.lora_evictions),
            },
            use_bin_type=True,
        )

    @classmethod
    def decode(cls, data: bytes) -> LoadReport:
        """Parse bytes from :meth:`encode`; raises EventDecodeError on anything else."""
        return cls._from_obj(_unpack(data, _LOAD_KIND))

    @classmethod
    def _from_obj(cls, obj: Mapping[str, Any]) -> LoadReport:
        return cls(
            worker_id=_get(obj, "worker_id", str),
            pool=_get(obj, "pool", str),
            seq=_get(obj, "seq", int),
            timestamp=float(_get(obj, "ts", (int, float))),
            total_blocks=_get(obj, "total", int),
            free_blocks=_get(obj, "free", int),
            live_blocks=_get(obj, "live", int),
            cached_blocks=_get(obj, "cached", int),
            peak_live_blocks=_get(obj, "peak_live", int),
            num_running=_get(obj, "running", int),
            num_waiting=_get(obj, "waiting", int),
            tenant_live_blocks=_count_map(obj, "tenant_live"),
            tenant_cap_refusals=_count_map(obj, "tenant_cap_refusals"),
            preemptions=_count_map(obj, "preemptions"),
            evictions=_get(obj, "evictions", int),
            prefix_query_tokens=_get(obj, "prefix_query_tokens", int),
            prefix_hit_tokens=_get(obj, "prefix_hit_tokens", int),
            incarnation=_get(obj, "incarnation", str),
            **{name: _get(obj, name, int) for name in _TIER_INT_FIELDS},
            progress=_get(obj, "progress", int),
            step_s=_cost(obj, "step_s"),
            committed_blocks=_get(obj, "committed", int),
            priority_claims=_priority_claims(obj),
            origin_claims=_count_map(obj, "origin_claims"),
            blocks_short=_get(obj, "blocks_short", int),
            requests=_request_loads(obj),
            migrations_out=_get(obj, "migrations_out", int),
            recompute_s_per_token=_cost(obj, "recompute_s_per_token"),
            kv_import_s_per_block=_cost(obj, "kv_import_s_per_block"),
            resident_adapters=_strings(obj, "resident_adapters"),
            lora_slots=_get(obj, "lora_slots", int),
            lora_loads=_count_map(obj, "lora_loads"),
            lora_evictions=_count_map(obj, "lora_evictions"),
        )

    @classmethod
    def from_engine_stats(
        cls,
        worker_id: str,
        pool: str,
        seq: int,
        stats: EngineStats,
        *,
        tenant_live_blocks: Mapping[str, int] | None = None,
        tenant_cap_refusals: Mapping[str, int] | None = None,
        timestamp: float | None = None,
        incarnation: str = "",
        progress: int = 0,
        step_s: float = 0.0,
        committed_blocks: int = 0,
        priority_claims: Mapping[int, tuple[int, int]] | None = None,
        origin_claims: Mapping[str, int] | None = None,
        blocks_short: int = 0,
        requests: Iterable[RequestLoad] = (),
        migrations_out: int = 0,
        recompute_s_per_token: float = 0.0,
        kv_import_s_per_block: float = 0.0,
        resident_adapters: Iterable[str] = (),
        lora_slots: int = 0,
        lora_loads: Mapping[str, int] | None = None,
        lora_evictions: Mapping[str, int] | None = None,
    ) -> LoadReport:
        """Build a report from an engine's counters (``LLMEngine.stats()``)."""
        return cls(
            worker_id=worker_id,
            pool=pool,
            seq=seq,
            timestamp=time.time() if timestamp is None else timestamp,
            total_blocks=stats.total,
            free_blocks=stats.free,
            live_blocks=stats.live,
            cached_blocks=stats.cached,
            peak_live_blocks=stats.peak_live,
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            tenant_live_blocks=dict(tenant_live_blocks or {}),
            tenant_cap_refusals=dict(tenant_cap_refusals or {}),
            preemptions=stats.preemptions,
            evictions=stats.evictions,
            prefix_query_tokens=stats.prefix_query_tokens,
            prefix_hit_tokens=stats.prefix_hit_tokens,
            incarnation=incarnation,
            **{name: getattr(stats, name) for name in _TIER_INT_FIELDS},
            progress=progress,
            step_s=step_s,
            committed_blocks=committed_blocks,
            priority_claims=dict(priority_claims or {}),
            origin_claims=dict(origin_claims or {}),
            blocks_short=blocks_short,
            requests=tuple(requests),
            migrations_out=migrations_out,
            recompute_s_per_token=recompute_s_per_token,
            kv_import_s_per_block=kv_import_s_per_block,
            resident_adapters=tuple(resident_adapters),
            lora_slots=lora_slots,
            lora_loads=dict(lora_loads or {}),
            lora_evictions=dict(lora_evictions or {}),
        )


@dataclass(frozen=True)
class KVEventBatch:
    """The KV events one worker drained since its previous batch.

    ``events`` keeps the pool's drain order, which matters: a hash can be
    stored, removed and stored again within one batch. ``reset`` makes the
    batch a snapshot: the receiver forgets everything it indexed for this
    worker, and ``events`` lists every hash the worker holds now as "stored"
    (sent by a worker that (re)started, and whenever the scheduler asks after
    a sequence gap or for its periodic drift check). ``seq`` counts batches
    within one ``incarnation`` (a process of the worker), from 1.
    ``adapters``, when not empty, names the LoRA adapter of each event's block
    ("" for the base model), parallel to ``events``; empty means every block
    is the base model's. The hashes already differ per adapter (the adapter's
    identity is in each of them); the names let an index group them.
    """

    worker_id: str
    seq: int
    events: tuple[tuple[str, bytes], ...] = ()
    reset: bool = False
    incarnation: str = ""
    adapters: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.adapters and len(self.adapters) != len(self.events):
            raise ValueError(
                f"adapters must be empty or one per event: {len(self.adapters)} for "
                f"{len(self.events)} events"
            )
        for kind, _ in self.events:
            if kind not in _KV_EVENT_TYPES:
                raise ValueError(
                    "KV event type must be 'stored' or 'removed' (in the offload tier "
                    f"'offload_stored' or 'offload_removed'), got {kind!r}"
                )

    @classmethod
    def from_engine(
        cls,
        worker_id: str,
        seq: int,
        events: Iterable[tuple[str, bytes]],
        *,
        reset: bool = False,
        incarnation: str = "",
        adapters: Iterable[str] = (),
    ) -> KVEventBatch:
        """Wrap ``engine.drain_kv_events()`` output (or, with `reset`, a snapshot), with
        ``engine.kv_event_adapters`` of it as `adapters`."""
        return cls(
            worker_id,
            seq,
            tuple((str(k), bytes(h)) for k, h in events),
            reset,
            incarnation,
            tuple(adapters),
        )

    def encode(self) -> bytes:
        """msgpack bytes; events as two parallel arrays to keep the message small."""
        return msgpack.packb(
            {
                "v": WIRE_VERSION,
                "kind": _KV_KIND,
                "worker_id": self.worker_id,
                "seq": self.seq,
                "reset": self.reset,
                "incarnation": self.incarnation,
                # 1 = stored, 0 = removed (3 / 2 in the offload tier): a byte per event
                "ops": bytes(_KV_OPS[kind] for kind, _ in self.events),
                "hashes": [h for _, h in self.events],
                # only when some block is an adapter's: base-only batches stay as small
                **({"adapters": list(self.adapters)} if self.adapters else {}),
            },
            use_bin_type=True,
        )

    @classmethod
    def decode(cls, data: bytes) -> KVEventBatch:
        """Parse bytes from :meth:`encode`; raises EventDecodeError on anything else."""
        return cls._from_obj(_unpack(data, _KV_KIND))

    @classmethod
    def _from_obj(cls, obj: Mapping[str, Any]) -> KVEventBatch:
        ops = _get(obj, "ops", bytes)
        hashes = _get(obj, "hashes", list)
        if len(ops) != len(hashes):
            raise EventDecodeError(f"{len(ops)} event types for {len(hashes)} hashes")
        if any(op not in _KV_KINDS for op in ops):
            raise EventDecodeError(
                "event types must be 0 (removed), 1 (stored), 2 (offload_removed) "
                "or 3 (offload_stored)"
            )
        if not all(isinstance(h, bytes) for h in hashes):
            raise EventDecodeError("block hashes must be bytes")
        events = tuple((_KV_KINDS[op], h) for op, h in zip(ops, hashes, strict=True))
        adapters = _get(obj, "adapters", list) if "adapters" in obj else []
        if adapters and (
            len(adapters) != len(events) or not all(isinstance(a, str) for a in adapters)
        ):
            raise EventDecodeError("adapters must hold one str per event")
        return cls(
            worker_id=_get(obj, "worker_id", str),
            seq=_get(obj, "seq", int),
            events=events,
            reset=_get(obj, "reset", bool),
            incarnation=_get(obj, "incarnation", str),
            adapters=tuple(adapters),
        )


def decode_message(data: bytes) -> LoadReport | KVEventBatch:
    """Decode either message kind; raises EventDecodeError on garbage or unknown kinds."""
    obj = _unpack(data, None)
    kind = obj.get("kind")
    if kind == _LOAD_KIND:
        return LoadReport._from_obj(obj)
    if kind == _KV_KIND:
        return KVEventBatch._from_obj(obj)
    raise EventDecodeError(f"unknown message kind {kind!r}")


# The central scheduler's named actor (pagefleet.scheduler.actor creates it; workers look
# it up by this name, so the worker package needs nothing from the scheduler package).
SCHEDULER_ACTOR_NAME = "pagefleet-scheduler"


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker tells the scheduler when it registers."""

    worker_id: str
    pool: str
    total_blocks: int
    block_size: int = 16
    node_id: str | None = None
    node_ip: str | None = None

    def __post_init__(self) -> None:
        if not self.worker_id:
            raise ValueError("worker_id must not be empty")
        if self.total_blocks < 0:
            raise ValueError(f"total_blocks must be >= 0, got {self.total_blocks}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
