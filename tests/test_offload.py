"""The KV offload tier: one copy path shared with swap, LRU host storage, spill on
eviction, revival on a prefix hit, and how the tier shows in stats, events,
load reports, metrics, routing and the cluster config."""

from __future__ import annotations

import pytest
import torch
from engine_stats import engine_stats
from prometheus_client import generate_latest

from pagefleet import LLM, SamplingParams
from pagefleet.cluster.config import ClusterConfig
from pagefleet.cluster.metrics import IngressMetrics
from pagefleet.cluster.router import Router, RouterConfig
from pagefleet.scheduler.state import ClusterState
from pagefleet.worker.block_pool import BlockPool
from pagefleet.worker.config import EngineConfig
from pagefleet.worker.events import KVEventBatch, LoadReport, WorkerInfo
from pagefleet.worker.kv_cache import KVCache, ModelShape
from pagefleet.worker.offload import BlockTransfer, HostOffloadTier, revive_offloaded
from pagefleet.worker.prefix_hash import hash_token_blocks

BS = 4
SHAPE = ModelShape(num_layers=3, num_kv_heads=2, head_dim=4, dtype=torch.float64)


def random_cache(num_blocks: int = 8) -> KVCache:
    kv = KVCache(SHAPE, num_blocks, BS)
    kv.tensor.copy_(torch.randn(kv.tensor.shape, generator=torch.Generator().manual_seed(0)))
    return kv


def hashes(n: int, salt: str = "t") -> list[bytes]:
    return hash_token_blocks(list(range(n * BS)), BS, salt=salt)


# ------------------------------------------------------------------- transfer


def test_transfer_round_trips_blocks_through_any_host_slots() -> None:
    kv = random_cache()
    before = kv.tensor.clone()
    host = kv.transfer.host_buffer(5)
    assert kv.transfer.to_host([6, 1, 2], host, [4, 0, 1]) == 3 * kv.transfer.bytes_per_block
    kv.tensor.zero_()
    kv.transfer.to_device(host, [1, 4, 0], [3, 5, 7])
    assert torch.equal(kv.tensor[:, :, 3], before[:, :, 2])
    assert torch.equal(kv.tensor[:, :, 5], before[:, :, 6])
    assert torch.equal(kv.tensor[:, :, 7], before[:, :, 1])


def test_swap_uses_the_same_transfer_layout_as_the_tier() -> None:
    kv = random_cache()
    host = kv.swap_out([2, 5])
    assert tuple(host.shape) == (2, *kv.transfer.block_shape)
    assert torch.equal(host[1], kv.tensor[:, :, 5])


def test_transfer_rejects_mismatched_slot_counts() -> None:
    kv = random_cache()
    with pytest.raises(ValueError, match="2 blocks for 1 host slots"):
        kv.transfer.to_host([0, 1], kv.transfer.host_buffer(1), [0])


# ----------------------------------------------------------------------- tier


def make_tier(kv: KVCache, blocks: int) -> HostOffloadTier:
    return HostOffloadTier(BlockTransfer(kv.tensor), blocks * kv.transfer.bytes_per_block, BS)


def test_tier_capacity_is_whole_blocks_of_the_byte_budget() -> None:
    kv = random_cache()
    per_block = kv.transfer.bytes_per_block
    tier = HostOffloadTier(kv.transfer, 3 * per_block + per_block // 2, BS)
    assert tier.capacity_blocks == 3


def test_tier_smaller_than_one_block_is_refused_with_the_block_size() -> None:
    kv = random_cache()
    per_block = kv.transfer.bytes_per_block
    with pytest.raises(ValueError, match=f"holds no block: one block of 4 tokens needs {per_block}"):
        HostOffloadTier(kv.transfer, per_block - 1, BS)


def test_tier_evicts_least_recently_used_first() -> None:
    kv = random_cache()
    tier = make_tier(kv, 2)
    h = hashes(3)
    tier.store([(h[0], 0), (h[1], 1)])
    tier.load([h[0]], [4])  # h0 is now the most recently used
    tier.store([(h[2], 2)])
    assert h[0] in tier and h[2] in tier and h[1] not in tier
    assert tier.stats().offload_evictions == 1
    tier.check_integrity()


def test_storing_a_hash_the_tier_holds_copies_nothing() -> None:
    kv = random_cache()
    tier = make_tier(kv, 4)
    h = hashes(1)
    tier.store([(h[0], 0)])
    tier.store([(h[0], 3)])
    assert tier.stats().offload_bytes_out == kv.transfer.bytes_per_block
    assert tier.stats().offload_blocks == 1


def test_tier_events_coalesce_a_store_and_eviction_between_drains() -> None:
    kv = random_cache()
    tier = make_tier(kv, 1)
    h = hashes(2)
    tier.store([(h[0], 0)])
    assert tier.drain_events() == [("offload_stored", h[0])]
    tier.store([(h[1], 1)])
    assert tier.drain_events() == [("offload_removed", h[0]), ("offload_stored", h[1])]


def test_loading_a_hash_the_tier_lacks_is_an_error() -> None:
    tier = make_tier(random_cache(), 2)
    with pytest.raises(KeyError, match="not in the offload tier"):
        tier.load(hashes(1), [0])


# ------------------------------------------------------------ pool and tier


def test_an_evicted_block_spills_with_its_kv_and_revives_into_a_fresh_block() -> None:
    kv = random_cache(4)
    tier = make_tier(kv, 4)
    pool = BlockPool(4, BS, spill=tier.store)
    h = hashes(1)
    [block] = pool.allocate(1)
    pool.register(block, h[0])
    saved = kv.tensor[:, :, block].clone()
    pool.free([block])
    taken = pool.allocate(4)  # evicts the cached block: its K/V go to the tier first
    kv.tensor.zero_()
    assert h[0] in tier and not pool.is_cached(h[0])
    pool.free(taken)
    revived = revive_offloaded(pool, tier, h)
    assert len(revived) == 1 and pool.block_hash(revived[0]) == h[0]
    assert torch.equal(kv.tensor[:, :, revived[0]], saved)
    pool.free(revived)
    pool.check_integrity()
    tier.check_integrity()


def two_cached_blocks_with_a_tier() -> tuple[HostOffloadTier, BlockPool, list[bytes]]:
    """A 4-block pool spilling into a tier, with two hashed blocks cached (ref 0)."""
    kv = random_cache(4)
    tier = make_tier(kv, 4)
    pool = BlockPool(4, BS, spill=tier.store)
    h = hashes(2)
    blocks = pool.allocate(2)
    for b, x in zip(blocks, h, strict=True):
        pool.register(b, x)
    pool.free(blocks)
    return tier, pool, h


def test_explicit_eviction_spills_too() -> None:
    tier, pool, h = two_cached_blocks_with_a_tier()
    assert pool.evict_cached(None) == 2
    assert tier.match(h) == 2


def test_eviction_of_a_block_duplicated_elsewhere_spills_too() -> None:
    # Replica-aware eviction takes the duplicated block first: the tier keeps it as well.
    tier, pool, h = two_cached_blocks_with_a_tier()
    pool.mark_duplicated([h[0]])
    assert pool.evict_cached(1) == 1
    assert h[0] in tier and h[1] not in tier
    assert pool.stats().cached == 1
    pool.check_integrity()


def test_revival_takes_no_more_blocks_than_the_pool_can_give() -> None:
    kv = random_cache(4)
    tier = make_tier(kv, 8)
    pool = BlockPool(4, BS, spill=tier.store)
    h = hashes(3)
    tier.store([(x, i) for i, x in enumerate(h)])
    held = pool.allocate(2)
    assert len(revive_offloaded(pool, tier, h)) == 2
    assert pool.num_allocatable == 0
    pool.free(held)
    pool.check_integrity()


# --------------------------------------------------------------------- config


def test_engine_config_refuses_a_negative_offload_budget() -> None:
    with pytest.raises(ValueError, match="kv_offload_bytes must be >= 0"):
        EngineConfig(kv_offload_bytes=-1)


def test_engine_config_refuses_offload_without_prefix_caching() -> None:
    with pytest.raises(ValueError, match="needs enable_prefix_caching"):
        EngineConfig(kv_offload_bytes=1 << 20, enable_prefix_caching=False)


def test_pool_yaml_kv_offload_is_a_byte_size() -> None:
    cfg = ClusterConfig.from_dict({"pools": [{"name": "chat", "kv_offload": "4GiB"}]})
    pool = cfg.pool("chat")
    assert pool.engine.kv_offload_bytes == 4 * 2**30


# --------------------------------------------------------- events and reports


def test_kv_events_of_the_tier_survive_the_wire() -> None:
    h = hashes(2)
    events = (("stored", h[0]), ("offload_stored", h[1]), ("offload_removed", h[0]))
    batch = KVEventBatch("w", 3, events)
    assert KVEventBatch.decode(batch.encode()).events == events


def test_load_report_carries_the_tier_counters() -> None:
    stats = engine_stats(total=8, free=8, offload_blocks=5, offload_hit_tokens=64,
                         offload_bytes_in=1000, offload_bytes_out=3000)  # fmt: skip
    report = LoadReport.from_engine_stats("w", "chat", 1, stats)
    decoded = LoadReport.decode(report.encode())
    assert (decoded.offload_blocks, decoded.offload_hit_tokens) == (5, 64)
    assert (decoded.offload_bytes_in, decoded.offload_bytes_out) == (1000, 3000)


def test_metrics_export_the_tier() -> None:
    metrics = IngressMetrics()
    metrics.observe_report(
        LoadReport("w", "chat", 1, 0.0, 8, 8, 0, 0, 0, offload_blocks=5,
                   offload_hit_tokens=64, offload_bytes_in=1000, offload_bytes_out=3000)
    )  # fmt: skip
    body = generate_latest(metrics.registry).decode()
    labels = '{pool="chat",worker="w"}'
    assert f"kv_offload_blocks{labels} 5.0" in body
    assert f"kv_offload_hit_tokens_total{labels} 64.0" in body
    assert f"kv_offload_bytes_in_total{labels} 1000.0" in body
    assert f"kv_offload_bytes_out_total{labels} 3000.0" in body


# -------------------------------------------------------------------- routing


def routed_to(router: Router, prompt: list[int]) -> str:
    return router.route("chat", prompt).worker_id


class Fleet:
    """Three workers behind the real scheduler state; a router follows its view."""

    def __init__(self) -> None:
        self.state = ClusterState(report_timeout_s=60.0)
        self.router = Router(RouterConfig(speculative_ttl_s=0.0), seed=0)
        self.seq: dict[str, int] = {}
        self.cursor = 0
        for w in ("pool", "tier", "cold"):
            self.state.register_worker(WorkerInfo(w, "chat", 100, 16))
            self.push(w)
        self.prompt = list(range(100, 100 + 6 * 16))
        self.hashes = self.router.block_hashes("chat", self.prompt)

    def push(self, worker_id: str, *events: tuple[str, bytes], reset: bool = False) -> None:
        """One worker push (report + KV events), then the router catches up with the view."""
        seq = self.seq[worker_id] = self.seq.get(worker_id, 0) + 1
        report = LoadReport(worker_id, "chat", seq, 0.0, 100, 100, 0, 0, 0, incarnation="p1")
        batch = KVEventBatch(worker_id, seq, events, reset=reset or seq == 1, incarnation="p1")
        self.state.push(report, batch)
        update = self.state.updates_since(self.state.generation, self.cursor)
        if update.snapshot:
            self.router.clear_index()
        for delta in update.deltas:
            self.router.apply_delta(delta)
        self.cursor = update.version


def test_router_prefers_a_pool_hit_over_a_tier_hit() -> None:
    fleet = Fleet()
    fleet.push("pool", *(("stored", x) for x in fleet.hashes))
    fleet.push("tier", *(("offload_stored", x) for x in fleet.hashes))
    assert routed_to(fleet.router, fleet.prompt) == "pool"


def test_router_prefers_a_tier_hit_over_a_miss() -> None:
    fleet = Fleet()
    fleet.push("tier", *(("offload_stored", x) for x in fleet.hashes))
    decision = fleet.router.route("chat", fleet.prompt)
    assert decision.worker_id == "tier" and decision.offload_blocks == len(fleet.hashes)


def test_router_counts_the_tier_run_after_the_pool_run() -> None:
    fleet = Fleet()
    h = fleet.hashes
    fleet.push("tier", *(("stored", x) for x in h[:2]), *(("offload_stored", x) for x in h[2:]))
    decision = fleet.router.route("chat", fleet.prompt)
    assert (decision.worker_id, decision.matched_blocks, decision.offload_blocks) == ("tier", 2, 4)


def test_a_snapshot_replaces_the_workers_tier() -> None:
    fleet = Fleet()
    fleet.push("tier", *(("offload_stored", x) for x in fleet.hashes))
    fleet.push("tier", reset=True)  # the worker's snapshot: its tier holds nothing now
    assert fleet.router.route("chat", fleet.prompt).offload_blocks == 0
    assert fleet.state.snapshot().deltas[1].offload_stored == ()


def test_offload_removed_events_leave_the_view() -> None:
    fleet = Fleet()
    fleet.push("tier", *(("offload_stored", x) for x in fleet.hashes))
    fleet.push("tier", *(("offload_removed", x) for x in fleet.hashes[3:]))
    assert fleet.router.route("chat", fleet.prompt).offload_blocks == 3


# --------------------------------------------------------------------- engine

TURN = SamplingParams(max_tokens=4, ignore_eos=True)


def conversations(n: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [[0, *(int(t) for t in torch.randint(3, 250, (length - 1,), generator=gen))]
            for _ in range(n)]  # fmt: skip


def two_turns(llm: LLM, firsts: list[list[int]]) -> list[int]:
    """Every first turn, then every second turn (history + answer + a question);
    returns the second turns' cached tokens."""
    outs = llm.generate(firsts, TURN)
    seconds = [p + o.token_ids + [5, 6, 7] for p, o in zip(firsts, outs, strict=True)]
    return [o.num_cached_tokens for o in llm.generate(seconds, TURN)]


def assert_clean(llm: LLM) -> None:
    llm.check_integrity()
    stats = llm.stats()
    assert stats.live == 0 and stats.free + stats.cached == stats.total, stats


# 12 blocks of 8 tokens hold about two of four 40-token histories; the tier holds all.
@pytest.fixture(scope="module")
def tier_llm() -> LLM:
    return LLM(model="tiny", block_size=8, num_kv_blocks=12, kv_offload_bytes=4 << 20,
               preemption_mode="swap", swap_space_bytes=1 << 20)  # fmt: skip


@pytest.fixture(scope="module")
def plain_llm() -> LLM:
    return LLM(model="tiny", block_size=8, num_kv_blocks=12)


def test_returning_conversations_hit_the_tier_and_count_as_cached(tier_llm: LLM) -> None:
    before = tier_llm.stats()
    cached = two_turns(tier_llm, conversations(4, 40, seed=1))
    stats = tier_llm.stats()
    # Each history's 5 full blocks come back: from the pool or copied from the tier.
    assert cached == [40] * 4, cached
    assert stats.offload_hit_tokens > before.offload_hit_tokens, stats
    assert stats.offload_bytes_in > before.offload_bytes_in, stats
    assert stats.prefix_hit_tokens - before.prefix_hit_tokens >= sum(cached), stats
    assert_clean(tier_llm)


def test_without_the_tier_the_same_conversations_recompute(plain_llm: LLM) -> None:
    cached = two_turns(plain_llm, conversations(4, 40, seed=1))
    assert sum(cached) < 4 * 40
    assert plain_llm.stats().offload_hit_tokens == 0


def test_kv_events_name_blocks_that_moved_to_the_tier(tier_llm: LLM) -> None:
    tier_llm.engine.drain_kv_events()
    two_turns(tier_llm, conversations(4, 40, seed=2))
    kinds = {kind for kind, _ in tier_llm.engine.drain_kv_events()}
    assert "offload_stored" in kinds


def test_abort_after_a_tier_hit_leaks_nothing(tier_llm: LLM) -> None:
    engine = tier_llm.engine
    firsts = conversations(4, 40, seed=3)
    tier_llm.generate(firsts, TURN)
    before = tier_llm.stats().offload_hit_tokens
    engine.add_request("back", firsts[0] + [9], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    assert tier_llm.stats().offload_hit_tokens > before
    assert engine.abort_request("back")
    engine.step()
    assert_clean(tier_llm)


def test_preemption_with_the_tier_leaks_nothing(tier_llm: LLM) -> None:
    before = tier_llm.stats().preemptions_total
    tier_llm.generate(conversations(4, 40, seed=4), SamplingParams(max_tokens=16, ignore_eos=True))
    assert tier_llm.stats().preemptions_total > before
    assert_clean(tier_llm)
