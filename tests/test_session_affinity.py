"""Session affinity on a real cluster: two CPU workers in one pool behind two ingress
replicas, sessions named by `x-session-id` over gRPC metadata and HTTP headers.

Every request of a session has a prompt of its own (no prefix in common), so prefix
affinity alone would spread them over both workers; the session pin keeps them on one.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import httpx
import openai
import pytest
import ray
from cluster_fixtures import (
    local_cluster,
    small_cluster_config,
    wait_for,
    wait_until_no_block_leaked,
)

from pagefleet.cluster.api import MAX_SESSION_ID_CHARS
from pagefleet.cluster.app import RunningCluster
from pagefleet.cluster.client import build_request
from pagefleet.cluster.proto import pagefleet_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(300)]

REPLICA_KEY = "x-pagefleet-replica"  # initial metadata naming the replica of a stream
# The tiny model spells digits one token each: a prompt's leading number of its own
# makes its first KV block (BOS + 3 digits) its own.
_NUMBERS = itertools.count(100)
BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "session.py"


@pytest.fixture(scope="module")
def cluster() -> Iterator[RunningCluster]:
    config = small_cluster_config(workers=2).replace(server={"ingress_replicas": 2, "http_port": 0})
    with local_cluster(config, grpc_port=0) as running:
        yield running


@pytest.fixture(autouse=True)
def nothing_leaked(cluster: RunningCluster) -> Iterator[None]:
    yield
    wait_until_no_block_leaked(cluster.workers["default"])


def _prompt(tag: str, turn: int) -> str:
    """A prompt no other shares a block with."""
    return f"{next(_NUMBERS)} {tag} says hello to the session test, turn {turn}."


def _generate(target: str, prompt: str, session: str, *, avoid: str = "") -> tuple[str, str]:
    """One Generate call of `session` on a fresh connection (one the kernel hands to a
    replica other than `avoid`, if given); returns (replica, worker) that served it."""
    for _ in range(60):
        channel = grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
        with channel:
            stub = pb_grpc.GenerationStub(channel)
            call = stub.Generate(
                build_request(prompt, {"max_tokens": 2}), timeout=120,
                metadata=(("x-session-id", session),),
            )  # fmt: skip
            replica = dict(call.initial_metadata())[REPLICA_KEY]
            if avoid and replica == avoid:
                call.cancel()
                continue
            return replica, list(call)[-1].worker_id
    raise AssertionError(f"60 connections and none reached a replica other than {avoid}")


def _session_pins(cluster: RunningCluster) -> int:
    return int(ray.get(cluster.scheduler.index_stats.remote(), timeout=30)["session_pins"])


def test_a_sessions_requests_land_on_one_worker_through_both_replicas(cluster: RunningCluster) -> None:
    pins = _session_pins(cluster)
    replica, worker = _generate(cluster.grpc_target, _prompt("alpha", 0), "grpc-one")
    # The pin reaches the scheduler, and from there every replica's long poll, at once;
    # a client sends its next turn after the answer, as here.
    wait_for(lambda: _session_pins(cluster) > pins, 30, "the session's pin at the scheduler", 0.01)
    served = {replica: {worker}}
    for turn in range(1, 8):
        # Every other turn through the other replica.
        replica, worker = _generate(
            cluster.grpc_target, _prompt("alpha", turn), "grpc-one", avoid=replica if turn % 2 else ""
        )
        served.setdefault(replica, set()).add(worker)
    assert len(served) == 2, "both replicas served the session"
    assert set.union(*served.values()) == {worker}


def test_different_sessions_spread_and_each_keeps_its_worker(cluster: RunningCluster) -> None:
    # One at a time: no worker ever has a request waiting (which would make it
    # overloaded, and move its session). Idle workers tie, and a tie goes to the
    # highest hash of (session, worker): these 12 names land on both workers.
    sessions = [f"spread-{i}" for i in range(12)]
    pins = _session_pins(cluster)
    first = {s: _generate(cluster.grpc_target, _prompt(s, 0), s)[1] for s in sessions}
    assert set(first.values()) == {wid for wid, _ in cluster.workers["default"]}
    # Each session's next turn may reach the other replica, which sends it to the pinned
    # worker once the pin has come through the scheduler (until then it only breaks ties
    # the same way, and a worker whose load report lags is no tie).
    wait_for(lambda: _session_pins(cluster) >= pins + len(sessions), 30, "the sessions' pins", 0.01)
    for session in sessions:
        assert _generate(cluster.grpc_target, _prompt(session, 1), session)[1] == first[session]


def _served_by(cluster: RunningCluster, send: Callable[[], None]) -> str:
    """Run `send()` and return the worker whose prefix cache it queried."""

    def queries() -> dict[str, int]:
        return {
            wid: int(ray.get(h.stats.remote(), timeout=30).prefix_query_tokens)
            for wid, h in cluster.workers["default"]
        }

    before = queries()
    send()
    after = queries()
    changed = [wid for wid in after if after[wid] != before[wid]]
    assert len(changed) == 1, (before, after)
    return changed[0]


def test_an_openai_clients_session_header_keeps_its_requests_on_one_worker(cluster: RunningCluster) -> None:
    # No keep-alive: each request takes a new connection, which the kernel hands to
    # either replica.
    http = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))
    client = openai.OpenAI(
        base_url=f"{cluster.http_url}/v1", api_key="x", timeout=120, max_retries=0, http_client=http
    )

    def ask(turn: int) -> None:
        client.completions.create(
            model="default", prompt=_prompt("http", turn), max_tokens=2,
            extra_headers={"x-session-id": "http-one"},
        )  # fmt: skip

    with http:
        workers = {_served_by(cluster, functools.partial(ask, turn)) for turn in range(6)}
    assert len(workers) == 1


@pytest.mark.parametrize("value", ["s" * (MAX_SESSION_ID_CHARS + 1), b"caf\xe9"])
def test_a_bad_session_id_is_a_400_naming_the_rule(cluster: RunningCluster, value: str | bytes) -> None:
    r = httpx.post(
        f"{cluster.http_url}/v1/completions", timeout=60, headers={"x-session-id": value},
        json={"model": "default", "prompt": "hello", "max_tokens": 2},
    )  # fmt: skip
    assert r.status_code == 400, r.text
    rule = f"at most {MAX_SESSION_ID_CHARS} characters" if isinstance(value, str) else "printable ASCII"
    assert f"x-session-id must be {rule}" in r.json()["error"]["message"]


def test_a_too_long_session_id_is_invalid_argument_over_grpc(cluster: RunningCluster) -> None:
    with grpc.insecure_channel(cluster.grpc_target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(
                build_request("hello", {"max_tokens": 2}), timeout=60,
                metadata=(("x-session-id", "s" * (MAX_SESSION_ID_CHARS + 1)),),
            ))  # fmt: skip
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"at most {MAX_SESSION_ID_CHARS} characters, got {MAX_SESSION_ID_CHARS + 1}" in (
        err.value.details() or ""
    )


def test_the_session_benchmark_smoke_prints_both_ways_and_their_ratios(
    capsys: pytest.CaptureFixture[str],
) -> None:
    spec = importlib.util.spec_from_file_location("session_bench", BENCHMARK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    assert module.main(["--smoke", "--ingress-replicas", "1,2"]) == 0
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    ways = {(cells[0].strip(), cells[1].strip()) for cells in rows if len(cells) == 6}
    assert ways >= {("session", "1"), ("prefix only", "1"), ("session", "2"), ("prefix only", "2")}
    ratios = [cells for cells in rows if len(cells) == 3 and cells[1].strip().endswith("x")]
    assert [cells[0].strip() for cells in ratios] == ["1", "2"]
