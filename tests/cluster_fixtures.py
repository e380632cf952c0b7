"""Helpers shared by the cluster tests: a small cluster config and gRPC calls."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import grpc
import psutil
import ray

from pagefleet.cluster.app import RunningCluster, start_cluster
from pagefleet.cluster.client import auth_metadata, build_request
from pagefleet.cluster.config import ClusterConfig
from pagefleet.cluster.proto import pagefleet_pb2 as pb
from pagefleet.cluster.proto import pagefleet_pb2_grpc as pb_grpc
from pagefleet.worker.engine import EngineStats
from pagefleet.worker.llm import LLM

# Small pools and short blocks: a 40-token prompt already spans several blocks.
BLOCK_SIZE = 4
NUM_KV_BLOCKS = 96
MAX_MODEL_LEN = 160


def small_cluster_config(
    *,
    workers: int = 2,
    policy: str = "prefix_affinity",
    extra_pools: int = 0,
    wait_queue: int = 2,
    scheduler_shards: int = 1,
) -> ClusterConfig:
    """Tiny model, `workers` CPU workers in pool "default" (+ 1-worker pools "spare<i>"),
    their view kept by `scheduler_shards` scheduler actors.

    Admission by prompt: the tests that fill a worker count requests against
    max_num_seqs with long streams; full admission (the default) has its own
    tests, which switch the mode at run time (`Ingress.set_admission`).
    """
    pool = {
        "model": "tiny",
        "block_size": BLOCK_SIZE,
        "num_kv_blocks": NUM_KV_BLOCKS,
        "max_model_len": MAX_MODEL_LEN,
        "max_num_seqs": 4,
        "max_num_batched_tokens": 256,
        "device": "cpu",
    }
    pools = [{"name": "default", "workers": workers, **pool}]
    pools += [{"name": f"spare{i}", "workers": 1, **pool} for i in range(extra_pools)]
    return ClusterConfig.from_dict(
        {
            "pools": pools,
            "router": {"policy": policy},
            "scheduler": {
                "report_interval_s": 0.2,
                "report_timeout_s": 2.0,
                "wait_queue_size": wait_queue,
                "shards": scheduler_shards,
                "admission": "prompt",
            },
            "server": {"host": "127.0.0.1", "grpc_port": 0, "http_port": None},
        }
    )


def stub(target: str) -> tuple[grpc.Channel, pb_grpc.GenerationStub]:
    channel = grpc.insecure_channel(target)
    return channel, pb_grpc.GenerationStub(channel)


def generate(
    target: str, prompt: str | list[int], *, pool: str = "", request_id: str = "", **sampling: Any
) -> list[pb.GenerateResponse]:
    """Run one Generate call to the end and return every message."""
    channel, s = stub(target)
    with channel:
        req = build_request(prompt, sampling, request_id=request_id, pool=pool)
        return list(s.Generate(req, timeout=120))


def tokens_of(messages: list[pb.GenerateResponse]) -> list[int]:
    return [t for m in messages for t in m.token_ids]


def status(target: str, pool: str = "", api_key: str | None = None) -> pb.StatusResponse:
    channel, s = stub(target)
    with channel:
        return s.GetStatus(pb.StatusRequest(pool=pool), timeout=30, metadata=auth_metadata(api_key))


def pool_status(
    target: str, pool: str = "default", api_key: str | None = None
) -> pb.PoolStatus:
    return status(target, pool, api_key).pools[0]


def wait_for(
    predicate: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.05
) -> None:
    """Poll `predicate` until it holds; fail with `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for: {what}")
        time.sleep(interval_s)


def open_stream(
    target: str, prompt: str | list[int], **sampling: Any
) -> tuple[grpc.Channel, Iterator[pb.GenerateResponse]]:
    """Start a Generate call and return (channel, response iterator) for the caller to drive."""
    channel, s = stub(target)
    return channel, s.Generate(build_request(prompt, sampling), timeout=120)


def offline_tiny() -> LLM:
    """The offline engine of a `small_cluster_config` pool: the no-fault, no-cluster answer."""
    return LLM(
        model="tiny", block_size=BLOCK_SIZE, num_kv_blocks=NUM_KV_BLOCKS, max_model_len=MAX_MODEL_LEN
    )


def wait_until_no_block_leaked(workers: Sequence[tuple[str, Any]], timeout_s: float = 60.0) -> None:
    """Poll every `(worker_id, handle)` until none holds a live block and on each
    free + cached == total; fail after `timeout_s`."""

    def clean() -> bool:
        for _, handle in workers:
            s = ray.get(handle.stats.remote(), timeout=30)
            if s.live != 0 or s.free + s.cached != s.total:
                return False
        return True

    wait_for(clean, timeout_s, "every worker with free + cached == total and no live blocks", 0.2)


def worker_stats(cluster: Any, worker_id: str) -> EngineStats:
    """`LLMEngine.stats()` of one worker of a running cluster."""
    stats: EngineStats = ray.get(cluster.worker_handle(worker_id).stats.remote(), timeout=30)
    return stats


@contextmanager
def local_cluster(config: ClusterConfig, **start: Any) -> Iterator[RunningCluster]:
    """`start_cluster` on a Ray of its own; after `shutdown()` no process it started is
    left (the GCS, raylet, agents and every actor's worker are this process's descendants),
    nor a metrics task of its Serve handle in this process."""
    since = time.time()
    tasks_before = set(serve_metrics_tasks())
    running = start_cluster(config, **start)
    try:
        yield running
    finally:
        started = [p for p in psutil.Process().children(recursive=True) if p.create_time() >= since - 1]
        running.shutdown()

        def left() -> list[str]:
            alive = []
            for proc in started:
                try:
                    if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                        alive.append(f"{proc.pid} {' '.join(proc.cmdline())[:80]}")
                except psutil.NoSuchProcess:
                    pass
            return alive

        wait_for(lambda: not left(), 30, f"no process of the cluster left ({left()})", 0.2)
        wait_for(
            lambda: not set(serve_metrics_tasks()) - tasks_before, 10,
            f"no Serve metrics task of the cluster's handle left ({serve_metrics_tasks()})", 0.1,
        )  # fmt: skip


def serve_metrics_tasks() -> list[str]:
    """The metrics tasks of Serve handles' routers running in this process (on Serve's
    shared router thread, which outlives Ray): "MetricsPusher.metrics_task at 0x..."."""
    from ray.serve._private.router import SingletonThreadRouter

    loop = SingletonThreadRouter._asyncio_loop
    if loop is None:
        return []
    coros = [task.get_coro() for task in asyncio.all_tasks(loop)]
    return [repr(c) for c in coros if "Metrics" in getattr(c, "__qualname__", "")]
