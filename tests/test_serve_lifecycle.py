"""`pagefleet serve` starting, stopping and failing as an operator meets it: another Ray
on the host, an impossible pool, busy ports, a worker that cannot load, a lost GCS (stop
signals: `test_serve_signals.py`). After every stop no process of the server is left
(Ray's agents included)."""

from __future__ import annotations

import signal
import socket
import time
from pathlib import Path

import httpx
import pytest
import yaml
from cluster_fixtures import generate, tokens_of
from serve_process import ServeProcess, other_ray_head, serving, write_config

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(900)]

@pytest.fixture(scope="module")
def other_ray() -> object:
    with other_ray_head() as address:
        yield address


def test_serve_starts_its_own_ray_while_another_runs_and_ray_address_names_it(
    tmp_path: Path, other_ray: str
) -> None:
    config = write_config(tmp_path / "cluster.yaml")
    with serving(["--config", str(config), "--metrics-port", "-1"], tmp_path / "serve.log",
                 RAY_ADDRESS=other_ray) as server:  # fmt: skip
        server.wait_serving()
        assert server.endpoint("Ray").rsplit(":", 1)[1] != other_ray.rsplit(":", 1)[1]
        messages = generate(server.endpoint("gRPC"), "Hello", max_tokens=8, ignore_eos=True)
        assert len(tokens_of(messages)) == 8
        assert server.stop(signal.SIGINT) == 0, server.log[-4000:]
        server.assert_nothing_left()


def test_a_pool_larger_than_the_machine_is_refused_before_ray(tmp_path: Path) -> None:
    config = write_config(tmp_path / "cluster.yaml", pool={"num_kv_blocks": 100_000_000_000})
    server = ServeProcess(["--config", str(config)], tmp_path / "serve.log")
    try:
        assert server.wait_exit(60) == 2
        [line] = server.error_lines()
        assert "pools[0] (default): 100000000000 KV blocks" in line
        assert "more than this machine's memory" in line and "blocks per worker fit" in line
        assert "Ray" not in server.log
        server.assert_nothing_left()
    finally:
        server.close()


def test_a_busy_metrics_port_is_refused_before_ray(tmp_path: Path) -> None:
    config = write_config(tmp_path / "cluster.yaml")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        server = ServeProcess(["--config", str(config), "--metrics-port", str(port)], tmp_path / "serve.log")
        try:
            assert server.wait_exit(60) == 2
            [line] = server.error_lines()
            assert f"cannot listen on 127.0.0.1:{port}" in line and "--metrics-port" in line
            assert "Ray" not in server.log
        finally:
            server.close()


def test_the_same_port_for_grpc_and_metrics_is_refused_before_ray(tmp_path: Path) -> None:
    config = write_config(tmp_path / "cluster.yaml")
    grpc_port = yaml.safe_load(config.read_text())["server"]["grpc_port"]
    server = ServeProcess(["--config", str(config), "--metrics-port", str(grpc_port)], tmp_path / "serve.log")
    try:
        assert server.wait_exit(60) == 2
        [line] = server.error_lines()
        assert f"port {grpc_port} is asked for twice" in line
    finally:
        server.close()


def test_a_worker_that_cannot_load_fails_the_start_in_one_line_after_bounded_retries(
    tmp_path: Path, other_ray: str
) -> None:
    # On a joined cluster the pool is not checked against this machine, so the worker
    # itself finds it cannot allocate the pool.
    config = write_config(tmp_path / "cluster.yaml", pool={"num_kv_blocks": 100_000_000_000})
    server = ServeProcess(["--config", str(config), "--address", other_ray, "--metrics-port", "-1"],
                          tmp_path / "serve.log")  # fmt: skip
    try:
        assert server.wait_exit(300) == 2, server.log[-4000:]
        [line] = server.error_lines()
        assert line.startswith("pagefleet serve: error: pool default: worker default-2 failed to load 3 times: ")
        assert "allocate" in line, line
        server.assert_nothing_left()
    finally:
        server.close()


def test_losing_the_gcs_ends_serve_non_zero_in_one_line_leaving_no_process(tmp_path: Path) -> None:
    config = write_config(tmp_path / "cluster.yaml")
    settings = yaml.safe_load(config.read_text())
    settings["server"]["health_details"] = True  # the operator's switch: per-pool detail to anyone
    config.write_text(yaml.safe_dump(settings))
    with serving(["--config", str(config), "--metrics-port", "-1"], tmp_path / "serve.log") as server:
        server.wait_serving()
        health = httpx.get(f"{server.endpoint('HTTP').removesuffix('/v1')}/health", timeout=30)
        assert health.json() == {"status": "ok", "live_workers": {"default": 1}}
        [gcs] = [p for p in server.processes() if p.name() == "gcs_server"]
        gcs.kill()
        killed = time.monotonic()
        assert server.wait_exit(120) == 1, server.log[-4000:]
        [line] = server.error_lines()
        assert f"the Ray GCS this server started (pid {gcs.pid}) exited" in line, line
        assert time.monotonic() - killed < 60
        server.assert_nothing_left(timeout_s=20)
