"""The KV cache of one worker behind one interface: block pool, KV tensors, offload tier.

`KVCacheManager` owns the three pieces and is the only way the batch
scheduler, the engine and migration reach them:

- **match** a sequence's prefix hashes (the pool's cached run, then the
  offload tier's copied back into fresh blocks), **touch** the prefixes
  about to be reused, ask how many leading hashes are held (`num_leading`);
- **allocate** and **free** through a sequence's `BlockTable`, which the
  manager hands out (`new_table`); ask whether blocks can be had
  (`can_allocate`, `num_allocatable`) and who holds one (`ref_count`);
- **register** full written blocks under their prefix hashes;
- **evict** cached blocks (LRU, those duplicated on other workers first) and
  take the scheduler's word on which those are (`mark_duplicated`);
- copy blocks: copy-on-write before a forward (`prepare_forward`), swap a
  preempted sequence out and in (`swap_out` / `swap_in`), **export** and
  **import** registered blocks for migration (`export_blocks` / `import_blocks`);
- **events**: KV events for the scheduler's index (`drain_events`, `snapshot`);
- typed **stats** (`KVStats`) and `check_integrity`: every block is exactly
  one of free, live or cached, and live blocks are held by whom the caller says.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from pagefleet.worker.block_pool import BlockPool, PoolStats
from pagefleet.worker.block_table import BlockTable
from pagefleet.worker.kv_cache import KVCache
from pagefleet.worker.kv_migration import ExportedKV
from pagefleet.worker.offload import HostOffloadTier, TierStats, revive_offloaded


@dataclass(frozen=True)
class KVStats(PoolStats, TierStats):
    """The KV cache's counters: the pool's (`PoolStats`), the offload tier's
    (`TierStats`, zeros without one) and the blocks migrated out and in.

    Unlike the pool's own count, `prefix_hit_tokens` counts hits in either
    tier; `offload_hit_tokens` is the part copied back from the offload tier.
    `LLMEngine.stats()` adds the engine's own counters (`EngineStats`).
    """

    kv_blocks_exported: int = 0
    kv_blocks_imported: int = 0


@dataclass(frozen=True)
class PrefixMatch:
    """What `KVCacheManager.match` found: the matched blocks (refs taken), and how many
    of the pool's hits were cached (ref 0) blocks, live again now."""

    block_ids: list[int]
    revived: int


class KVCacheManager:
    """The paged KV cache of one worker: the blocks of `cache` in a block pool, with a
    prefix cache and, with `offload_bytes`, a host-memory tier behind it."""

    def __init__(
        self, cache: KVCache, *, enable_prefix_caching: bool = True, offload_bytes: int = 0
    ) -> None:
        self.cache = cache  # the tensors, bound once by the model runner
        num_blocks, block_size = cache.num_blocks, cache.block_size
        # Evicted prefix blocks spill to the offload tier (if any) instead of being lost.
        self._tier: HostOffloadTier | None = None
        if offload_bytes:
            self._tier = HostOffloadTier(self.cache.transfer, offload_bytes, block_size)
        self._pool = BlockPool(
            num_blocks,
            block_size,
            enable_prefix_caching,
            spill=self._tier.store if self._tier is not None else None,
        )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._exported = 0
        self._imported = 0

    # ----------------------------------------------------------------- queries

    @property
    def bytes_per_block(self) -> int:
        """KV bytes of one block (every layer, keys and values)."""
        return self.cache.transfer.bytes_per_block

    @property
    def num_free(self) -> int:
        """Blocks that hold nothing (allocating them evicts no cached block)."""
        return self._pool.stats().free

    @property
    def num_allocatable(self) -> int:
        """Blocks that can be allocated now: free plus cached (evictable)."""
        return self._pool.num_allocatable

    def can_allocate(self, n: int) -> bool:
        """Whether `n` blocks can be allocated now."""
        return self._pool.can_allocate(n)

    def ref_count(self, block_id: int) -> int:
        """How many sequences hold `block_id`."""
        return self._pool.ref_count(block_id)

    def is_cached(self, block_hash: bytes) -> bool:
        """Whether a pool block (live or cached) is registered under `block_hash`."""
        return self._pool.is_cached(block_hash)

    def holds(self, block_hash: bytes) -> bool:
        """Whether the pool or the offload tier holds `block_hash`."""
        return self._pool.is_cached(block_hash) or (
            self._tier is not None and block_hash in self._tier
        )

    def num_leading(self, hashes: Iterable[bytes], *, live_only: bool = False) -> int:
        """How many of `hashes`, from the first, the pool holds (in use, with `live_only`)."""
        return self._pool.leading(hashes, live_only=live_only)

    # -------------------------------------------------------------- allocation

    def new_table(self) -> BlockTable:
        """An empty block table: a sequence allocates and frees its blocks through it."""
        return BlockTable(self._pool)

    def match(self, hashes: Seq[bytes]) -> PrefixMatch:
        """The longest run of `hashes` held, refs taken: the pool's cached run, then the
        offload tier's copied back into fresh blocks. Counts a prefix query."""
        hits = self._pool.lookup(hashes) if hashes else []
        revived = sum(1 for b in hits if self._pool.ref_count(b) == 1)
        if self._tier is not None and len(hits) < len(hashes):
            # The pool missed: the rest of the run may be in the offload tier.
            hits = hits + revive_offloaded(self._pool, self._tier, hashes[len(hits) :])
        return PrefixMatch(hits, revived)

    def touch(self, hashes: Iterable[bytes]) -> None:
        """Make the cached blocks under `hashes` the most recently used, in order
        (`BlockPool.touch`): the last hash given is evicted last."""
        self._pool.touch(hashes)

    def register(self, block_id: int, block_hash: bytes) -> bool:
        """Make a full, written, live block findable under `block_hash` (`BlockPool.register`)."""
        return self._pool.register(block_id, block_hash)

    # ---------------------------------------------------------------- eviction

    def evict(self, n: int | None = None) -> int:
        """Evict up to `n` cached blocks (all when None): duplicated ones first, then LRU.

        Live blocks stay; each evicted hash spills to the offload tier (if any)
        and emits a "removed" event. Returns how many were evicted.
        """
        return self._pool.evict_cached(n)

    def mark_duplicated(self, hashes: Iterable[bytes]) -> None:
        """The hashes another worker also holds: evicted before last copies
        (`BlockPool.mark_duplicated`)."""
        self._pool.mark_duplicated(hashes)

    # ------------------------------------------------------------------ copies

    def prepare_forward(self, copies: Seq[tuple[int, int]]) -> None:
        """Before a forward: wait for the spills and loads issued so far, then do the
        step's copy-on-write block copies `(src, dst)`."""
        self.cache.transfer.wait()
        if copies:
            self.cache.copy_blocks(copies)

    def swap_out(self, block_ids: Seq[int]) -> torch.Tensor:
        """A host copy of the blocks (`KVCache.swap_out`); the caller frees them afterwards."""
        return self.cache.swap_out(block_ids)

    def swap_in(self, host: torch.Tensor, block_ids: Seq[int]) -> None:
        """Write blocks saved by `swap_out` into allocated blocks `block_ids`."""
        self.cache.swap_in(host, block_ids)

    def export_blocks(self, hashes: Seq[bytes]) -> ExportedKV | None:
        """A host copy of the leading run of `hashes` registered here (live or cached),
        to continue a request on another worker; None when not even the first is.
        The blocks themselves are untouched."""
        pool = self._pool
        n = pool.leading(hashes)
        if n == 0:
            return None
        block_ids = [pool.block_of(h) for h in hashes[:n]]
        self._exported += n
        return ExportedKV(tuple(hashes[:n]), self.cache.swap_out(block_ids))

    def import_blocks(self, hashes: Seq[bytes], blocks: torch.Tensor) -> int:
        """Write exported `blocks` in as cached blocks (ref count 0) under `hashes`;
        returns how many were written.

        Hashes held already are skipped (the own copy serves). The blocks come
        from the free list, evicting cached blocks (least recently used first)
        when it runs out, as an admission would, but never the leading run of
        `hashes` held here, and never a live block: when the room is short, the
        leading part of the run that fits is written. Raises ValueError when
        the blocks do not fit this cache's layout.
        """
        pool, cache = self._pool, self.cache
        expected = (len(hashes), *cache.transfer.block_shape)
        if tuple(blocks.shape) != expected or blocks.dtype != cache.tensor.dtype:
            raise ValueError(
                f"KV blocks of shape {tuple(blocks.shape)} and dtype {blocks.dtype} do not fit "
                f"this pool: expected {expected} and {cache.tensor.dtype}"
            )
        if not self.enable_prefix_caching:
            return 0
        own = pool.leading(hashes)
        pool.touch(hashes[:own])  # the cached ones among them are evicted after everything else
        kept = sum(1 for h in hashes[:own] if not pool.is_live(h))
        todo = [i for i in range(own, len(hashes)) if not pool.is_cached(hashes[i])]
        todo = todo[: max(0, pool.num_allocatable - kept)]
        if not todo:
            return 0
        block_ids = pool.allocate(len(todo))
        cache.swap_in(blocks[todo], block_ids)
        for block_id, i in zip(block_ids, todo, strict=True):
            pool.register(block_id, hashes[i])
        # Tail first: the run's first blocks are evicted last, as for a finished request.
        pool.free(reversed(block_ids))
        self._imported += len(block_ids)
        return len(block_ids)

    # ------------------------------------------------------------------ events

    def drain_events(self) -> list[tuple[str, bytes]]:
        """KV events since the last drain: ("stored" | "removed", hash) for the pool,
        then ("offload_stored" | "offload_removed", hash) for the tier."""
        events = self._pool.drain_events()
        if self._tier is not None:
            events.extend(self._tier.drain_events())
        return events

    def snapshot(self) -> list[tuple[str, bytes]]:
        """Every held hash as ("stored", hash) for the pool and ("offload_stored", hash)
        for the tier, pending events dropped: a receiver that replaces its index with
        this list is exactly in sync."""
        self.drain_events()
        events = [("stored", h) for h in self._pool.registered_hashes()]
        if self._tier is not None:
            events.extend(("offload_stored", h) for h in self._tier.hashes())
        return events

    # ------------------------------------------------------------------- state

    def stats(self) -> KVStats:
        """The counters now."""
        pool = self._pool.stats()
        tier = self._tier.stats() if self._tier is not None else _NO_TIER
        fields = {**pool.as_dict(), **tier.as_dict()}
        fields["prefix_hit_tokens"] += tier.offload_hit_tokens
        return KVStats(**fields, kv_blocks_exported=self._exported, kv_blocks_imported=self._imported)

    def check_integrity(self, holders: Mapping[int, int] | None = None) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent.

        Every block is exactly one of free, live or cached (the pool's own
        check) and the offload tier's slots are consistent (a hash there and
        not in the pool is offloaded-only: it holds no pool block). With
        `holders` (block id -> how many sequences hold it), each block's ref
        count must equal its holders.
        """
        self._pool.check_integrity()
        if self._tier is not None:
            self._tier.check_integrity()
        if holders is None:
            return
        for block in range(self.num_blocks):
            held = holders.get(block, 0)
            assert self._pool.ref_count(block) == held, (
                f"block {block} has ref count {self._pool.ref_count(block)} "
                f"but {held} sequences hold it"
            )


_NO_TIER = TierStats(**dict.fromkeys(TierStats.__dataclass_fields__, 0))
