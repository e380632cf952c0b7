"""The block pool: allocation, ref counts, LRU prefix cache, counters, events, integrity."""

from __future__ import annotations

import pytest

from pagefleet.worker.block_pool import BlockPool, NoFreeBlocks
from pagefleet.worker.prefix_hash import hash_token_blocks


def assert_released(pool: BlockPool) -> None:
    """The end state every test checks: consistent, and nothing live."""
    pool.check_integrity()
    stats = pool.stats()
    assert stats.live == 0
    assert stats.free + stats.cached == stats.total


def chain(n: int, salt: str | None = None, block_size: int = 4) -> list[bytes]:
    return hash_token_blocks(list(range(n * block_size)), block_size, salt=salt)


def filled(pool: BlockPool, hashes: list[bytes]) -> list[int]:
    """Blocks that hold `hashes` (as a sequence's prefill would leave them), still live."""
    blocks = pool.allocate(len(hashes))
    for b, h in zip(blocks, hashes, strict=True):
        assert pool.register(b, h)
    return blocks


def test_allocate_gives_distinct_blocks_with_ref_one() -> None:
    pool = BlockPool(8, 4)
    blocks = pool.allocate(5)
    assert len(set(blocks)) == 5
    assert all(pool.ref_count(b) == 1 for b in blocks)
    assert pool.stats().live == 5
    pool.check_integrity()
    pool.free(blocks)
    assert_released(pool)


def test_allocate_zero_is_empty_and_negative_is_rejected() -> None:
    pool = BlockPool(2, 4)
    assert pool.allocate(0) == []
    with pytest.raises(ValueError):
        pool.allocate(-1)
    assert_released(pool)


def test_allocation_beyond_capacity_raises_and_changes_nothing() -> None:
    pool = BlockPool(6, 4)
    held = filled(pool, chain(2))
    pool.free(held)  # 2 cached blocks: evictable, they count as available
    live = pool.allocate(3)
    before = pool.stats()
    assert pool.num_allocatable == 3
    assert not pool.can_allocate(4)
    with pytest.raises(NoFreeBlocks) as err:
        pool.allocate(4)
    assert err.value.requested == 4 and err.value.available == 3
    assert pool.stats() == before
    assert pool.drain_events() == [("stored", h) for h in chain(2)]  # no "removed"
    pool.check_integrity()
    pool.free(live)
    assert_released(pool)


def test_all_blocks_can_be_allocated_then_none() -> None:
    pool = BlockPool(4, 4)
    blocks = pool.allocate(4)
    assert sorted(blocks) == [0, 1, 2, 3]
    assert not pool.can_allocate(1)
    with pytest.raises(NoFreeBlocks):
        pool.allocate(1)
    pool.free(blocks)
    assert_released(pool)


def test_free_more_often_than_allocated_raises() -> None:
    pool = BlockPool(4, 4)
    [b] = pool.allocate(1)
    pool.free([b])
    with pytest.raises(ValueError, match="freed more often"):
        pool.free([b])
    assert_released(pool)


@pytest.mark.parametrize("block_size", [0, 3, 12, 24])
def test_block_size_must_be_a_power_of_two(block_size: int) -> None:
    with pytest.raises(ValueError, match="power of two"):
        BlockPool(4, block_size)


def test_pool_needs_at_least_one_block() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        BlockPool(0, 16)


def test_incref_keeps_block_live_until_last_free() -> None:
    pool = BlockPool(4, 4)
    [b] = pool.allocate(1)
    pool.incref([b])
    pool.free([b])
    assert pool.ref_count(b) == 1 and pool.stats().live == 1
    pool.free([b])
    assert_released(pool)


def test_incref_of_a_block_nobody_holds_is_rejected() -> None:
    pool = BlockPool(4, 4)
    with pytest.raises(ValueError, match="not live"):
        pool.incref([0])
    assert_released(pool)


def test_released_registered_block_is_cached_and_found_by_lookup() -> None:
    pool = BlockPool(8, 4)
    hashes = chain(3)
    blocks = filled(pool, hashes)
    pool.free(reversed(blocks))
    stats = pool.stats()
    assert (stats.cached, stats.free, stats.live) == (3, 5, 0)
    assert pool.lookup(hashes) == blocks
    assert [pool.ref_count(b) for b in blocks] == [1, 1, 1]
    assert pool.stats().cached == 0
    pool.free(reversed(blocks))
    assert_released(pool)


def test_lookup_returns_longest_prefix_and_stops_at_first_miss() -> None:
    pool = BlockPool(8, 4)
    hashes = chain(4)
    blocks = filled(pool, hashes)
    pool.free(reversed(blocks))
    pool.evict_cached(1)  # the LRU one: the tail block (released first)
    assert pool.lookup(hashes) == blocks[:3]
    other = chain(4, salt="x")
    assert pool.lookup(other) == []
    pool.free(reversed(blocks[:3]))
    assert_released(pool)


def test_lookup_of_a_live_block_shares_it() -> None:
    pool = BlockPool(8, 4)
    hashes = chain(2)
    blocks = filled(pool, hashes)
    assert pool.lookup(hashes) == blocks
    assert [pool.ref_count(b) for b in blocks] == [2, 2]
    assert pool.stats().live == 2
    pool.free(blocks)
    pool.free(blocks)
    assert_released(pool)


def test_lookup_counts_queried_and_hit_tokens() -> None:
    pool = BlockPool(8, 4)
    hashes = chain(4)
    blocks = filled(pool, hashes[:2])
    got = pool.lookup(hashes)
    stats = pool.stats()
    assert stats.prefix_query_tokens == 16 and stats.prefix_hit_tokens == 8
    assert stats.prefix_hit_rate == 0.5
    pool.free(got + blocks)
    assert_released(pool)


def test_free_blocks_are_used_before_any_cached_block_is_evicted() -> None:
    pool = BlockPool(6, 4)
    hashes = chain(2)
    cached = filled(pool, hashes)
    pool.free(cached)
    fresh = pool.allocate(4)
    assert not set(fresh) & set(cached)
    assert pool.stats().evictions == 0
    assert pool.lookup(hashes) == cached
    pool.free(fresh + cached)
    assert_released(pool)


def test_cached_blocks_are_evicted_least_recently_released_first() -> None:
    pool = BlockPool(3, 4)
    a, b, c = (chain(1, salt=s) for s in "abc")
    blocks = {name: filled(pool, h)[0] for name, h in (("a", a), ("b", b), ("c", c))}
    for name in ("b", "a", "c"):  # release order = LRU order
        pool.free([blocks[name]])
    pool.drain_events()
    assert pool.allocate(1) == [blocks["b"]]
    assert pool.allocate(1) == [blocks["a"]]
    assert pool.drain_events() == [("removed", b[0]), ("removed", a[0])]
    assert pool.stats().evictions == 2
    assert pool.lookup(c) == [blocks["c"]]
    assert pool.lookup(a + b) == []
    pool.free(blocks.values())
    assert_released(pool)


def test_a_prefix_hit_makes_a_cached_block_most_recently_used() -> None:
    pool = BlockPool(2, 4)
    a, b = chain(1, salt="a"), chain(1, salt="b")
    [block_a], [block_b] = filled(pool, a), filled(pool, b)
    pool.free([block_a, block_b])  # a is LRU
    pool.free(pool.lookup(a))  # a used again: now b is LRU
    assert pool.allocate(1) == [block_b]
    assert pool.lookup(a) == [block_a]
    pool.free([block_a, block_b])
    assert_released(pool)


def test_eviction_forgets_the_hash() -> None:
    pool = BlockPool(1, 4)
    hashes = chain(1)
    pool.free(filled(pool, hashes))
    assert pool.is_cached(hashes[0])
    [b] = pool.allocate(1)
    assert not pool.is_cached(hashes[0]) and pool.block_hash(b) is None
    pool.free([b])
    assert pool.stats().cached == 0
    assert pool.lookup(hashes) == []
    assert_released(pool)


def test_register_emits_stored_events_and_drain_empties_them() -> None:
    pool = BlockPool(4, 4)
    hashes = chain(2)
    blocks = filled(pool, hashes)
    assert pool.drain_events() == [("stored", hashes[0]), ("stored", hashes[1])]
    assert pool.drain_events() == []
    pool.free(blocks)
    assert_released(pool)


def test_stored_then_evicted_before_a_drain_emits_nothing() -> None:
    pool = BlockPool(1, 4)
    hashes = chain(1)
    pool.free(filled(pool, hashes))
    pool.free(pool.allocate(1))
    assert pool.drain_events() == []
    assert_released(pool)


def test_events_replayed_on_a_mirror_give_the_registered_hashes() -> None:
    pool = BlockPool(3, 4)
    mirror: set[bytes] = set()
    for salt in "abcdefab":
        pool.free(filled(pool, chain(1, salt=salt)))
        if salt in "ce":
            for kind, h in pool.drain_events():
                mirror.add(h) if kind == "stored" else mirror.remove(h)
    for kind, h in pool.drain_events():
        mirror.add(h) if kind == "stored" else mirror.remove(h)
    assert mirror == {h for h in (chain(1, salt=s)[0] for s in "abcdef") if pool.is_cached(h)}
    assert len(mirror) == 3
    assert_released(pool)


def test_registering_a_hash_another_block_holds_keeps_the_first_block() -> None:
    pool = BlockPool(4, 4)
    hashes = chain(1)
    [first] = filled(pool, hashes)
    [second] = pool.allocate(1)
    assert not pool.register(second, hashes[0])
    assert pool.block_hash(second) is None
    assert pool.drain_events() == [("stored", hashes[0])]
    pool.free([second, first])
    assert pool.stats().cached == 1
    assert pool.lookup(hashes) == [first]
    pool.free([first])
    assert_released(pool)


def test_registering_a_block_under_a_second_hash_is_rejected() -> None:
    pool = BlockPool(4, 4)
    [b] = filled(pool, chain(1, salt="a"))
    assert pool.register(b, chain(1, salt="a")[0])  # same hash again: fine
    with pytest.raises(ValueError, match="another hash"):
        pool.register(b, chain(1, salt="b")[0])
    pool.free([b])
    assert_released(pool)


def test_without_prefix_caching_nothing_is_cached_or_found() -> None:
    pool = BlockPool(4, 4, enable_prefix_caching=False)
    hashes = chain(2)
    blocks = pool.allocate(2)
    assert not pool.register(blocks[0], hashes[0])
    pool.free(blocks)
    assert pool.lookup(hashes) == []
    assert pool.stats().cached == 0
    assert pool.drain_events() == []
    assert_released(pool)


def test_peak_live_is_the_high_water_mark() -> None:
    pool = BlockPool(8, 4)
    a = pool.allocate(5)
    pool.free(a[:3])
    b = pool.allocate(2)
    assert pool.stats().peak_live == 5
    c = pool.allocate(3)
    assert pool.stats().peak_live == 7
    pool.free(a[3:] + b + c)
    assert pool.stats().peak_live == 7
    assert_released(pool)


def test_evict_cached_drops_lru_hashes_and_makes_blocks_free() -> None:
    pool = BlockPool(6, 4)
    hashes = chain(3)
    blocks = filled(pool, hashes)
    pool.free(reversed(blocks))  # LRU: blocks[2], blocks[1], blocks[0]
    pool.drain_events()
    assert pool.evict_cached(2) == 2
    assert pool.drain_events() == [("removed", hashes[2]), ("removed", hashes[1])]
    stats = pool.stats()
    assert (stats.cached, stats.free, stats.evictions) == (1, 5, 2)
    pool.check_integrity()
    assert pool.reset_prefix_cache() == 1
    assert pool.stats().cached == 0
    assert_released(pool)


def test_check_integrity_catches_a_wrong_counter() -> None:
    pool = BlockPool(4, 4)
    pool._num_free -= 1
    with pytest.raises(AssertionError, match="free counter"):
        pool.check_integrity()


def test_check_integrity_catches_a_live_block_in_the_free_queue() -> None:
    pool = BlockPool(4, 4)
    pool._ref[2] = 1
    with pytest.raises(AssertionError, match="live block 2 is in the free queue"):
        pool.check_integrity()


def test_check_integrity_catches_a_broken_link() -> None:
    pool = BlockPool(4, 4)
    pool._prev[2] = 0
    with pytest.raises(AssertionError, match="link broken"):
        pool.check_integrity()


def test_check_integrity_catches_a_stale_hash_map_entry() -> None:
    pool = BlockPool(4, 4)
    pool._cached[b"x" * 32] = 1
    with pytest.raises(AssertionError, match="hash map"):
        pool.check_integrity()


def test_leading_counts_registered_hashes_from_the_first_and_live_ones_when_asked() -> None:
    pool = BlockPool(4, 4)
    h = hash_token_blocks(list(range(12)), 4)
    a, b = pool.allocate(2)
    pool.register(a, h[0])
    pool.register(b, h[1])
    pool.free([b])  # h[1] stays cached, no longer live
    assert pool.leading(h) == 2  # h[2] was never registered
    assert pool.leading(h, live_only=True) == 1
    assert pool.leading(h[1:]) == 1 and pool.leading(h[2:]) == 0
    pool.free([a])
    assert_released(pool)
