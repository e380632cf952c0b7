"""`pagefleet serve` stopped by a signal: SIGTERM to serve, and SIGTERM or SIGHUP to its
whole process group (serve among them), drain the running streams (new ones refused) and
exit 0; SIGINT during start-up stops at once, on a local Ray and on a joined cluster. After
every stop no process of the server is left (Ray's agents included)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from cluster_fixtures import generate, open_stream, tokens_of, wait_for
from ray._private.state import actors as actors_in_gcs
from ray_nodes import ray_nodes
from serve_process import ServeProcess, serving, write_config

from pagefleet.cluster.names import NAMESPACE

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(900)]

STREAM_TOKENS = 300  # a stream still running when the stop signal comes
# ... and one that outlasts the seconds Ray's GCS and raylet take to end on a SIGTERM.
LONG_STREAM_TOKENS = 1000


def test_sigterm_drains_running_streams_refuses_new_ones_and_exits_0(tmp_path: Path) -> None:
    # SIGHUP reaches serve in the process-group test below, beside Ray's processes.
    # A dead address in RAY_ADDRESS (a past cluster's) changes nothing either.
    _assert_stop_drains(
        tmp_path, lambda server: server.proc.send_signal(signal.SIGTERM), RAY_ADDRESS="127.0.0.1:1"
    )


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_stop_signal_to_the_whole_process_group_drains_like_one_to_serve(
    tmp_path: Path, sig: signal.Signals
) -> None:
    # What a closed terminal (SIGHUP) and systemd's default KillMode=control-group
    # (SIGTERM) do: the signal reaches the local Ray's processes too, not only serve.
    _assert_stop_drains(tmp_path, lambda server: os.killpg(server.proc.pid, sig), tokens=LONG_STREAM_TOKENS)


def _assert_stop_drains(
    tmp_path: Path, send_stop: Callable[[ServeProcess], None], tokens: int = STREAM_TOKENS, **env: str
) -> None:
    """With a stream of `tokens` running, `send_stop` stops serve: the stream finishes, a new
    request is refused, serve exits 0 and no process of it is left."""
    config = write_config(tmp_path / "cluster.yaml")
    with serving(["--config", str(config), "--metrics-port", "-1"], tmp_path / "serve.log", **env) as server:
        server.wait_serving()
        target = server.endpoint("gRPC")
        channel, stream = open_stream(target, "Hello", max_tokens=tokens, ignore_eos=True)
        with channel:
            messages = [next(stream)]  # running on the worker
            send_stop(server)
            wait_for(lambda: "pagefleet: draining" in server.log, 30, "the drain to start")
            refused = _refusal(target)
            messages += list(stream)
        assert refused == grpc.StatusCode.UNAVAILABLE
        assert len(tokens_of(messages)) == tokens
        assert messages[-1].finish_reason == "length"
        assert server.wait_exit(120) == 0, server.log[-4000:]
        server.assert_nothing_left()


def _refusal(target: str) -> grpc.StatusCode:
    """The code a new request gets once the drain has begun (it may take the ingress a
    moment to hear of it)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            generate(target, "Hi", max_tokens=1)
        except grpc.RpcError as exc:
            return exc.code()  # type: ignore[no-any-return]  # grpc's stubs are untyped
        assert time.monotonic() < deadline, "new requests still accepted 30 s into the drain"
        time.sleep(0.2)


def test_sigint_during_start_up_stops_at_once(tmp_path: Path) -> None:
    config = write_config(tmp_path / "cluster.yaml")
    server = ServeProcess(["--config", str(config), "--metrics-port", "-1"], tmp_path / "serve.log")
    try:
        wait_for(lambda: "Started a local Ray instance" in server.log, 300, "Ray to start", 0.2)
        started = time.monotonic()
        code = server.stop(signal.SIGINT, timeout_s=60)
        took = time.monotonic() - started
        assert code == 130, server.log[-4000:]
        assert "SIGINT during start-up: stopped" in server.log
        assert took < 20, f"took {took:.1f}s to stop"
        server.assert_nothing_left()
    finally:
        server.close()


def test_sigint_during_start_up_on_a_joined_cluster_leaves_no_serve_app_or_actor_there(tmp_path: Path) -> None:
    config = write_config(tmp_path / "cluster.yaml")
    with ray_nodes() as nodes:
        nodes.start_head()
        nodes.init(NAMESPACE)  # this test's own driver, to see the cluster's actors
        server = ServeProcess(["--config", str(config), "--address", nodes.address, "--metrics-port", "-1"],
                              tmp_path / "serve.log")  # fmt: skip
        try:

            def deploying() -> bool:
                assert server.proc.poll() is None, server.log[-4000:]
                # Serve runs the app's ingress replica: the start is inside serve.run.
                return any(name.startswith("ServeReplica:") for name in _live_actors())

            wait_for(deploying, 300, "the ingress replica to start", 0.2)
            assert server.stop(signal.SIGINT, timeout_s=60) == 130, server.log[-4000:]
            assert "SIGINT during start-up: stopped" in server.log
            server.assert_nothing_left()
            # Serve's controller may stay (Serve's own, detached); nothing of pagefleet's does.
            wait_for(lambda: set(_live_actors()) <= {"ServeController"}, 60, "pagefleet's actors to end", 0.5)
        finally:
            server.close()


def _live_actors() -> list[str]:
    """The class names of the live actors on the cluster this test's driver joined."""
    return [a["ActorClassName"] for a in actors_in_gcs().values() if a["State"] == "ALIVE"]
