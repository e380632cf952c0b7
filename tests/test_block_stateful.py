"""Random operation sequences against a simple model of the pool (hypothesis state machine).

The machine drives real `BlockPool`/`BlockTable` objects through new sequences
(with prefix lookups), appends (with copy-on-write), forks, frees and explicit
evictions, writes each token id into a simulated KV store at the slots the
tables hand out, and after every step checks the pool against a model:

- ref counts equal the number of tables holding each block;
- every sequence reads back its own tokens through its block table (so no write
  ever lands in a block another sequence still sees);
- every registered hash points at a block holding exactly the tokens it was
  computed from (a prefix hit can never return wrong KV);
- cached blocks are evicted duplicated ones first (those `mark_duplicated`
  named: another worker holds them), then last copies, each class in LRU
  order (release order, tail blocks first), and only when no never-hashed
  free block is left;
- with the offload tier behind the pool (`TIER_BLOCKS` blocks, LRU): every
  evicted block spills there with its K/V, the tier holds exactly the model's
  hashes, and a lookup that misses the pool revives the tier's run into fresh
  blocks that read back the original tokens.

The simulated KV store is a real `KVCache` (one layer, one head, head_dim 1,
float64: a slot holds its token id), so spills and revivals go through the
same `BlockTransfer` copies as serving.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagefleet.worker.block_pool import BlockPool, NoFreeBlocks
from pagefleet.worker.block_table import BlockTable
from pagefleet.worker.kv_cache import KVCache, ModelShape
from pagefleet.worker.offload import HostOffloadTier, revive_offloaded
from pagefleet.worker.prefix_hash import extend_block_hashes, hash_token_blocks

BS = 4
NUM_BLOCKS = 12
TIER_BLOCKS = 6
SYSTEM_PROMPTS = [[], [7, 7, 7, 7, 8, 8, 8, 8], [9, 9, 9, 9]]


@dataclass
class Seq:
    table: BlockTable
    tokens: list[int]
    salt: str
    hashes: list[bytes]  # chained hashes of the full blocks seen so far


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.cache = KVCache(ModelShape(1, 1, 1, torch.float64), NUM_BLOCKS, BS)
        self.cache.tensor.fill_(-1)
        self.kv = self.cache.tensor[0, 0, :, :, 0, 0].reshape(-1)  # a view: slot -> token
        per_block = self.cache.transfer.bytes_per_block
        self.tier = HostOffloadTier(self.cache.transfer, TIER_BLOCKS * per_block, BS)
        self.pool = BlockPool(NUM_BLOCKS, BS, spill=self.tier.store)
        self.seqs: list[Seq] = []
        # The model: which block holds each registered hash and what that block
        # must contain; the cached (ref 0) ones in LRU order; evictions so far.
        self.registry: dict[bytes, int] = {}
        self.contents: dict[bytes, tuple[int, ...]] = {}
        # Cached last copies and cached duplicates, each LRU first; the hashes marked
        # duplicated; when each cached block was last released.
        self.lru: OrderedDict[bytes, int] = OrderedDict()
        self.dup_lru: OrderedDict[bytes, int] = OrderedDict()
        self.duplicated: set[bytes] = set()
        self.released_at: dict[bytes, int] = {}
        self.clock = 0
        self.evictions = 0
        self.tier_model: OrderedDict[bytes, tuple[int, ...]] = OrderedDict()  # LRU first

    def tokens_at(self, start: int, end: int) -> list[int]:
        return [int(x) for x in self.kv[start:end].tolist()]

    # ------------------------------------------------------------ model helpers

    def model_refs(self) -> dict[int, int]:
        refs: dict[int, int] = {}
        for seq in self.seqs:
            for b in seq.table.block_ids:
                refs[b] = refs.get(b, 0) + 1
        return refs

    def allocate_through(self, seq: Seq, n: int) -> bool:
        """append_slots(n) on `seq`, checking eviction and all-or-nothing against the model."""
        needed = seq.table.blocks_needed(n)
        before = (list(seq.table.block_ids), seq.table.num_tokens, self.pool.stats())
        free_before = before[2].free
        try:
            result = seq.table.append_slots(n)
        except NoFreeBlocks:
            assert needed > free_before + self.num_cached()
            assert (seq.table.block_ids, seq.table.num_tokens, self.pool.stats()) == before
            return False
        self.model_evict(max(0, needed - free_before))
        for src, dst in result.copies:  # copy-on-write, before the new tokens land
            self.kv[dst * BS : (dst + 1) * BS] = self.kv[src * BS : (src + 1) * BS].clone()
        return True

    def model_evict(self, n: int, reviving: Collection[bytes] = ()) -> None:
        """The pool evicted its next `n` cached blocks (duplicates first, then last copies,
        LRU in each): they spill to the tier, in order. A hash in `reviving` may be
        cached again at once: the revive that evicted it loads it back from the tier."""
        for _ in range(n):
            queue = self.dup_lru if self.dup_lru else self.lru
            h, _block = queue.popitem(last=False)
            if h not in reviving:
                assert not self.pool.is_cached(h), "a cached block was evicted out of order"
            self.duplicated.discard(h)
            del self.registry[h]
            contents = self.contents.pop(h)
            if h in self.tier_model:
                self.tier_model.move_to_end(h)
            else:
                if len(self.tier_model) == TIER_BLOCKS:
                    self.tier_model.popitem(last=False)
                self.tier_model[h] = contents
        self.evictions += n

    def model_tier_run(self, hashes: list[bytes]) -> int:
        n = 0
        while n < len(hashes) and hashes[n] in self.tier_model:
            n += 1
        return n

    def revive(self, hashes: list[bytes]) -> list[int]:
        """revive_offloaded on the hashes after the pool's hit, checked against the model."""
        free_before = self.pool.stats().free
        k = min(self.model_tier_run(hashes), free_before + self.num_cached())
        blocks = revive_offloaded(self.pool, self.tier, hashes)
        self.model_evict(max(0, k - free_before), reviving=hashes[:k])
        still = self.model_tier_run(hashes[:k])
        assert len(blocks) == still
        for block, h in zip(blocks, hashes, strict=False):
            self.tier_model.move_to_end(h)
            if h not in self.registry:
                self.registry[h] = block
                self.contents[h] = self.tier_model[h]
            assert tuple(self.tokens_at(block * BS, (block + 1) * BS)) == self.tier_model[h]
        return blocks

    def write_and_register(self, seq: Seq, new_tokens: list[int], start: int) -> None:
        for i, token in enumerate(new_tokens):
            self.kv[seq.table.slot(start + i)] = token
        new_hashes = extend_block_hashes(seq.hashes, seq.tokens, BS, salt=seq.salt)
        for i, h in enumerate(new_hashes, start=len(seq.hashes)):
            block = seq.table.block_ids[i]
            registered = self.pool.register(block, h)
            assert registered == (h not in self.registry)
            if registered:
                self.registry[h] = block
                self.contents[h] = tuple(seq.tokens[i * BS : (i + 1) * BS])
        seq.hashes.extend(new_hashes)

    def release(self, seq: Seq) -> None:
        blocks = list(seq.table.block_ids)
        seq.table.free()
        self.seqs.remove(seq)
        refs = self.model_refs()
        for b in reversed(blocks):  # the pool releases tail first: that is the LRU order
            h = self.pool.block_hash(b)
            if refs.get(b, 0) == 0 and h is not None:
                self.clock += 1
                self.released_at[h] = self.clock
                (self.dup_lru if h in self.duplicated else self.lru)[h] = b

    def num_cached(self) -> int:
        return len(self.lru) + len(self.dup_lru)

    # ------------------------------------------------------------------ rules

    @rule(
        system=st.sampled_from(SYSTEM_PROMPTS),
        suffix=st.lists(st.integers(0, 1), max_size=9),
        salt=st.sampled_from(["a", "b"]),
    )
    def new_sequence(self, system: list[int], suffix: list[int], salt: str) -> None:
        tokens = system + suffix
        if not tokens:
            return
        hashes = hash_token_blocks(tokens, BS, salt=salt)
        expected_hits = 0
        for h in hashes:
            if h not in self.registry:
                break
            expected_hits += 1
        hits = self.pool.lookup(hashes)
        assert hits == [self.registry[h] for h in hashes[:expected_hits]]
        for h in hashes[:expected_hits]:
            self.lru.pop(h, None)  # revived: out of the free queue
            self.dup_lru.pop(h, None)
        seq = Seq(BlockTable(self.pool), tokens, salt, hashes[:expected_hits])
        seq.table.append_cached(hits)
        if expected_hits < len(hashes):
            revived = self.revive(hashes[expected_hits:])
            seq.table.append_cached(revived)
            seq.hashes = hashes[: expected_hits + len(revived)]
        self.seqs.append(seq)
        cached_tokens = seq.table.num_tokens
        if not self.allocate_through(seq, len(tokens) - cached_tokens):
            self.release(seq)  # admission failed: give the prefix hits back
            return
        self.write_and_register(seq, tokens[cached_tokens:], cached_tokens)

    @precondition(lambda self: self.seqs)
    @rule(
        pick=st.integers(0, 10**6), new_tokens=st.lists(st.integers(0, 1), min_size=1, max_size=6)
    )
    def append(self, pick: int, new_tokens: list[int]) -> None:
        seq = self.seqs[pick % len(self.seqs)]
        start = seq.table.num_tokens
        if not self.allocate_through(seq, len(new_tokens)):
            return
        seq.tokens.extend(new_tokens)
        self.write_and_register(seq, new_tokens, start)

    @precondition(lambda self: self.seqs)
    @rule(pick=st.integers(0, 10**6))
    def fork(self, pick: int) -> None:
        parent = self.seqs[pick % len(self.seqs)]
        child = Seq(parent.table.fork(), list(parent.tokens), parent.salt, list(parent.hashes))
        self.seqs.append(child)

    @precondition(lambda self: self.seqs)
    @rule(pick=st.integers(0, 10**6))
    def free(self, pick: int) -> None:
        self.release(self.seqs[pick % len(self.seqs)])

    @rule(n=st.integers(0, 4))
    def evict(self, n: int) -> None:
        expected = min(n, self.num_cached())
        assert self.pool.evict_cached(n) == expected
        self.model_evict(expected)

    @rule(picks=st.lists(st.integers(0, 10**6), max_size=6), unknown=st.booleans())
    def mark_duplicated(self, picks: list[int], unknown: bool) -> None:
        """The scheduler's latest word on which hashes another worker holds."""
        registered = sorted(self.registry)
        named = {registered[p % len(registered)] for p in picks} if registered else set()
        self.pool.mark_duplicated([*named, *([b"unknown" * 2] if unknown else [])])
        old, self.duplicated = self.duplicated, named
        # Blocks changing class join the new one's tail, in release order.
        for moved, src, dst in ((old - named, self.dup_lru, self.lru), (named - old, self.lru, self.dup_lru)):
            for h in sorted((h for h in moved if h in src), key=self.released_at.__getitem__):
                dst[h] = src.pop(h)

    # ------------------------------------------------------------- invariants

    @invariant()
    def pool_is_consistent(self) -> None:
        self.pool.check_integrity()
        self.tier.check_integrity()

    @invariant()
    def the_tier_holds_exactly_the_spilled_hashes(self) -> None:
        assert self.tier.stats().offload_blocks == len(self.tier_model)
        assert all(h in self.tier for h in self.tier_model)

    @invariant()
    def ref_counts_match_the_tables(self) -> None:
        refs = self.model_refs()
        for b in range(NUM_BLOCKS):
            assert self.pool.ref_count(b) == refs.get(b, 0)
        stats = self.pool.stats()
        assert stats.live == len(refs)
        assert stats.cached == self.num_cached()
        assert stats.evictions == self.evictions

    @invariant()
    def every_sequence_reads_back_its_own_tokens(self) -> None:
        for seq in self.seqs:
            assert seq.table.num_tokens == len(seq.tokens)
            assert [int(self.kv[seq.table.slot(p)]) for p in range(len(seq.tokens))] == seq.tokens

    @invariant()
    def every_registered_hash_points_at_its_tokens(self) -> None:
        for h, block in self.registry.items():
            assert self.pool.is_cached(h) and self.pool.block_hash(block) == h
            assert tuple(self.tokens_at(block * BS, (block + 1) * BS)) == self.contents[h]
        for h, block in [*self.lru.items(), *self.dup_lru.items()]:
            assert self.pool.ref_count(block) == 0 and self.registry[h] == block
        for h in self.registry:
            assert self.pool.is_duplicated(h) == (h in self.duplicated)

    def teardown(self) -> None:
        for seq in list(self.seqs):
            self.release(seq)
        self.pool.check_integrity()
        self.tier.check_integrity()
        stats = self.pool.stats()
        assert stats.live == 0
        assert stats.free + stats.cached == stats.total == NUM_BLOCKS
        assert stats.cached == self.num_cached()


BlockManagerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
test_block_manager_state_machine = BlockManagerMachine.TestCase


def test_a_revive_whose_allocation_evicts_a_block_of_its_own_run_loads_it_back() -> None:
    """The example the machine once found: the pool holds the second block of a prefix
    but not the first, the tier holds both; reviving them needs the pool's last two
    cached blocks, one of them that second block, which spills and is loaded back."""
    state = BlockManagerMachine()
    two_blocks, other = [7, 7, 7, 7, 8, 8, 8, 8], [9, 9, 9, 9]
    state.new_sequence(salt="a", suffix=[0, 0, 1, 0], system=[])
    state.free(pick=0)
    state.new_sequence(salt="b", suffix=[], system=two_blocks)
    state.mark_duplicated(picks=[1, 128], unknown=False)
    state.free(pick=0)
    state.evict(n=1)
    state.new_sequence(salt="a", suffix=[0], system=[])
    state.free(pick=0)
    state.new_sequence(salt="b", suffix=[], system=two_blocks)
    state.new_sequence(salt="a", suffix=[0, 0, 0, 0, 0], system=other)
    state.free(pick=0)
    state.new_sequence(salt="b", suffix=[0, 0], system=other)
    state.new_sequence(salt="a", suffix=[0, 0, 0, 0], system=two_blocks)
    state.append(new_tokens=[0], pick=6434)
    state.append(new_tokens=[0, 0, 0], pick=1)
    before = state.pool.stats().evictions
    state.new_sequence(salt="b", suffix=[], system=two_blocks)
    assert state.pool.stats().evictions == before + 2  # both cached blocks went
    state.every_registered_hash_points_at_its_tokens()
    state.every_sequence_reads_back_its_own_tokens()
    state.teardown()
