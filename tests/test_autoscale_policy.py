"""The pool autoscaling policy (`pagefleet.scheduler.autoscale`), without Ray."""

from __future__ import annotations

import pytest

from pagefleet.cluster.config import ClusterConfig, ConfigError
from pagefleet.scheduler.autoscale import (
    AutoscalePolicy,
    PoolAutoscaler,
    PoolLoad,
    ScaleDecision,
    pool_load,
)
from pagefleet.scheduler.state import ClusterState
from pagefleet.worker.events import KVEventBatch, LoadReport, WorkerInfo

POLICY = AutoscalePolicy(min_workers=1, max_workers=3, free_fraction=0.1, out_after_s=5, in_after_s=20, cooldown_s=10)


def pressed(workers: int) -> PoolLoad:
    return PoolLoad(workers=workers, free_blocks=2, total_blocks=100 * workers, running=4, waiting=3)


def idle(workers: int) -> PoolLoad:
    return PoolLoad(workers=workers, free_blocks=100 * workers, total_blocks=100 * workers, running=0, waiting=0)


def busy(workers: int) -> PoolLoad:
    return PoolLoad(workers=workers, free_blocks=50, total_blocks=100 * workers, running=2, waiting=0)


def test_sustained_block_pressure_with_waiting_requests_adds_one_worker() -> None:
    scaler = PoolAutoscaler(POLICY, 1)
    assert scaler.observe(0.0, pressed(1)) is None
    assert scaler.observe(4.9, pressed(1)) is None
    decision = scaler.observe(5.0, pressed(1))
    assert decision == ScaleDecision(2, "scale out: 2% blocks free (< 10%) and 3 waiting for 5s")
    assert (scaler.target, scaler.reason) == (2, decision.reason)


def test_pressure_that_lets_up_starts_the_clock_again() -> None:
    scaler = PoolAutoscaler(POLICY, 1)
    scaler.observe(0.0, pressed(1))
    scaler.observe(3.0, busy(1))
    assert scaler.observe(6.0, pressed(1)) is None
    assert scaler.observe(11.0, pressed(1)) is not None


def test_few_free_blocks_without_waiting_requests_is_no_reason_to_grow() -> None:
    scaler = PoolAutoscaler(POLICY, 1)
    full_but_keeping_up = PoolLoad(workers=1, free_blocks=1, total_blocks=100, running=4, waiting=0)
    assert all(scaler.observe(t, full_but_keeping_up) is None for t in (0.0, 10.0, 100.0))


def test_requests_held_back_at_the_ingress_count_as_waiting() -> None:
    # Admission keeps requests at the ingress while the workers' blocks are claimed:
    # the workers report nobody waiting, and the pool is still short.
    scaler = PoolAutoscaler(POLICY, 1)
    held_back = PoolLoad(workers=1, free_blocks=5, total_blocks=100, running=2, waiting=0, queued=4)
    assert scaler.observe(0.0, held_back) is None
    assert scaler.observe(5.0, held_back) == ScaleDecision(2, "scale out: 5% blocks free (< 10%) and 4 waiting for 5s")
    quiet_workers = PoolLoad(workers=2, free_blocks=200, total_blocks=200, running=0, waiting=0, queued=1)
    assert not quiet_workers.idle  # a queued request is not idleness


class _Clock:
    now = 50.0

    def __call__(self) -> float:
        return self.now


def test_the_pool_load_counts_claimed_blocks_as_taken_and_live_replicas_queues() -> None:
    clock = _Clock()
    state = ClusterState(report_timeout_s=3.0, clock=clock)
    state.register_worker(WorkerInfo("w0", "chat", 100))
    # 60 allocatable, of which the running requests will still take 45 to reach max_tokens.
    report = LoadReport("w0", "chat", 1, 0.0, 100, 50, 40, 10, 40, num_running=2, committed_blocks=45)
    state.push(report, KVEventBatch("w0", 1))
    state.note_replica("ingress-a", queued={"chat": 3})
    state.note_replica("ingress-b", queued={"chat": 2, "batch": 1})
    load = pool_load(state.view(), "chat")
    assert (load.workers, load.free_blocks, load.total_blocks, load.running, load.waiting, load.queued) == (
        1, 15, 100, 2, 0, 5,
    )  # fmt: skip
    # Admission by prompt does not hold blocks for max_tokens: only the allocatable count.
    assert pool_load(state.view(), "chat", "prompt").free_blocks == 60
    clock.now += 2.0
    state.note_replica("ingress-a", queued={"chat": 1})
    clock.now += 2.0  # ingress-b has not subscribed for 4 s (> 3 s): its queue is gone
    assert pool_load(state.view(), "chat").queued == 1


def test_no_second_move_before_the_pool_reached_its_target_nor_within_the_cooldown() -> None:
    scaler = PoolAutoscaler(POLICY, 1)
    scaler.observe(0.0, pressed(1))
    assert scaler.observe(5.0, pressed(1)) is not None  # target 2
    assert scaler.observe(12.0, pressed(1)) is None  # the new worker is still loading
    scaler.observe(12.5, pressed(2))
    assert scaler.observe(14.0, pressed(2)) is None  # within the cooldown (moved at 5 s)
    assert scaler.observe(17.0, pressed(2)) == ScaleDecision(3, "scale out: 1% blocks free (< 10%) and 3 waiting for 5s")


def test_growth_stops_at_max_workers() -> None:
    scaler = PoolAutoscaler(POLICY, 3)
    assert all(scaler.observe(t, pressed(3)) is None for t in (0.0, 50.0, 100.0))


def test_an_idle_pool_shrinks_one_worker_at_a_time_down_to_min_workers() -> None:
    scaler = PoolAutoscaler(POLICY, 3)
    assert scaler.observe(0.0, idle(3)) is None
    assert scaler.observe(20.0, idle(3)) == ScaleDecision(2, "scale in: idle for 20s")
    assert scaler.observe(25.0, idle(2)) is None  # the idle clock starts again after a move
    assert scaler.observe(45.0, idle(2)) == ScaleDecision(1, "scale in: idle for 20s")
    assert all(scaler.observe(t, idle(1)) is None for t in (70.0, 200.0))


def test_a_busy_pool_is_not_idle() -> None:
    scaler = PoolAutoscaler(POLICY, 2)
    assert all(scaler.observe(t, busy(2)) is None for t in (0.0, 30.0, 100.0))


def test_the_start_target_is_clamped_to_the_bounds_and_fixed_pools_are_inactive() -> None:
    assert PoolAutoscaler(POLICY, 7).target == 3
    assert not AutoscalePolicy(2, 2).active and POLICY.active


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"min_workers": 0, "max_workers": 2}, "need 1 <= min_workers <= max_workers, got 0 and 2"),
        ({"min_workers": 3, "max_workers": 2}, "need 1 <= min_workers <= max_workers, got 3 and 2"),
        ({"min_workers": 1, "max_workers": 2, "free_fraction": 1.5}, "free_fraction must be in [0, 1], got 1.5"),
        ({"min_workers": 1, "max_workers": 2, "cooldown_s": -1}, "cooldown_s must be >= 0, got -1"),
    ],
)
def test_bad_bounds_are_refused_with_the_limit(kwargs: dict[str, float], error: str) -> None:
    with pytest.raises(ValueError) as exc:
        AutoscalePolicy(**kwargs)  # type: ignore[arg-type]
    assert str(exc.value) == error


def test_a_pool_autoscales_between_min_and_max_workers_given_in_its_config() -> None:
    config = ClusterConfig.from_dict(
        {"pools": [{"name": "a", "workers": 2, "min_workers": 1, "max_workers": 4}],
         "scheduler": {"autoscale_out_after_s": 2, "autoscale_cooldown_s": 5}}
    )  # fmt: skip
    pool = config.pools[0]
    policy = config.scheduler.autoscale_policy(*pool.worker_bounds())
    assert (policy.min_workers, policy.max_workers, policy.out_after_s, policy.cooldown_s) == (1, 4, 2.0, 5.0)
    assert ClusterConfig.from_dict({"pools": [{"name": "b", "workers": 3}]}).pools[0].worker_bounds() == (3, 3)


@pytest.mark.parametrize(
    ("data", "error"),
    [
        ({"pools": [{"name": "a", "workers": 2, "max_workers": 1}]},
         "pools[0].max_workers: need 1 <= min_workers <= workers <= max_workers, got 2, 2, 1"),
        ({"pools": [{"name": "a"}], "scheduler": {"autoscale_in_after_s": -1}},
         "scheduler.autoscale_in_after_s: must be >= 0, got -1"),
    ],
)  # fmt: skip
def test_bad_autoscaling_config_names_the_field_and_the_limit(data: dict[str, object], error: str) -> None:
    with pytest.raises(ConfigError) as exc:
        ClusterConfig.from_dict(data)
    assert str(exc.value) == error
