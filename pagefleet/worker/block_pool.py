"""The block pool: fixed-size KV blocks, ref counts, a free queue and the prefix cache.

Every block is in exactly one of three states:

- **free**: ref count 0 and no hash (never filled, or evicted);
- **cached**: ref count 0 with a hash: nobody uses it, but a prefix lookup can
  still revive it until the block is handed out again;
- **live**: ref count > 0.

Free and cached blocks sit in one free queue, an intrusive doubly linked list
kept in two int arrays (`_prev`, `_next`) so that unlinking a block from the
middle (a prefix hit on a cached block) is O(1). A divider node splits the
cached blocks into two classes, each least recently released first:

    head -> [free ...] [cached, duplicated elsewhere] DIVIDER [cached, last copies] -> tail

Allocation pops from the head, so free blocks are used before any cached block
is evicted, cached blocks another worker of the pool also holds (the
scheduler says which: `mark_duplicated`) go before the last copies, and each
class goes in LRU order. A released block with a hash goes to the tail of its
class (most recently used); a released block without one goes to the head (it
holds nothing worth keeping, so it is reused first). Without duplicates marked
the first class is empty: plain LRU.

With an offload tier (`spill`), each evicted block's `(hash, block_id)` is
handed to the tier before `allocate` (or `evict_cached`) returns, i.e. before
anybody can write into the block again; the tier copies it out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass


def is_valid_block_size(block_size: int) -> bool:
    """Block sizes are powers of two (kernels and slot arithmetic rely on it)."""
    return block_size >= 1 and block_size & (block_size - 1) == 0


class NoFreeBlocks(RuntimeError):
    """The pool cannot hand out the requested number of blocks; nothing was changed."""

    def __init__(self, requested: int, available: int) -> None:
        super().__init__(
            f"cannot allocate {requested} KV blocks: only {available} free or evictable"
        )
        self.requested = requested
        self.available = available


@dataclass(frozen=True)
class PoolStats:
    """A snapshot of the pool's counters (blocks, and tokens for the prefix cache)."""

    total: int
    free: int
    live: int
    cached: int
    peak_live: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    evictions: int
    duplicate_evictions: int = 0  # of `evictions`, blocks marked duplicated elsewhere

    @property
    def prefix_hit_rate(self) -> float:
        """Share of queried prefix tokens that were found cached (0 when nothing was queried)."""
        if self.prefix_query_tokens == 0:
            return 0.0
        return self.prefix_hit_tokens / self.prefix_query_tokens

    def as_dict(self) -> dict[str, int]:
        """The counters as a plain dict (merged into `KVCacheManager.stats()`)."""
        return asdict(self)


class BlockPool:
    """`num_blocks` KV blocks of `block_size` tokens with ref counts and a prefix cache.

    All operations are O(1) per block. `allocate` is all-or-nothing. Block ids are
    ints in `[0, num_blocks)`; a block's KV slots are
    `block_id * block_size + offset`.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        spill: Callable[[list[tuple[bytes, int]]], None] | None = None,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        if not is_valid_block_size(block_size):
            raise ValueError(f"block_size must be a power of two, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._spill = spill  # receives evicted (hash, block) pairs, e.g. an offload tier

        self._ref = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}  # hash -> block id (live or cached)
        # Registered hashes another worker also holds (the scheduler's latest word):
        # their blocks, once cached, are evicted before last copies. A subset of
        # `_cached`, so never larger than the pool.
        self._duplicated: set[bytes] = set()
        # When each cached block last became the most recently used (a counter):
        # blocks changing class keep their order among themselves.
        self._released_at = [0] * num_blocks
        self._clock = 0

        # Free queue; index `num_blocks` is the sentinel (head = _next[s], tail = _prev[s]),
        # `num_blocks + 1` the divider between duplicated and last-copy cached blocks.
        s, d = num_blocks, num_blocks + 1
        self._sentinel, self._divider = s, d
        self._next = [*range(1, num_blocks), d, 0, s]
        self._prev = [s, *range(0, num_blocks - 1), d, num_blocks - 1]

        self._num_free = num_blocks
        self._num_cached = 0
        self._peak_live = 0
        self._query_tokens = 0
        self._hit_tokens = 0
        self._evictions = 0
        self._duplicate_evictions = 0
        # Pending KV events, coalesced per hash (stored then removed before a drain
        # cancels out), so the queue stays under 2 * num_blocks even if nobody drains.
        self._events: dict[bytes, str] = {}

    # ----------------------------------------------------------------- queries

    @property
    def num_allocatable(self) -> int:
        """Blocks that `allocate` can hand out now: free plus cached (evictable)."""
        return self._num_free + self._num_cached

    @property
    def num_live(self) -> int:
        """Blocks with ref count > 0."""
        return self.num_blocks - self._num_free - self._num_cached

    def can_allocate(self, n: int) -> bool:
        """Whether `allocate(n)` would succeed."""
        return n <= self._num_free + self._num_cached

    def ref_count(self, block_id: int) -> int:
        """The number of sequences holding `block_id`."""
        return self._ref[block_id]

    def block_hash(self, block_id: int) -> bytes | None:
        """The prefix hash `block_id` is registered under, if any."""
        return self._hash[block_id]

    def block_of(self, block_hash: bytes) -> int:
        """The block registered under `block_hash` (live or cached); KeyError if none is."""
        return self._cached[block_hash]

    def is_cached(self, block_hash: bytes) -> bool:
        """Whether a block (live or cached) is registered under `block_hash`."""
        return block_hash in self._cached

    def is_live(self, block_hash: bytes) -> bool:
        """Whether a block registered under `block_hash` is in use (ref count > 0)."""
        block = self._cached.get(block_hash)
        return block is not None and self._ref[block] > 0

    def leading(self, hashes: Iterable[bytes], *, live_only: bool = False) -> int:
        """How many of `hashes`, from the first, are registered here (in use, with `live_only`)."""
        held = self.is_live if live_only else self.is_cached
        n = 0
        for h in hashes:
            if not held(h):
                break
            n += 1
        return n

    def stats(self) -> PoolStats:
        """The counters now."""
        return PoolStats(
            total=self.num_blocks,
            free=self._num_free,
            live=self.num_live,
            cached=self._num_cached,
            peak_live=self._peak_live,
            prefix_query_tokens=self._query_tokens,
            prefix_hit_tokens=self._hit_tokens,
            evictions=self._evictions,
            duplicate_evictions=self._duplicate_evictions,
        )

    # ------------------------------------------------------------- allocation

    def allocate(self, n: int) -> list[int]:
        """Hand out `n` blocks with ref count 1; evicts cached blocks if needed
        (duplicated ones first, then last copies, LRU within each).

        All-or-nothing: raises `NoFreeBlocks` and changes nothing when fewer than
        `n` blocks are free or evictable.
        """
        if n <= 0:
            if n == 0:
                return []
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        available = self._num_free + self._num_cached
        if n > available:
            raise NoFreeBlocks(n, available)
        nxt, ref, hashes = self._next, self._ref, self._hash
        s, d = self._sentinel, self._divider
        out: list[int] = []
        b = nxt[s]
        passed_divider = False
        if n <= self._num_free:
            # Free blocks sit ahead of every cached one (and the divider): no eviction here.
            for _ in range(n):
                out.append(b)
                ref[b] = 1
                b = nxt[b]
            evicted = 0
        else:
            evicted = n - self._num_free
            spilled: list[tuple[bytes, int]] = []
            for _ in range(n):
                if b == d:  # at most once, and enough blocks follow it
                    passed_divider = True
                    b = nxt[b]
                out.append(b)
                ref[b] = 1
                if hashes[b] is not None:
                    spilled.append((self._evict(b), b))
                b = nxt[b]
            if self._spill is not None:
                self._spill(spilled)
        # The n blocks form the head of the queue (bar the divider): splice them out.
        if passed_divider:
            nxt[s], self._prev[d] = d, s
            s = d
        nxt[s] = b
        self._prev[b] = s
        self._num_cached -= evicted
        self._num_free -= n - evicted
        live = self.num_blocks - self._num_free - self._num_cached
        if live > self._peak_live:
            self._peak_live = live
        return out

    def _evict(self, block_id: int) -> bytes:
        h = self._hash[block_id]
        assert h is not None
        self._hash[block_id] = None
        del self._cached[h]
        self._evictions += 1
        if h in self._duplicated:
            self._duplicated.discard(h)
            self._duplicate_evictions += 1
        self._event("removed", h)
        return h

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference on each block, in the order given.

        A block whose count reaches 0 becomes cached (it has a hash: queued at the
        tail of its class, evicted last in it) or free (queued at the head, reused
        first). Pass a sequence's tail blocks first so its shared head blocks are
        evicted later.
        """
        ref, hashes, nxt, prev = self._ref, self._hash, self._next, self._prev
        s, d, duplicated, at = self._sentinel, self._divider, self._duplicated, self._released_at
        clock = self._clock
        for b in block_ids:
            r = ref[b] - 1
            if r < 0:
                self._clock = clock
                raise ValueError(f"block {b} freed more often than it was allocated")
            ref[b] = r
            if r:
                continue
            h = hashes[b]
            if h is not None:
                clock += 1
                at[b] = clock
                end = d if h in duplicated else s
                tail = prev[end]
                nxt[tail] = b
                prev[b] = tail
                nxt[b] = end
                prev[end] = b
                self._num_cached += 1
            else:
                head = nxt[s]
                prev[head] = b
                nxt[b] = head
                prev[b] = s
                nxt[s] = b
                self._num_free += 1
        self._clock = clock

    def incref(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on each live block (a fork shares its parent's blocks)."""
        ref = self._ref
        for b in block_ids:
            if ref[b] <= 0:
                raise ValueError(
                    f"block {b} is not live; revive cached blocks with lookup(), not incref()"
                )
            ref[b] += 1

    # ----------------------------------------------------------- prefix cache

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """The longest run of cached blocks matching `hashes` from the start; refs taken.

        Counts `len(hashes) * block_size` queried tokens and the matched blocks'
        tokens as hits. Cached (ref 0) blocks are taken out of the free queue.
        """
        if not self.enable_prefix_caching:
            return []
        out: list[int] = []
        cached, ref = self._cached, self._ref
        nxt, prev = self._next, self._prev
        revived = 0
        for h in hashes:
            b = cached.get(h)
            if b is None:
                break
            if ref[b] == 0:
                p, n = prev[b], nxt[b]
                nxt[p] = n
                prev[n] = p
                revived += 1
            ref[b] += 1
            out.append(b)
        self._query_tokens += len(hashes) * self.block_size
        self._hit_tokens += len(out) * self.block_size
        if revived:
            self._num_cached -= revived
            live = self.num_blocks - self._num_free - self._num_cached
            if live > self._peak_live:
                self._peak_live = live
        return out

    def touch(self, hashes: Iterable[bytes]) -> None:
        """Make the cached (ref 0) blocks under `hashes` the most recently used of
        their class (duplicated or last copy), in order.

        The last hash given ends up evicted last. Live and unknown hashes are
        ignored; counts no prefix query. The batch scheduler calls this for the
        prefixes that waiting requests are about to reuse.
        """
        cached, ref, duplicated = self._cached, self._ref, self._duplicated
        for h in hashes:
            b = cached.get(h)
            if b is not None and not ref[b]:
                self._clock += 1
                self._released_at[b] = self._clock
                self._move(b, self._divider if h in duplicated else self._sentinel)

    def mark_duplicated(self, hashes: Iterable[bytes]) -> None:
        """Replace the set of hashes another worker of the pool also holds.

        Their cached blocks are evicted before last copies from now on. Blocks
        changing class become the most recently used of the new one, in their
        order of use among themselves. Hashes this pool does not hold are
        ignored, so the set never outgrows the pool. Costs O(k log k) for the k
        hashes that change class, not a scan of the cache.
        """
        cached, ref, at = self._cached, self._ref, self._released_at
        new = {h for h in hashes if h in cached}
        old = self._duplicated
        for moved, end in ((old - new, self._sentinel), (new - old, self._divider)):
            unused = [b for b in (cached[h] for h in moved) if not ref[b]]
            for b in sorted(unused, key=at.__getitem__):
                self._move(b, end)
        self._duplicated = new

    def is_duplicated(self, block_hash: bytes) -> bool:
        """Whether `block_hash` is registered here and marked held by another worker too."""
        return block_hash in self._duplicated

    def _move(self, b: int, before: int) -> None:
        """Unlink block `b` from the free queue and put it back just before node
        `before`: the sentinel (tail of the last copies), the divider (tail of the
        duplicated ones) or the head block (allocated first)."""
        nxt, prev = self._next, self._prev
        p, n = prev[b], nxt[b]
        nxt[p] = n
        prev[n] = p
        after = before
        before = prev[after]
        nxt[before] = b
        prev[b] = before
        nxt[b] = after
        prev[after] = b

    def _move_to_head(self, b: int) -> None:
        nxt, prev, s = self._next, self._prev, self._sentinel
        p, n = prev[b], nxt[b]
        nxt[p] = n
        prev[n] = p
        head = nxt[s]
        nxt[s] = b
        prev[b] = s
        nxt[b] = head
        prev[head] = b

    def register(self, block_id: int, block_hash: bytes) -> bool:
        """Make a full, written, live block findable under `block_hash`.

        Returns whether the block was registered. When another block already holds
        the hash (two sequences computed the same block at once), the existing
        mapping stays and `block_id` stays unhashed: it is released as a plain free
        block later, so the map never holds duplicates. No-op without prefix caching.
        """
        if not self.enable_prefix_caching:
            return False
        if self._ref[block_id] <= 0:
            raise ValueError(f"block {block_id} is not live; only live blocks can be registered")
        current = self._hash[block_id]
        if current is not None:
            if current == block_hash:
                return True
            raise ValueError(f"block {block_id} is already registered under another hash")
        if block_hash in self._cached:
            return False
        self._hash[block_id] = block_hash
        self._cached[block_hash] = block_id
        self._event("stored", block_hash)
        return True

    def evict_cached(self, n: int | None = None) -> int:
        """Drop the hashes of up to `n` cached blocks (all if None) in eviction
        order: duplicated ones first, then last copies, LRU within each.

        The blocks become plain free blocks (spilled to the tier first, if any).
        Returns how many were evicted. The pool evicts by itself on allocation;
        this is for an explicit policy (the scheduler's watermark) or a reset.
        Walks the free blocks ahead of the cached ones: cheap when few are free,
        which is when the scheduler asks.
        """
        limit = self._num_cached if n is None else min(n, self._num_cached)
        nxt, hashes = self._next, self._hash
        s, d = self._sentinel, self._divider
        b = nxt[s]
        done = 0
        spilled: list[tuple[bytes, int]] = []
        while done < limit:
            after = nxt[b]
            if b != d and hashes[b] is not None:
                spilled.append((self._evict(b), b))
                self._move_to_head(b)
                done += 1
            b = after
        self._num_cached -= done
        self._num_free += done
        if self._spill is not None and spilled:
            self._spill(spilled)
        return done

    def reset_prefix_cache(self) -> int:
        """Forget every cached (ref 0) block's hash; live blocks keep theirs. Returns count."""
        return self.evict_cached(None)

    # ----------------------------------------------------------------- events

    def _event(self, kind: str, block_hash: bytes) -> None:
        pending = self._events.get(block_hash)
        if pending is not None and pending != kind:
            # stored-then-removed (or the reverse) since the last drain: no net change.
            del self._events[block_hash]
        else:
            self._events[block_hash] = kind

    def drain_events(self) -> list[tuple[str, bytes]]:
        """KV events ("stored" | "removed", hash) since the last drain, oldest first.

        Events are coalesced per hash: applying them to a set of hashes mirrored at
        the previous drain yields exactly the hashes registered now.
        """
        out = [(kind, h) for h, kind in self._events.items()]
        self._events = {}
        return out

    def registered_hashes(self) -> list[bytes]:
        """Every hash registered now (live or cached): what the drained events add up to."""
        return list(self._cached)

    # -------------------------------------------------------------- integrity

    def check_integrity(self) -> None:
        """Raise AssertionError if any block is in no state or two, or a counter is off."""
        n, s, d = self.num_blocks, self._sentinel, self._divider
        in_queue = [False] * n
        seen = 0
        seen_cached = seen_divider = False
        b = self._next[s]
        p = s
        while b != s:
            assert self._prev[b] == p, f"free queue link broken at node {b}"
            if b == d:
                assert not seen_divider, "the divider is in the free queue twice"
                seen_divider = True
                p, b = b, self._next[b]
                continue
            assert 0 <= b < n, f"free queue holds invalid block id {b}"
            assert not in_queue[b], f"block {b} is in the free queue twice"
            in_queue[b] = True
            seen += 1
            assert seen <= n, "free queue has a cycle"
            h = self._hash[b]
            if h is not None:
                seen_cached = True
                # Duplicated blocks sit ahead of the divider, last copies behind it.
                assert (h in self._duplicated) != seen_divider, (
                    f"cached block {b} is in the wrong class (duplicated: {h in self._duplicated})"
                )
            else:
                assert not seen_cached and not seen_divider, (
                    f"free block {b} sits behind cached blocks in the queue"
                )
            p, b = b, self._next[b]
        assert seen_divider, "the divider is missing from the free queue"
        assert self._prev[s] == p, "free queue tail link broken"
        assert self._duplicated <= self._cached.keys(), "a duplicated hash is not registered"

        free = cached = live = 0
        for b in range(n):
            r, h = self._ref[b], self._hash[b]
            assert r >= 0, f"block {b} has negative ref count {r}"
            if r > 0:
                live += 1
                assert not in_queue[b], f"live block {b} is in the free queue"
            else:
                assert in_queue[b], f"block {b} has ref 0 but is not in the free queue"
                if h is None:
                    free += 1
                else:
                    cached += 1
            if h is not None:
                assert self._cached.get(h) == b, f"block {b}'s hash does not map back to it"
        assert len(self._cached) == sum(h is not None for h in self._hash), (
            "hash map holds entries for blocks without that hash"
        )
        assert free == self._num_free, f"free counter {self._num_free} != {free} free blocks"
        assert cached == self._num_cached, (
            f"cached counter {self._num_cached} != {cached} cached blocks"
        )
        assert free + cached + live == n, "block states do not add up to the total"
        assert live <= self._peak_live, f"peak_live {self._peak_live} < live {live}"
        if not self.enable_prefix_caching:
            assert not self._cached, "prefix caching is off but blocks carry hashes"
