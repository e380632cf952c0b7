"""Router: prefix matching from KV events, the cost with its imbalance guard, the baselines,
and session affinity (pins, their expiry and bounds, shared between replicas)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagefleet.cluster.api import MAX_SESSION_ID_CHARS, GenerationRequest, session_id_from_metadata
from pagefleet.cluster.config import ClusterConfig
from pagefleet.cluster.errors import InvalidArgument
from pagefleet.cluster.fleet_view import FleetView
from pagefleet.cluster.ingress import Ingress
from pagefleet.cluster.metrics import IngressMetrics
from pagefleet.cluster.router import NoWorkerAvailable, RouteDecision, Router, RouterConfig
from pagefleet.cluster.worker_slots import WorkerSlot
from pagefleet.scheduler.messages import ViewUpdate, WorkerDelta
from pagefleet.scheduler.session_pins import SessionKey, SessionPin
from pagefleet.scheduler.state import ClusterState
from pagefleet.worker.events import LoadReport, WorkerInfo
from pagefleet.worker.prefix_hash import hash_token_blocks
from pagefleet.worker.sampling_params import SamplingParams

BS = 16
SYSTEM_A = list(range(1000, 1000 + 8 * BS))  # 8 full blocks
SYSTEM_B = list(range(5000, 5000 + 8 * BS))


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_router(n: int = 3, *, seed: int = 0, **cfg: object) -> tuple[Router, list[str]]:
    cfg.setdefault("speculative_ttl_s", 0.0)  # most tests look at KV events alone
    router = Router(RouterConfig(**cfg), seed=seed, clock=FakeClock())  # type: ignore[arg-type]
    ids = [f"w{i}" for i in range(n)]
    for wid in ids:
        router.add_worker(wid, "chat", block_size=BS)
    return router, ids


def _events(
    router: Router, worker_id: str, stored: Sequence[bytes] = (), removed: Sequence[bytes] = ()
) -> None:
    """A view delta carrying these KV events (the worker's liveness unchanged)."""
    alive = worker_id in router.workers(alive_only=True)
    info = WorkerInfo(worker_id, "chat", 1000, BS)
    router.apply_delta(WorkerDelta(info, alive, None, tuple(stored), tuple(removed)))


def store(router: Router, worker_id: str, hashes: list[bytes]) -> None:
    _events(router, worker_id, stored=hashes)


def remove(router: Router, worker_id: str, hashes: list[bytes]) -> None:
    _events(router, worker_id, removed=hashes)


def load(router: Router, worker_id: str, live: int, *, waiting: int = 0, seq: int = 1) -> None:
    router.apply_load_report(
        LoadReport(
            worker_id, "chat", seq, 0.0, 1000, 1000 - live, live, 0, live, num_waiting=waiting
        )
    )


def prompt(system: list[int], suffix: int = 0) -> list[int]:
    return system + [suffix] * (2 * BS + 3)


def test_routes_to_the_worker_holding_the_prefix() -> None:
    router, _ = make_router()
    store(router, "w2", hash_token_blocks(SYSTEM_A, BS))
    decision = router.route("chat", prompt(SYSTEM_A))
    assert decision.worker_id == "w2"
    assert decision.matched_blocks == 8
    assert decision.prompt_blocks == 10


def test_longest_cached_prefix_wins() -> None:
    router, _ = make_router()
    hashes = hash_token_blocks(SYSTEM_A, BS)
    store(router, "w0", hashes[:3])
    store(router, "w1", hashes[:6])
    assert router.route("chat", prompt(SYSTEM_A)).worker_id == "w1"


def test_match_must_start_at_the_first_block() -> None:
    router, _ = make_router()
    hashes = hash_token_blocks(SYSTEM_A, BS)
    store(router, "w1", hashes[1:])
    assert router.matched_blocks("w1", hashes) == 0


def test_evicted_middle_block_ends_the_match() -> None:
    router, _ = make_router()
    hashes = hash_token_blocks(SYSTEM_A, BS)
    store(router, "w0", hashes)
    remove(router, "w0", [hashes[4]])
    assert router.matched_blocks("w0", hashes) == 4


def test_removed_events_take_away_affinity() -> None:
    router, _ = make_router(2)
    hashes = hash_token_blocks(SYSTEM_A, BS)
    store(router, "w1", hashes)
    remove(router, "w1", hashes)
    assert router.route("chat", prompt(SYSTEM_A)).matched_blocks == 0


def test_same_salt_hits_and_other_salt_misses() -> None:
    router, _ = make_router(2)
    store(router, "w1", hash_token_blocks(SYSTEM_A, BS, salt="acme"))
    acme = router.block_hashes("chat", prompt(SYSTEM_A), salt="acme")
    globex = router.block_hashes("chat", prompt(SYSTEM_A), salt="globex")
    assert router.matched_blocks("w1", acme) == 8
    assert router.matched_blocks("w1", globex) == 0


def test_overloaded_worker_loses_its_affinity() -> None:
    router, _ = make_router(2, imbalance_ratio=1.5, imbalance_slack_blocks=16, w_load=0.0)
    store(router, "w0", hash_token_blocks(SYSTEM_A, BS))
    load(router, "w0", 500)
    load(router, "w1", 10)
    decision = router.route("chat", prompt(SYSTEM_A))
    assert decision.worker_id == "w1"


def test_imbalance_guard_applies_per_candidate_not_fleet_wide() -> None:
    router, _ = make_router(3, imbalance_ratio=1.5, imbalance_slack_blocks=16, w_load=0.0)
    store(router, "w0", hash_token_blocks(SYSTEM_A, BS))
    store(router, "w1", hash_token_blocks(SYSTEM_B, BS))
    load(router, "w0", 500)  # overloaded: loses affinity
    load(router, "w1", 20)  # within the guard: keeps it
    load(router, "w2", 5)
    decision = router.route("chat", prompt(SYSTEM_B))
    assert decision.worker_id == "w1"
    assert decision.matched_blocks == 8


def test_load_outweighs_a_small_prefix_match() -> None:
    router, _ = make_router(2, imbalance_slack_blocks=1000)
    store(router, "w0", hash_token_blocks(SYSTEM_A, BS)[:2])
    load(router, "w0", 100)
    load(router, "w1", 0)
    assert router.route("chat", prompt(SYSTEM_A)).worker_id == "w1"


def test_waiting_requests_add_to_the_cost() -> None:
    router, _ = make_router(2, w_queue=8.0)
    load(router, "w0", 10, waiting=5)
    load(router, "w1", 30, waiting=0)
    assert router.route("chat", prompt(SYSTEM_A)).worker_id == "w1"


def test_decision_reports_its_cost() -> None:
    router, _ = make_router(1, w_prefill=2.0, w_load=1.0, w_queue=0.0)
    store(router, "w0", hash_token_blocks(SYSTEM_A, BS)[:5])
    load(router, "w0", 7)
    decision = router.route("chat", prompt(SYSTEM_A))
    assert decision.cost == pytest.approx(2.0 * (10 - 5) + 7)
    assert decision.num_candidates == 1
    assert decision.policy == "prefix_affinity"


def test_ties_are_broken_at_random_and_reproducibly_with_a_seed() -> None:
    def choices(seed: int) -> list[str]:
        router, _ = make_router(8, seed=seed, w_load=0.0, w_queue=0.0)
        return [router.route("chat", prompt(SYSTEM_A, i)).worker_id for i in range(40)]

    assert choices(1) == choices(1)
    assert len(set(choices(1))) > 1


def test_round_robin_cycles_through_live_workers() -> None:
    router, _ = make_router(3, policy="round_robin")
    router.set_alive("w1", False)
    picked = [router.route("chat", prompt(SYSTEM_A)).worker_id for _ in range(4)]
    assert picked == ["w0", "w2", "w0", "w2"]


def test_round_robin_ignores_the_cache() -> None:
    router, _ = make_router(3, policy="round_robin")
    store(router, "w2", hash_token_blocks(SYSTEM_A, BS))
    picked = {router.route("chat", prompt(SYSTEM_A)).worker_id for _ in range(3)}
    assert picked == {"w0", "w1", "w2"}


def test_least_loaded_picks_the_lightest_worker() -> None:
    router, _ = make_router(3, policy="least_loaded")
    store(router, "w0", hash_token_blocks(SYSTEM_A, BS))
    load(router, "w0", 50)
    load(router, "w1", 5)
    load(router, "w2", 30)
    assert router.route("chat", prompt(SYSTEM_A)).worker_id == "w1"


def test_power_of_two_picks_the_lighter_of_its_pair() -> None:
    router, _ = make_router(2, policy="power_of_two")
    load(router, "w0", 80)
    load(router, "w1", 5)
    assert router.route("chat", prompt(SYSTEM_A)).worker_id == "w1"


def test_policy_can_be_chosen_per_call() -> None:
    router, _ = make_router(2)
    assert router.route("chat", prompt(SYSTEM_A), policy="round_robin").policy == "round_robin"
    with pytest.raises(ValueError, match="unknown routing policy"):
        router.route("chat", prompt(SYSTEM_A), policy="random")


def test_empty_pool_raises_no_worker_available() -> None:
    router, _ = make_router(1)
    with pytest.raises(NoWorkerAvailable, match="'other'") as info:
        router.route("other", prompt(SYSTEM_A))
    assert info.value.pool == "other"


def test_dead_pool_raises_no_worker_available() -> None:
    router, ids = make_router(2)
    for wid in ids:
        router.set_alive(wid, False)
    with pytest.raises(NoWorkerAvailable):
        router.route("chat", prompt(SYSTEM_A))


def test_excluded_worker_is_not_chosen() -> None:
    router, _ = make_router(2)
    store(router, "w0", hash_token_blocks(SYSTEM_A, BS))
    assert router.route("chat", prompt(SYSTEM_A), exclude={"w0"}).worker_id == "w1"


def test_removed_worker_takes_its_index_with_it() -> None:
    router, _ = make_router(2)
    hashes = hash_token_blocks(SYSTEM_A, BS)
    store(router, "w0", hashes)
    router.remove_worker("w0")
    router.add_worker("w0", "chat", block_size=BS)
    assert router.matched_blocks("w0", hashes) == 0
    assert router.workers("chat") == ["w1", "w0"]


def test_a_pool_keeps_one_block_size() -> None:
    router, _ = make_router(1)
    with pytest.raises(ValueError, match="block_size 16"):
        router.add_worker("w9", "chat", block_size=32)


def test_routed_prefix_is_sticky_before_the_workers_events_arrive() -> None:
    router, _ = make_router(4, speculative_ttl_s=5.0)
    first = router.route("chat", prompt(SYSTEM_A, 1))
    follower = router.route("chat", prompt(SYSTEM_A, 2))
    assert follower.worker_id == first.worker_id
    assert follower.matched_blocks == 8


def test_speculative_entries_expire() -> None:
    clock = FakeClock()
    router = Router(RouterConfig(speculative_ttl_s=2.0), seed=0, clock=clock)
    router.add_worker("w0", "chat", block_size=BS)
    hashes = router.block_hashes("chat", prompt(SYSTEM_A))
    router.route_hashes("chat", hashes)
    assert router.matched_blocks("w0", hashes) == 10
    clock.now = 3.0
    assert router.matched_blocks("w0", hashes) == 0


def test_stored_event_confirms_a_speculative_entry_past_its_expiry() -> None:
    clock = FakeClock()
    router = Router(RouterConfig(speculative_ttl_s=2.0), seed=0, clock=clock)
    router.add_worker("w0", "chat", block_size=BS)
    hashes = router.block_hashes("chat", prompt(SYSTEM_A))
    router.route_hashes("chat", hashes)
    store(router, "w0", hashes[:8])
    clock.now = 3.0
    assert router.matched_blocks("w0", hashes) == 8


def test_clearing_some_workers_index_keeps_the_others_confirmed_and_speculative_entries() -> None:
    clock = FakeClock()
    router = Router(RouterConfig(speculative_ttl_s=2.0), seed=0, clock=clock)
    router.add_worker("w0", "chat", block_size=BS)
    router.add_worker("w1", "other", block_size=BS)
    hashes = router.block_hashes("chat", prompt(SYSTEM_A))
    store(router, "w0", hashes[:8])
    router.apply_delta(WorkerDelta(WorkerInfo("w1", "other", 1000, BS), True, None, tuple(hashes[:4])))
    router.route_hashes("other", hashes)  # w1 now holds all 10 speculatively
    router.clear_index(["w0", "unknown"])
    assert router.matched_blocks("w0", hashes) == 0
    assert router.matched_blocks("w1", hashes) == 10
    clock.now = 3.0  # w1's speculative entries expire as usual; its confirmed ones stay
    assert router.matched_blocks("w1", hashes) == 4


def test_routing_counts_as_load_until_the_next_report() -> None:
    router, _ = make_router(2, policy="least_loaded")
    load(router, "w0", 0, seq=1)
    load(router, "w1", 0, seq=1)
    first = router.route("chat", prompt(SYSTEM_A)).worker_id
    second = router.route("chat", prompt(SYSTEM_A)).worker_id
    assert first != second


def test_older_load_report_is_ignored() -> None:
    router, _ = make_router(2, policy="least_loaded")
    load(router, "w0", 100, seq=5)
    load(router, "w0", 0, seq=4)
    load(router, "w1", 50, seq=1)
    assert router.route("chat", prompt(SYSTEM_A)).worker_id == "w1"


def test_delta_of_the_scheduler_view_carries_load_and_index() -> None:
    router, _ = make_router(2, policy="least_loaded")
    hashes = hash_token_blocks(SYSTEM_A, BS)
    report = LoadReport("w0", "chat", 1, 0.0, 100, 10, 90, 0, 90)
    router.apply_delta(WorkerDelta(WorkerInfo("w0", "chat", 100, BS), True, report, tuple(hashes)))
    assert router.matched_blocks("w0", hashes) == 8
    assert router.route("chat", prompt(SYSTEM_A)).worker_id == "w1"


def _delta(worker_id: str, alive: bool, *stored: bytes, gone: bool = False) -> WorkerDelta:
    return WorkerDelta(WorkerInfo(worker_id, "chat", 100, BS), alive, None, stored, gone=gone)


def test_view_delta_adds_workers_and_sets_liveness() -> None:
    router = Router(seed=0)
    router.apply_delta(_delta("a", True))
    router.apply_delta(_delta("b", False))
    assert router.workers("chat") == ["a", "b"]
    assert router.workers("chat", alive_only=True) == ["a"]


def test_view_delta_of_a_deregistered_worker_removes_it() -> None:
    router = Router(seed=0)
    router.apply_delta(_delta("a", True))
    router.apply_delta(_delta("a", False, gone=True))
    assert router.workers("chat") == []


def test_snapshot_rebuilds_the_index_and_keeps_workers_it_does_not_list() -> None:
    router = Router(seed=0)
    hashes = hash_token_blocks(SYSTEM_A, BS)
    view = FleetView(router, lambda _delta: None)
    view.apply(ViewUpdate(1, 2, False, (_delta("a", True, *hashes), _delta("b", True, *hashes))))
    # A restarted scheduler that so far knows only b: a's index is gone, a still routes.
    view.apply(ViewUpdate(2, 1, True, (_delta("b", True, *hashes[:2]),)))
    assert (view.generation, view.version) == (2, 1)
    assert router.matched_blocks("a", hashes) == 0
    assert router.matched_blocks("b", hashes) == 2
    assert router.workers("chat", alive_only=True) == ["a", "b"]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.booleans(), st.integers(0, 7)),  # worker, stored?, block
        max_size=80,
    )
)
def test_index_matches_a_naive_per_worker_set(ops: list[tuple[int, bool, int]]) -> None:
    router, ids = make_router(4)
    hashes = hash_token_blocks(SYSTEM_A, BS)
    naive: dict[str, set[bytes]] = {wid: set() for wid in ids}
    for w, stored, block in ops:
        wid, h = ids[w], hashes[block]
        (store if stored else remove)(router, wid, [h])
        (naive[wid].add if stored else naive[wid].discard)(h)
    for wid in ids:
        expected = 0
        while expected < len(hashes) and hashes[expected] in naive[wid]:
            expected += 1
        assert router.matched_blocks(wid, hashes) == expected
    best = max(router.matched_blocks(wid, hashes) for wid in ids)
    assert router.route_hashes("chat", hashes).matched_blocks == best


def test_report_from_a_new_incarnation_replaces_the_old_one() -> None:
    router, _ = make_router(2, policy="least_loaded")
    router.apply_load_report(LoadReport("w0", "chat", 40, 0.0, 1000, 500, 500, 0, 500, incarnation="a"))
    router.apply_load_report(LoadReport("w1", "chat", 1, 0.0, 1000, 900, 100, 0, 100, incarnation="x"))
    router.apply_load_report(LoadReport("w0", "chat", 1, 0.0, 1000, 1000, 0, 0, 0, incarnation="b"))
    assert router.route("chat", prompt(SYSTEM_A)).worker_id == "w0"


# ----- routing decisions shared between ingress replicas ----------------------------


def test_each_decision_goes_to_on_routed_when_shared() -> None:
    seen: list[tuple[str, str, int]] = []
    router = Router(RouterConfig(), seed=0, on_routed=lambda p, w, h: seen.append((p, w, len(h))))
    router.add_worker("w0", "chat", block_size=BS)
    decision = router.route("chat", prompt(SYSTEM_A))
    assert seen == [("chat", decision.worker_id, 10)]
    quiet = Router(RouterConfig(share_routes=False), seed=0, on_routed=lambda *a: seen.append(a))
    quiet.add_worker("w0", "chat", block_size=BS)
    quiet.route("chat", prompt(SYSTEM_A))
    assert len(seen) == 1


def test_another_replicas_decision_is_sticky_here_and_counts_as_load() -> None:
    # Two replicas' routers with the same fleet; replica 1 learns replica 0's decision.
    zero, _ = make_router(2, speculative_ttl_s=5.0, policy="prefix_affinity")
    one, _ = make_router(2, speculative_ttl_s=5.0, policy="prefix_affinity")
    for router in (zero, one):
        load(router, "w0", 0, seq=1)
        load(router, "w1", 0, seq=1)
    hashes = zero.block_hashes("chat", prompt(SYSTEM_A, 1))
    chosen = zero.route_hashes("chat", hashes).worker_id
    other = "w1" if chosen == "w0" else "w0"
    one.note_routed_elsewhere(chosen, hashes)
    assert one.matched_blocks(chosen, hashes) == 10 and one.matched_blocks(other, hashes) == 0
    follower = one.route("chat", prompt(SYSTEM_A, 2))
    assert follower.worker_id == chosen and follower.matched_blocks == 8
    # The note's uncached blocks count as pending load there, as the decision's own do.
    assert one.route("chat", prompt(SYSTEM_B), policy="least_loaded").worker_id == other
    one.note_routed_elsewhere("unknown", hashes)  # a worker this replica does not know: ignored


def test_an_adapter_request_goes_where_the_adapter_is_resident_unless_a_prefix_outweighs_it() -> None:
    router, ids = make_router(3, w_adapter_load=8.0)
    for wid in ids:
        resident = ("alpha",) if wid == "w1" else ()
        router.apply_load_report(
            LoadReport(wid, "chat", 1, 0.0, 1000, 1000, 0, 0, 0, resident_adapters=resident)
        )
    prompt = list(range(300, 300 + 2 * BS))
    hashes = hash_token_blocks(prompt, BS, adapter_id="alpha:0")
    assert router.route_hashes("chat", hashes, adapter="alpha").worker_id == "w1"
    # A base-model request has no adapter to load: any worker (here the tie-break).
    assert {router.route_hashes("chat", hashes).worker_id for _ in range(20)} == set(ids)
    # Ten cached blocks of the prompt on w2 outweigh loading the adapter there (8 blocks).
    long_prompt = list(range(900, 900 + 10 * BS))
    long_hashes = hash_token_blocks(long_prompt, BS, adapter_id="alpha:0")
    store(router, "w2", long_hashes)
    assert router.route_hashes("chat", long_hashes, adapter="alpha").worker_id == "w2"


def test_a_cold_adapter_follows_its_first_request_until_the_reports_show_it() -> None:
    router, _ = make_router(3, w_adapter_load=8.0, speculative_ttl_s=2.0)
    hashes = hash_token_blocks(list(range(50, 50 + BS)), BS, adapter_id="beta:0")
    first = router.route_hashes("chat", hashes, adapter="beta").worker_id
    other = hash_token_blocks(list(range(70, 70 + BS)), BS, adapter_id="beta:0")
    assert all(router.route_hashes("chat", other, adapter="beta").worker_id == first for _ in range(5))


def slots_report(
    router: Router, worker_id: str, resident: tuple[str, ...], *, live: int = 0, slots: int = 2
) -> None:
    """A load report of a worker with `slots` LoRA slots, `resident` in them."""
    router.apply_load_report(
        LoadReport(
            worker_id, "chat", 1, 0.0, 1000, 1000 - live, live, 0, live,
            resident_adapters=resident, lora_slots=slots,
        )
    )


def test_a_cold_adapter_goes_where_a_slot_is_free_rather_than_evict_a_resident_one() -> None:
    router, _ = make_router(3, w_adapter_load=8.0, w_load=0.25)
    slots_report(router, "w0", ("a", "b"))
    slots_report(router, "w1", ("c", "d"))
    # w2 is busier (20 live blocks: 5 in cost), but one slot of its two is free.
    slots_report(router, "w2", ("e",), live=20)
    hashes = hash_token_blocks(list(range(40, 40 + 2 * BS)), BS, adapter_id="f:0")
    assert router.route_hashes("chat", hashes, adapter="f").worker_id == "w2"


def test_a_hot_adapter_gathers_where_it_is_resident_even_with_every_slot_taken() -> None:
    router, _ = make_router(3, w_adapter_load=8.0, w_load=0.25)
    slots_report(router, "w0", ("a", "b"), live=20)
    slots_report(router, "w1", ("c", "d"))
    slots_report(router, "w2", ())
    hashes = hash_token_blocks(list(range(40, 40 + 2 * BS)), BS, adapter_id="a:0")
    assert all(router.route_hashes("chat", hashes, adapter="a").worker_id == "w0" for _ in range(5))


def test_a_slot_this_router_just_filled_is_not_free_for_the_next_cold_adapter() -> None:
    router, _ = make_router(2, w_adapter_load=8.0, w_load=0.25, speculative_ttl_s=2.0)
    slots_report(router, "w0", ("a", "b"))
    slots_report(router, "w1", ("c",), live=20)
    first = hash_token_blocks(list(range(40, 40 + BS)), BS, adapter_id="f:0")
    assert router.route_hashes("chat", first, adapter="f").worker_id == "w1"
    # "f" takes w1's last slot: "g" evicts wherever it goes, and w0 is the less loaded.
    second = hash_token_blocks(list(range(90, 90 + BS)), BS, adapter_id="g:0")
    assert router.route_hashes("chat", second, adapter="g").worker_id == "w0"


def test_a_worker_holds_no_more_adapters_than_its_slots_by_the_routers_account() -> None:
    router, _ = make_router(2, w_adapter_load=8.0, w_load=0.25, speculative_ttl_s=2.0)
    slots_report(router, "w0", ("a", "b"))
    slots_report(router, "w1", (), live=20)
    # "c" and "d" go to w0, where their prompts are cached: loading them there evicts
    # "a" and "b", though no report has said so yet.
    for name, start in (("c", 40), ("d", 90)):
        hashes = hash_token_blocks(list(range(start, start + 4 * BS)), BS, adapter_id=f"{name}:0")
        store(router, "w0", hashes)
        assert router.route_hashes("chat", hashes, adapter=name).worker_id == "w0"
    # So "a" is a load wherever it goes, and w1 has free slots: there it costs one load
    # and no eviction.
    hashes = hash_token_blocks(list(range(200, 200 + BS)), BS, adapter_id="a:0")
    assert router.route_hashes("chat", hashes, adapter="a").worker_id == "w1"


# ----- session affinity ---------------------------------------------------------------

S1 = ("acme", "s1")  # (tenant, session id)


def session_router(
    n: int = 3, *, on_pinned: Callable[[SessionPin], None] | None = None, **cfg: object
) -> tuple[Router, FakeClock]:
    """A router over `n` idle workers w0.. of pool "chat", on a clock the test moves."""
    clock = FakeClock()
    cfg.setdefault("speculative_ttl_s", 0.0)
    router = Router(RouterConfig(**cfg), seed=0, clock=clock, on_pinned=on_pinned)  # type: ignore[arg-type]
    for i in range(n):
        router.add_worker(f"w{i}", "chat", block_size=BS)
        load(router, f"w{i}", 0)
    return router, clock


def pinned_to(router: Router, worker_id: str, session: SessionKey = S1) -> None:
    """Route the session's first request where its prompt is cached: the pin's worker."""
    hashes = hash_token_blocks(prompt(SYSTEM_A, 7), BS)
    store(router, worker_id, hashes)
    decision = router.route_hashes("chat", hashes, session=session)
    assert (decision.worker_id, decision.session) == (worker_id, "new")


def route_b(router: Router, session: SessionKey | None = S1, **kw: object) -> RouteDecision:
    """Route a prompt of SYSTEM_B, which the test has cached on w2 (if anywhere)."""
    return router.route_hashes("chat", hash_token_blocks(prompt(SYSTEM_B), BS), session=session, **kw)  # type: ignore[arg-type]


def test_a_session_goes_to_its_pinned_worker_even_where_another_holds_the_prompt() -> None:
    router, _ = session_router()
    pinned_to(router, "w0")
    store(router, "w2", hash_token_blocks(SYSTEM_B, BS))
    hit = route_b(router)
    assert (hit.worker_id, hit.session) == ("w0", "hit")
    assert route_b(router, session=None).worker_id == "w2"  # without the session: by prefix


def test_a_session_whose_worker_died_is_repinned_by_prefix_scoring() -> None:
    router, _ = session_router()
    pinned_to(router, "w0")
    store(router, "w2", hash_token_blocks(SYSTEM_B, BS))
    router.set_alive("w0", False)
    moved = route_b(router)
    assert (moved.worker_id, moved.session) == ("w2", "repin")
    router.set_alive("w0", True)  # back, but the session now lives on w2
    assert (route_b(router).worker_id, route_b(router).session) == ("w2", "hit")


@pytest.mark.parametrize(("live", "waiting"), [(200, 0), (0, 1)])
def test_a_session_leaves_an_overloaded_worker(live: int, waiting: int) -> None:
    # Overloaded: load beyond imbalance_ratio x the least load + slack (0 x 1.5 + 64), or
    # requests waiting in its engine.
    router, _ = session_router()
    pinned_to(router, "w0")
    store(router, "w2", hash_token_blocks(SYSTEM_B, BS))
    load(router, "w0", live, waiting=waiting, seq=2)
    moved = route_b(router)
    assert (moved.worker_id, moved.session) == ("w2", "repin")


def test_a_session_stays_on_a_worker_loaded_within_the_guard() -> None:
    router, _ = session_router()
    pinned_to(router, "w0")
    store(router, "w2", hash_token_blocks(SYSTEM_B, BS))
    load(router, "w0", 60, seq=2)  # within 1.5 x 0 + 64
    assert route_b(router).worker_id == "w0"


def test_a_session_whose_worker_has_no_room_is_repinned() -> None:
    router, _ = session_router()
    pinned_to(router, "w0")
    moved = route_b(router, exclude=("w0",))  # admission excludes the workers without room
    assert moved.worker_id != "w0" and moved.session == "repin"


def test_a_pin_expires_its_ttl_after_its_last_use() -> None:
    router, clock = session_router(session_ttl_s=10.0)
    pinned_to(router, "w0")
    store(router, "w2", hash_token_blocks(SYSTEM_B, BS))
    clock.now = 8.0
    assert route_b(router).session == "hit"  # the use refreshes the pin
    clock.now = 17.0
    assert route_b(router).session == "hit"
    clock.now = 27.5
    expired = route_b(router)
    assert (expired.worker_id, expired.session) == ("w2", "new")


def test_one_tenants_session_id_does_not_route_another_tenants_requests() -> None:
    router, _ = session_router()
    pinned_to(router, "w0", ("acme", "s1"))
    store(router, "w2", hash_token_blocks(SYSTEM_B, BS))
    other = route_b(router, session=("globex", "s1"))
    assert (other.worker_id, other.session) == ("w2", "new")
    assert route_b(router, session=("acme", "s1")).worker_id == "w0"


def test_pins_per_pool_are_capped_dropping_the_least_recently_used() -> None:
    router, _ = session_router(session_max_pins=2)
    for session in ("s1", "s2", "s3"):
        route_b(router, session=("acme", session))
    assert router.sessions.size("chat") == 2
    assert route_b(router, session=("acme", "s1")).session == "new"  # the oldest went
    assert route_b(router, session=("acme", "s3")).session == "hit"


def test_a_removed_workers_pins_are_dropped() -> None:
    router, _ = session_router()
    pinned_to(router, "w0")
    router.remove_worker("w0")
    assert router.sessions.size("chat") == 0
    assert route_b(router).session == "new"


def test_new_pins_are_shared_and_a_hit_only_before_the_others_copies_expire() -> None:
    told: list[SessionPin] = []
    router, clock = session_router(on_pinned=told.append, session_ttl_s=10.0)
    first = route_b(router)
    assert told == [SessionPin("chat", "acme", "s1", first.worker_id, 10.0)]
    clock.now = 4.0
    route_b(router)  # the others' copy still has 6 s
    assert len(told) == 1
    clock.now = 5.5
    route_b(router)  # under half a TTL left there: told again
    assert len(told) == 2


def _replica(state: ClusterState, replica_id: str, clock: FakeClock) -> FleetView:
    router = Router(RouterConfig(speculative_ttl_s=0.0), seed=len(replica_id), clock=clock,
                    on_pinned=lambda pin: state.note_pins((pin,)))  # fmt: skip
    view = FleetView(router, lambda _delta: None, replica_id)
    view.apply(state.updates_since(None, 0))
    return view


def _fleet_state(clock: FakeClock) -> ClusterState:
    state = ClusterState(generation=1, clock=clock)
    for wid in ("w0", "w1"):
        state.register_worker(WorkerInfo(wid, "chat", 1000, BS))
    return state


def test_a_second_replica_sends_a_session_to_the_worker_the_first_pinned() -> None:
    clock = FakeClock()
    state = _fleet_state(clock)
    zero, one = _replica(state, "r0", clock), _replica(state, "r1", clock)
    chosen = route_b(zero.router).worker_id
    one.apply(state.updates_since(one.generation, one.version))
    # Replica 1 has the prompt cached elsewhere by its view: the pin still wins.
    store(one.router, "w1" if chosen == "w0" else "w0", hash_token_blocks(SYSTEM_B, BS))
    assert (route_b(one.router).worker_id, route_b(one.router).session) == (chosen, "hit")


def test_a_replica_that_starts_later_gets_the_live_pins_with_its_snapshot() -> None:
    clock = FakeClock()
    state = _fleet_state(clock)
    chosen = route_b(_replica(state, "r0", clock).router).worker_id
    late = _replica(state, "r1", clock)
    assert late.router.sessions.get("chat", S1) == chosen
    state.deregister_worker(chosen)  # the scheduler forgets a gone worker's pins
    assert list(state.sessions.pins()) == []


def test_two_replicas_pinning_one_session_at_once_settle_on_the_schedulers_last() -> None:
    clock = FakeClock()
    state = _fleet_state(clock)
    zero, one = _replica(state, "r0", clock), _replica(state, "r1", clock)
    store(zero.router, "w0", hash_token_blocks(SYSTEM_B, BS))
    store(one.router, "w1", hash_token_blocks(SYSTEM_B, BS))
    assert route_b(zero.router).worker_id == "w0" and route_b(one.router).worker_id == "w1"
    for view in (zero, one):
        view.apply(state.updates_since(view.generation, view.version))
    assert zero.router.sessions.get("chat", S1) == one.router.sessions.get("chat", S1) == "w1"


@pytest.mark.parametrize("policy", ["prefix_affinity", "least_loaded"])
def test_replicas_that_have_no_pin_yet_send_a_new_session_to_one_worker(policy: str) -> None:
    # Replicas whose routers differ in their coins, before either has heard of the
    # other's pin: idle workers tie, and every session's turns still meet on one
    # worker, while sessions spread.
    def first_turn(seed: int, session: SessionKey, gone: str = "") -> str:
        """Where a replica seeded `seed` sends `session`'s first turn, every worker idle."""
        router = Router(RouterConfig(speculative_ttl_s=0.0, policy=policy), seed=seed, clock=FakeClock())
        for i in range(4):
            router.add_worker(f"w{i}", "chat", block_size=BS)
            load(router, f"w{i}", 0)
        if gone:
            router.remove_worker(gone)
        return route_b(router, session=session).worker_id

    sessions = [("acme", f"s{i}") for i in range(32)]
    first = {s: first_turn(1, s) for s in sessions}
    assert {s: first_turn(2, s) for s in sessions} == first
    assert set(first.values()) == {"w0", "w1", "w2", "w3"}
    # A worker's loss moves its sessions only: elsewhere the same worker still wins.
    moved = {s: first_turn(3, s, gone="w0") for s in sessions}
    assert {s: w for s, w in moved.items() if first[s] != "w0"} == {s: w for s, w in first.items() if w != "w0"}


def test_the_session_header_is_a_lowercase_header_name() -> None:
    assert RouterConfig(session_header="X-Correlation-ID").session_header == "x-correlation-id"
    for bad in ("", "x session", "x-session-bin", "grpc-session"):
        with pytest.raises(ValueError, match="session_header"):
            RouterConfig(session_header=bad)


def test_a_session_id_is_read_from_the_configured_header_within_its_limits() -> None:
    headers = [("x-api-key", "k"), ("x-session-id", "chat-42")]
    assert session_id_from_metadata(headers, "x-session-id") == "chat-42"
    assert session_id_from_metadata(headers, "x-correlation-id") == ""
    with pytest.raises(InvalidArgument, match=f"at most {MAX_SESSION_ID_CHARS} characters, got 129"):
        session_id_from_metadata([("x-session-id", "s" * 129)], "x-session-id")
    with pytest.raises(InvalidArgument, match="printable ASCII"):
        session_id_from_metadata([("x-session-id", "a\tb")], "x-session-id")


def test_admission_sends_a_session_to_its_worker_and_counts_hits_new_and_repins() -> None:
    async def scenario() -> None:
        config = ClusterConfig.from_dict({"pools": [{"name": "a", "block_size": BS}]})
        metrics = IngressMetrics()
        ingress = Ingress(config, {"a": [("w0", None), ("w1", None)]}, metrics=metrics)

        def view(*alive: str) -> None:
            deltas = tuple(
                WorkerDelta(WorkerInfo(w, "a", 1000, BS), w in alive,
                            LoadReport(w, "a", ingress.fleet.version + 1, 0.0, 1000, 1000, 0, 0, 0))
                for w in ("w0", "w1")
            )  # fmt: skip
            ingress.fleet.apply(ViewUpdate(1, ingress.fleet.version + 1, False, deltas))

        def admit(i: int, session: str = "s1") -> str:
            # Prompts of their own: nothing cached in common, so only the pin holds them.
            req = GenerationRequest(
                f"r{i}", tuple(range(100 * i, 100 * i + 2 * BS)), SamplingParams(max_tokens=4),
                pool="a", tenant="default", session_id=session,
            )  # fmt: skip
            slot = ingress.admission.admit(config.pools[0], req, list(req.prompt_ids))
            assert isinstance(slot, WorkerSlot)
            ingress.admission.release(slot, req.key)
            return slot.worker_id

        view("w0", "w1")
        first = admit(0)
        assert [admit(i) for i in range(1, 5)] == [first] * 4
        other = "w1" if first == "w0" else "w0"
        view(other)  # the session's worker leaves routing
        assert admit(5) == other
        view("w0", "w1")
        assert admit(6) == other  # re-pinned: it stays there

        def count(outcome: str) -> float | None:
            return metrics.registry.get_sample_value("session_routes_total", {"pool": "a", "outcome": outcome})

        assert (count("new"), count("hit"), count("repin")) == (1.0, 5.0, 1.0)

    asyncio.run(scenario())
