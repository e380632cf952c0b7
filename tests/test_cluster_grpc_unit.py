"""The gRPC edge without Ray: request validation, tenants, the client's message building."""

from __future__ import annotations

import pytest

from pagefleet.cluster.client import build_request, format_status, sampling_to_proto
from pagefleet.cluster.config import ClusterConfig
from pagefleet.cluster.grpc_server import api_key_from_metadata, request_from_proto
from pagefleet.cluster.ingress import ErrorCode, Ingress, IngressError
from pagefleet.cluster.proto import pagefleet_pb2 as pb
from pagefleet.worker.sampling_params import SamplingParams


def _keyed_config() -> ClusterConfig:
    return ClusterConfig.from_dict(
        {
            "pools": [{"name": "a"}, {"name": "b"}],
            "tenants": [
                {"name": "alice", "pool": "a", "api_key": "k-alice"},
                {"name": "bob", "pool": "b", "api_key": "k-bob", "salt": "bob-salt"},
            ],
        }
    )


def test_unset_sampling_fields_take_the_engine_defaults() -> None:
    req = request_from_proto(pb.GenerateRequest(prompt="hi"))
    assert req.params == SamplingParams(max_tokens=16)
    assert req.request_id  # the server picks one


def test_seed_travels_only_when_set() -> None:
    with_seed = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(seed=0))
    assert request_from_proto(with_seed).params.seed == 0
    assert request_from_proto(pb.GenerateRequest(prompt="hi")).params.seed is None


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
    assert (req.request_id, req.pool) == ("r1", "a")


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


def test_unknown_api_key_is_unauthenticated() -> None:
    ingress = Ingress(_keyed_config(), {})
    with pytest.raises(IngressError) as err:
        ingress.authenticate("wrong")
    assert err.value.code is ErrorCode.UNAUTHENTICATED
    with pytest.raises(IngressError):
        ingress.authenticate(None)


def test_tenant_runs_in_its_own_pool_and_is_denied_another() -> None:
    ingress = Ingress(_keyed_config(), {})
    bob = ingress.authenticate("k-bob")
    assert bob.cache_salt() == "bob-salt"
    assert ingress.tenant_pool(bob, "") == "b"
    with pytest.raises(IngressError) as err:
        ingress.tenant_pool(bob, "a")
    assert err.value.code is ErrorCode.PERMISSION_DENIED


def test_open_cluster_lets_a_request_choose_any_known_pool() -> None:
    config = ClusterConfig.from_dict({"pools": [{"name": "a"}, {"name": "b"}]})
    ingress = Ingress(config, {})
    tenant = ingress.authenticate(None)
    assert ingress.tenant_pool(tenant, "b") == "b"
    with pytest.raises(IngressError) as err:
        ingress.tenant_pool(tenant, "c")
    assert err.value.code is ErrorCode.NOT_FOUND


def test_pool_without_live_workers_is_unavailable() -> None:
    ingress = Ingress(ClusterConfig.from_dict({"pools": [{"name": "a"}]}), {})
    with pytest.raises(IngressError) as err:
        ingress._admit(ingress.config.pools[0])
    assert err.value.code is ErrorCode.UNAVAILABLE


def test_format_status_prints_one_row_per_worker() -> None:
    status = pb.StatusResponse(
        pools=[
            pb.PoolStatus(
                name="p",
                workers=[
                    pb.WorkerStatus(worker_id="p-0", alive=True, total_blocks=8, free_blocks=8),
                    pb.WorkerStatus(worker_id="p-1", alive=False),
                ],
            )
        ]
    )
    lines = format_status(status).splitlines()
    assert lines[0].startswith("pool p:")
    assert lines[2].split()[:4] == ["p-0", "yes", "8", "8"]
    assert lines[3].split()[:2] == ["p-1", "no"]
