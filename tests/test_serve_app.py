"""`serve run manifests/serve.yaml`: the Serve application builder starts a serving cluster."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import yaml
from cluster_fixtures import generate, status, wait_for
from grpc_health.v1 import health_pb2, health_pb2_grpc
from ray_nodes import free_port

from pagefleet.cluster.config import ClusterConfig
from pagefleet.cluster.serve_app import parse_args, parse_user_config

REPO = Path(__file__).resolve().parent.parent
SERVE_YAML = REPO / "manifests" / "serve.yaml"


def test_builder_args_name_an_unknown_argument() -> None:
    with pytest.raises(ValueError, match=r"args\.port: unknown argument"):
        parse_args({"port": 1})


def test_builder_args_name_the_bad_config_field() -> None:
    with pytest.raises(ValueError, match=r"args\.config: pools\[0\]\.workers: must be >= 1"):
        parse_args({"config": {"pools": [{"name": "a", "workers": 0}]}})


def test_builder_args_default_every_argument() -> None:
    parsed = parse_args({})
    assert parsed.config == ClusterConfig.default()
    assert (parsed.metrics_port, parsed.ready_timeout_s) == (9400, 600.0)
    assert parsed.ingress_resource is None and parsed.ingress_replicas_per_node is None


def test_builder_args_are_typed() -> None:
    with pytest.raises(ValueError, match=r"^pagefleet args\.metrics_port: must be int, got str '9400'$"):
        parse_args({"metrics_port": "9400"})
    with pytest.raises(ValueError, match=r"^pagefleet args\.ready_timeout_s: must be > 0, got 0$"):
        parse_args({"ready_timeout_s": 0})
    with pytest.raises(ValueError, match=r"^pagefleet args\.config: must be a mapping or a YAML file path"):
        parse_args({"config": 3})


def test_builder_args_refuse_a_bad_metrics_port() -> None:
    with pytest.raises(ValueError, match=r"metrics_port: must be in \[0, 65535\]"):
        parse_args({"config": {"pools": [{"name": "a"}]}, "metrics_port": 70000})


def test_builder_spreads_ingress_replicas_per_node_only_off_the_head_node() -> None:
    from pagefleet.cluster.serve_app import build_application

    pools = {"pools": [{"name": "a"}], "server": {"ingress_replicas": 2}}
    args = {"config": pools, "ingress_resource": "pagefleet_ingress", "ingress_replicas_per_node": 1}
    assert parse_args(args).ingress_replicas_per_node == 1
    ingress = build_application(args)._bound_deployment
    assert ingress._replica_config.max_replicas_per_node == 1
    with pytest.raises(ValueError, match=r"ingress_replicas_per_node: needs ingress_resource"):
        parse_args({"config": pools, "ingress_replicas_per_node": 1})
    with pytest.raises(ValueError, match=r"ingress_replicas_per_node: must be an integer >= 1"):
        parse_args({**args, "ingress_replicas_per_node": 0})


def test_builder_reads_a_config_file(tmp_path: Path) -> None:
    path = tmp_path / "pagefleet.yaml"
    path.write_text("pools:\n  - {name: chat, workers: 3}\n")
    parsed = parse_args({"config": str(path), "metrics_port": None})
    assert [(p.name, p.workers) for p in parsed.config.pools] == [("chat", 3)]
    assert parsed.metrics_port is None


def test_user_config_sets_pool_sizes_and_names_a_bad_field() -> None:
    config = parse_args({"config": {"pools": [{"name": "a"}, {"name": "b"}]}}).config
    assert parse_user_config({"pool_workers": {"b": 3}}, config) == {"b": 3}
    assert parse_user_config(None, config) == {}
    with pytest.raises(ValueError, match=r"pool_workers\.c: unknown pool \(pools: a, b\)"):
        parse_user_config({"pool_workers": {"c": 1}}, config)
    with pytest.raises(ValueError, match=r"pool_workers\.a: must be >= 1, got 0"):
        parse_user_config({"pool_workers": {"a": 0}}, config)
    with pytest.raises(ValueError, match=r"user_config\.workers: unknown field \(known: pool_workers\)"):
        parse_user_config({"workers": 2}, config)


def _serve_config(tmp_path: Path, ports: dict[str, int]) -> Path:
    """manifests/serve.yaml with free ports and a small CPU pool."""
    data: dict[str, Any] = yaml.safe_load(SERVE_YAML.read_text())
    args = data["applications"][0]["args"]
    args["metrics_port"] = ports["metrics"]
    args["config"]["server"].update(host="127.0.0.1", grpc_port=ports["grpc"], http_port=ports["http"])
    args["config"]["pools"][0].update(num_kv_blocks=64, max_model_len=128, device="cpu")
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _serving(target: str) -> bool:
    with grpc.insecure_channel(target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=2
            )
        except grpc.RpcError:
            return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """`serve run` of manifests/serve.yaml (free ports), as a user runs it; SIGINT at the end."""
    tmp = tmp_path_factory.mktemp("serve")
    ports = {"grpc": free_port(), "http": free_port(), "metrics": free_port()}
    log = (tmp / "serve.log").open("w+")
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    # A second `serve run` onto this cluster (the pool-size test) joins it: no token.
    env["RAY_AUTH_MODE"] = "disabled"
    # Its own local Ray, whatever other Ray runs on the host (another test module's
    # `ray start` cluster, whose address file a bare `serve run` would join).
    env["RAY_ADDRESS"] = "local"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ray.serve.scripts", "run", str(_serve_config(tmp, ports))],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=tmp,
    )
    target = f"127.0.0.1:{ports['grpc']}"
    try:
        wait_for(lambda: proc.poll() is not None or _serving(target), 300, "serve run to serve", 1.0)
        assert proc.poll() is None, Path(log.name).read_text()[-4000:]
        yield {
            "target": target, "http": f"http://127.0.0.1:{ports['http']}", "log": Path(log.name),
            "config": tmp / "serve.yaml", "env": env, "tmp": tmp, "process": proc,
        }
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.mark.cluster
def test_serve_run_of_the_manifest_answers_generate_over_grpc(served: dict[str, Any]) -> None:
    messages = generate(served["target"], "Hello", max_tokens=4, temperature=0.0, ignore_eos=True)
    assert sum(len(m.token_ids) for m in messages) == 4
    assert messages[-1].finish_reason == "length"


@pytest.mark.cluster
def test_serve_run_starts_every_worker_of_the_config(served: dict[str, Any]) -> None:
    pool = status(served["target"]).pools[0]
    assert pool.name == "default"
    assert sorted(w.worker_id for w in pool.workers) == ["default-0", "default-1"]
    # A busy machine may answer a poll late for a moment; both must be in routing soon.
    wait_for(lambda: status(served["target"]).pools[0].live_workers == 2, 60, "both workers live")



# ----- /dashboard, on the same cluster -----------------------------------------------------


def chromium_dom(url: str) -> str:
    """The page's DOM after its scripts ran, from a real headless Chromium."""
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        pytest.fail("the dashboard test needs Chromium: apt-get install -y chromium")
    result = subprocess.run(
        [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--virtual-time-budget=4000", "--dump-dom", url],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    return result.stdout


def _routed(dom: str) -> dict[str, int]:
    """worker id -> its 'routed N' counter, as the rendered page shows it."""
    found = re.findall(r'data-worker="([^"]+)".*?routed (\d+)', dom, flags=re.S)
    return {worker: int(n) for worker, n in found}


@pytest.mark.cluster
def test_dashboard_state_has_every_worker_with_its_block_map_counts(served: dict[str, Any]) -> None:
    state = httpx.get(served["http"] + "/dashboard/state", timeout=30).json()
    grpc_workers = {w.worker_id for p in status(served["target"]).pools for w in p.workers}
    workers = [w for p in state["pools"] for w in p["workers"]]
    assert {w["worker_id"] for w in workers} == grpc_workers
    for w in workers:
        assert w["free_blocks"] + w["live_blocks"] + w["cached_blocks"] == w["total_blocks"]
        assert {"tenant_live_blocks", "preemptions", "evictions"} <= w.keys()


@pytest.mark.cluster
def test_dashboard_in_chromium_names_every_worker_and_follows_traffic(served: dict[str, Any]) -> None:
    url = served["http"] + "/dashboard"
    before = _routed(chromium_dom(url))
    grpc_workers = {w.worker_id for p in status(served["target"]).pools for w in p.workers}
    assert set(before) == grpc_workers
    for i in range(4):
        generate(served["target"], f"dashboard traffic {i}", max_tokens=2, temperature=0.0)
    wait_for(
        lambda: sum(w.requests_routed for w in status(served["target"]).pools[0].workers)
        >= sum(before.values()) + 4,
        30,
        "the requests to be counted",
    )
    after = _routed(chromium_dom(url))
    assert set(after) == grpc_workers
    assert sum(after.values()) >= sum(before.values()) + 4


# ----- pool sizes from the Serve config: user_config + serve run again (reconfigure) ------------


def _gcs_address(process: subprocess.Popen[bytes]) -> str:
    """The GCS address of the Ray instance `serve run` started: its own gcs_server descendant."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parents[int(stat.parent.name)] = int(fields[1])
    mine = {process.pid}
    while grown := {pid for pid, ppid in parents.items() if ppid in mine} - mine:
        mine |= grown
    for pid in mine:
        with contextlib.suppress(OSError):
            args = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
            flags = dict(a[2:].split("=", 1) for a in args if a.startswith("--") and "=" in a)
            if "gcs_server_port" in flags:
                # Port 0 asks for a free one; the chosen port is written to the session dir.
                port = flags["gcs_server_port"]
                if port == "0":
                    (written,) = Path(flags["session-dir"]).glob("gcs_server_port_*")
                    port = written.read_text().strip()
                return f"{flags.get('node-ip-address', '127.0.0.1')}:{port}"
    raise AssertionError("no gcs_server under the serve run process")


def _redeploy_with_pool_size(served: dict[str, Any], workers: int) -> None:
    """The served config with `pagefleet-workers`' user_config naming the pool's size, deployed
    again onto the running cluster: a lightweight update (Serve calls `reconfigure`)."""
    data: dict[str, Any] = yaml.safe_load(served["config"].read_text())
    (owner,) = [d for d in data["applications"][0]["deployments"] if d["name"] == "pagefleet-workers"]
    owner["user_config"] = {"pool_workers": {"default": workers}}
    path = served["tmp"] / f"serve-{workers}.yaml"
    path.write_text(yaml.safe_dump(data))
    # `serve run` submits the config and returns; never `auto` on a machine with other clusters.
    address = _gcs_address(served["process"])
    done = subprocess.run(
        [sys.executable, "-m", "ray.serve.scripts", "run", "--non-blocking", "--address", address, str(path)],
        env=served["env"], cwd=served["tmp"], capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


@pytest.mark.cluster
def test_a_user_config_change_adds_and_drains_workers_without_a_restart(served: dict[str, Any]) -> None:
    def workers() -> dict[str, bool]:
        return {w.worker_id: w.alive for w in status(served["target"]).pools[0].workers}

    before = generate(served["target"], "Hello", max_tokens=4, temperature=0.0, ignore_eos=True)
    _redeploy_with_pool_size(served, 3)
    wait_for(lambda: workers() == {"default-0": True, "default-1": True, "default-2": True}, 180, "3 live")
    routed = {generate(served["target"], f"spread {i}", max_tokens=1)[-1].worker_id for i in range(16)}
    assert "default-2" in routed
    _redeploy_with_pool_size(served, 2)
    wait_for(lambda: workers() == {"default-0": True, "default-1": True}, 180, "default-2 drained and gone")
    # The same ingress replica and workers serve on: the greedy answer is unchanged.
    again = generate(served["target"], "Hello", max_tokens=4, temperature=0.0, ignore_eos=True)
    assert [t for m in again for t in m.token_ids] == [t for m in before for t in m.token_ids]
