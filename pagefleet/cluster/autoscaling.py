"""Serve autoscaling of the ingress replicas on the streams they hold.

Streams arrive over the ingress's own gRPC and HTTP servers, not as Serve
requests, so Serve's built-in signal (ongoing Serve requests) reads 0. Each
replica reports its open streams instead (`IngressDeployment.
record_autoscaling_stats`, metric `STREAMS_METRIC`), and `StreamsPolicy`
asks for one replica per `target_streams` of them. Serve wraps the policy
with the deployment's bounds (`ingress_replicas`..`ingress_max_replicas`)
and its upscale / downscale delays.

Serve pickles this module by value into its controller: keep it free of
pagefleet imports at module level.
"""

from __future__ import annotations

import math
from typing import Any

# The custom metric each ingress replica reports: its generation requests in flight
# (streaming or waiting in its queue).
STREAMS_METRIC = "pagefleet_streams"
POLICY_PATH = "pagefleet.cluster.autoscaling:StreamsPolicy"


class StreamsPolicy:
    """Desired replicas = ceil(total streams / target_streams), at least one."""

    def __init__(self, target_streams: float = 64) -> None:
        if not target_streams > 0:
            raise ValueError(f"target_streams must be > 0, got {target_streams}")
        self.target_streams = float(target_streams)

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        """`ctx` is Serve's `AutoscalingContext`; returns (replicas, policy state)."""
        per_replica = (ctx.aggregated_metrics or {}).get(STREAMS_METRIC, {})
        streams = float(sum(per_replica.values()))
        desired = max(1, math.ceil(streams / self.target_streams))
        return desired, dict(ctx.policy_state or {})


def ingress_replica_options(
    replicas: int,
    max_replicas: int | None,
    target_streams: int,
    upscale_delay_s: float,
    downscale_delay_s: float,
    drain_timeout_s: float,
) -> dict[str, Any]:
    """`serve.deployment` options for the ingress: a fixed count, or autoscaling on streams.

    A replica that Serve stops drains first (`IngressDeployment.__del__`), so
    its graceful shutdown must outlast `drain_timeout_s`.
    """
    options: dict[str, Any] = {"graceful_shutdown_timeout_s": drain_timeout_s + 10.0}
    if max_replicas is None or max_replicas == replicas:
        options["num_replicas"] = replicas
        return options
    options["autoscaling_config"] = {
        "min_replicas": replicas,
        "initial_replicas": replicas,
        "max_replicas": max_replicas,
        "upscale_delay_s": upscale_delay_s,
        "downscale_delay_s": downscale_delay_s,
        "metrics_interval_s": 1.0,
        "look_back_period_s": 5.0,
        "policy": {"policy_function": POLICY_PATH, "policy_kwargs": {"target_streams": target_streams}},
    }
    return options
