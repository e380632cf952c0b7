"""The cluster end to end: a local Ray, CPU workers on the tiny model, a real gRPC channel.

One cluster for the whole module: pool "default" (2 workers) and pool "spare0"
(1 worker, used by the tests that fill or break a pool), each owned by its own
scheduler shard (`scheduler.shards: 2`: default on shard 0, spare0 on shard 1).
Tests that kill workers run last.
"""

from __future__ import annotations

import concurrent.futures
import re
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import ray
from cluster_fixtures import (
    MAX_MODEL_LEN,
    generate,
    local_cluster,
    offline_tiny,
    open_stream,
    pool_status,
    small_cluster_config,
    status,
    stub,
    tokens_of,
    wait_for,
    worker_stats,
)
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pagefleet import LLM, SamplingParams
from pagefleet.cluster.app import RunningCluster
from pagefleet.cluster.client import build_request, stream_generate
from pagefleet.cluster.proto import pagefleet_pb2 as pb
from pagefleet.worker.structured_output import StructuredOutput

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(300)]

PROMPTS = [
    "The quick brown fox",
    "Once upon a time there was",
    "In the beginning the model",
]


@pytest.fixture(scope="module")
def cluster() -> Iterator[RunningCluster]:
    with local_cluster(small_cluster_config(extra_pools=1, scheduler_shards=2), grpc_port=0) as running:
        yield running


@pytest.fixture(scope="module")
def target(cluster: RunningCluster) -> str:
    return cluster.grpc_target


@pytest.fixture(scope="module")
def offline() -> LLM:
    return offline_tiny()


def _hit_tokens(target: str, worker_id: str) -> int:
    """The worker's prefix hits as the ingress's view has them (its reports arrive through it)."""
    return next(w.prefix_hit_tokens for p in status(target).pools for w in p.workers if w.worker_id == worker_id)


def _live_workers(target: str) -> list[str]:
    return [w.worker_id for p in status(target).pools for w in p.workers if w.alive]


@pytest.fixture(autouse=True)
def pools_end_clean(cluster: RunningCluster, target: str) -> Iterator[None]:
    """After every test: no live blocks anywhere, and free + cached == total on every worker."""
    yield

    def clean() -> bool:
        for worker_id in _live_workers(target):
            s = worker_stats(cluster, worker_id)
            if s.live != 0 or s.free + s.cached != s.total:
                return False
        return True

    wait_for(clean, 30, "every live worker with free + cached == total and no live blocks")


def _set_policy(cluster: RunningCluster, policy: str) -> None:
    cluster.ingress.set_router_policy.remote(policy).result()


# ----- correctness --------------------------------------------------------


@pytest.mark.parametrize(("pool", "shard"), [("default", 0), ("spare0", 1)])
def test_each_pool_is_served_through_the_scheduler_shard_that_owns_it(
    cluster: RunningCluster, target: str, pool: str, shard: int
) -> None:
    _set_policy(cluster, "prefix_affinity")
    assert cluster.config.scheduler_shards() == {"default": 0, "spare0": 1}
    owner, other = cluster.schedulers[shard], cluster.schedulers[1 - shard]
    members = sorted(wid for wid, _ in cluster.workers[pool])
    assert sorted(w.worker_id for w in ray.get(owner.get_view.remote(), timeout=30).workers) == members
    assert not {w.worker_id for w in ray.get(other.get_view.remote(), timeout=30).workers} & set(members)
    indexed = {w: len(ray.get(owner.cached_hashes.remote(w), timeout=30)) for w in members}
    prefix = LONG_PREFIX.format(f"shard {shard}")
    first = generate(target, f"{prefix} question 0?", pool=pool, max_tokens=2)[-1]
    worker, before = first.worker_id, _hit_tokens(target, first.worker_id)
    assert worker in members and first.usage.cached_tokens == 0
    wait_for(
        lambda: len(ray.get(owner.cached_hashes.remote(worker), timeout=30)) >= indexed[worker] + 2,
        30, f"the prompt's blocks in shard {shard}'s index",
    )  # fmt: skip
    # Past the router's own speculative entry: only the shard's view can send it back.
    time.sleep(cluster.config.router.speculative_ttl_s + 1.0)
    second = generate(target, f"{prefix} question 1?", pool=pool, max_tokens=2)[-1]
    assert second.worker_id == worker and second.usage.cached_tokens >= 8
    wait_for(lambda: _hit_tokens(target, worker) >= before + 8, 30, f"{pool}'s hit in the ingress's view")


def test_grpc_streams_equal_offline_generate(target: str, offline: LLM) -> None:
    params = SamplingParams(max_tokens=12)
    expected = offline.generate(PROMPTS, params)
    assert len({t for out in expected for t in out.token_ids}) > 5, "reference output not diverse"
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(lambda p: generate(target, p, max_tokens=12), PROMPTS))
    for want, got in zip(expected, results, strict=True):
        assert tokens_of(got) == want.token_ids
        assert "".join(m.text for m in got) == want.text
        assert got[-1].finish_reason == want.finish_reason
        assert got[-1].usage.completion_tokens == len(want.token_ids)
        assert got[-1].usage.prompt_tokens == len(want.prompt_token_ids)


def _by_index(messages: list[pb.GenerateResponse], n: int) -> tuple[list[list[int]], list[list[str]]]:
    """Each completion's tokens, and the finish reasons of its messages (non-empty only)."""
    tokens: list[list[int]] = [[] for _ in range(n)]
    reasons: list[list[str]] = [[] for _ in range(n)]
    for m in messages:
        tokens[m.index].extend(m.token_ids)
        if m.finish_reason:
            reasons[m.index].append(m.finish_reason)
    return tokens, reasons


def test_grpc_n_streams_each_completion_by_index_to_its_own_finish_reason(
    target: str, offline: LLM
) -> None:
    want = offline.generate(PROMPTS[0], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    got = generate(target, PROMPTS[0], max_tokens=12, ignore_eos=True, n=2)
    tokens, reasons = _by_index(got, 2)
    assert tokens == [want.token_ids, want.token_ids]
    assert reasons == [["length"], ["length"]]
    assert {m.index for m in got[:-1]} == {0, 1} and got[-1].finish_reason
    assert got[-1].usage.completion_tokens == 2 * len(want.token_ids)
    assert got[-1].usage.prompt_tokens == len(want.prompt_token_ids)


def test_token_id_prompt_equals_text_prompt(target: str, offline: LLM) -> None:
    ids = offline.tokenizer.encode(PROMPTS[0])
    assert tokens_of(generate(target, ids, max_tokens=8)) == tokens_of(
        generate(target, PROMPTS[0], max_tokens=8)
    )


def test_client_stream_generate_streams_the_offline_output(target: str, offline: LLM) -> None:
    want = offline.generate(PROMPTS[1], SamplingParams(max_tokens=10))[0]
    chunks = list(stream_generate(target, PROMPTS[1], SamplingParams(max_tokens=10)))
    assert [t for c in chunks for t in c.token_ids] == want.token_ids
    assert chunks[-1].finish_reason == want.finish_reason


# ----- routing ------------------------------------------------------------


def _run_group(target: str, prefix: str, n: int) -> list[pb.GenerateResponse]:
    """n requests sharing `prefix`, one after another; the last message of each."""
    return [generate(target, f"{prefix} question {j}?", max_tokens=2)[-1] for j in range(n)]


LONG_PREFIX = "{} team: you are a helpful assistant. Answer briefly and politely."


def test_prefix_affinity_keeps_a_group_on_one_worker_and_hits_its_cache(
    cluster: RunningCluster, target: str
) -> None:
    _set_policy(cluster, "prefix_affinity")
    hits_before = pool_status(target).workers
    for group in ("alpha", "beta"):
        finals = _run_group(target, LONG_PREFIX.format(group), 4)
        assert len({m.worker_id for m in finals}) == 1
        assert finals[0].usage.cached_tokens == 0
        assert all(m.usage.cached_tokens >= 8 for m in finals[1:])
    # GetStatus sees the same hits (reports arrive asynchronously).
    before = sum(w.prefix_hit_tokens for w in hits_before)
    wait_for(
        lambda: sum(w.prefix_hit_tokens for w in pool_status(target).workers) >= before + 6 * 8,
        10,
        "prefix hits visible in GetStatus",
    )


def test_round_robin_spreads_a_group_and_misses_the_cache(
    cluster: RunningCluster, target: str
) -> None:
    _set_policy(cluster, "round_robin")
    try:
        finals = _run_group(target, LONG_PREFIX.format("gamma"), 4)
    finally:
        _set_policy(cluster, "prefix_affinity")
    assert len({m.worker_id for m in finals}) == 2
    # The first request on each worker found nothing cached.
    first_per_worker = {}
    for m in finals:
        first_per_worker.setdefault(m.worker_id, m)
    assert all(m.usage.cached_tokens == 0 for m in first_per_worker.values())


# ----- cancel, disconnect, abort -----------------------------------------


def _stream_started(target: str, prompt: str) -> tuple[grpc.Channel, Any, str]:
    channel, it = open_stream(target, prompt, max_tokens=MAX_MODEL_LEN - 20, ignore_eos=True)
    first = next(it)
    while not first.token_ids:
        first = next(it)
    return channel, it, first.worker_id


def _leave_mid_stream(cluster: RunningCluster, target: str, how: str) -> None:
    """Start a long stream, then cancel the call or close the channel after its first token,
    and check the worker aborts it (not just finishes it) and frees its blocks."""
    for attempt in range(3):
        channel, it, worker_id = _stream_started(target, f"Leave me after a token ({attempt})")
        stats = worker_stats(cluster, worker_id)
        if stats.live == 0:
            # A loaded machine let the whole request finish before the client could
            # leave: that proves nothing about abort, so try again.
            channel.close()
            continue
        if how == "cancel":
            it.cancel()
        else:
            channel.close()
        # The issue asks for "within a second", which it takes on an idle machine; the
        # bound is loose so a loaded CI box does not turn scheduling delay into a failure.
        # The abort counter tells an aborted request from one that ran to its end.
        aborted_before = stats.requests_aborted

        def aborted_and_freed(worker: str = worker_id, before: int = aborted_before) -> bool:
            now = worker_stats(cluster, worker)
            return bool(now.live == 0 and now.requests_aborted == before + 1)

        wait_for(
            aborted_and_freed,
            5.0,
            f"the request aborted and its blocks freed after the client's {how}",
        )
        channel.close()
        return
    pytest.fail("three requests finished before the client could leave")


def test_cancel_aborts_the_request_and_frees_its_blocks(
    cluster: RunningCluster, target: str
) -> None:
    _leave_mid_stream(cluster, target, "cancel")


def test_disconnect_aborts_the_request_and_frees_its_blocks(
    cluster: RunningCluster, target: str
) -> None:
    _leave_mid_stream(cluster, target, "disconnect")


def test_abort_rpc_ends_the_stream_with_abort(cluster: RunningCluster, target: str) -> None:
    channel, s = stub(target)
    with channel:
        req = pb.GenerateRequest(
            request_id="to-abort",
            prompt="Abort me by id",
            sampling=pb.SamplingParams(max_tokens=MAX_MODEL_LEN - 20, ignore_eos=True),
        )
        it = s.Generate(req, timeout=60)
        next(it)
        assert s.Abort(pb.AbortRequest(request_id="to-abort")).found
        rest = list(it)
    assert rest[-1].finish_reason == "abort"
    channel, s = stub(target)
    with channel:
        assert not s.Abort(pb.AbortRequest(request_id="to-abort")).found


# ----- bad requests --------------------------------------------------------

BAD_REQUESTS = {
    "empty prompt": (pb.GenerateRequest(), grpc.StatusCode.INVALID_ARGUMENT, "empty"),
    "text and ids": (
        pb.GenerateRequest(prompt="hi", prompt_token_ids=[1, 2]),
        grpc.StatusCode.INVALID_ARGUMENT,
        "exactly one",
    ),
    "prompt too long": (
        pb.GenerateRequest(prompt_token_ids=[5] * (MAX_MODEL_LEN + 1)),
        grpc.StatusCode.INVALID_ARGUMENT,
        str(MAX_MODEL_LEN),
    ),
    "max_tokens too large": (
        pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=MAX_MODEL_LEN)),
        grpc.StatusCode.INVALID_ARGUMENT,
        str(MAX_MODEL_LEN),
    ),
    "negative temperature": (
        pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(temperature=-1.0)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "temperature",
    ),
    "n above server.max_n": (
        pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(n=17)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "n must be at most 16 (server.max_n",
    ),
    "negative n": (
        pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(n=-1)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "n must be an integer >= 1",
    ),
    "top_p above 1": (
        pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(top_p=1.5)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "top_p",
    ),
    "token id outside the vocabulary": (
        pb.GenerateRequest(prompt_token_ids=[1, 10**9]),
        grpc.StatusCode.INVALID_ARGUMENT,
        "vocabulary",
    ),
    "unknown pool": (
        pb.GenerateRequest(prompt="hi", pool="nope"),
        grpc.StatusCode.NOT_FOUND,
        "nope",
    ),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_gets_its_status_code_and_the_server_keeps_serving(
    target: str, case: str
) -> None:
    request, code, detail = BAD_REQUESTS[case]
    channel, s = stub(target)
    with channel:
        with pytest.raises(grpc.RpcError) as err:
            list(s.Generate(request, timeout=60))
        assert err.value.code() == code
        assert detail in err.value.details()
    assert generate(target, "still serving", max_tokens=2)[-1].finish_reason


def test_full_pool_answers_resource_exhausted(cluster: RunningCluster, target: str) -> None:
    # spare0: 1 worker x max_num_seqs 4 + wait_queue_size 2 = 6 outstanding requests.
    streams = []
    try:
        for i in range(6):
            streams.append(open_stream_in_pool(target, f"fill the pool {i}", "spare0"))
        wait_for(
            lambda: (lambda p: p.num_running + p.num_waiting)(pool_status(target, "spare0")) == 6,
            30,
            "six requests running or waiting in spare0",
        )
        with pytest.raises(grpc.RpcError) as err:
            generate(target, "one too many", pool="spare0", max_tokens=2)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "limit 6" in err.value.details()
    finally:
        for channel, it in streams:
            it.cancel()
            channel.close()


def _hold_spare0(cluster: RunningCluster, target: str) -> list[tuple[grpc.Channel, Any]]:
    """Four long streams: spare0's one worker (max_num_seqs 4) has no room left."""
    holders = [open_stream_in_pool(target, f"hold the worker {i}", "spare0") for i in range(4)]
    worker_id = cluster.workers["spare0"][0][0]
    wait_for(
        lambda: (lambda s: s.num_running + s.num_waiting)(worker_stats(cluster, worker_id)) == 4,
        30,
        "four requests on spare0's worker",
    )
    return holders


def _on_worker_and_pool(cluster: RunningCluster, target: str) -> tuple[int, int]:
    """(requests in spare0's engine, requests the pool status counts incl. the ingress queue)."""
    s = worker_stats(cluster, cluster.workers["spare0"][0][0])
    p = pool_status(target, "spare0")
    return s.num_running + s.num_waiting, p.num_running + p.num_waiting


def test_request_waits_at_the_ingress_and_runs_when_a_slot_frees(
    cluster: RunningCluster, target: str
) -> None:
    holders = _hold_spare0(cluster, target)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            queued = pool.submit(generate, target, "wait for a slot", pool="spare0", max_tokens=2)
            # Late binding: the fifth request is not sent to the full worker's engine queue.
            wait_for(
                lambda: _on_worker_and_pool(cluster, target) == (4, 5),
                30,
                "four requests on the worker and one waiting at the ingress",
            )
            for _channel, it in holders:
                it.cancel()
            result = queued.result(timeout=120)
        assert result[-1].finish_reason == "length"
        assert len(tokens_of(result)) == 2
    finally:
        for channel, it in holders:
            it.cancel()
            channel.close()


def test_a_cancelled_waiting_request_leaves_the_ingress_queue(
    cluster: RunningCluster, target: str
) -> None:
    holders = _hold_spare0(cluster, target)
    channel, waiting = open_stream_in_pool(target, "cancel me while I wait", "spare0")
    try:
        wait_for(
            lambda: _on_worker_and_pool(cluster, target) == (4, 5),
            30,
            "four requests on the worker and one waiting at the ingress",
        )
        waiting.cancel()
        # The pool's count (reports + ingress queue) falls back to what the engine holds.
        wait_for(
            lambda: (lambda c: c[0] == c[1])(_on_worker_and_pool(cluster, target)),
            30,
            "the cancelled request gone from the ingress queue",
        )
    finally:
        channel.close()
        for holder_channel, it in holders:
            it.cancel()
            holder_channel.close()


def open_stream_in_pool(target: str, prompt: str, pool: str) -> tuple[grpc.Channel, Any]:
    channel, s = stub(target)
    req = pb.GenerateRequest(
        prompt=prompt,
        pool=pool,
        sampling=pb.SamplingParams(max_tokens=MAX_MODEL_LEN - 20, ignore_eos=True),
    )
    return channel, s.Generate(req, timeout=120)


# ----- policy when the pool fills: admission and priority ---------------------


def _run_in_spare0(
    target: str, prompts: list[str], max_tokens: int, priority: int = 0
) -> list[concurrent.futures.Future[list[pb.GenerateResponse]]]:
    def call(prompt: str) -> list[pb.GenerateResponse]:
        channel, s = stub(target)
        with channel:
            req = build_request(
                prompt, {"max_tokens": max_tokens, "ignore_eos": True}, pool="spare0",
                priority=priority,
            )
            return list(s.Generate(req, timeout=240))

    executor = concurrent.futures.ThreadPoolExecutor(len(prompts))
    futures = [executor.submit(call, p) for p in prompts]
    executor.shutdown(wait=False)
    return futures


@pytest.mark.parametrize("mode", ["prompt", "full"])
def test_full_admission_keeps_a_full_pool_free_of_preemptions(
    cluster: RunningCluster, target: str, offline: LLM, mode: str
) -> None:
    # Four 140-token requests each claim ~37 of spare0's 96 blocks: by prompt all four
    # run and outgrow the pool; by prompt + max_tokens two run and two wait.
    worker = cluster.workers["spare0"][0][0]
    prompts = [f"admission {mode} request {i}" for i in range(4)]
    max_tokens = MAX_MODEL_LEN - 20
    before = worker_stats(cluster, worker).preemptions_total
    cluster.ingress.set_admission.remote(mode).result()
    try:
        results = [f.result(timeout=240) for f in _run_in_spare0(target, prompts, max_tokens)]
    finally:
        cluster.ingress.set_admission.remote("prompt").result()
    preempted = worker_stats(cluster, worker).preemptions_total - before
    if mode == "full":
        assert preempted == 0
    else:
        assert preempted > 0
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for prompt, got in zip(prompts, results, strict=True):
        assert tokens_of(got) == offline.generate(prompt, params)[0].token_ids


def test_a_high_priority_request_preempts_low_ones_in_a_full_pool_and_finishes_first(
    cluster: RunningCluster, target: str, offline: LLM
) -> None:
    # Four long low-priority streams take all of spare0's sequence slots.
    worker = cluster.workers["spare0"][0][0]
    low_prompts = [f"low priority stream {i}" for i in range(4)]
    long = MAX_MODEL_LEN - 20
    lows = _run_in_spare0(target, low_prompts, long)
    wait_for(
        lambda: worker_stats(cluster, worker).num_running == 4, 30, "four low streams running"
    )
    before = worker_stats(cluster, worker).preemptions_total
    (high,) = _run_in_spare0(target, ["an urgent request"], 8, priority=5)
    high_result = high.result(timeout=240)
    # Sent at once (not queued behind them), and a low one made way in the engine.
    assert not any(f.done() for f in lows), "the high-priority request should finish first"
    assert worker_stats(cluster, worker).preemptions_total > before
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    assert tokens_of(high_result) == offline.generate("an urgent request", params)[0].token_ids
    long_params = SamplingParams(max_tokens=long, ignore_eos=True)
    for prompt, future in zip(low_prompts, lows, strict=True):
        assert tokens_of(future.result(timeout=240)) == offline.generate(prompt, long_params)[0].token_ids


# ----- operations ------------------------------------------------------------


def test_health_service_reports_serving(target: str) -> None:
    with grpc.insecure_channel(target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "pagefleet.v1.Generation"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_the_generation_service(target: str) -> None:
    with grpc.insecure_channel(target) as channel:
        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = refl.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
        )
        names = {s.name for r in replies for s in r.list_services_response.service}
    assert "pagefleet.v1.Generation" in names


def test_status_lists_every_worker_with_its_pool_counters(target: str) -> None:
    pools = {p.name: p for p in status(target).pools}
    assert set(pools) == {"default", "spare0"}
    default = pools["default"]
    assert [w.worker_id for w in default.workers] == ["default-0", "default-1"]
    for w in default.workers:
        assert w.alive and w.total_blocks == 96
        assert w.free_blocks + w.cached_blocks + w.live_blocks == w.total_blocks
    assert default.total_blocks == 192


def test_status_command_prints_a_row_per_worker(
    target: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from pagefleet.cli import main

    assert main(["status", "--target", target]) == 0
    out = capsys.readouterr().out
    for worker_id in ("default-0", "default-1", "spare0-0"):
        assert worker_id in out


def test_metrics_endpoint_exports_pool_gauges_and_latency_histograms(
    cluster: RunningCluster, target: str
) -> None:
    generate(target, "measure me", max_tokens=3)
    url = f"http://127.0.0.1:{cluster.metrics_port}/metrics"
    body = urllib.request.urlopen(url, timeout=10).read().decode()
    assert 'kv_blocks_total{pool="default",worker="default-0"} 96.0' in body
    for name in ("kv_blocks_free", "kv_blocks_cached", "prefix_cache_hits_total", "num_running"):
        assert f"{name}{{" in body
    assert "time_to_first_token_seconds_bucket" in body
    assert "e2e_request_latency_seconds_count" in body
    assert 'ingress_waiting_requests{pool="default"} 0.0' in body


# ----- faults (run last: they restart actors) ---------------------------------


def test_killing_one_scheduler_shard_leaves_both_pools_serving_and_its_view_rebuilds(
    cluster: RunningCluster, target: str
) -> None:
    shard0, shard1 = cluster.schedulers
    kept = ray.get(shard0.generation.remote(), timeout=30)
    killed = ray.get(shard1.generation.remote(), timeout=30)
    ray.kill(shard1, no_restart=False)
    for pool in ("default", "spare0"):
        assert generate(target, f"serve {pool} without its shard", pool=pool, max_tokens=4)[-1].finish_reason

    def rebuilt() -> bool:
        if ray.get(shard1.generation.remote(), timeout=10) == killed:
            return False
        view = ray.get(shard1.get_view.remote(), timeout=10)
        stats = ray.get(shard1.index_stats.remote(), timeout=10)
        return [w.worker_id for w in view.workers if w.alive] == ["spare0-0"] and stats["snapshots"] >= 1
    wait_for(rebuilt, 60, "spare0-0 re-registered with the restarted shard 1, with a snapshot", 0.5)
    # The other shard never noticed: same incarnation, same workers.
    assert ray.get(shard0.generation.remote(), timeout=30) == kept
    assert sorted(w.worker_id for w in ray.get(shard0.get_view.remote(), timeout=30).workers) == ["default-0", "default-1"]
    # The ingress follows the new incarnation: spare0's fresh hits reach GetStatus through it.
    before = _hit_tokens(target, "spare0-0")
    prefix = LONG_PREFIX.format("after the restart")
    for j in range(2):
        generate(target, f"{prefix} question {j}?", pool="spare0", max_tokens=2)
    wait_for(lambda: _hit_tokens(target, "spare0-0") >= before + 8, 30, "spare0's new hits in the ingress's view")
    assert generate(target, "default after the rebuild", max_tokens=3)[-1].finish_reason == "length"


def _stream_killing_its_worker(
    cluster: RunningCluster, target: str, prompt: str, **sampling: Any
) -> tuple[list[Any], str]:
    """Stream `prompt`, kill (Ray restarts it) the worker that sends its first token, and
    read the stream to its end; its messages, and the killed worker's id."""
    channel, it = open_stream(target, prompt, **sampling)
    with channel:
        got = [next(it)]
        while not got[-1].token_ids:
            got.append(next(it))
        victim = got[-1].worker_id
        ray.kill(cluster.worker_handle(victim), no_restart=False)
        got += list(it)
    return got, victim


def test_worker_killed_mid_stream_resumes_with_the_no_fault_output(
    cluster: RunningCluster, target: str, offline: LLM
) -> None:
    prompt = "A worker dies while this stream runs"
    max_tokens = MAX_MODEL_LEN - 20
    want = offline.generate(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))[0]
    got, victim = _stream_killing_its_worker(cluster, target, prompt, max_tokens=max_tokens, ignore_eos=True)
    assert tokens_of(got) == want.token_ids
    assert got[-1].finish_reason == "length"
    assert got[-1].worker_id != victim, "the stream should have moved to the other worker"
    wait_for(
        lambda: victim in _live_workers(target), 120, f"{victim} back in routing", interval_s=0.5
    )


def test_a_worker_killed_mid_stream_of_n_2_resumes_each_completion_with_the_no_fault_output(
    cluster: RunningCluster, target: str, offline: LLM
) -> None:
    """Each completion goes on from its own output so far (as an n=1 continuation)."""
    prompt = "A worker dies while two completions stream"
    max_tokens = MAX_MODEL_LEN - 20
    want = offline.generate(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))[0]
    got, victim = _stream_killing_its_worker(cluster, target, prompt, max_tokens=max_tokens, ignore_eos=True, n=2)
    tokens, reasons = _by_index(got, 2)
    assert tokens == [want.token_ids, want.token_ids]
    assert reasons == [["length"], ["length"]]
    assert got[-1].worker_id != victim, "the streams should have moved to the other worker"
    assert got[-1].usage.completion_tokens == 2 * max_tokens
    wait_for(
        lambda: victim in _live_workers(target), 120, f"{victim} back in routing", interval_s=0.5
    )


def test_a_seeded_sampled_n_2_stream_resumed_after_its_worker_died_draws_the_no_fault_tokens(
    cluster: RunningCluster, target: str, offline: LLM
) -> None:
    """Each draw depends only on (seed, completion, output position), so the continuations
    on the other worker draw what the undisturbed completions drew."""
    prompt = "A worker dies while two seeded completions stream"
    max_tokens = MAX_MODEL_LEN - 20
    sampling = {"max_tokens": max_tokens, "ignore_eos": True, "n": 2, "temperature": 0.8, "seed": 5}
    want = offline.generate(prompt, SamplingParams(**sampling))[0]  # type: ignore[arg-type]
    got, victim = _stream_killing_its_worker(cluster, target, prompt, **sampling)
    tokens, _ = _by_index(got, 2)
    assert got[-1].worker_id != victim, "the streams should have moved to the other worker"
    assert tokens == [c.token_ids for c in want.outputs]
    wait_for(
        lambda: victim in _live_workers(target), 120, f"{victim} back in routing", interval_s=0.5
    )


def test_a_structured_stream_resumed_after_its_worker_died_keeps_to_its_grammar(
    cluster: RunningCluster, target: str, offline: LLM
) -> None:
    """The new worker rebuilds the matcher from the tokens streamed so far."""
    regex = r"[a-z]{400}"  # longer than max_tokens allow: the stream runs to its end
    prompt = "A worker dies mid-regex"
    max_tokens = MAX_MODEL_LEN - 20
    params = SamplingParams(max_tokens=max_tokens, structured=StructuredOutput(regex=regex))
    want = offline.generate(prompt, params)[0]
    got, victim = _stream_killing_its_worker(cluster, target, prompt, max_tokens=max_tokens, regex=regex)
    assert got[-1].worker_id != victim, "the stream should have moved to the other worker"
    assert tokens_of(got) == want.token_ids
    assert got[-1].finish_reason == want.finish_reason == "length"
    assert re.fullmatch(r"[a-z]+", "".join(m.text for m in got))
    wait_for(
        lambda: victim in _live_workers(target), 120, f"{victim} back in routing", interval_s=0.5
    )


def test_pool_without_a_live_worker_answers_unavailable(
    cluster: RunningCluster, target: str
) -> None:
    ray.kill(cluster.worker_handle("spare0-0"), no_restart=True)
    wait_for(lambda: "spare0-0" not in _live_workers(target), 30, "spare0-0 out of routing")
    with pytest.raises(grpc.RpcError) as err:
        generate(target, "nobody home", pool="spare0", max_tokens=2)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert generate(target, "the default pool still serves", max_tokens=2)[-1].finish_reason
    # A pool with no live worker is a degraded server: the health service says so.
    with grpc.insecure_channel(target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service="pagefleet.v1.Generation")
        wait_for(
            lambda: health.Check(request, timeout=10).status
            == health_pb2.HealthCheckResponse.NOT_SERVING,
            10,
            "health NOT_SERVING while pool spare0 has no live worker",
        )
