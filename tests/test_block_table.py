"""Block tables: slot mapping, all-or-nothing appends, prefix sharing, fork and copy-on-write."""

from __future__ import annotations

import pytest

from pagefleet.worker.block_pool import BlockPool, NoFreeBlocks
from pagefleet.worker.block_table import BlockTable
from pagefleet.worker.prefix_hash import hash_token_blocks

BS = 4


def assert_released(pool: BlockPool) -> None:
    pool.check_integrity()
    stats = pool.stats()
    assert stats.live == 0
    assert stats.free + stats.cached == stats.total


def prefill(pool: BlockPool, tokens: list[int], salt: str | None = None) -> BlockTable:
    """A sequence after prefill: prefix hits adopted, the rest appended, full blocks registered."""
    hashes = hash_token_blocks(tokens, BS, salt=salt)
    table = BlockTable(pool)
    table.append_cached(pool.lookup(hashes))
    table.append_slots(len(tokens) - table.num_tokens)
    for block, h in zip(table.block_ids, hashes, strict=False):
        pool.register(block, h)
    return table


def test_slots_are_block_id_times_block_size_plus_offset() -> None:
    pool = BlockPool(8, BS)
    table = BlockTable(pool)
    result = table.append_slots(6)
    b0, b1 = table.block_ids
    assert result.slots == [b0 * BS + i for i in range(4)] + [b1 * BS, b1 * BS + 1]
    assert result.copies == []
    assert [table.slot(p) for p in range(6)] == result.slots
    table.free()
    assert_released(pool)


def test_append_fills_the_partial_last_block_before_allocating() -> None:
    pool = BlockPool(8, BS)
    table = BlockTable(pool)
    table.append_slots(3)
    assert table.blocks_needed(1) == 0
    assert table.append_slots(1).slots == [table.block_ids[0] * BS + 3]
    assert len(table) == 1
    assert table.blocks_needed(5) == 2
    table.append_slots(5)
    assert len(table) == 3 and table.num_tokens == 9
    table.free()
    assert_released(pool)


def test_append_that_does_not_fit_raises_and_changes_nothing() -> None:
    pool = BlockPool(3, BS)
    table = BlockTable(pool)
    table.append_slots(5)
    before = (list(table.block_ids), table.num_tokens, pool.stats())
    with pytest.raises(NoFreeBlocks):
        table.append_slots(8)  # needs 2 more blocks, 1 free
    assert (table.block_ids, table.num_tokens, pool.stats()) == before
    table.append_slots(7)  # exactly fills the pool
    assert pool.num_allocatable == 0
    table.free()
    assert_released(pool)


def test_free_releases_tail_blocks_before_head_blocks() -> None:
    pool = BlockPool(3, BS)
    tokens = list(range(12))
    table = prefill(pool, tokens)
    head, middle, tail = table.block_ids
    table.free()
    # The pool is all cached now; each new block evicts the LRU one: tail first.
    assert pool.allocate(1) == [tail]
    assert pool.allocate(1) == [middle]
    reuse = BlockTable(pool)
    reuse.append_cached(pool.lookup(hash_token_blocks(tokens, BS)))
    assert reuse.block_ids == [head]
    pool.free([tail, middle])
    reuse.free()
    assert_released(pool)


def test_a_second_sequence_hits_the_first_ones_prefix_while_it_runs() -> None:
    pool = BlockPool(16, BS)
    system = list(range(100, 108))  # two full blocks shared
    first = prefill(pool, [*system, 1, 2, 3, 4, 5])
    second = prefill(pool, [*system, 9, 9])
    assert second.block_ids[:2] == first.block_ids[:2]
    assert second.block_ids[2] != first.block_ids[2]
    assert all(pool.ref_count(b) == 2 for b in first.block_ids[:2])
    assert pool.stats().prefix_hit_tokens == 8
    first.free()
    second.free()
    assert_released(pool)


def test_a_later_sequence_hits_a_finished_ones_cached_blocks() -> None:
    pool = BlockPool(16, BS)
    prompt = list(range(50, 63))  # 3 full blocks + 1 token
    first = prefill(pool, prompt)
    head = first.block_ids[:3]
    first.free()
    second = prefill(pool, prompt)
    assert second.block_ids[:3] == head
    assert pool.stats().prefix_hit_tokens == 12
    second.free()
    assert_released(pool)


def test_same_salt_hits_and_a_different_salt_misses() -> None:
    pool = BlockPool(16, BS)
    prompt = list(range(12))
    owner = prefill(pool, prompt, salt="tenant-a")
    same = prefill(pool, prompt, salt="tenant-a")
    other = prefill(pool, prompt, salt="tenant-b")
    assert same.block_ids == owner.block_ids
    assert not set(other.block_ids) & set(owner.block_ids)
    assert pool.stats().prefix_hit_tokens == 12  # only the same-salt lookup hit
    for table in (owner, same, other):
        table.free()
    assert_released(pool)


def test_fork_shares_every_block() -> None:
    pool = BlockPool(8, BS)
    parent = BlockTable(pool)
    parent.append_slots(6)
    child = parent.fork()
    assert child.block_ids == parent.block_ids and child.num_tokens == 6
    assert all(pool.ref_count(b) == 2 for b in parent.block_ids)
    assert pool.stats().live == 2
    parent.free()
    child.free()
    assert_released(pool)


def test_first_write_into_a_shared_partial_block_copies_it() -> None:
    pool = BlockPool(8, BS)
    parent = BlockTable(pool)
    parent.append_slots(6)
    child = parent.fork()
    shared_last = parent.block_ids[1]
    assert child.blocks_needed(1) == 1
    result = child.append_slots(1)
    new_last = child.block_ids[1]
    assert result.copies == [(shared_last, new_last)]
    assert result.slots == [new_last * BS + 2]
    assert child.block_ids[0] == parent.block_ids[0]
    assert pool.ref_count(shared_last) == 1 and pool.ref_count(new_last) == 1
    # The parent is the sole owner now: it writes in place.
    assert parent.append_slots(1) == type(result)(slots=[shared_last * BS + 2], copies=[])
    parent.free()
    child.free()
    assert_released(pool)


def test_copy_on_write_also_covers_tokens_past_the_copied_block() -> None:
    pool = BlockPool(8, BS)
    parent = BlockTable(pool)
    parent.append_slots(5)
    child = parent.fork()
    assert child.blocks_needed(6) == 2  # the copy plus one more block
    result = child.append_slots(6)
    assert len(result.copies) == 1 and len(child) == 3 and child.num_tokens == 11
    assert result.slots == [child.slot(p) for p in range(5, 11)]
    parent.free()
    child.free()
    assert_released(pool)


def test_a_full_shared_last_block_stays_shared() -> None:
    pool = BlockPool(8, BS)
    parent = BlockTable(pool)
    parent.append_slots(8)
    child = parent.fork()
    result = child.append_slots(1)
    assert result.copies == []
    assert child.block_ids[:2] == parent.block_ids
    assert len(child) == 3
    parent.free()
    child.free()
    assert_released(pool)


def test_copy_on_write_without_a_free_block_raises_and_changes_nothing() -> None:
    pool = BlockPool(2, BS)
    parent = BlockTable(pool)
    parent.append_slots(6)
    child = parent.fork()
    before = (list(child.block_ids), child.num_tokens, pool.stats())
    with pytest.raises(NoFreeBlocks):
        child.append_slots(1)
    assert (child.block_ids, child.num_tokens, pool.stats()) == before
    assert pool.ref_count(parent.block_ids[1]) == 2
    parent.free()
    child.free()
    assert_released(pool)


def test_free_empties_the_table() -> None:
    pool = BlockPool(4, BS)
    table = BlockTable(pool)
    table.append_slots(9)
    table.free()
    assert table.block_ids == [] and table.num_tokens == 0
    assert_released(pool)


def test_cached_blocks_can_only_follow_full_blocks() -> None:
    pool = BlockPool(4, BS)
    table = BlockTable(pool)
    table.append_slots(2)
    with pytest.raises(ValueError, match="full blocks"):
        table.append_cached([3])
    table.free()
    assert_released(pool)


def test_slot_outside_the_sequence_is_an_index_error() -> None:
    pool = BlockPool(4, BS)
    table = BlockTable(pool)
    table.append_slots(2)
    with pytest.raises(IndexError):
        table.slot(2)
    table.free()
    assert_released(pool)
