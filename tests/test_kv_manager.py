"""The KV cache manager's contract: one interface over block pool, KV tensors and offload tier.

Each scenario ends with `check_integrity` (every block exactly one of free,
live or cached; ref counts equal to the holders given) and, once nothing is
held, free + cached == total.
"""

from __future__ import annotations

import pytest
import torch

from pagefleet.worker.block_table import BlockTable
from pagefleet.worker.kv_cache import KVCache, ModelShape
from pagefleet.worker.kv_manager import KVCacheManager, KVStats

BS = 4
SHAPE = ModelShape(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32)


def manager(num_blocks: int = 8, *, offload_blocks: int = 0, caching: bool = True) -> KVCacheManager:
    return KVCacheManager(
        KVCache(SHAPE, num_blocks, BS),
        enable_prefix_caching=caching,
        offload_bytes=offload_blocks * SHAPE.bytes_per_block(BS),
    )


def hashes(n: int, tag: bytes = b"h") -> list[bytes]:
    return [tag + bytes([i]) * 31 for i in range(n)]


def fill(m: KVCacheManager, table: BlockTable, seed: int) -> None:
    """Write distinct K/V into every block of `table` (what a forward would write)."""
    gen = torch.Generator().manual_seed(seed)
    for b in table.block_ids:
        block = m.cache.tensor[:, :, b]
        block.copy_(torch.randn(block.shape, generator=gen))


def kv_of(m: KVCacheManager, block_ids: list[int]) -> torch.Tensor:
    return m.cache.tensor[:, :, block_ids].clone()


def prefill(m: KVCacheManager, hs: list[bytes], seed: int = 0) -> BlockTable:
    """A sequence of `len(hs)` full blocks, written and registered under `hs`."""
    table = m.new_table()
    table.append_slots(len(hs) * BS)
    fill(m, table, seed)
    for block, h in zip(table.block_ids, hs, strict=True):
        assert m.register(block, h)
    return table


def assert_idle(m: KVCacheManager) -> None:
    m.check_integrity({})
    s = m.stats()
    assert s.live == 0 and s.free + s.cached == s.total


def test_stats_are_typed_and_keep_the_engine_stats_keys() -> None:
    s = manager(8).stats()
    assert isinstance(s, KVStats)
    assert (s.total, s.free, s.live, s.cached, s.peak_live) == (8, 8, 0, 0, 0)
    keys = set(s.as_dict())
    assert {"total", "free", "live", "cached", "peak_live", "evictions"} <= keys
    assert {"offload_blocks", "offload_hit_tokens", "kv_blocks_exported", "kv_blocks_imported"} <= keys
    with pytest.raises(AttributeError):
        s.total = 3  # type: ignore[misc]


def test_allocate_and_free_through_a_table_return_every_block() -> None:
    m = manager(8)
    table = m.new_table()
    table.append_slots(3 * BS + 1)
    assert m.stats().live == 4 and m.num_free == 4 and m.num_allocatable == 4
    assert m.can_allocate(4) and not m.can_allocate(5)
    m.check_integrity({b: 1 for b in table.block_ids})
    table.free()
    assert m.num_free == 8
    assert_idle(m)


def test_integrity_fails_when_the_holders_disagree_with_the_ref_counts() -> None:
    m = manager(4)
    table = m.new_table()
    table.append_slots(BS)
    with pytest.raises(AssertionError, match="ref count 1 but 0"):
        m.check_integrity({})
    table.free()


def test_a_prefix_hit_revives_cached_blocks_with_their_refs_taken() -> None:
    m = manager(8)
    hs = hashes(3)
    first = prefill(m, hs)
    blocks = list(first.block_ids)
    first.free()
    assert m.stats().cached == 3 and m.num_leading(hs) == 3 and m.num_leading(hs, live_only=True) == 0

    hit = m.match(hs[:2] + hashes(1, b"x"))
    assert hit.block_ids == blocks[:2] and hit.revived == 2
    assert [m.ref_count(b) for b in hit.block_ids] == [1, 1]
    assert m.num_leading(hs, live_only=True) == 2
    s = m.stats()
    assert (s.prefix_query_tokens, s.prefix_hit_tokens) == (3 * BS, 2 * BS)

    again = m.match(hs[:1])  # a live hit is shared, not revived
    assert again.block_ids == blocks[:1] and again.revived == 0
    m.check_integrity({blocks[0]: 2, blocks[1]: 1})
    _table_of(m, hit.block_ids).free()
    _table_of(m, again.block_ids).free()
    assert_idle(m)


def _table_of(m: KVCacheManager, block_ids: list[int]) -> BlockTable:
    table = m.new_table()
    table.append_cached(block_ids)
    return table


def test_no_prefix_caching_means_no_match_and_no_registration() -> None:
    m = manager(4, caching=False)
    table = m.new_table()
    table.append_slots(BS)
    assert not m.register(table.block_ids[0], hashes(1)[0])
    table.free()
    assert m.match(hashes(1)).block_ids == [] and m.stats().cached == 0
    assert_idle(m)


def test_evict_drops_cached_blocks_with_removed_events() -> None:
    m = manager(8)
    hs = hashes(3)
    prefill(m, hs).free()
    assert sorted(m.drain_events()) == sorted(("stored", h) for h in hs)
    assert m.evict(2) == 2
    assert m.stats().cached == 1 and m.stats().evictions == 2
    removed = m.drain_events()
    assert [k for k, _ in removed] == ["removed", "removed"]
    assert not any(m.holds(h) for _, h in removed)
    assert m.evict() == 1  # all the rest
    assert_idle(m)
    assert m.stats().cached == 0


def test_allocation_evicts_least_recently_used_unless_touched() -> None:
    m = manager(4)
    a, b = hashes(2, b"a"), hashes(2, b"b")
    prefill(m, a, seed=1).free()
    prefill(m, b, seed=2).free()
    m.touch(a)  # about to be reused: evicted after b
    table = m.new_table()
    table.append_slots(2 * BS)
    assert m.num_leading(a) == 2 and m.num_leading(b) == 0
    table.free()
    assert_idle(m)


def test_mark_duplicated_blocks_are_evicted_first() -> None:
    m = manager(4)
    a, b = hashes(2, b"a"), hashes(2, b"b")
    prefill(m, a).free()
    prefill(m, b).free()
    m.mark_duplicated(b)  # another worker holds b: ours goes first
    assert m.evict(2) == 2
    assert m.num_leading(a) == 2 and not m.is_cached(b[0])
    assert m.stats().duplicate_evictions == 2
    assert_idle(m)


def test_evicted_blocks_spill_to_the_offload_tier_and_come_back_on_a_match() -> None:
    m = manager(4, offload_blocks=4)
    hs = hashes(2)
    table = prefill(m, hs, seed=7)
    original = kv_of(m, table.block_ids)
    table.free()
    assert m.evict() == 2
    assert not m.is_cached(hs[0]) and m.holds(hs[0])
    assert m.stats().offload_blocks == 2
    events = m.drain_events()
    assert ("offload_stored", hs[0]) in events

    m.cache.tensor.zero_()  # the pool copy is gone: only the tier's can serve
    hit = m.match(hs)
    assert len(hit.block_ids) == 2 and hit.revived == 0
    m.prepare_forward([])  # the load is complete before a forward reads it
    assert torch.equal(kv_of(m, hit.block_ids), original)
    s = m.stats()
    assert s.offload_hit_tokens == 2 * BS and s.prefix_hit_tokens == 2 * BS
    assert m.is_cached(hs[0])  # registered in the pool again
    m.check_integrity({b: 1 for b in hit.block_ids})
    _table_of(m, hit.block_ids).free()
    assert_idle(m)


def test_snapshot_lists_both_tiers_and_drops_pending_events() -> None:
    m = manager(4, offload_blocks=4)
    a, b = hashes(1, b"a"), hashes(1, b"b")
    prefill(m, a).free()
    m.evict()
    prefill(m, b).free()
    snap = m.snapshot()
    assert sorted(snap) == sorted([("stored", b[0]), ("offload_stored", a[0])])
    assert m.drain_events() == []
    assert_idle(m)


def test_copy_on_write_copies_run_in_prepare_forward() -> None:
    m = manager(4)
    table = m.new_table()
    table.append_slots(BS - 1)
    fill(m, table, seed=3)
    child = table.fork()
    result = child.append_slots(1)  # writes into the shared partial block: a copy first
    (src, dst), = result.copies
    m.prepare_forward(result.copies)
    assert torch.equal(kv_of(m, [dst]), kv_of(m, [src]))
    m.check_integrity({src: 1, dst: 1})
    child.free()
    table.free()
    assert_idle(m)


def test_swap_out_and_in_restore_the_blocks_elsewhere() -> None:
    m = manager(6)
    table = m.new_table()
    table.append_slots(2 * BS)
    fill(m, table, seed=5)
    original = kv_of(m, table.block_ids)
    host = m.swap_out(table.block_ids)
    assert host.shape[0] == 2 and host.numel() * host.element_size() == 2 * m.bytes_per_block
    table.free()
    m.cache.tensor.zero_()
    back = m.new_table()
    back.append_slots(2 * BS)
    m.swap_in(host, back.block_ids)
    assert torch.equal(kv_of(m, back.block_ids), original)
    back.free()
    assert_idle(m)


def test_export_then_import_moves_registered_blocks_as_cached() -> None:
    source, target = manager(8), manager(8)
    hs = hashes(3)
    table = prefill(source, hs, seed=9)
    original = kv_of(source, table.block_ids)
    exported = source.export_blocks(hs + hashes(1, b"x"))
    assert exported is not None and list(exported.block_hashes) == hs
    assert source.export_blocks(hashes(1, b"x")) is None
    assert target.import_blocks(list(exported.block_hashes), exported.blocks) == 3
    assert target.import_blocks(list(exported.block_hashes), exported.blocks) == 0  # held already
    assert source.stats().kv_blocks_exported == 3 and target.stats().kv_blocks_imported == 3
    assert target.stats().cached == 3
    hit = target.match(hs)
    assert torch.equal(kv_of(target, hit.block_ids), original)
    _table_of(target, hit.block_ids).free()
    table.free()
    assert_idle(source)
    assert_idle(target)


def test_an_aborted_prefill_leaves_no_block_behind() -> None:
    m = manager(8)
    hs = hashes(2)
    prefill(m, hs).free()
    # A second request hits the prefix, starts its own tail, and is aborted mid-way.
    hit = m.match(hs)
    table = m.new_table()
    table.append_cached(hit.block_ids)
    table.append_slots(BS + 2)
    m.check_integrity({b: 1 for b in table.block_ids})
    table.free()
    assert_idle(m)
    assert m.stats().cached == 2  # its registered prefix stays reusable
