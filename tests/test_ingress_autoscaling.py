"""Serve autoscales the ingress replicas on the streams they hold (not on Serve requests).

The policy alone against Serve's own `AutoscalingContext`, then on a real local
Ray: streams held open (their worker stopped) scale the ingress from 1 to 2
replicas; once they finish it scales back to 1, and every stream ends with
the offline output.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import grpc
import pytest
import ray
from cluster_fixtures import (
    MAX_MODEL_LEN,
    local_cluster,
    offline_tiny,
    small_cluster_config,
    tokens_of,
    wait_for,
    worker_stats,
)
from ray import serve
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.config import AutoscalingContext

from pagefleet import SamplingParams
from pagefleet.cluster.app import APP_NAME, INGRESS_NAME, RunningCluster
from pagefleet.cluster.autoscaling import STREAMS_METRIC, StreamsPolicy, ingress_replica_options
from pagefleet.cluster.client import build_request
from pagefleet.cluster.config import ClusterConfig, ConfigError
from pagefleet.cluster.proto import pagefleet_pb2_grpc as pb_grpc


def _context(streams: list[float], current: int) -> AutoscalingContext:
    deployment = DeploymentID(name=INGRESS_NAME, app_name=APP_NAME)
    replicas = [ReplicaID(f"r{i}", deployment) for i in range(len(streams))]
    return AutoscalingContext(
        deployment_id=deployment, deployment_name=INGRESS_NAME, app_name=APP_NAME,
        current_num_replicas=current, target_num_replicas=current, running_replicas=replicas,
        total_num_requests=0.0, total_queued_requests=0.0,
        aggregated_metrics={STREAMS_METRIC: dict(zip(replicas, streams, strict=True))},
        raw_metrics=None, capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=8,
        policy_state={}, last_scale_up_time=None, last_scale_down_time=None,
        current_time=None, config=None,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("streams", "want"),
    [([0.0], 1), ([64.0], 1), ([64.0, 1.0], 2), ([100.0, 100.0, 100.0], 5)],
)
def test_the_policy_asks_for_one_replica_per_target_streams(streams: list[float], want: int) -> None:
    # Serve's own request count reads 0 here: the streams are not Serve requests.
    assert StreamsPolicy(target_streams=64)(_context(streams, len(streams)))[0] == want


def test_a_fixed_count_or_autoscaling_and_the_limits_named() -> None:
    fixed = ingress_replica_options(2, None, 64, 10.0, 300.0, 30.0)
    assert fixed["num_replicas"] == 2 and "autoscaling_config" not in fixed
    auto = ingress_replica_options(1, 4, 64, 10.0, 300.0, 30.0)["autoscaling_config"]
    assert (auto["min_replicas"], auto["max_replicas"]) == (1, 4)
    assert auto["policy"]["policy_kwargs"] == {"target_streams": 64}
    with pytest.raises(ConfigError, match=r"ingress_max_replicas: must be >= ingress_replicas \(2\), got 1"):
        ClusterConfig.from_dict({"pools": [{"name": "a"}], "server": {"ingress_replicas": 2, "ingress_max_replicas": 1}})


# ----- on a real local Ray ---------------------------------------------------------


@pytest.fixture(scope="module")
def cluster() -> Iterator[RunningCluster]:
    base = small_cluster_config(workers=1)
    config = base.replace(
        server={
            "ingress_replicas": 1, "ingress_max_replicas": 2, "ingress_target_streams": 2,
            "ingress_upscale_delay_s": 0.0, "ingress_downscale_delay_s": 2.0,
        },
        # The streams wait on a stopped worker: they must stay, not move.
        scheduler={"stall_timeout_s": 600.0},
    )  # fmt: skip
    with local_cluster(config, grpc_port=0) as running:
        yield running


def _running_replicas() -> int:
    app = serve.status().applications[APP_NAME]
    return int(app.deployments[INGRESS_NAME].replica_states.get("RUNNING", 0))


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_held_streams_scale_the_ingress_out_and_idle_scales_it_back(cluster: RunningCluster) -> None:
    offline = offline_tiny()
    sampling = {"max_tokens": MAX_MODEL_LEN - 40, "ignore_eos": True}
    prompts = [f"stream {i} holds the ingress open" for i in range(4)]
    want = [offline.generate(p, SamplingParams(**sampling))[0].token_ids for p in prompts]
    (worker_id, handle), = cluster.workers["default"]
    pid = int(ray.get(handle.info.remote(), timeout=30)["pid"])
    assert _running_replicas() == 1
    channel = grpc.insecure_channel(cluster.grpc_target)
    stub = pb_grpc.GenerationStub(channel)
    os.kill(pid, signal.SIGSTOP)  # the streams stay open: 4 streams, target 2 per replica
    try:
        calls = [stub.Generate(build_request(p, sampling), timeout=300) for p in prompts]
        wait_for(lambda: _running_replicas() == 2, 180, "a second ingress replica", 0.5)
    finally:
        os.kill(pid, signal.SIGCONT)
    for call, tokens in zip(calls, want, strict=True):
        got = list(call)
        assert tokens_of(got) == tokens and got[-1].finish_reason == "length"
    channel.close()
    wait_for(lambda: _running_replicas() == 1, 180, "back to one ingress replica when idle", 0.5)
    s = worker_stats(cluster, worker_id)
    assert s.live == 0 and s.free + s.cached == s.total
