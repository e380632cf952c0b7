"""Admission at the ingress against the whole request (prompt + max_tokens), and priority.

Admission only (no request reaches a worker), so no Ray is needed: one live
worker with a placeholder handle, whose load reports the test writes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from pagefleet.cluster.admission import Waiter
from pagefleet.cluster.api import GenerationRequest, scoped_request_id
from pagefleet.cluster.config import ClusterConfig
from pagefleet.cluster.ingress import Ingress
from pagefleet.cluster.request_run import worker_request_id
from pagefleet.cluster.worker_slots import WorkerSlot
from pagefleet.scheduler.messages import ViewUpdate, WorkerDelta
from pagefleet.worker.events import LoadReport, WorkerInfo
from pagefleet.worker.sampling_params import SamplingParams
from pagefleet.worker.wire import origin_of

# 3 prompt tokens + 64 max_tokens = 66 tokens written: 5 blocks of 16.
CLAIM = 5


def one_worker(admission: str = "full", max_num_seqs: int = 8) -> Ingress:
    config = ClusterConfig.from_dict(
        {
            "pools": [{"name": "a", "max_num_seqs": max_num_seqs, "block_size": 16}],
            "scheduler": {"wait_queue_size": 8, "admission": admission},
        }
    )
    ingress = Ingress(config, {"a": [("w0", None)]})
    report(ingress, free=10)
    return ingress


_seq = 0


def report(
    ingress: Ingress,
    *,
    free: int,
    committed: int = 0,
    priority_claims: Mapping[int, tuple[int, int]] | None = None,
    mine: int = 0,
) -> None:
    """The scheduler's view brings a fresh load report of w0 (10 blocks)."""
    global _seq
    _seq += 1
    load = LoadReport(
        "w0", "a", _seq, 0.0, 10, free, 10 - free, 0, 0,
        committed_blocks=committed,
        priority_claims=dict(priority_claims or {}),
        origin_claims={ingress.replica_id: mine} if mine else {},
    )
    ingress.fleet.apply(ViewUpdate(1, _seq, False, (WorkerDelta(WorkerInfo("w0", "a", 10), True, load),)))


def request(request_id: str, priority: int = 0, tenant: str = "default") -> GenerationRequest:
    return GenerationRequest(
        request_id, (1, 2, 3), SamplingParams(max_tokens=64), priority, pool="a", tenant=tenant
    )


def admit(ingress: Ingress, req: GenerationRequest) -> WorkerSlot | Waiter:
    return ingress.admission.admit(ingress.config.pools[0], req, [1, 2, 3])


def test_full_admission_sends_only_requests_whose_max_tokens_fit() -> None:
    async def scenario() -> None:
        ingress = one_worker("full")
        # 10 blocks hold two requests' 5-block claims; the third waits, though its
        # prompt alone (1 block) would fit.
        placed = [admit(ingress, request(f"r{i}")) for i in range(3)]
        assert [isinstance(p, WorkerSlot) for p in placed] == [True, True, False]
        assert ingress.admission.waiting("a") == 1

    asyncio.run(scenario())


def test_prompt_admission_sends_whatever_prompt_fits() -> None:
    async def scenario() -> None:
        ingress = one_worker("prompt")
        placed = [admit(ingress, request(f"r{i}")) for i in range(3)]
        assert all(isinstance(p, WorkerSlot) for p in placed)

    asyncio.run(scenario())


def test_a_fresh_report_of_our_own_requests_is_not_counted_twice() -> None:
    async def scenario() -> None:
        ingress = one_worker("full")
        first, second = admit(ingress, request("r0")), admit(ingress, request("r1"))
        assert isinstance(first, WorkerSlot) and isinstance(second, WorkerSlot)
        waiter = admit(ingress, request("r2"))
        assert isinstance(waiter, Waiter)
        # The worker now reports both: 4 blocks held, 6 still to come, 10 claimed by us.
        report(ingress, free=6, committed=6, priority_claims={0: (2, 10)}, mine=2 * CLAIM)
        assert not waiter.future.done()
        ingress.admission.release(first, request("r0").key)  # r0 finished: its claim is ours to drop
        assert waiter.future.result() is first

    asyncio.run(scenario())


def test_requests_of_another_replica_count_against_the_room() -> None:
    async def scenario() -> None:
        ingress = one_worker("full")
        assert isinstance(admit(ingress, request("r0")), WorkerSlot)
        # Another replica's request there will still take 6 of the 10 blocks.
        report(ingress, free=10, committed=6, priority_claims={0: (1, 6)})
        assert isinstance(admit(ingress, request("r1")), Waiter)

    asyncio.run(scenario())


def test_a_higher_priority_request_is_sent_to_preempt_lower_ones_instead_of_waiting() -> None:
    async def scenario() -> None:
        ingress = one_worker("full")
        low = [admit(ingress, request(f"low{i}")) for i in range(3)]
        assert isinstance(low[2], Waiter)
        report(ingress, free=6, committed=6, priority_claims={0: (2, 10)}, mine=2 * CLAIM)
        # An equal priority waits its turn; a higher one goes now, past the waiting low2.
        assert isinstance(admit(ingress, request("same")), Waiter)
        high = admit(ingress, request("high", priority=5))
        assert isinstance(high, WorkerSlot) and high.worker_id == "w0"
        # The two low ones' 10 blocks seat two high ones; the third has nothing left
        # to preempt for (the claims of the high ones sent stand on the worker).
        assert isinstance(admit(ingress, request("high2", priority=5)), WorkerSlot)
        assert isinstance(admit(ingress, request("high3", priority=5)), Waiter)

    asyncio.run(scenario())


def test_a_higher_priority_request_takes_a_sequence_slot_held_by_a_lower_one() -> None:
    async def scenario() -> None:
        ingress = one_worker("prompt", max_num_seqs=1)
        assert isinstance(admit(ingress, request("low")), WorkerSlot)
        # Before any report shows it, our own in-flight claim says what runs there.
        assert isinstance(admit(ingress, request("high", priority=1)), WorkerSlot)
        assert isinstance(admit(ingress, request("higher", priority=1)), Waiter)

    asyncio.run(scenario())


def test_the_wait_queue_serves_higher_priority_first() -> None:
    async def scenario() -> None:
        ingress = one_worker("full", max_num_seqs=1)
        running = admit(ingress, request("r0", priority=3))
        assert isinstance(running, WorkerSlot)
        low = admit(ingress, request("low"))
        high = admit(ingress, request("high", priority=3))  # nothing of lower priority runs
        assert isinstance(low, Waiter) and isinstance(high, Waiter)
        ingress.admission.release(running, request("r0").key)
        assert high.future.result() is running and not low.future.done()

    asyncio.run(scenario())


def test_full_admission_claims_the_blocks_of_every_completion_of_n() -> None:
    async def scenario() -> None:
        ingress = one_worker("full")
        two = GenerationRequest("r0", (1, 2, 3), SamplingParams(max_tokens=64, n=2), pool="a")
        slot = admit(ingress, two)
        assert isinstance(slot, WorkerSlot)
        # The prompt shares no full block: each completion claims its own 5 blocks.
        assert slot.claims[two.key].blocks == 2 * CLAIM
        assert isinstance(admit(ingress, request("r1")), Waiter)

    asyncio.run(scenario())


def test_a_split_request_leaves_one_claim_per_continuation_in_place_of_its_own() -> None:
    async def scenario() -> None:
        ingress = one_worker("full")
        two = GenerationRequest("r0", (1, 2, 3), SamplingParams(max_tokens=64, n=2), pool="a")
        slot = admit(ingress, two)
        assert isinstance(slot, WorkerSlot)
        # Completion 0 streamed 30 tokens (34 left), completion 1 streamed 2 (62 left).
        parts = [(f"{two.key}#0", [1, 2, 3, *range(30)], 34), (f"{two.key}#1", [1, 2, 3, 7, 8], 62)]
        moved = ingress.admission.split(slot, two.key, 0, parts, None, exclude=[])
        assert moved == [slot, slot]
        assert {key: c.blocks for key, c in slot.claims.items()} == {f"{two.key}#0": 5, f"{two.key}#1": 5}

    asyncio.run(scenario())


def test_a_continuation_is_known_at_the_workers_as_the_replica_that_sent_it() -> None:
    # A worker's claims per replica (`LoadReport.origin_claims`) read it from the id.
    key = scoped_request_id("t", "a@b#1")  # client ids may hold "@" and "#"
    assert origin_of(worker_request_id(key, "r1")) == "r1"
    assert origin_of(f"{worker_request_id(key, 'r1')}#1") == "r1"
    assert origin_of("no-origin") == ""
