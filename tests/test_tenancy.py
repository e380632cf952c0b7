"""Tenancy: API key -> tenant -> pool, the one rule both fronts and the dashboard ask."""

from __future__ import annotations

import pytest

from pagefleet.cluster.config import ClusterConfig, ConfigError
from pagefleet.cluster.errors import ErrorCode, IngressError
from pagefleet.cluster.tenancy import Target, Tenancy


def _config(tenants: list[dict[str, str]], pools: list[dict[str, str]] | None = None) -> ClusterConfig:
    return ClusterConfig.from_dict({"pools": pools or [{"name": "chat"}], "tenants": tenants})


def _keyed() -> Tenancy:
    """Pools "a" and "b" (both the tiny model); alice in a, bob in b; every tenant has a key."""
    return Tenancy(
        _config(
            [
                {"name": "alice", "pool": "a", "api_key": "k-alice-0123456789abcdef"},
                {"name": "bob", "pool": "b", "api_key": "k-bob-0123456789abcdef", "salt": "bob-salt"},
            ],
            [{"name": "a"}, {"name": "b"}],
        )
    )


def test_wrong_or_missing_key_authenticates_nobody_when_all_tenants_have_keys() -> None:
    tenancy = Tenancy(_config([{"name": "t", "pool": "chat", "api_key": "k1-0123456789abcdef"}]))
    assert tenancy.auth_required
    assert tenancy.tenant_for_api_key("k2-0123456789abcdef") is None
    assert tenancy.tenant_for_api_key(None) is None


def test_any_key_is_the_open_tenant_when_no_tenant_has_a_key() -> None:
    cfg = ClusterConfig.default()
    tenancy = Tenancy(cfg)
    assert tenancy.tenant_for_api_key("x") == tenancy.tenant_for_api_key(None) == cfg.tenant("default")


def test_unknown_key_is_refused_once_any_tenant_has_a_key() -> None:
    cfg = _config([{"name": "open", "pool": "chat"}, {"name": "t", "pool": "chat", "api_key": "k1-0123456789abcdef"}])
    tenancy = Tenancy(cfg)
    assert not tenancy.auth_required
    assert tenancy.tenant_for_api_key(None) == cfg.tenant("open")
    assert tenancy.tenant_for_api_key("k2-0123456789abcdef") is None


def test_unknown_or_missing_api_key_is_unauthenticated_saying_which() -> None:
    tenancy = _keyed()
    with pytest.raises(IngressError) as unknown:
        tenancy.authenticate("wrong")
    with pytest.raises(IngressError) as missing:
        tenancy.authenticate(None)
    assert unknown.value.code is missing.value.code is ErrorCode.UNAUTHENTICATED
    assert (unknown.value.message, missing.value.message) == ("unknown API key", "missing API key")


def test_tenant_runs_in_its_own_pool_and_another_pool_answers_like_an_unknown_one() -> None:
    tenancy = _keyed()
    bob = tenancy.authenticate("k-bob-0123456789abcdef")
    assert bob.cache_salt() == "bob-salt"
    assert tenancy.resolve(bob, Target()).pool.name == "b"
    with pytest.raises(IngressError) as other:
        tenancy.resolve(bob, Target("a"))
    with pytest.raises(IngressError) as unknown:
        tenancy.resolve(bob, Target("zz"))
    assert other.value.code is unknown.value.code is ErrorCode.NOT_FOUND
    assert other.value.message.replace("'a'", "'zz'") == unknown.value.message


def test_open_cluster_lets_a_request_choose_any_known_pool() -> None:
    tenancy = Tenancy(ClusterConfig.from_dict({"pools": [{"name": "a"}, {"name": "b"}]}))
    tenant = tenancy.authenticate(None)
    assert tenancy.resolve(tenant, Target("b")).pool.name == "b"
    with pytest.raises(IngressError) as err:
        tenancy.resolve(tenant, Target("c"))
    assert err.value.code is ErrorCode.NOT_FOUND
    assert err.value.message == "unknown pool 'c'"


def test_a_model_name_resolves_to_the_callers_own_pool_among_those_serving_it() -> None:
    tenancy = _keyed()
    bob = tenancy.authenticate("k-bob-0123456789abcdef")
    assert tenancy.resolve(bob, Target("tiny", "model")).pool.name == "b"
    with pytest.raises(IngressError) as other:  # another tenant's pool: as if it did not exist
        tenancy.resolve(bob, Target("a", "model"))
    assert other.value.code is ErrorCode.NOT_FOUND
    assert other.value.message == "model 'a' does not exist"


def test_keys_required_show_a_tenant_only_its_own_pool() -> None:
    tenancy = _keyed()
    assert tenancy.visible_pools(tenancy.authenticate("k-alice-0123456789abcdef")) == ["a"]
    assert tenancy.visible_pools(None) == ["a", "b"]
    with pytest.raises(IngressError, match="unknown pool 'b'"):
        tenancy.visible_pool(tenancy.authenticate("k-alice-0123456789abcdef"), "b")


def _with_adapters() -> Tenancy:
    """Pool "a" serves adapters alpha and beta; alice may use alpha only, bob every one."""
    pools = [{"name": "a", "lora_adapters": {"alpha": "/adapters/alpha", "beta": "/adapters/beta"}}]
    return Tenancy(
        _config(
            [
                {"name": "alice", "pool": "a", "api_key": "k-alice-0123456789abcdef", "adapters": ["alpha"]},
                {"name": "bob", "pool": "a", "api_key": "k-bob-0123456789abcdef"},
            ],
            pools,  # type: ignore[arg-type]
        )
    )


def test_a_model_naming_an_adapter_runs_it_on_the_pool_that_serves_it() -> None:
    tenancy = _with_adapters()
    bob = tenancy.authenticate("k-bob-0123456789abcdef")
    resolved = tenancy.resolve(bob, Target("beta", "model"))
    assert (resolved.pool.name, resolved.adapter) == ("a", "beta")
    assert tenancy.resolve(bob, Target("a", "model")).adapter is None  # the base model
    grpc = tenancy.resolve(bob, Target("a", adapter="alpha"))
    assert (grpc.pool.name, grpc.adapter) == ("a", "alpha")
    with pytest.raises(IngressError) as err:  # a pool field naming an adapter is no pool
        tenancy.resolve(bob, Target("alpha"))
    assert err.value.message == "unknown pool 'alpha'"
    with pytest.raises(IngressError) as twice:
        tenancy.resolve(bob, Target("beta", "model", adapter="alpha"))
    assert twice.value.code is ErrorCode.INVALID_ARGUMENT


def test_an_adapter_the_tenant_may_not_use_answers_like_an_unknown_one() -> None:
    tenancy = _with_adapters()
    alice = tenancy.authenticate("k-alice-0123456789abcdef")
    assert tenancy.adapters(alice, "a") == ["alpha"]
    for name in ("beta", "gamma"):
        with pytest.raises(IngressError) as by_model:
            tenancy.resolve(alice, Target(name, "model"))
        assert by_model.value.message == f"model {name!r} does not exist"
        with pytest.raises(IngressError) as by_field:
            tenancy.resolve(alice, Target(adapter=name))
        assert by_field.value.code is ErrorCode.NOT_FOUND
        assert by_field.value.message == f"unknown LoRA adapter {name!r}"


@pytest.mark.parametrize(
    ("pools", "tenants", "error"),
    [
        ([{"name": "a", "lora_adapters": {"a": "/x"}}], [],
         "pools[0].lora_adapters: adapter 'a' has the name of a pool"),
        ([{"name": "a", "lora_adapters": {"alpha": "/x"}}], [{"name": "t", "pool": "a", "adapters": ["beta"]}],
         "tenants[0].adapters: unknown LoRA adapter 'beta' (pools serve: alpha)"),
    ],
)  # fmt: skip
def test_adapter_names_are_checked_at_load(
    pools: list[dict[str, object]], tenants: list[dict[str, object]], error: str
) -> None:
    with pytest.raises(ConfigError) as exc:
        ClusterConfig.from_dict({"pools": pools, "tenants": tenants})
    assert str(exc.value) == error
