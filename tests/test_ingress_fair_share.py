"""Two tenants sharing one pool at the ingress: a flood by one leaves the other room.

Admission only (no request reaches a worker), so no Ray is needed: the
workers are live slots with placeholder handles.
"""

from __future__ import annotations

import asyncio

import pytest

from pagefleet.cluster.api import ErrorCode, GenerationRequest, IngressError
from pagefleet.cluster.config import ClusterConfig, ConfigError
from pagefleet.cluster.ingress import Ingress
from pagefleet.cluster.worker_slots import WorkerSlot
from pagefleet.scheduler.messages import ViewUpdate, WorkerDelta
from pagefleet.worker.events import WorkerInfo
from pagefleet.worker.sampling_params import SamplingParams


def _shared_pool(weights: tuple[float, float] = (1, 1), queue: int = 4) -> Ingress:
    """Pool "shared": two live workers taking one request each; tenants a and b live there."""
    config = ClusterConfig.from_dict(
        {
            "pools": [{"name": "shared", "max_num_seqs": 1}],
            "tenants": [
                {"name": "a", "pool": "shared", "api_key": "ka-0123456789abcdef", "weight": weights[0]},
                {"name": "b", "pool": "shared", "api_key": "kb-0123456789abcdef", "weight": weights[1]},
            ],
            "scheduler": {"wait_queue_size": queue},
        }
    )
    ingress = Ingress(config, {"shared": [("w0", None), ("w1", None)]})
    # The scheduler's view brings both workers into routing.
    live = tuple(WorkerDelta(WorkerInfo(w, "shared", 64), True, None) for w in ("w0", "w1"))
    ingress.fleet.apply(ViewUpdate(1, 2, True, live))
    return ingress


def _request(tenant: str, request_id: str) -> GenerationRequest:
    return GenerationRequest(request_id, (1, 2, 3), SamplingParams(), pool="shared", tenant=tenant)


def _flood(ingress: Ingress, tenant: str, count: int) -> tuple[list[object], list[IngressError]]:
    pool = ingress.config.pools[0]
    admitted: list[object] = []
    refused: list[IngressError] = []
    for i in range(count):
        try:
            admitted.append(ingress.admission.admit(pool, _request(tenant, f"{tenant}{i}"), [1, 2, 3]))
        except IngressError as exc:
            refused.append(exc)
    return admitted, refused


def test_a_flood_is_refused_past_its_share_of_the_queue_naming_it() -> None:
    async def scenario() -> None:
        ingress = _shared_pool()
        admitted, refused = _flood(ingress, "a", 10)
        # 2 running + a's half of a queue of 4.
        assert len(admitted) == 4 and len(refused) == 6
        assert all(e.code is ErrorCode.RESOURCE_EXHAUSTED for e in refused)
        assert "tenant 'a' has 2 requests waiting in pool 'shared', its share of wait_queue_size 4" in (
            refused[0].message
        )

    asyncio.run(scenario())


def test_while_a_floods_b_is_admitted_to_the_queue() -> None:
    async def scenario() -> None:
        ingress = _shared_pool()
        _flood(ingress, "a", 10)
        admitted, refused = _flood(ingress, "b", 2)
        assert not refused and len(admitted) == 2

    asyncio.run(scenario())


def test_the_first_slot_that_frees_goes_to_b_not_to_a_s_backlog() -> None:
    async def scenario() -> None:
        ingress = _shared_pool()
        running, _ = _flood(ingress, "a", 4)
        (b_waiter,), _ = _flood(ingress, "b", 1)
        first = running[0]
        assert isinstance(first, WorkerSlot) and not isinstance(b_waiter, WorkerSlot)
        ingress.admission.release(first, _request("a", "a0").key)  # one of a's requests finished
        assert b_waiter.future.result() is first
        assert ingress.admission.waiting("shared", "a") == 2

    asyncio.run(scenario())


@pytest.mark.parametrize("weights, share_a, share_b", [((1, 1), 4, 4), ((3, 1), 6, 2)])
def test_queue_shares_follow_the_tenant_weights(
    weights: tuple[float, float], share_a: int, share_b: int
) -> None:
    async def scenario() -> None:
        ingress = _shared_pool(weights, queue=8)
        a, _ = _flood(ingress, "a", 20)
        b, _ = _flood(ingress, "b", 20)
        # The two workers' slots went to a; the queue holds each tenant's share.
        assert len(a) == 2 + share_a and len(b) == share_b

    asyncio.run(scenario())


@pytest.mark.parametrize("weight", [0, -1, float("inf")])
def test_a_tenant_weight_must_be_a_finite_positive_number(weight: float) -> None:
    with pytest.raises(ConfigError, match=r"tenants\[0\]\.weight: must be a finite number > 0"):
        ClusterConfig.from_dict(
            {"pools": [{"name": "p"}], "tenants": [{"name": "a", "pool": "p", "weight": weight}]}
        )
