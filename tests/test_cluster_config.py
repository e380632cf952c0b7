"""Cluster config: YAML loading, validation messages with the field path, tenant lookup."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pagefleet.cluster.config import ClusterConfig, ConfigError, PoolConfig, parse_bytes
from pagefleet.scheduler.policy import blocks_to_evict
from pagefleet.worker.config import EngineConfig
from pagefleet.worker.events import LoadReport

MANIFEST = Path(__file__).resolve().parents[1] / "manifests" / "pagefleet.yaml"


def config(**top: Any) -> dict[str, Any]:
    data: dict[str, Any] = {"pools": [{"name": "chat"}]}
    data.update(top)
    return data


def test_example_manifest_loads_with_two_pools_and_tenants(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEFLEET_ACME_KEY", "acme-secret")
    monkeypatch.setenv("PAGEFLEET_GLOBEX_KEY", "globex-secret")
    cfg = ClusterConfig.from_yaml(MANIFEST)
    assert len(cfg.pools) == 2
    assert len(cfg.tenants) >= 2
    assert cfg.tenant_for_api_key("acme-secret") is not None


def test_default_config_is_one_open_pool_of_two_workers() -> None:
    cfg = ClusterConfig.default()
    assert [(p.name, p.workers, p.model) for p in cfg.pools] == [("default", 2, "tiny")]
    assert cfg.tenant_for_api_key(None) == cfg.tenant("default")
    assert not cfg.auth_required


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (config(pools=[{"name": "chat", "workers": 0}]), "pools[0].workers: must be >= 1, got 0"),
        (config(pools=[{"name": "a"}, {"name": "b", "block_size": 12}]), "pools[1].block_size: must be a power of two"),
        (config(pools=[{"name": "chat", "workers": "two"}]), "pools[0].workers: must be int, got str"),
        (config(pools=[{"name": "chat", "wrkers": 2}]), "pools[0].wrkers: unknown field"),
        (config(pools=[{"workers": 2}]), "pools[0].name: is required"),
        (config(pools=[{"name": "chat", "kv_memory": "lots"}]), "pools[0].kv_memory_bytes: expected a byte size"),
        (config(pools=[{"name": "chat", "dtype": "int8"}]), "pools[0].dtype: must be one of"),
        (config(pools=[{"name": "chat", "kv_cache_dtype": "fp8"}]), "pools[0].kv_cache_dtype: must be one of"),
        (config(pools=[{"name": "a"}, {"name": "a"}]), "pools[1].name: duplicate pool name 'a'"),
        (config(pools=[]), "pools: must list at least one pool"),
        ({"tenants": []}, "pools: must be a list"),
        (config(tenants=[{"name": "t", "pool": "nope"}]), "tenants[0].pool: unknown pool 'nope'"),
        (config(tenants=[{"name": "t", "pool": "chat", "api_key": "k"}, {"name": "u", "pool": "chat", "api_key": "k"}]), "tenants[1].api_key: two tenants share"),
        (config(tenants=[{"name": "t", "pool": "chat"}, {"name": "u", "pool": "chat"}]), "tenants: at most one tenant may have no API key"),
        (config(router={"policy": "random"}), "router.policy: must be one of prefix_affinity"),
        (config(router={"w_load": -1}), "router.w_load: must be >= 0, got -1"),
        (config(scheduler={"wait_queue_size": -5}), "scheduler.wait_queue_size: must be >= 0, got -5"),
        (config(scheduler={"report_interval_s": 2.0, "report_timeout_s": 1.0}), "scheduler.report_timeout_s: must be > report_interval_s"),
        (config(scheduler={"shards": 0}), "scheduler.shards: must be >= 1, got 0"),
        (config(scheduler={"shards": 2}), "scheduler.shards: must be <= the number of pools (1)"),
        (config(server={"grpc_port": 70000}), "server.grpc_port: must be in [0, 65535], got 70000"),
        (config(server={"max_body_bytes": 100}), "server.max_body_bytes: must be in [1024, 2**31), got 100"),
        (config(server={"max_message_bytes": "3GiB"}), "server.max_message_bytes: must be in [1024, 2**31)"),
        (config(server={"header_timeout_s": 0}), "server.header_timeout_s: must be > 0, got 0"),
        (config(server={"drain_timeout_s": -1}), "server.drain_timeout_s: must be >= 0, got -1"),
        (config(server={"tls_cert_file": "c.pem"}), "server.tls_key_file: give both tls_cert_file and tls_key_file"),
        (config(server={"tls_cert_file": "/nonexistent/c.pem", "tls_key_file": "/nonexistent/k.pem"}), "server.tls_cert_file: no such file: /nonexistent/c.pem"),
        (config(extra=1), "extra: unknown field"),
    ],
)  # fmt: skip
def test_invalid_config_names_the_field_and_reason(data: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        ClusterConfig.from_dict(data)
    assert str(info.value).startswith(message)


def test_server_limits_default_to_safe_values_and_metrics_to_localhost() -> None:
    server = ClusterConfig.from_dict(config(server={"max_body_bytes": "1MiB"})).server
    assert server.max_body_bytes == 2**20 and server.max_message_bytes == 4 * 2**20
    assert server.metrics_host == "127.0.0.1" and server.drain_timeout_s == 30.0
    assert not server.tls


def test_yaml_errors_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("pools: [name: {")
    with pytest.raises(ConfigError, match=r"bad\.yaml: not valid YAML"):
        ClusterConfig.from_yaml(path)


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        ClusterConfig.from_yaml(tmp_path / "absent.yaml")


def test_api_key_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("T_KEY", "s3cret")
    cfg = ClusterConfig.from_dict(
        config(tenants=[{"name": "t", "pool": "chat", "api_key_env": "T_KEY"}])
    )
    assert cfg.tenant_for_api_key("s3cret") == cfg.tenant("t")


def test_unset_api_key_env_fails_at_load(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("T_KEY", raising=False)
    with pytest.raises(
        ConfigError, match=r"tenants\[0\].api_key_env: environment variable T_KEY is not set"
    ):
        ClusterConfig.from_dict(
            config(tenants=[{"name": "t", "pool": "chat", "api_key_env": "T_KEY"}])
        )


def test_wrong_or_missing_key_authenticates_nobody_when_all_tenants_have_keys() -> None:
    cfg = ClusterConfig.from_dict(config(tenants=[{"name": "t", "pool": "chat", "api_key": "k1"}]))
    assert cfg.auth_required
    assert cfg.tenant_for_api_key("k2") is None
    assert cfg.tenant_for_api_key(None) is None


def test_any_key_is_the_open_tenant_when_no_tenant_has_a_key() -> None:
    cfg = ClusterConfig.default()
    assert cfg.tenant_for_api_key("x") == cfg.tenant_for_api_key(None) == cfg.tenant("default")


def test_unknown_key_is_refused_once_any_tenant_has_a_key() -> None:
    tenants = [{"name": "open", "pool": "chat"}, {"name": "t", "pool": "chat", "api_key": "k1"}]
    cfg = ClusterConfig.from_dict(config(tenants=tenants))
    assert cfg.tenant_for_api_key(None) == cfg.tenant("open")
    assert cfg.tenant_for_api_key("k2") is None


def test_tenant_salts_differ_and_an_explicit_salt_wins() -> None:
    cfg = ClusterConfig.from_dict(
        config(
            tenants=[
                {"name": "a", "pool": "chat", "api_key": "ka"},
                {"name": "b", "pool": "chat", "api_key": "kb"},
                {"name": "c", "pool": "chat", "api_key": "kc", "salt": "fixed"},
            ]
        )
    )
    assert cfg.tenant("a").cache_salt() != cfg.tenant("b").cache_salt()
    assert cfg.tenant("c").cache_salt() == "fixed"


def test_memory_sizes_accept_units() -> None:
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("2GB") == 2 * 10**9
    assert parse_bytes(4096) == 4096
    cfg = ClusterConfig.from_dict(config(pools=[{"name": "chat", "kv_memory": "1GiB"}]))
    assert cfg.pool("chat").kv_memory_bytes == 2**30


def test_engine_kwargs_build_an_engine_config() -> None:
    pool = PoolConfig("chat", block_size=32, num_kv_blocks=128, max_num_seqs=8)
    engine = EngineConfig(**pool.engine_kwargs(device="cpu"))
    assert (engine.block_size, engine.num_kv_blocks, engine.max_num_seqs) == (32, 128, 8)


def test_kv_cache_dtype_comes_from_yaml_into_the_engine_config() -> None:
    cfg = ClusterConfig.from_dict(config(pools=[{"name": "chat", "kv_cache_dtype": "float16"}]))
    assert EngineConfig(**cfg.pool("chat").engine_kwargs(device="cpu")).kv_cache_dtype == "float16"
    assert EngineConfig(**PoolConfig("chat").engine_kwargs(device="cpu")).kv_cache_dtype == "auto"


def test_engine_kwargs_leave_unset_limits_to_the_engine() -> None:
    kwargs = PoolConfig("chat").engine_kwargs(device="cpu")
    assert "max_num_seqs" not in kwargs
    assert EngineConfig(**kwargs).max_num_seqs == EngineConfig().max_num_seqs


def test_cli_overrides_apply_to_every_pool_and_are_validated() -> None:
    cfg = ClusterConfig.from_dict({"pools": [{"name": "a"}, {"name": "b"}]})
    assert [p.workers for p in cfg.with_overrides(workers=3).pools] == [3, 3]
    with pytest.raises(ConfigError, match=r"pools\[0\].workers: must be >= 1"):
        cfg.with_overrides(workers=0)


def test_router_weights_come_from_yaml() -> None:
    cfg = ClusterConfig.from_dict(config(router={"policy": "round_robin", "w_prefill": 2}))
    assert cfg.router.policy == "round_robin"
    assert cfg.router.w_prefill == 2.0


def test_unknown_pool_lookup_raises_key_error() -> None:
    with pytest.raises(KeyError):
        ClusterConfig.default().pool("nope")


def test_eviction_watermarks_come_from_the_scheduler_section_and_zero_turns_them_off() -> None:
    pools = [{"name": "default"}]
    on = ClusterConfig.from_dict(
        {"pools": pools, "scheduler": {"evict_low_watermark": 0.2, "evict_high_watermark": 0.3}}
    )
    marks = on.scheduler.eviction_watermarks()
    assert marks is not None and (marks.low, marks.high) == (0.2, 0.3)
    off = ClusterConfig.from_dict(
        {"pools": pools, "scheduler": {"evict_low_watermark": 0, "replica_aware_eviction": False}}
    )
    assert off.scheduler.eviction_watermarks() is None


def test_a_zero_low_watermark_evicts_nothing_ahead_but_keeps_replica_awareness() -> None:
    config = ClusterConfig.from_dict({"pools": [{"name": "default"}], "scheduler": {"evict_low_watermark": 0}})
    marks = config.scheduler.eviction_watermarks()
    assert marks is not None and marks.low == 0 and marks.replica_aware
    starving = LoadReport("w", "default", 1, 0.0, 100, 0, 50, 50, 50)
    assert blocks_to_evict(starving, marks) == 0


def test_replica_aware_eviction_is_on_by_default_and_must_be_a_bool() -> None:
    pools = [{"name": "default"}]
    marks = ClusterConfig.from_dict({"pools": pools}).scheduler.eviction_watermarks()
    assert marks is not None and marks.replica_aware
    off = ClusterConfig.from_dict({"pools": pools, "scheduler": {"replica_aware_eviction": False}})
    marks = off.scheduler.eviction_watermarks()
    assert marks is not None and not marks.replica_aware
    with pytest.raises(ConfigError, match="replica_aware_eviction: must be bool"):
        ClusterConfig.from_dict({"pools": pools, "scheduler": {"replica_aware_eviction": "yes"}})


def test_scheduler_policy_none_turns_eviction_ahead_of_need_off() -> None:
    base = {"pools": [{"name": "default"}]}
    on = ClusterConfig.from_dict({**base, "scheduler": {"policy": "watermark"}})
    off = ClusterConfig.from_dict({**base, "scheduler": {"policy": "none"}})
    assert on.scheduler.eviction_watermarks() is not None
    assert off.scheduler.eviction_watermarks() is None


def test_scheduler_migration_is_on_by_default_and_can_be_turned_off() -> None:
    on = ClusterConfig.from_dict({"pools": [{"name": "default"}]}).scheduler.migration_policy()
    assert on is not None and on.margin_blocks == 4 and on.cooldown_s == 10.0
    assert on.transfer == "auto"
    for transfer in (True, False):
        fixed = ClusterConfig.from_dict(
            {"pools": [{"name": "default"}], "scheduler": {"migration_transfer": transfer}}
        ).scheduler.migration_policy()
        assert fixed is not None and fixed.transfer is transfer
    with pytest.raises(
        ConfigError, match="migration_transfer: must be true, false or 'auto', got 'always'"
    ):
        ClusterConfig.from_dict(
            {"pools": [{"name": "default"}], "scheduler": {"migration_transfer": "always"}}
        )
    off = ClusterConfig.from_dict({"pools": [{"name": "default"}], "scheduler": {"migration": False}})
    assert off.scheduler.migration_policy() is None
    with pytest.raises(ConfigError, match="migration_margin_blocks: must be >= 0, got -1"):
        ClusterConfig.from_dict(
            {"pools": [{"name": "default"}], "scheduler": {"migration_margin_blocks": -1}}
        )


def test_scheduler_preemption_mode_is_a_pool_setting_not_a_scheduler_one() -> None:
    with pytest.raises(ConfigError, match="preemption_mode"):
        ClusterConfig.from_dict(
            {"pools": [{"name": "default"}], "scheduler": {"preemption_mode": "swap"}}
        )


def test_one_scheduler_shard_owns_every_pool_by_default() -> None:
    cfg = ClusterConfig.from_dict({"pools": [{"name": "a"}, {"name": "b"}, {"name": "c"}]})
    assert cfg.scheduler.shards == 1
    assert cfg.scheduler_shards() == {"a": 0, "b": 0, "c": 0}


def test_scheduler_shards_own_whole_pools_balanced_by_workers() -> None:
    pools = [{"name": "a", "workers": 4}, {"name": "b", "workers": 1},
             {"name": "c", "workers": 1}, {"name": "d", "workers": 2}]  # fmt: skip
    cfg = ClusterConfig.from_dict({"pools": pools, "scheduler": {"shards": 2}})
    owners = cfg.scheduler_shards()
    # The largest pool first, each to the lightest shard: a | d, b, c; 4 workers each.
    assert owners == {"a": 0, "b": 1, "c": 1, "d": 1}
    assert list(owners) == ["a", "b", "c", "d"]  # config order
    assert ClusterConfig.from_dict({"pools": pools, "scheduler": {"shards": 2}}).scheduler_shards() == owners


def test_every_scheduler_shard_owns_a_pool_and_ties_go_to_the_lower_shard() -> None:
    pools = [{"name": f"p{i}", "workers": 3} for i in range(5)]
    cfg = ClusterConfig.from_dict({"pools": pools, "scheduler": {"shards": 5}})
    assert cfg.scheduler_shards() == {f"p{i}": i for i in range(5)}
    two = ClusterConfig.from_dict({"pools": pools, "scheduler": {"shards": 2}}).scheduler_shards()
    assert two == {"p0": 0, "p1": 1, "p2": 0, "p3": 1, "p4": 0}


def test_admission_defaults_to_the_full_request_and_bad_values_name_the_field() -> None:
    assert ClusterConfig.from_dict({"pools": [{"name": "a"}]}).scheduler.admission == "full"
    with pytest.raises(ConfigError, match=r"scheduler\.admission: must be one of full, prompt"):
        ClusterConfig.from_dict({"pools": [{"name": "a"}], "scheduler": {"admission": "max"}})
    with pytest.raises(ConfigError, match=r"scheduler\.admission_overcommit: must be a factor from 1\.0"):
        ClusterConfig.from_dict(
            {"pools": [{"name": "a"}], "scheduler": {"admission_overcommit": 0.5}}
        )
