"""Cluster config: YAML loading, validation messages with the field path, tenant lookup."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from pagefleet.cli import main
from pagefleet.cluster.config import ENGINE_FIELDS, ClusterConfig, ConfigError, PoolConfig
from pagefleet.cluster.tenancy import Tenancy
from pagefleet.scheduler.policy import blocks_to_evict
from pagefleet.worker.config import EngineConfig
from pagefleet.worker.events import LoadReport
from pagefleet.worker.sizes import parse_bytes

REPO = Path(__file__).resolve().parents[1]
MANIFEST = REPO / "manifests" / "pagefleet.yaml"


def config(**top: Any) -> dict[str, Any]:
    data: dict[str, Any] = {"pools": [{"name": "chat"}]}
    data.update(top)
    return data


def test_example_manifest_loads_with_two_pools_and_tenants(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEFLEET_ACME_KEY", "acme-secret-0123456789abcdef")
    monkeypatch.setenv("PAGEFLEET_GLOBEX_KEY", "globex-secret-0123456789abcdef")
    cfg = ClusterConfig.from_yaml(MANIFEST)
    assert len(cfg.pools) == 2
    assert len(cfg.tenants) >= 2
    assert Tenancy(cfg).tenant_for_api_key("acme-secret-0123456789abcdef") is not None


def test_default_config_is_one_open_pool_of_two_workers() -> None:
    cfg = ClusterConfig.default()
    assert [(p.name, p.workers, p.engine.model) for p in cfg.pools] == [("default", 2, "tiny")]
    assert Tenancy(cfg).tenant_for_api_key(None) == cfg.tenant("default")
    assert not Tenancy(cfg).auth_required


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
        (config(tenants=[{"name": "t", "pool": "chat", "api_key": "k-0123456789abcdef"}, {"name": "u", "pool": "chat", "api_key": "k-0123456789abcdef"}]), "tenants[1].api_key: two tenants share"),
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
    monkeypatch.setenv("T_KEY", "s3cret-0123456789abcdef")
    cfg = ClusterConfig.from_dict(
        config(tenants=[{"name": "t", "pool": "chat", "api_key_env": "T_KEY"}])
    )
    assert Tenancy(cfg).tenant_for_api_key("s3cret-0123456789abcdef") == cfg.tenant("t")


def test_unset_api_key_env_fails_at_load(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("T_KEY", raising=False)
    with pytest.raises(
        ConfigError, match=r"tenants\[0\].api_key_env: environment variable T_KEY is not set"
    ):
        ClusterConfig.from_dict(
            config(tenants=[{"name": "t", "pool": "chat", "api_key_env": "T_KEY"}])
        )


def test_tenant_salts_differ_and_an_explicit_salt_wins() -> None:
    cfg = ClusterConfig.from_dict(
        config(
            tenants=[
                {"name": "a", "pool": "chat", "api_key": "ka-0123456789abcdef"},
                {"name": "b", "pool": "chat", "api_key": "kb-0123456789abcdef"},
                {"name": "c", "pool": "chat", "api_key": "kc-0123456789abcdef", "salt": "fixed"},
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
    assert cfg.pool("chat").engine.kv_memory_bytes == 2**30


def test_a_pools_flat_engine_settings_are_its_engine_config() -> None:
    pool = PoolConfig(name="chat", block_size=32, num_kv_blocks=128, max_num_seqs=8)
    engine = pool.engine
    assert isinstance(engine, EngineConfig)
    assert (engine.block_size, engine.num_kv_blocks, engine.max_num_seqs) == (32, 128, 8)


def test_kv_cache_dtype_comes_from_yaml_into_the_engine_config() -> None:
    cfg = ClusterConfig.from_dict(config(pools=[{"name": "chat", "kv_cache_dtype": "float16"}]))
    assert cfg.pool("chat").engine.kv_cache_dtype == "float16"
    assert PoolConfig(name="chat").engine.kv_cache_dtype == "auto"


def test_enforce_eager_comes_from_yaml_into_the_engine_config() -> None:
    cfg = ClusterConfig.from_dict(config(pools=[{"name": "chat", "enforce_eager": True}]))
    assert cfg.pool("chat").engine.enforce_eager is True
    assert PoolConfig(name="chat").engine.enforce_eager is False


def test_unset_engine_settings_keep_the_engines_defaults() -> None:
    engine = PoolConfig(name="chat").engine
    assert engine == EngineConfig()
    assert engine.max_num_seqs == EngineConfig().max_num_seqs


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


# ----- types, unknown fields, byte sizes -----------------------------------------------------


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (config(pools=[{"name": "chat", "block_size": "16"}]), "pools[0].block_size: must be int, got str '16'"),
        (config(pools=[{"name": "chat", "workers": True}]), "pools[0].workers: must be int, got bool True"),
        (config(pools=[{"name": "chat", "enable_prefix_caching": "yes"}]), "pools[0].enable_prefix_caching: must be bool, got str 'yes'"),
        (config(pools=[{"name": "chat", "enforce_eager": "yes"}]), "pools[0].enforce_eager: must be bool, got str 'yes'"),
        (config(pools=["chat"]), "pools[0]: must be a mapping, got str 'chat'"),
        (config(scheduler={"report_interval_s": "fast"}), "scheduler.report_interval_s: must be float, got str 'fast'"),
        (config(router={"share_routes": 1}), "router.share_routes: must be bool, got int 1"),
        (config(server={"http_port": 80.5}), "server.http_port: must be int, got float 80.5"),
        (config(tenants={"name": "t", "pool": "chat"}), "tenants: must be a list, got dict"),
        (config(scheduler=[1]), "scheduler: must be a mapping, got list"),
    ],
)  # fmt: skip
def test_a_value_of_the_wrong_type_is_named_with_its_type(data: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        ClusterConfig.from_dict(data)
    assert str(info.value) == message


@pytest.mark.parametrize(
    ("data", "path"),
    [
        (config(server={"prot": 1}), "server.prot"),
        (config(router={"weight": 1}), "router.weight"),
        (config(tenants=[{"name": "t", "pool": "chat", "key": "k"}]), "tenants[0].key"),
        (config(pools=[{"name": "a"}, {"name": "b", "kv_memry": "1G"}]), "pools[1].kv_memry"),
    ],
)  # fmt: skip
def test_an_unknown_field_is_named_at_its_path(data: dict[str, Any], path: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{re.escape(path)}: unknown field \(known: "):
        ClusterConfig.from_dict(data)


def test_an_unknown_pool_field_lists_the_pools_and_the_engines_fields() -> None:
    with pytest.raises(ConfigError) as info:
        ClusterConfig.from_dict(config(pools=[{"name": "chat", "wrkers": 2}]))
    known = str(info.value).split("(known: ")[1].rstrip(")").split(", ")
    assert {"name", "workers", "device", "kv_memory", "kv_offload"} <= set(known)
    assert set(ENGINE_FIELDS) <= set(known)
    assert "engine" not in known


def test_engine_settings_are_written_flat_in_the_pool_not_nested() -> None:
    with pytest.raises(ConfigError, match=r"^pools\[0\]\.engine: unknown field"):
        ClusterConfig.from_dict(config(pools=[{"name": "chat", "engine": {"block_size": 32}}]))


EIGHT_GIB = 8 * 2**30


@pytest.mark.parametrize("size", ["8G", "8GiB", "8 GiB", "8192MiB", "8g", EIGHT_GIB, str(EIGHT_GIB)])
@pytest.mark.parametrize("field", ["kv_memory", "kv_memory_bytes", "kv_offload", "swap_space_bytes"])
def test_every_pool_byte_field_reads_every_spelling(field: str, size: int | str) -> None:
    pool = ClusterConfig.from_dict(config(pools=[{"name": "chat", field: size}])).pool("chat")
    assert getattr(pool.engine, field if field.endswith("_bytes") else f"{field}_bytes") == EIGHT_GIB


@pytest.mark.parametrize(("size", "expected"), [("2GB", 2 * 10**9), ("1.5GB", 1_500_000_000), ("512KB", 512_000)])
def test_decimal_units_are_powers_of_ten(size: str, expected: int) -> None:
    pool = ClusterConfig.from_dict(config(pools=[{"name": "chat", "kv_memory": size}])).pool("chat")
    assert pool.engine.kv_memory_bytes == expected


@pytest.mark.parametrize("size", ["1M", "1MiB", "1024KiB", 2**20])
@pytest.mark.parametrize("field", ["max_message_bytes", "max_body_bytes"])
def test_server_byte_limits_read_every_spelling(field: str, size: int | str) -> None:
    server = ClusterConfig.from_dict(config(server={field: size})).server
    assert getattr(server, field) == 2**20


@pytest.mark.parametrize("size", ["lots", "-1GiB", "8 GiBs", "1e9", 1.5])
def test_a_bad_byte_size_names_the_field(size: object) -> None:
    with pytest.raises(ConfigError, match=r"^pools\[0\]\.kv_memory_bytes: "):
        ClusterConfig.from_dict(config(pools=[{"name": "chat", "kv_memory": size}]))


def test_a_byte_field_takes_one_spelling_of_its_name() -> None:
    with pytest.raises(ConfigError, match=r"^pools\[0\]\.kv_offload: give kv_offload or kv_offload_bytes"):
        ClusterConfig.from_dict(config(pools=[{"name": "chat", "kv_offload": "1G", "kv_offload_bytes": 5}]))


@pytest.mark.parametrize("budget", ["8G", "8GiB", "8192MiB", str(EIGHT_GIB)])
def test_plan_budget_reads_the_same_spellings_as_the_config(
    budget: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", "--budget", budget, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["budget_bytes"] == EIGHT_GIB


def test_generate_kv_memory_refuses_a_bad_size_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "hi", "--model", "tiny", "--kv-memory", "lots"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("pagefleet generate: error: --kv-memory: expected a byte size")
    assert "\n" not in err


# ----- the engine's rules, at the pool's path ------------------------------------------------


@pytest.mark.parametrize(
    ("pool", "message"),
    [
        ({"kv_offload": "1GiB", "enable_prefix_caching": False}, "pools[0].kv_offload_bytes: needs enable_prefix_caching"),
        ({"cpu_kv_memory_fraction": 0.95}, "pools[0].cpu_kv_memory_fraction: must be in (0, 0.9], got 0.95"),
        ({"gpu_memory_utilization": 0}, "pools[0].gpu_memory_utilization: must be in (0, 1], got 0"),
        ({"max_num_seqs": 0}, "pools[0].max_num_seqs: must be >= 1, got 0"),
        ({"max_model_len": 1}, "pools[0].max_model_len: must be >= 2, got 1"),
        ({"preemption_mode": "drop"}, "pools[0].preemption_mode: must be one of ('recompute', 'swap', 'auto'), got 'drop'"),
        ({"seed": "7"}, "pools[0].seed: must be int, got str '7'"),
    ],
)  # fmt: skip
def test_the_engines_own_rules_are_reported_at_the_pool_path(pool: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        ClusterConfig.from_dict(config(pools=[{"name": "chat", **pool}]))
    assert str(info.value).startswith(message)


def test_a_pools_engine_errors_equal_the_engines_own() -> None:
    with pytest.raises(ValueError) as engine:
        EngineConfig(num_kv_blocks=0)
    with pytest.raises(ConfigError) as pool:
        ClusterConfig.from_dict(config(pools=[{"name": "chat", "num_kv_blocks": 0}]))
    assert str(engine.value) == "num_kv_blocks must be >= 1, got 0"
    assert str(pool.value) == "pools[0].num_kv_blocks: must be >= 1, got 0"


def test_every_engine_field_but_the_per_worker_ones_is_a_pool_field() -> None:
    per_worker = {"device", "tenant_max_live_blocks"}
    assert set(ENGINE_FIELDS) == {f.name for f in dataclasses.fields(EngineConfig)} - per_worker
    pool = ClusterConfig.from_dict(config(pools=[{"name": "chat", "seed": 7, "gpu_memory_utilization": 0.5}]))
    assert (pool.pool("chat").engine.seed, pool.pool("chat").engine.gpu_memory_utilization) == (7, 0.5)


def test_a_model_override_keeps_the_pools_other_engine_settings() -> None:
    cfg = ClusterConfig.from_dict(config(pools=[{"name": "chat", "block_size": 32, "kv_memory": "1G"}]))
    engine = cfg.with_overrides(model="smollm2-135m-instruct").pool("chat").engine
    assert (engine.model, engine.block_size, engine.kv_memory_bytes) == ("smollm2-135m-instruct", 32, 2**30)


def test_replace_validates_the_copy_and_names_the_field() -> None:
    cfg = ClusterConfig.from_dict(config())
    assert cfg.replace(server={"http_port": None}).server.http_port is None
    assert cfg.replace(server={"http_port": None}).server.grpc_port == cfg.server.grpc_port
    with pytest.raises(ConfigError, match=r"^server\.http_port: must differ from grpc_port"):
        cfg.replace(server={"http_port": cfg.server.grpc_port})


def test_a_yaml_syntax_error_is_one_line_with_its_position(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("pools:\n  - {name: chat\n")
    with pytest.raises(ConfigError) as info:
        ClusterConfig.from_yaml(path)
    assert "\n" not in str(info.value) and "line 3" in str(info.value)


# ----- pagefleet serve --config F --check ----------------------------------------------------


def check(path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(
        [sys.executable, "-m", "pagefleet", "serve", "--config", str(path), *flags, "--check"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip


def test_check_prints_the_resolved_config_with_every_default_and_exits_0(tmp_path: Path) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text("pools:\n  - {name: chat, workers: 3, kv_memory: 512MiB}\n")
    done = check(path)
    assert done.returncode == 0, done.stderr
    resolved = yaml.safe_load(done.stdout)
    assert list(resolved) == ["pools", "tenants", "router", "scheduler", "server"]
    (pool,) = resolved["pools"]
    assert (pool["name"], pool["workers"], pool["kv_memory_bytes"]) == ("chat", 3, 512 * 2**20)
    assert pool["max_num_seqs"] == EngineConfig().max_num_seqs and pool["device"] == "auto"
    assert resolved["tenants"] == [
        {"name": "default", "pool": "chat", "salt": None, "api_key": None, "api_key_env": None,
         "weight": 1.0, "max_live_blocks": None, "adapters": None},
    ]  # fmt: skip
    assert resolved["scheduler"]["report_timeout_s"] == 3.0
    assert resolved["server"]["max_body_bytes"] == 4 * 2**20


def test_the_resolved_config_loads_as_the_same_config(tmp_path: Path) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text(
        "pools:\n"
        "  - {name: chat, model: tiny, workers: 2, block_size: 32, kv_memory: 1G, kv_offload: 2GB}\n"
        "  - {name: batch, workers: 1, max_num_seqs: 8, device: cpu, num_gpus_per_worker: 0}\n"
        "tenants: [{name: open, pool: chat, weight: 2, max_live_blocks: 64}]\n"
        "router: {policy: round_robin, w_prefill: 2}\n"
        "scheduler: {shards: 2, migration_transfer: true}\n"
        "server: {http_port: null, max_body_bytes: 1MiB}\n"
    )
    done = check(path)
    assert done.returncode == 0, done.stderr
    assert ClusterConfig.from_dict(yaml.safe_load(done.stdout)) == ClusterConfig.from_yaml(path)


def test_check_applies_the_command_line_flags(tmp_path: Path) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text("pools:\n  - {name: chat}\n")
    done = check(path, "--workers", "4", "--http-port", "-1", "--grpc-port", "6000")
    resolved = yaml.safe_load(done.stdout)
    assert resolved["pools"][0]["workers"] == 4
    assert (resolved["server"]["http_port"], resolved["server"]["grpc_port"]) == (None, 6000)


def test_check_hides_api_keys(tmp_path: Path) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text("pools: [{name: chat}]\ntenants: [{name: t, pool: chat, api_key: sk-secret-1-0123456789}]\n")
    done = check(path)
    assert done.returncode == 0, done.stderr
    assert "sk-secret-1-0123456789" not in done.stdout
    assert yaml.safe_load(done.stdout)["tenants"][0]["api_key"] == "<hidden>"


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("pools:\n  - {name: chat, workers: 0}\n", "pools[0].workers: must be >= 1, got 0"),
        ("pools:\n  - {name: chat, kv_memory: lots}\n", "pools[0].kv_memory_bytes: expected a byte size"),
        ("pools: [{name: chat}]\nserver: {grpc_prot: 1}\n", "server.grpc_prot: unknown field"),
        ("pools:\n  - {name: chat\n", "not valid YAML (line 3"),
    ],
)
def test_check_of_a_bad_config_exits_2_with_one_line_naming_the_field(
    tmp_path: Path, text: str, field: str
) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    done = check(path)
    assert done.returncode == 2
    assert done.stdout == ""
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("pagefleet serve: error: invalid config: ") and field in line


def test_an_idle_worker_heartbeats_at_a_third_of_the_report_deadline_never_faster_than_it_reports() -> None:
    scheduler = ClusterConfig.from_dict({"pools": [{"name": "p"}]}).scheduler
    assert (scheduler.report_interval_s, scheduler.report_timeout_s, scheduler.heartbeat_s) == (0.5, 3.0, 1.0)
    tight = ClusterConfig.from_dict(
        {"pools": [{"name": "p"}], "scheduler": {"report_interval_s": 0.4, "report_timeout_s": 0.6}}
    )
    assert tight.scheduler.heartbeat_s == 0.4
