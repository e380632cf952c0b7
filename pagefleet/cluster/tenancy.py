"""Who a caller is and where its requests run: API key -> tenant -> pool -> salt.

Both fronts (gRPC and OpenAI HTTP) and the dashboard ask this one place, so
they share one authentication rule and one pool rule:

- Authentication: a request's API key (`x-api-key`, or `authorization:
  Bearer`) names a tenant, compared in constant time. No key means the
  keyless tenant, if one is configured; with no keyed tenant at all, any key
  (or none) is the open tenant, so clients that must send some key work
  unchanged. When every tenant has a key, auth is *required*.
- Pools: a tenant sees its own pool when auth is required, every pool
  otherwise. A request names its target by pool name or by the model a pool
  serves (the tenant's own pool wins when several serve it); nothing named:
  the tenant's pool. A pool the tenant may not see answers exactly like an
  unknown one, so a tenant learns nothing of another's pools.
- LoRA adapters: a request selects one of its pool's adapters by name, as
  OpenAI's `model` (the adapter's name in place of a pool or model; the
  tenant's own pool wins when several list it) or as gRPC's `adapter`
  field. An adapter the tenant may not use (`tenants[].adapters`) answers
  exactly like an unknown one.
- Salt: the tenant's prefix-cache salt (`TenantConfig.cache_salt`), set by
  the server, never by the client.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Literal

from pagefleet.cluster.config import ClusterConfig, PoolConfig, TenantConfig
from pagefleet.cluster.errors import InvalidArgument, NotFound, Unauthenticated


@dataclass(frozen=True)
class Target:
    """What a request names to run on: a pool or a model, as its wire spells it.

    Both resolve by the same rule (`Tenancy.resolve`); `kind` only says which
    word the NOT_FOUND message uses (gRPC's `pool` field, OpenAI's `model`).
    """

    name: str = ""
    kind: Literal["pool", "model"] = "pool"
    # A LoRA adapter of the pool, named apart from the pool (gRPC's `adapter`); "": none.
    adapter: str = ""

    def not_found(self) -> NotFound:
        """NOT_FOUND for this name; it names no other pool."""
        if self.kind == "model":
            return NotFound(f"model {self.name!r} does not exist")
        return unknown_pool(self.name)


@dataclass(frozen=True)
class Resolved:
    """Where a request runs: its pool and the pool's LoRA adapter it selected (None: the base model)."""

    pool: PoolConfig
    adapter: str | None = None


def unknown_adapter(name: str) -> NotFound:
    """NOT_FOUND for an adapter the caller may not use; names no other adapter."""
    return NotFound(f"unknown LoRA adapter {name!r}")


def unknown_pool(name: str) -> NotFound:
    """NOT_FOUND for a pool the caller may not see; names no other pool."""
    return NotFound(f"unknown pool {name!r}")


class Tenancy:
    """The cluster's tenants and the rules above, for one `ClusterConfig`."""

    def __init__(self, config: ClusterConfig) -> None:
        self._config = config
        self._keyed = any(t.api_key is not None for t in config.tenants)
        self.auth_required = all(t.api_key is not None for t in config.tenants)
        """True when every tenant has an API key (requests without one are refused)."""

    def tenant_for_api_key(self, key: str | None) -> TenantConfig | None:
        """The tenant this key authenticates (None: no tenant has it)."""
        if not key or not self._keyed:
            return next((t for t in self._config.tenants if t.api_key is None), None)
        encoded = key.encode()
        match = None
        for tenant in self._config.tenants:
            # Compare against every key in constant time: no early exit to time.
            if tenant.api_key is not None and hmac.compare_digest(tenant.api_key.encode(), encoded):
                match = tenant
        return match

    def authenticate(self, api_key: str | None) -> TenantConfig:
        """The tenant an API key belongs to; UNAUTHENTICATED when none."""
        tenant = self.tenant_for_api_key(api_key)
        if tenant is None:
            raise Unauthenticated("missing API key" if api_key is None else "unknown API key")
        return tenant

    def tenant(self, name: str) -> TenantConfig | None:
        """The tenant called `name`, or None."""
        return next((t for t in self._config.tenants if t.name == name), None)

    def visible_pools(self, tenant: TenantConfig | None) -> list[str]:
        """Pools a tenant may see and use: its own when keys are required, else all.

        Every lookup (GetStatus, /v1/models, a request's pool) answers a pool
        outside this list exactly like an unknown one.
        """
        if tenant is not None and self.auth_required:
            return [tenant.pool]
        return [p.name for p in self._config.pools]

    def resolve(self, tenant: TenantConfig, target: Target) -> Resolved:
        """The pool (and LoRA adapter) a tenant's request runs on; NOT_FOUND for a target
        it may not use."""
        resolved = self._by_name(tenant, target)
        if not target.adapter:
            return resolved
        if resolved.adapter is not None:
            raise InvalidArgument(
                f"model {target.name!r} is a LoRA adapter already: name no second adapter"
            )
        if target.adapter not in self.adapters(tenant, resolved.pool.name):
            raise unknown_adapter(target.adapter)
        return Resolved(resolved.pool, target.adapter)

    def _by_name(self, tenant: TenantConfig, target: Target) -> Resolved:
        if not target.name:
            return Resolved(self._config.pool(tenant.pool))
        visible = self.visible_pools(tenant)
        if target.name in visible:
            return Resolved(self._config.pool(target.name))
        serving = [p.name for p in self._config.pools if p.engine.model == target.name and p.name in visible]
        if serving:
            return Resolved(self._config.pool(_own_first(tenant, serving)))
        if target.kind == "model":
            # An adapter's name in place of the model, as vLLM's clients select one.
            holding = [p for p in visible if target.name in self.adapters(tenant, p)]
            if holding:
                return Resolved(self._config.pool(_own_first(tenant, holding)), target.name)
        raise target.not_found()

    def adapters(self, tenant: TenantConfig | None, pool: str) -> list[str]:
        """The LoRA adapters of a pool the tenant may use (the pool's, less those
        `tenants[].adapters` leaves out), in the pool's order."""
        names = list(self._config.pool(pool).engine.adapter_dirs)
        return [n for n in names if tenant is None or tenant.may_use_adapter(n)]

    def visible_pool(self, tenant: TenantConfig | None, name: str) -> PoolConfig:
        """The pool called `name` if the tenant may see it (GetStatus's, /v1/models' lookup)."""
        if name not in self.visible_pools(tenant):
            raise unknown_pool(name)
        return self._config.pool(name)

    def salt_names(self) -> dict[str, str]:
        """Tenant name by prefix-cache salt (salts are secrets: show names, never salts)."""
        return {t.cache_salt(): t.name for t in self._config.tenants}


def _own_first(tenant: TenantConfig, pools: list[str]) -> str:
    """The tenant's own pool if it is among `pools`, else the first of them."""
    return tenant.pool if tenant.pool in pools else pools[0]


__all__ = ["Resolved", "Target", "Tenancy", "unknown_adapter", "unknown_pool"]
