"""A Ray cluster whose autoscaler launches and removes nodes on this machine.

Ray's fake multi-node provider (`RAY_FAKE_CLUSTER=1 ray start --head
--autoscaling-config=<yaml>` with `provider: {type: fake_multinode}`) runs the real
autoscaler; a node it launches is one more raylet on this host with the node type's
resources (GPUs are advertised, the compute is CPU). The node types are
manifests/cluster.yaml's, sized for a laptop: a head without GPUs and the GPU
worker type.

The head runs in a PID namespace of its own (`unshare --pid --kill-child`), and so
does everything it starts, the nodes the autoscaler launches included: stopping the
head by its pid ends them all, and Ray's session files stay in the cluster's own
temporary folder (its address file too, so a later bare `ray.init()` cannot join it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import ray
import yaml
from ray_nodes import free_port

from pagefleet.cluster.app import NAMESPACE

MANIFEST = Path(__file__).resolve().parent.parent / "manifests" / "cluster.yaml"
HEAD_NODE_TYPE = "ray.head.default"  # the only head type name the fake provider knows
GPU_NODE_TYPE = "gpu_worker"  # manifests/cluster.yaml's GPU worker type
GPU_NODE_RESOURCES = {"CPU": 1, "GPU": 1}  # one GPU per node: one pagefleet worker
IDLE_TIMEOUT_S = 6.0


def autoscaling_config(
    gcs_address: str, *, idle_timeout_s: float = IDLE_TIMEOUT_S
) -> dict[str, Any]:
    """manifests/cluster.yaml's node types on the fake multi-node provider.

    The head keeps the manifest's GPU count (none) and no CPUs, so that a CPU task
    or worker runs on a launched node only; the GPU type keeps its name and its
    node count bounds, with one GPU and one CPU a node.
    """
    manifest = yaml.safe_load(MANIFEST.read_text())
    head = manifest["available_node_types"][manifest["head_node_type"]]
    gpu = manifest["available_node_types"][GPU_NODE_TYPE]
    return {
        "cluster_name": "pagefleet-fake-autoscaler",
        "max_workers": gpu["max_workers"],
        "upscaling_speed": manifest["upscaling_speed"],
        "idle_timeout_minutes": idle_timeout_s / 60,
        "provider": {
            "type": "fake_multinode",
            "gcs_address": gcs_address,
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
        },
        "available_node_types": {
            HEAD_NODE_TYPE: {
                "resources": {"CPU": 0, "GPU": head["resources"]["GPU"]},
                "node_config": {},
                "max_workers": 0,
            },
            GPU_NODE_TYPE: {
                "resources": dict(GPU_NODE_RESOURCES),
                "node_config": {},
                "min_workers": 0,
                "max_workers": gpu["max_workers"],
            },
        },
        "head_node_type": HEAD_NODE_TYPE,
        "auth": {},
        "docker": {},
        "initialization_commands": [],
        "setup_commands": [],
        "head_setup_commands": [],
        "worker_setup_commands": [],
        "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
        "file_mounts": {},
        "cluster_synced_files": [],
        "file_mounts_sync_continuously": False,
        "rsync_exclude": [],
        "rsync_filter": [],
    }


@dataclass
class FakeAutoscalingCluster:
    """A running head with the autoscaler; `address` is its GCS address."""

    address: str
    process: subprocess.Popen[bytes]
    temp_dir: Path
    log: Path

    def alive_nodes(self) -> list[dict[str, Any]]:
        """Ray's node table (`ray.nodes()`), alive nodes only; needs `ray.init`."""
        return [n for n in ray.nodes() if n["Alive"]]

    def gpu_nodes(self) -> list[dict[str, Any]]:
        """The alive nodes the autoscaler launched with the GPU node type."""
        return [n for n in self.alive_nodes() if n["Resources"].get("GPU", 0) > 0]

    def wait_for_nodes(self, count: int, timeout_s: float) -> None:
        """Wait until `count` nodes (the head included) are alive."""
        deadline = time.monotonic() + timeout_s
        while len(self.alive_nodes()) != count:
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise AssertionError(
                    f"{len(self.alive_nodes())} alive nodes, waited {timeout_s}s for {count};"
                    f" the autoscaler's log:\n{self.monitor_log()[-4000:]}"
                )
            time.sleep(0.5)

    def monitor_log(self) -> str:
        logs = sorted(self.temp_dir.glob("ray/session_*/logs/monitor.log"))
        return logs[-1].read_text() if logs else "(no monitor.log)"

    def stop(self) -> None:
        self.process.kill()  # --kill-child: the head's PID namespace ends, every node with it
        self.process.wait(timeout=60)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def start_fake_autoscaling_cluster(
    idle_timeout_s: float = IDLE_TIMEOUT_S,
) -> FakeAutoscalingCluster:
    """Start the head and its autoscaler; return once the head is up."""
    assert shutil.which("unshare"), "the fake autoscaling cluster needs util-linux's unshare"
    # Short: Ray's socket paths under it must fit the 107-byte limit.
    temp_dir = Path(tempfile.mkdtemp(prefix="pf-fake-"))
    port = free_port()
    address = f"127.0.0.1:{port}"
    config = temp_dir / "autoscaling.yaml"
    config.write_text(yaml.safe_dump(autoscaling_config(address, idle_timeout_s=idle_timeout_s)))
    command = [
        "unshare", "--pid", "--fork", "--mount-proc", "--kill-child",
        "ray", "start", "--head", "--block",
        f"--port={port}",
        "--num-cpus=0", "--num-gpus=0",
        f"--ray-client-server-port={free_port()}",
        f"--dashboard-agent-listen-port={free_port()}",
        f"--dashboard-agent-grpc-port={free_port()}",
        f"--metrics-export-port={free_port()}",
        "--include-dashboard=false",
        f"--dashboard-port={free_port()}",  # checked even without the dashboard
        "--disable-usage-stats",
        f"--temp-dir={temp_dir / 'ray'}",
        f"--autoscaling-config={config}",
    ]  # fmt: skip
    env = {
        **os.environ,
        "RAY_FAKE_CLUSTER": "1",
        "AUTOSCALER_UPDATE_INTERVAL_S": "1",
        # A raylet waits this long for its agents' ports (30 s by default): a busy machine
        # starts their Python processes slowly.
        "RAY_agent_register_timeout_ms": "120000",
        "RAY_raylet_start_wait_time_s": "120",  # and for its raylet to register with the GCS
        # The nodes the autoscaler launches take their temporary folder from here.
        "TMPDIR": str(temp_dir),
        # The test process joins this cluster by address: no token on either side.
        "RAY_AUTH_MODE": "disabled",
    }
    log = temp_dir / "head.log"
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    cluster = FakeAutoscalingCluster(address, process, temp_dir, log)
    deadline = time.monotonic() + 300  # a machine shared with other tests starts it slowly
    while b"Ray runtime started" not in log.read_bytes():
        if process.poll() is not None or time.monotonic() > deadline:
            output = log.read_text()
            cluster.stop()
            raise AssertionError(f"the fake autoscaling head did not start:\n{output[-4000:]}")
        time.sleep(0.5)
    return cluster


@pytest.fixture(scope="module")
def fake_autoscaling_cluster() -> Iterator[FakeAutoscalingCluster]:
    """A head with the autoscaler on the fake multi-node provider, this process joined to it."""
    cluster = start_fake_autoscaling_cluster()
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("RAY_AUTH_MODE", "disabled")
            ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
        yield cluster
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.stop()
