"""The gRPC edge without Ray: request validation, tenants, the client's message building,
and the ingress's admission into its cluster wait queue."""

from __future__ import annotations

import asyncio

import pytest

from pagefleet.cluster.api import (
    ErrorCode,
    GenerationRequest,
    IngressError,
    Target,
    api_key_from_metadata,
)
from pagefleet.cluster.client import build_request, format_status, sampling_to_proto
from pagefleet.cluster.config import ClusterConfig
from pagefleet.cluster.grpc_server import request_from_proto, status_to_proto
from pagefleet.cluster.ingress import Ingress
from pagefleet.cluster.proto import pagefleet_pb2 as pb
from pagefleet.cluster.status import PoolStatus, WorkerStatus
from pagefleet.cluster.worker_slots import WorkerSlot
from pagefleet.scheduler.messages import ViewUpdate, WorkerDelta
from pagefleet.worker.events import WorkerInfo
from pagefleet.worker.sampling_params import SamplingParams


def test_unset_sampling_fields_take_the_engine_defaults() -> None:
    req = request_from_proto(pb.GenerateRequest(prompt="hi"))
    assert req.params == SamplingParams(max_tokens=16)
    assert req.request_id  # the server picks one


def test_seed_travels_only_when_set() -> None:
    with_seed = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(seed=0))
    assert request_from_proto(with_seed).params.seed == 0
    assert request_from_proto(pb.GenerateRequest(prompt="hi")).params.seed is None


def test_penalties_and_logit_bias_travel_through_the_wire_message() -> None:
    params = SamplingParams(
        min_p=0.25, repetition_penalty=1.5, presence_penalty=-0.5, frequency_penalty=1.0,
        logit_bias={5: -100.0, 9: 2.5},
    )  # fmt: skip
    msg = build_request("hi", params)
    assert request_from_proto(msg).params == params


def test_an_unset_repetition_penalty_is_off() -> None:
    assert request_from_proto(pb.GenerateRequest(prompt="hi")).params.repetition_penalty == 1.0


def test_a_logit_bias_out_of_range_is_invalid_argument_naming_the_limit() -> None:
    sampling = pb.SamplingParams(logit_bias={5: 101.0})
    with pytest.raises(IngressError, match=r"logit_bias values must be numbers in \[-100, 100\]"):
        request_from_proto(pb.GenerateRequest(prompt="hi", sampling=sampling))


def test_sampling_errors_become_invalid_argument_naming_the_limit() -> None:
    msg = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=-3))
    with pytest.raises(IngressError) as err:
        request_from_proto(msg)
    assert err.value.code is ErrorCode.INVALID_ARGUMENT
    assert ">= 1" in err.value.message


def test_client_request_round_trips_through_the_server_validation() -> None:
    params = SamplingParams(max_tokens=5, temperature=0.5, top_k=3, seed=7, stop=("x",))
    req = request_from_proto(build_request([1, 2, 3], params, request_id="r1", pool="a"))
    assert req.prompt == (1, 2, 3)
    assert req.params == params
    assert (req.request_id, req.target) == ("r1", Target("a"))


def test_sampling_to_proto_accepts_a_mapping_and_overrides() -> None:
    msg = sampling_to_proto({"max_tokens": 4, "stop": "END"}, ignore_eos=True)
    assert (msg.max_tokens, list(msg.stop), msg.ignore_eos) == (4, ["END"], True)


@pytest.mark.parametrize(
    ("metadata", "key"),
    [
        ((("x-api-key", "k1"),), "k1"),
        ((("authorization", "Bearer k2"),), "k2"),
        ((("authorization", "Basic zzz"),), None),
        ((), None),
    ],
)
def test_api_key_comes_from_x_api_key_or_a_bearer_token(
    metadata: tuple[tuple[str, str], ...], key: str | None
) -> None:
    assert api_key_from_metadata(metadata) == key


def test_pool_without_live_workers_is_unavailable() -> None:
    ingress = Ingress(ClusterConfig.from_dict({"pools": [{"name": "a"}]}), {})
    with pytest.raises(IngressError) as err:
        ingress.admission.admit(ingress.config.pools[0], _request("r0"), [1, 2, 3])
    assert err.value.code is ErrorCode.UNAVAILABLE


# ----- the cluster wait queue (admission only: no request reaches a worker) -----


def _request(request_id: str) -> GenerationRequest:
    return GenerationRequest(request_id, (1, 2, 3), SamplingParams(), tenant="default")


def _two_full_workers() -> Ingress:
    """Pool "a": two live workers taking one request each, and a wait queue of 2."""
    config = ClusterConfig.from_dict(
        {"pools": [{"name": "a", "max_num_seqs": 1}], "scheduler": {"wait_queue_size": 2}}
    )
    # Admission never calls a worker, so the handles can be placeholders.
    ingress = Ingress(config, {"a": [("w0", None), ("w1", None)]})
    # The scheduler's view brings both workers into routing.
    live = tuple(WorkerDelta(WorkerInfo(w, "a", 64), True, None) for w in ("w0", "w1"))
    ingress.fleet.apply(ViewUpdate(1, 2, True, live))
    return ingress


def test_requests_beyond_the_workers_room_wait_and_leave_in_fifo_order() -> None:
    async def scenario() -> None:
        ingress = _two_full_workers()
        pool = ingress.config.pools[0]
        first = ingress.admission.admit(pool, _request("r1"), [1, 2, 3])
        second = ingress.admission.admit(pool, _request("r2"), [1, 2, 3])
        assert isinstance(first, WorkerSlot) and isinstance(second, WorkerSlot)
        assert {first.worker_id, second.worker_id} == {"w0", "w1"}  # one each
        waiting = [ingress.admission.admit(pool, _request(r), [1, 2, 3]) for r in ("r3", "r4")]
        assert not any(isinstance(w, WorkerSlot) for w in waiting)
        assert ingress.status("a")[0].num_waiting == 2
        ingress.admission.release(first, _request("r1").key)  # r1 finished
        w3, w4 = (w for w in waiting if not isinstance(w, WorkerSlot))
        assert w3.future.result() is first and not w4.future.done()
        assert ingress.status("a")[0].num_waiting == 1

    asyncio.run(scenario())


def test_a_full_wait_queue_is_resource_exhausted_naming_the_limit() -> None:
    async def scenario() -> None:
        ingress = _two_full_workers()
        pool = ingress.config.pools[0]
        for r in ("r1", "r2", "r3", "r4"):
            ingress.admission.admit(pool, _request(r), [1, 2, 3])
        with pytest.raises(IngressError) as err:
            ingress.admission.admit(pool, _request("r5"), [1, 2, 3])
        assert err.value.code is ErrorCode.RESOURCE_EXHAUSTED
        assert "limit 4 (2 workers x max_num_seqs 1 + wait_queue_size 2)" in err.value.message

    asyncio.run(scenario())


def test_aborting_a_waiting_request_ends_it_and_frees_its_place() -> None:
    async def scenario() -> None:
        ingress = _two_full_workers()
        pool = ingress.config.pools[0]
        for r in ("r1", "r2"):
            ingress.admission.admit(pool, _request(r), [1, 2, 3])
        waiter = ingress.admission.admit(pool, _request("r3"), [1, 2, 3])
        assert not isinstance(waiter, WorkerSlot)
        assert await ingress.abort("r3", tenant="default")
        assert waiter.future.result() is None  # generate() ends the stream with "abort"
        assert ingress.status("a")[0].num_waiting == 0

    asyncio.run(scenario())


def test_format_status_prints_one_row_per_worker() -> None:
    status = pb.StatusResponse(
        pools=[
            pb.PoolStatus(
                name="p",
                workers=[
                    pb.WorkerStatus(
                        worker_id="p-0", alive=True, total_blocks=8, free_blocks=8,
                        node_ip="10.0.0.7", node_id="0123456789abcdef",
                    ),
                    pb.WorkerStatus(worker_id="p-1", alive=False),
                ],
            )
        ]
    )
    lines = format_status(status).splitlines()
    assert lines[0].startswith("pool p:")
    assert lines[1].split()[:3] == ["worker", "alive", "node"]
    assert lines[2].split()[:6] == ["p-0", "yes", "10.0.0.7", "01234567", "8", "8"]
    assert lines[3].split()[:2] == ["p-1", "no"]


def test_text_prompt_for_a_model_without_tokenizer_is_invalid_argument(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import shutil

    from pagefleet.worker.tiny_model import ensure_tiny_model

    for name in ("config.json", "model.safetensors"):
        shutil.copy(ensure_tiny_model() / name, tmp_path / name)
    ingress = Ingress(ClusterConfig.from_dict({"pools": [{"name": "a", "model": str(tmp_path)}]}), {})
    tenant = ingress.tenancy.authenticate(None)

    async def first() -> None:
        await anext(ingress.submit(tenant, Target(), "hello", SamplingParams()))

    with pytest.raises(IngressError) as err:
        asyncio.run(first())
    assert err.value.code is ErrorCode.INVALID_ARGUMENT
    assert "prompt_token_ids" in err.value.message


def test_get_status_carries_every_counter_of_the_typed_status() -> None:
    worker = WorkerStatus(
        "p-0", "p", alive=True, node_id="n1", total_blocks=8, free_blocks=5, live_blocks=2,
        cached_blocks=1, peak_live_blocks=3, num_running=1, num_waiting=2, prefix_query_tokens=10,
        prefix_hit_tokens=4, hit_rate=0.4, requests_routed=7, migrations_out=1, draining=True,
        resident_adapters=("alpha",),
    )  # fmt: skip
    pool = PoolStatus(
        "p", "tiny", "prefix_affinity", live_workers=1, hit_rate=0.4, migrations=1,
        total_blocks=8, free_blocks=5, live_blocks=2, cached_blocks=1, peak_live_blocks=3,
        num_running=1, num_waiting=4, preemptions=0, evictions=0, workers=(worker,),
    )  # fmt: skip
    msg = status_to_proto([pool]).pools[0]
    assert (msg.name, msg.model, msg.router_policy, msg.num_waiting, msg.migrations) == (
        "p", "tiny", "prefix_affinity", 4, 1
    )
    w = msg.workers[0]
    assert (w.worker_id, w.node_id, w.live_blocks, w.requests_routed, w.hit_rate, w.draining) == (
        "p-0", "n1", 2, 7, 0.4, True
    )
    assert list(w.resident_adapters) == ["alpha"]
