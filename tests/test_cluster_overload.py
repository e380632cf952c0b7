"""Overload: 2,000 concurrent gRPC streams on one small worker with a short wait
queue. Every stream either completes or is refused with RESOURCE_EXHAUSTED or
UNAVAILABLE and a reason; none ends CANCELLED (or with any other code, or no message).
gRPC core's own cut of calls the server has not picked up yet (at random past 1,000
of them) would end about 9% of them CANCELLED."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator

import grpc
import pytest
from cluster_fixtures import local_cluster, small_cluster_config, wait_until_no_block_leaked

from pagefleet.cluster.app import RunningCluster
from pagefleet.cluster.client import build_request
from pagefleet.cluster.proto import pagefleet_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(600)]

STREAMS = 2000
CHANNELS = 8  # clients spread over connections, as many clients are
REFUSALS = {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE}


@pytest.fixture(scope="module")
def cluster() -> Iterator[RunningCluster]:
    with local_cluster(small_cluster_config(workers=1, wait_queue=4)) as running:
        yield running


async def _stream(stub: pb_grpc.GenerationStub, i: int) -> tuple[grpc.StatusCode, str]:
    call = stub.Generate(build_request(f"overload {i}", {"max_tokens": 16}), timeout=240)
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


async def _flood(target: str) -> list[tuple[grpc.StatusCode, str]]:
    channels = [grpc.aio.insecure_channel(target) for _ in range(CHANNELS)]
    try:
        stubs = [pb_grpc.GenerationStub(channel) for channel in channels]
        return await asyncio.gather(*(_stream(stubs[i % CHANNELS], i) for i in range(STREAMS)))
    finally:
        for channel in channels:
            await channel.close()


def test_every_stream_of_a_flood_completes_or_is_refused_with_a_reason(cluster: RunningCluster) -> None:
    results = asyncio.run(_flood(cluster.grpc_target))
    codes = Counter(code for code, _ in results)
    unexplained = [(code, details) for code, details in results
                   if code != grpc.StatusCode.OK and (code not in REFUSALS or not details)]  # fmt: skip
    assert not unexplained, f"{len(unexplained)} streams ended without a reasoned refusal: {codes}"
    assert codes[grpc.StatusCode.OK] > 0 and codes[grpc.StatusCode.RESOURCE_EXHAUSTED] > 0, codes
    wait_until_no_block_leaked(cluster.workers["default"])
