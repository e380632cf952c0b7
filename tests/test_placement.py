"""Placement arithmetic and messages (`pagefleet.cluster.placement`), without Ray."""

from __future__ import annotations

import pytest

from pagefleet.cluster.config import ClusterConfig, ConfigError, PoolConfig
from pagefleet.cluster.membership import CPU_WORKER_NUM_CPUS, worker_shape
from pagefleet.cluster.placement import (
    NodeResources,
    WorkerShape,
    autoscaler_request,
    cannot_place,
    capacity,
    label_matches,
)

GPU_NODE = {"CPU": 1.0, "GPU": 1.0}
ACME = NodeResources("a" * 56, "10.0.0.2", {"pool": "acme", "ray.io/node-id": "a" * 56}, GPU_NODE, GPU_NODE)
SHARED = NodeResources("b" * 56, "10.0.0.3", {}, GPU_NODE, {"CPU": 0.0, "GPU": 0.0})
HEAD = NodeResources("c" * 56, "10.0.0.1", {}, {"CPU": 2.0}, {"CPU": 2.0})


def test_a_cpu_pool_on_a_gpu_cluster_takes_one_gpu_per_worker_by_default() -> None:
    assert worker_shape(PoolConfig(name="p", device="cpu"), cluster_gpus=3) == WorkerShape(1.0, 1.0)


def test_a_pool_on_a_cluster_without_gpus_asks_for_none() -> None:
    assert worker_shape(PoolConfig(name="p", device="auto"), cluster_gpus=0) == WorkerShape(CPU_WORKER_NUM_CPUS, 0.0)


def test_num_gpus_per_worker_overrides_the_default() -> None:
    shape = worker_shape(PoolConfig(name="p", num_gpus_per_worker=0.5), cluster_gpus=0)
    assert (shape.num_cpus, shape.num_gpus) == (1.0, 0.5)


def test_node_labels_become_the_workers_label_selector() -> None:
    shape = worker_shape(PoolConfig(name="p", node_labels={"pool": "acme"}), cluster_gpus=1)
    assert shape.options() == {"num_cpus": 1.0, "num_gpus": 1.0, "label_selector": {"pool": "acme"}}


def test_the_autoscaler_is_asked_for_each_worker_on_a_node_with_its_pools_labels() -> None:
    pinned = worker_shape(PoolConfig(name="acme", node_labels={"pool": "acme"}), cluster_gpus=1)
    anywhere = worker_shape(PoolConfig(name="default", node_labels={}), cluster_gpus=0)
    bundles, selectors = autoscaler_request([(pinned, 2), (anywhere, 1)])
    assert bundles == [{"CPU": 1.0, "GPU": 1.0}, {"CPU": 1.0, "GPU": 1.0}, {"CPU": CPU_WORKER_NUM_CPUS}]
    assert selectors == [{"pool": "acme"}, {"pool": "acme"}, {}]


def test_rays_request_resources_takes_the_request_with_each_selector_beside_its_bundle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ray.autoscaler import sdk
    from ray.autoscaler._private import commands

    sent: list[tuple[object, ...]] = []
    # Only the write to the GCS is replaced: the argument checks are Ray's own.
    monkeypatch.setattr(commands, "request_resources", lambda *args: sent.append(args))
    shape = WorkerShape(1.0, 1.0, {"pool": "acme", "zone": "!eu", "tier": "in(a,b)"})
    bundles, selectors = autoscaler_request([(shape, 1), (WorkerShape(0.5, 0.0), 1)])
    sdk.request_resources(bundles=bundles, bundle_label_selectors=selectors)
    assert sent == [(None, [{"CPU": 1.0, "GPU": 1.0}, {"CPU": 0.5}],
                     [{"pool": "acme", "zone": "!eu", "tier": "in(a,b)"}, {}])]  # fmt: skip


def test_label_selectors_match_values_negations_and_sets() -> None:
    assert label_matches("acme", "acme") and not label_matches(None, "acme")
    assert label_matches(None, "!acme") and label_matches("beta", "!acme") and not label_matches("acme", "!acme")
    assert label_matches("b", "in(a, b)") and not label_matches("b", "!in(a,b)")


def test_capacity_counts_only_nodes_with_the_labels_and_the_resources() -> None:
    pinned = WorkerShape(1.0, 1.0, {"pool": "acme"})
    assert capacity(pinned, [ACME, SHARED, HEAD], free=False) == 1
    assert capacity(WorkerShape(1.0, 1.0), [ACME, SHARED, HEAD], free=False) == 2
    assert capacity(WorkerShape(1.0, 1.0), [ACME, SHARED, HEAD], free=True) == 1
    assert capacity(WorkerShape(0.5, 0.0), [HEAD], free=True) == 4


def test_the_unplaceable_message_names_what_was_asked_and_what_each_node_has() -> None:
    message = cannot_place("tenant", WorkerShape(1.0, 1.0, {"pool": "beta"}), 2, [ACME, SHARED])
    assert "pool 'tenant': 2 worker(s) cannot be placed" in message
    assert "1 CPU and 1 GPU on a node labelled {pool: beta}" in message
    assert "node aaaaaaaa (10.0.0.2) labels {pool: acme}: 1/1 CPU, 1/1 GPU free" in message
    assert "node bbbbbbbb (10.0.0.3) labels {}: 0/1 CPU, 0/1 GPU free" in message
    assert "ray.io" not in message


def test_node_labels_come_from_yaml_as_a_mapping_of_strings() -> None:
    pools = [{"name": "acme", "node_labels": {"pool": "acme", "zone": "!eu"}}]
    assert ClusterConfig.from_dict({"pools": pools}).pools[0].node_labels == {"pool": "acme", "zone": "!eu"}


@pytest.mark.parametrize(
    ("labels", "error"),
    [
        ("pool=acme", "pools[0].node_labels: must be dict, got str 'pool=acme'"),
        ({"pool": 1}, "pools[0].node_labels: keys and values must be non-empty strings, got 'pool': 1"),
        ({"pool": ""}, "pools[0].node_labels: keys and values must be non-empty strings, got 'pool': ''"),
    ],
)
def test_bad_node_labels_are_refused_with_the_field_and_the_entry(labels: object, error: str) -> None:
    with pytest.raises(ConfigError) as exc:
        ClusterConfig.from_dict({"pools": [{"name": "acme", "node_labels": labels}]})
    assert str(exc.value) == error
