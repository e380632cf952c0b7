"""GCS fault tolerance: with the head's GCS on an external Redis, losing the GCS costs no stream.

The cluster is a real `ray start --head` with `RAY_REDIS_ADDRESS` naming a
private `redis-server` (`ray_nodes.redis_server`), and `pagefleet serve
--address` on it with `server.gcs_fault_tolerance: true`. The module's scenario
opens long greedy streams, SIGKILLs the head's `gcs_server` while they run,
starts it again a few seconds later with the same command line (KubeRay
restarts the head pod; here the GCS process alone restarts, so the head's
raylet and the actors on it live on), and records what the clients saw. Each
test then checks one thing about it: the streams' output is the no-fault
output (the pool's engine run in the test's process) and tokens kept arriving
while the GCS was down, health stayed serving, requests after the GCS is back
succeed, no KV block leaked, and stopping the server leaves no process of it.

Without fault tolerance the behaviour is the one of issue 21 and is tested
where it lives: health turns NOT_SERVING within seconds
(`test_cluster_health.test_losing_the_gcs_turns_grpc_and_http_health_not_serving_within_seconds`)
and `pagefleet serve` exits 1 in one line leaving no process
(`test_serve_lifecycle.test_losing_the_gcs_ends_serve_non_zero_in_one_line_leaving_no_process`).
The `GcsWatch` rule that tells the two apart is checked here without a cluster.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import ray
import yaml
from cluster_fixtures import (
    generate,
    open_stream,
    pool_status,
    tokens_of,
    wait_for,
    wait_until_no_block_leaked,
)
from grpc_health.v1 import health_pb2, health_pb2_grpc
from ray._private.state import actors as actors_in_gcs
from ray_nodes import RayNodes, ray_nodes, redis_server
from serve_process import ServeProcess, free_port, serving

from pagefleet import LLM, SamplingParams
from pagefleet.cluster.config import ClusterConfig, ConfigError
from pagefleet.cluster.gcs_watch import (
    GIVE_UP_MARGIN_S,
    PROBES_LOST,
    GcsWatch,
    gcs_storage,
    ray_reconnect_timeout_s,
    tolerance_s,
)
from pagefleet.cluster.names import NAMESPACE, worker_actor_name

# Two streams per worker, each with room for its prompt and every token it streams.
POOL = {"model": "tiny", "workers": 2, "device": "cpu", "block_size": 4, "num_kv_blocks": 1024,
        "max_model_len": 2048, "max_num_seqs": 4}  # fmt: skip
PROMPTS = [f"stream {i} runs through the GCS restart" for i in range(4)]
STREAM_TOKENS = 1800  # long enough to be running before the kill and after the restart
GCS_DOWN_S = 4.0  # from the kill to the restart
AFTER_TOKENS = 64  # a request once the GCS is back
HEALTH_POLL_S = 0.2


# the rule, without a cluster ---------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_without_fault_tolerance_the_gcs_is_lost_after_three_unanswered_probes_in_a_row() -> None:
    watch = GcsWatch(fault_tolerant=False, clock=FakeClock())
    assert [watch.observe(False), watch.observe(False), watch.observe(True)] == [None, None, None]
    for _ in range(PROBES_LOST - 1):
        assert watch.observe(False) is None
    assert watch.observe(False) == "no GCS fault tolerance: the cluster cannot recover"


def test_with_fault_tolerance_the_gcs_may_be_away_until_the_tolerance_and_come_back() -> None:
    clock = FakeClock()
    watch = GcsWatch(fault_tolerant=True, tolerate_s=30.0, clock=clock)
    for _ in range(50):  # 29.4 s of unanswered probes, one every 0.6 s
        assert watch.observe(False) is None
        clock.now += 0.6
    assert watch.observe(True) is None and watch.away_s == 0.0  # back: the outage is over
    assert watch.observe(False) is None  # a new outage starts from zero
    clock.now += 30.0
    assert watch.observe(False) == (
        "not back within 30s (GCS fault tolerance; Ray gives up at its reconnect timeout)"
    )


def test_the_tolerance_is_rays_reconnect_timeout_less_a_margin() -> None:
    assert ray_reconnect_timeout_s({}) == 60.0  # Ray's default
    assert ray_reconnect_timeout_s({"RAY_gcs_rpc_server_reconnect_timeout_s": "120"}) == 120.0
    assert tolerance_s(120.0) == 120.0 - GIVE_UP_MARGIN_S
    assert tolerance_s(2.0) > 0  # never shorter than a few probes


def test_gcs_fault_tolerance_is_an_explicit_switch_off_by_default() -> None:
    assert ClusterConfig.from_dict({"pools": [{"name": "p"}]}).server.gcs_fault_tolerance is False
    with pytest.raises(ConfigError, match=r"server\.gcs_fault_tolerance: must be bool"):
        ClusterConfig.from_dict({"pools": [{"name": "p"}], "server": {"gcs_fault_tolerance": "yes"}})


def _write_config(path: Path, *, fault_tolerant: bool) -> Path:
    config = {
        "pools": [{"name": "default", **POOL}],
        "server": {"host": "127.0.0.1", "grpc_port": free_port(), "http_port": free_port(),
                   "gcs_fault_tolerance": fault_tolerant},
    }  # fmt: skip
    path.write_text(yaml.safe_dump(config))
    return path


def test_a_local_start_with_gcs_fault_tolerance_is_refused_before_ray(tmp_path: Path) -> None:
    config = _write_config(tmp_path / "cluster.yaml", fault_tolerant=True)
    server = ServeProcess(["--config", str(config)], tmp_path / "serve.log")
    try:
        assert server.wait_exit(60) == 2, server.log[-4000:]
        [line] = server.error_lines()
        assert "server.gcs_fault_tolerance needs --address" in line, line
        assert "Ray" not in server.log.replace(line, "")
    finally:
        server.close()


@pytest.mark.cluster
@pytest.mark.slow
def test_fault_tolerance_on_a_head_that_keeps_its_gcs_in_memory_is_refused_at_start(tmp_path: Path) -> None:
    config = _write_config(tmp_path / "cluster.yaml", fault_tolerant=True)
    with ray_nodes() as nodes:  # a plain `ray start --head`: no Redis
        nodes.start_head(num_cpus=1)  # returns once the head has recorded its GCS storage
        args = ["--config", str(config), "--address", nodes.address, "--metrics-port", "-1"]
        server = ServeProcess(args, tmp_path / "serve.log")
        try:
            assert server.wait_exit(120) == 2, server.log[-4000:]
            [line] = server.error_lines()
            assert "server.gcs_fault_tolerance is set, but the Ray GCS at" in line, line
            assert "keeps its tables in memory: start its head with RAY_REDIS_ADDRESS" in line, line
            server.assert_nothing_left()
        finally:
            server.close()


# the cluster's GCS restarts under running streams ---------------------------------------------


@dataclass
class Stream:
    """One client's stream: its messages and when each arrived."""

    prompt: str
    messages: list[Any] = field(default_factory=list)
    arrived: list[float] = field(default_factory=list)
    error: BaseException | None = None


@dataclass
class Outage:
    """What the clients saw around one GCS kill and restart."""

    nodes: RayNodes
    server: ServeProcess
    target: str
    http_url: str
    want: dict[str, list[int]]  # prompt -> its greedy tokens in a no-fault run
    streams: list[Stream]
    killed_at: float
    restarted_at: float
    health: list[tuple[float, int, int]]  # (time, gRPC health status, HTTP /health status)


def _start_streams(target: str) -> tuple[list[Stream], list[threading.Thread]]:
    """One client thread per prompt of PROMPTS, each running its stream to the end."""
    streams = [Stream(prompt) for prompt in PROMPTS]
    clients = [threading.Thread(target=_run_stream, args=(target, s)) for s in streams]
    for client in clients:
        client.start()
    return streams, clients


def _no_fault_tokens() -> dict[str, list[int]]:
    """The same streams with nothing failing, on the pool's engine in this process (no
    cluster, no GCS): the answer to compare with."""
    engine = {k: v for k, v in POOL.items() if k not in ("workers", "device")}
    llm = LLM(**engine)  # type: ignore[arg-type]
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=STREAM_TOKENS, ignore_eos=True, temperature=0.0))
    return {prompt: list(out.token_ids) for prompt, out in zip(PROMPTS, outputs, strict=True)}


def _run_stream(target: str, stream: Stream) -> None:
    try:
        channel, responses = open_stream(target, stream.prompt, max_tokens=STREAM_TOKENS, ignore_eos=True)
        with channel:
            for message in responses:
                stream.messages.append(message)
                stream.arrived.append(time.monotonic())
    except BaseException as exc:  # recorded: the test says which stream failed how
        stream.error = exc


def _watch_health(target: str, http_url: str, until: threading.Event, seen: list[tuple[float, int, int]]) -> None:
    channel = grpc.insecure_channel(target)
    health = health_pb2_grpc.HealthStub(channel)
    with channel, httpx.Client(timeout=10) as http:
        while not until.is_set():
            status = health.Check(health_pb2.HealthCheckRequest(), timeout=10).status
            seen.append((time.monotonic(), status, http.get(f"{http_url}/health").status_code))
            until.wait(HEALTH_POLL_S)


@pytest.fixture(scope="module")
def outage(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Outage]:
    tmp = tmp_path_factory.mktemp("gcs_ft")
    with redis_server() as redis, ray_nodes(env={"RAY_REDIS_ADDRESS": redis.address}) as nodes:
        nodes.start_head(num_cpus=4)
        config = _write_config(tmp / "cluster.yaml", fault_tolerant=True)
        args = ["--config", str(config), "--address", nodes.address, "--metrics-port", "-1"]
        with serving(args, tmp / "serve.log") as server:
            server.wait_serving()
            target, http_url = server.endpoint("gRPC"), server.endpoint("HTTP").removesuffix("/v1")
            want = _no_fault_tokens()
            streams, clients = _start_streams(target)
            deadline = time.monotonic() + 120
            while not all(s.messages or s.error for s in streams):
                assert time.monotonic() < deadline, "the streams did not start within 120 s"
                time.sleep(0.05)
            health: list[tuple[float, int, int]] = []
            done = threading.Event()
            watcher = threading.Thread(target=_watch_health, args=(target, http_url, done, health))
            watcher.start()
            killed_at = time.monotonic()
            gcs = nodes.kill_gcs()
            time.sleep(GCS_DOWN_S)
            nodes.start_gcs(gcs)
            restarted_at = time.monotonic()
            for client in clients:
                client.join(timeout=300)
            time.sleep(2.0)  # health a while longer, with the GCS back
            done.set()
            watcher.join(timeout=30)
            yield Outage(nodes, server, target, http_url, want, streams, killed_at, restarted_at, health)


@pytest.mark.cluster
@pytest.mark.slow
def test_every_stream_finishes_with_the_no_fault_output_streaming_through_the_outage(outage: Outage) -> None:
    for stream in outage.streams:
        assert stream.error is None, f"{stream.prompt!r}: {stream.error!r}"
        assert len(outage.want[stream.prompt]) == STREAM_TOKENS
        assert tokens_of(stream.messages) == outage.want[stream.prompt]
        assert stream.messages[-1].finish_reason == "length"
        # The GCS's outage fell inside the stream, and tokens came while it was down.
        assert stream.arrived[0] < outage.killed_at < outage.restarted_at < stream.arrived[-1]
        assert any(outage.killed_at < t < outage.restarted_at for t in stream.arrived)


@pytest.mark.cluster
@pytest.mark.slow
def test_health_stays_serving_while_the_gcs_restarts(outage: Outage) -> None:
    assert outage.health and outage.health[-1][0] > outage.restarted_at
    serving_ = health_pb2.HealthCheckResponse.SERVING
    assert [h for h in outage.health if h[1:] != (serving_, 200)] == []
    assert outage.server.proc.poll() is None, outage.server.log[-4000:]
    assert outage.server.error_lines() == []
    # `pagefleet serve` saw the GCS go and come back, and waited instead of stopping.
    tolerated = tolerance_s(ray_reconnect_timeout_s())  # serve's environment is this process's
    assert f"the Ray GCS does not answer: serving on for up to {tolerated:.0f}s" in outage.server.log
    # The driver's GCS client reconnects with gRPC's backoff: it may hear of the GCS after
    # the streams ended, but within the tolerance.
    wait_for(lambda: "the Ray GCS answers again after" in outage.server.log, tolerated, "serve to see the GCS back")


@pytest.mark.cluster
@pytest.mark.slow
def test_new_requests_after_the_gcs_is_back_succeed(outage: Outage) -> None:
    # Greedy: the first tokens of a prompt's no-fault stream.
    messages = generate(outage.target, PROMPTS[0], max_tokens=AFTER_TOKENS, ignore_eos=True)
    assert tokens_of(messages) == outage.want[PROMPTS[0]][:AFTER_TOKENS]
    r = httpx.post(f"{outage.http_url}/v1/completions", timeout=60,
                   json={"model": "default", "prompt": "over HTTP", "max_tokens": 8})  # fmt: skip
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")


@pytest.mark.cluster
@pytest.mark.slow
def test_the_restarted_gcs_still_knows_its_storage_is_redis(outage: Outage) -> None:
    outage.nodes.init(NAMESPACE)  # a new driver joins the restarted GCS
    assert gcs_storage() == "redis"  # what `start_cluster` checks against the config


@pytest.mark.cluster
@pytest.mark.slow
def test_no_kv_block_leaks_on_any_worker(outage: Outage) -> None:
    # The restarted GCS kept the cluster's tables: the named workers still resolve.
    if not ray.is_initialized():
        outage.nodes.init(NAMESPACE)
    workers = [w.worker_id for w in pool_status(outage.target).workers]
    assert len(workers) == POOL["workers"]
    handles = [(wid, ray.get_actor(worker_actor_name(wid), namespace=NAMESPACE)) for wid in workers]
    wait_until_no_block_leaked(handles)


@pytest.mark.cluster
@pytest.mark.slow
def test_stopping_the_server_leaves_no_process_of_it(outage: Outage) -> None:
    assert outage.server.stop(signal.SIGTERM) == 0, outage.server.log[-4000:]
    outage.server.assert_nothing_left()
    if not ray.is_initialized():
        outage.nodes.init(NAMESPACE)
    deadline = time.monotonic() + 60
    while (left := _pagefleet_actors_alive()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert left == []


def _pagefleet_actors_alive() -> list[str]:
    """Every live actor on the cluster: pagefleet's own (scheduler, membership, workers)
    and Serve's (controller, ingress replicas); the test's driver starts none."""
    alive = [a for a in actors_in_gcs().values() if a["State"] == "ALIVE"]
    return sorted(f"{a['ActorClassName']} {a['Name']}" for a in alive)
