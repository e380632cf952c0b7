"""Where a pool's workers can go: what each asks Ray for, and what the cluster's nodes offer.

A worker asks for `num_cpus` CPUs and `num_gpus` GPUs on a node whose Ray
labels include the pool's `node_labels`. These are plain functions over
`NodeResources` (taken from Ray by `cluster_nodes`), so the arithmetic and the
messages an operator reads when a pool cannot be placed are tested without a
cluster.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

# Labels Ray sets on every node itself (`ray.io/node-id`, ...): not worth printing.
_RAY_LABEL_PREFIX = "ray.io/"


@dataclass(frozen=True)
class WorkerShape:
    """What one worker of a pool asks Ray for."""

    num_cpus: float
    num_gpus: float
    labels: Mapping[str, str] = field(default_factory=dict, hash=False)

    def options(self) -> dict[str, Any]:
        """The Ray actor options that ask for this shape."""
        options: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.labels:
            options["label_selector"] = dict(self.labels)
        return options

    def bundle(self) -> dict[str, float]:
        """The resource bundle of one such worker, as Ray's autoscaler is asked for it."""
        return {"CPU": self.num_cpus, **({"GPU": self.num_gpus} if self.num_gpus else {})}

    def describe(self) -> str:
        asks = f"{self.num_cpus:g} CPU and {self.num_gpus:g} GPU"
        return f"{asks} on a node labelled {_labels(self.labels)}" if self.labels else f"{asks} on any node"


@dataclass(frozen=True)
class NodeResources:
    """One alive Ray node: its labels and its total and free resources."""

    node_id: str
    ip: str
    labels: Mapping[str, str] = field(default_factory=dict, hash=False)
    total: Mapping[str, float] = field(default_factory=dict, hash=False)
    free: Mapping[str, float] = field(default_factory=dict, hash=False)

    def matches(self, labels: Mapping[str, str]) -> bool:
        """True when the node satisfies every entry of a Ray label selector: `value`,
        `!value` (any other value, or none), `in(a,b)`, `!in(a,b)`."""
        return all(label_matches(self.labels.get(k), v) for k, v in labels.items())

    def fits(self, shape: WorkerShape, *, free: bool) -> int:
        """How many workers of `shape` its free (or total) resources hold; 0 off its labels."""
        if not self.matches(shape.labels):
            return 0
        have = self.free if free else self.total
        counts = [
            math.floor(have.get(name, 0.0) / need + 1e-9)
            for name, need in (("CPU", shape.num_cpus), ("GPU", shape.num_gpus))
            if need > 0
        ]
        return min(counts) if counts else 1_000_000  # asks for nothing: no resource bound

    def describe(self) -> str:
        labels = {k: v for k, v in self.labels.items() if not k.startswith(_RAY_LABEL_PREFIX)}
        return (
            f"node {self.node_id[:8]} ({self.ip}) labels {_labels(labels) if labels else '{}'}: "
            f"{_amount(self.free, 'CPU')}/{_amount(self.total, 'CPU')} CPU, "
            f"{_amount(self.free, 'GPU')}/{_amount(self.total, 'GPU')} GPU free"
        )


def label_matches(have: str | None, selector: str) -> bool:
    """Whether a node's label value (None: it has no such label) satisfies `selector`."""
    negated = selector.startswith("!")
    wanted = selector[1:] if negated else selector
    if wanted.startswith("in(") and wanted.endswith(")"):
        values = {v.strip() for v in wanted[3:-1].split(",")}
    else:
        values = {wanted}
    return (have not in values) if negated else (have in values)


def capacity(shape: WorkerShape, nodes: Iterable[NodeResources], *, free: bool) -> int:
    """How many workers of `shape` the nodes hold, by their free (or total) resources."""
    return sum(node.fits(shape, free=free) for node in nodes)


def autoscaler_request(
    wanted: Iterable[tuple[WorkerShape, int]],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """`bundles` and `bundle_label_selectors` of `ray.autoscaler.sdk.request_resources` for
    `count` workers of each shape: one bundle per worker, each with its pool's labels as its
    label selector (empty for a pool on any node), so the autoscaler launches nodes of the
    type the pool is pinned to."""
    bundles: list[dict[str, Any]] = []
    selectors: list[dict[str, Any]] = []
    for shape, count in wanted:
        bundles += [shape.bundle() for _ in range(count)]
        selectors += [dict(shape.labels) for _ in range(count)]
    return bundles, selectors


def describe_cluster(nodes: Iterable[NodeResources]) -> str:
    """What the cluster has, one node after the other (`; `-separated)."""
    listed = [node.describe() for node in nodes]
    return "; ".join(listed) if listed else "no alive node"


def cannot_place(pool: str, shape: WorkerShape, wanted: int, nodes: list[NodeResources]) -> str:
    """The message for `wanted` workers of `pool` that the cluster does not place."""
    return (
        f"pool {pool!r}: {wanted} worker(s) cannot be placed: each asks Ray for {shape.describe()}; "
        f"the cluster has {describe_cluster(nodes)}"
    )


def cluster_nodes() -> list[NodeResources]:
    """The alive nodes of the connected Ray cluster, with labels and free resources."""
    import ray
    from ray._private.state import available_resources_per_node

    free = available_resources_per_node()
    return [
        NodeResources(
            node_id=str(info["NodeID"]),
            ip=str(info["NodeManagerAddress"]),
            labels=dict(info.get("Labels") or {}),
            total=dict(info["Resources"]),
            free=dict(free.get(info["NodeID"], {})),
        )
        for info in ray.nodes()
        if info["Alive"]
    ]


def _labels(labels: Mapping[str, str]) -> str:
    return "{" + ", ".join(f"{k}: {v}" for k, v in sorted(labels.items())) + "}"


def _amount(resources: Mapping[str, float], name: str) -> str:
    return f"{resources.get(name, 0.0):g}"
