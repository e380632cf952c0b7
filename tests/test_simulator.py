"""Discrete-event simulator: policies compared on a shared-prefix workload with real block pools."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from pagefleet.cluster.router import RouterConfig

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "simulator.py"
_spec = importlib.util.spec_from_file_location("simulator", SCRIPT)
assert _spec is not None and _spec.loader is not None
sim_module = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = sim_module  # dataclasses look their module up while the file runs
_spec.loader.exec_module(sim_module)

EVICTION_MODES = sim_module.EVICTION_MODES
SimConfig = sim_module.SimConfig
Simulation = sim_module.Simulation
Workload = sim_module.Workload
format_table = sim_module.format_table
ideal_hit_rate = sim_module.ideal_hit_rate
make_requests = sim_module.make_requests
simulate = sim_module.simulate

WORKLOAD = Workload(
    num_requests=160, num_groups=6, system_prompt_tokens=256, suffix_tokens=32, arrival_rate=10.0
)
# Each worker holds about two groups' prefixes next to its running requests, not all six.
FLEET = SimConfig(num_workers=3, num_blocks=96, block_size=16, max_num_seqs=8)


def test_prefix_affinity_beats_round_robin_on_hit_rate() -> None:
    affinity = simulate("prefix_affinity", WORKLOAD, FLEET)
    round_robin = simulate("round_robin", WORKLOAD, FLEET)
    assert affinity.hit_rate > round_robin.hit_rate + 0.1


def test_prefix_affinity_comes_close_to_one_shared_cache() -> None:
    assert simulate("prefix_affinity", WORKLOAD, FLEET).hit_rate_vs_ideal > 0.9


@pytest.mark.parametrize(
    "policy", ["prefix_affinity", "round_robin", "least_loaded", "power_of_two"]
)
def test_every_request_finishes_and_every_block_returns(policy: str) -> None:
    sim = Simulation(WORKLOAD, FLEET, policy)
    result = sim.run()
    assert result.num_requests == WORKLOAD.num_requests
    for worker in sim.workers.values():
        stats = worker.pool.stats()
        assert stats.free + stats.cached == stats.total
        worker.pool.check_integrity()
    assert sum(w.served for w in sim.workers.values()) == WORKLOAD.num_requests


def test_same_seed_gives_the_same_result() -> None:
    assert simulate("power_of_two", WORKLOAD, FLEET) == simulate("power_of_two", WORKLOAD, FLEET)


def test_ideal_hit_rate_counts_every_repeat_of_a_prefix() -> None:
    workload = Workload(num_requests=3, num_groups=1, system_prompt_tokens=32, suffix_tokens=16)
    requests = make_requests(workload, 16)
    # 48-token prompts; the first request misses, the two others hit the 2 system blocks.
    assert ideal_hit_rate(requests, 16) == pytest.approx(2 * 32 / (3 * 48))


def test_request_larger_than_a_worker_pool_is_refused() -> None:
    with pytest.raises(ValueError, match="a worker has only 4"):
        simulate("round_robin", WORKLOAD, SimConfig(num_blocks=4))


def test_table_lists_each_policy() -> None:
    table = format_table([simulate("round_robin", WORKLOAD, FLEET)])
    assert "| round_robin |" in table


def test_imbalance_guard_spreads_one_hot_prefix_over_the_fleet() -> None:
    hot = replace(WORKLOAD, num_groups=1)
    # Load and queue weights off: only the guard stands between affinity and a hot spot.
    unguarded = RouterConfig(w_load=0.0, w_queue=0.0, imbalance_slack_blocks=10**6)
    guarded = RouterConfig(w_load=0.0, w_queue=0.0, imbalance_slack_blocks=8)
    assert simulate("prefix_affinity", hot, FLEET, unguarded).max_worker_share == 1.0
    assert simulate("prefix_affinity", hot, FLEET, guarded).max_worker_share < 0.5


def test_four_ingress_replicas_on_one_scheduler_view_keep_the_single_replica_hit_rate() -> None:
    one = simulate("prefix_affinity", WORKLOAD, FLEET)
    four = simulate("prefix_affinity", WORKLOAD, replace(FLEET, num_ingress_replicas=4))
    assert four.hit_rate >= 0.95 * one.hit_rate


def test_replicas_sharing_their_decisions_keep_the_hit_rate_when_kv_events_come_late() -> None:
    # KV events with the next report, every 0.5 s, as real workers push them: without
    # the route notes four replicas keep 93.8% of one replica's hit rate here.
    late = replace(FLEET, kv_events_with_reports=True, report_interval_s=0.5)
    workload = replace(WORKLOAD, arrival_rate=20.0)
    one = simulate("prefix_affinity", workload, late)
    four = simulate("prefix_affinity", workload, replace(late, num_ingress_replicas=4))
    assert four.hit_rate >= 0.95 * one.hit_rate


def test_simulated_fleet_state_goes_through_the_real_scheduler() -> None:
    sim = Simulation(WORKLOAD, replace(FLEET, num_ingress_replicas=2), "prefix_affinity")
    sim.run()
    sim._on_report(None)  # one more push round delivers every pending event
    for wid, worker in sim.workers.items():
        assert sim.state.cached_hashes(wid) == set(worker.pool.registered_hashes())
    assert [view.version for view in sim.replicas] == [sim.state.version] * 2


@pytest.mark.parametrize("mode", ["lru", "replica_aware"])
def test_scheduler_steered_eviction_keeps_every_pool_whole(mode: str) -> None:
    cfg = replace(FLEET, eviction=EVICTION_MODES[mode])
    sim = Simulation(replace(WORKLOAD, hot_share=0.3), cfg, "round_robin")
    result = sim.run()
    assert result.eviction == mode and result.num_requests == WORKLOAD.num_requests
    for worker in sim.workers.values():
        stats = worker.pool.stats()
        assert stats.free + stats.cached == stats.total
        worker.pool.check_integrity()
    # Round robin copies every prefix everywhere: replica awareness evicts copies first.
    assert (result.duplicate_evictions > 0) == (mode == "replica_aware")


def test_several_seeds_print_medians_against_the_single_replica(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--requests", "40", "--groups", "2", "--system-tokens", "64", "--workers", "2",
            "--policies", "prefix_affinity", "--ingress-replicas", "1,2", "--seeds", "2"]  # fmt: skip
    assert sim_module.main(argv) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| prefix")]
    assert [row.split("|")[3].strip() for row in rows] == ["1", "2"]
    assert rows[0].split("|")[5].strip() == "100.0%"  # one replica against itself
