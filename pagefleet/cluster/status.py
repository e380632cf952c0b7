"""The cluster's status as one ingress replica sees it: typed, read by every front.

`Ingress.status` returns `PoolStatus`es; gRPC's GetStatus (`to_proto`), the
dashboard's JSON and the CLI read these same objects, so a counter has one
name and one meaning everywhere. Worker rows come from the worker's latest
load report plus what this replica alone knows (requests it routed there).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

# The block and queue counters a pool sums over its live workers.
BLOCK_FIELDS = (
    "total_blocks",
    "free_blocks",
    "live_blocks",
    "cached_blocks",
    "peak_live_blocks",
    "num_running",
    "num_waiting",
)


@dataclass(frozen=True)
class WorkerStatus:
    """One worker's row: its liveness, KV blocks, queue and prefix-cache counters.

    `tenant_live_blocks` is keyed by prefix-cache salt (a secret): a front
    that shows it labels it by tenant name (see `dashboard`).
    """

    worker_id: str
    pool: str
    alive: bool = False
    # Being removed: out of routing while its streams finish.
    draining: bool = False
    node_id: str = ""
    node_ip: str = ""
    total_blocks: int = 0
    free_blocks: int = 0
    live_blocks: int = 0
    cached_blocks: int = 0
    peak_live_blocks: int = 0
    num_running: int = 0
    num_waiting: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    hit_rate: float = 0.0
    # Requests this ingress replica sent to the worker so far.
    requests_routed: int = 0
    # Requests the worker handed to another worker on the scheduler's order, since it started.
    migrations_out: int = 0
    preemptions: int = 0
    evictions: int = 0
    tenant_live_blocks: Mapping[str, int] = field(default_factory=dict)
    # The LoRA adapters in its device slots (to a tenant: only those it may use).
    resident_adapters: tuple[str, ...] = ()


@dataclass(frozen=True)
class PoolStatus:
    """One pool: its counters summed over its live workers, and every worker's row."""

    name: str
    model: str
    router_policy: str
    live_workers: int
    # prefix hits / queries over every reporting worker; 0 before any query.
    hit_rate: float
    # The workers' migrations_out summed.
    migrations: int
    total_blocks: int
    free_blocks: int
    live_blocks: int
    cached_blocks: int
    peak_live_blocks: int
    num_running: int
    # In the workers' engine queues plus this replica's wait queue.
    num_waiting: int
    preemptions: int
    evictions: int
    workers: tuple[WorkerStatus, ...] = ()
    # The pool's size as membership last set it (autoscaling or `pagefleet scale`), and why.
    target_workers: int = 0
    scale_reason: str = ""


__all__ = ["BLOCK_FIELDS", "PoolStatus", "WorkerStatus"]
