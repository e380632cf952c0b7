"""Tenancy: API key -> tenant -> pool, the one rule both fronts and the dashboard ask."""

from __future__ import annotations

import pytest

from pagefleet.cluster.config import ClusterConfig
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
    assert tenancy.pool_for(bob, Target()).name == "b"
    with pytest.raises(IngressError) as other:
        tenancy.pool_for(bob, Target("a"))
    with pytest.raises(IngressError) as unknown:
        tenancy.pool_for(bob, Target("zz"))
    assert other.value.code is unknown.value.code is ErrorCode.NOT_FOUND
    assert other.value.message.replace("'a'", "'zz'") == unknown.value.message


def test_open_cluster_lets_a_request_choose_any_known_pool() -> None:
    tenancy = Tenancy(ClusterConfig.from_dict({"pools": [{"name": "a"}, {"name": "b"}]}))
    tenant = tenancy.authenticate(None)
    assert tenancy.pool_for(tenant, Target("b")).name == "b"
    with pytest.raises(IngressError) as err:
        tenancy.pool_for(tenant, Target("c"))
    assert err.value.code is ErrorCode.NOT_FOUND
    assert err.value.message == "unknown pool 'c'"


def test_a_model_name_resolves_to_the_callers_own_pool_among_those_serving_it() -> None:
    tenancy = _keyed()
    bob = tenancy.authenticate("k-bob-0123456789abcdef")
    assert tenancy.pool_for(bob, Target("tiny", "model")).name == "b"
    with pytest.raises(IngressError) as other:  # another tenant's pool: as if it did not exist
        tenancy.pool_for(bob, Target("a", "model"))
    assert other.value.code is ErrorCode.NOT_FOUND
    assert other.value.message == "model 'a' does not exist"


def test_keys_required_show_a_tenant_only_its_own_pool() -> None:
    tenancy = _keyed()
    assert tenancy.visible_pools(tenancy.authenticate("k-alice-0123456789abcdef")) == ["a"]
    assert tenancy.visible_pools(None) == ["a", "b"]
    with pytest.raises(IngressError, match="unknown pool 'b'"):
        tenancy.visible_pool(tenancy.authenticate("k-alice-0123456789abcdef"), "b")
