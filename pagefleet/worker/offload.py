"""The KV offload tier: evicted prefix blocks spill to host memory and come back on a hit.

Two parts:

- `BlockTransfer` is the one copy path between the device KV tensor and host
  memory. Swap preemption (`KVCache.swap_out` / `swap_in`) and the offload tier
  both use it. Host buffers are block-major (`[n, layers, 2, block_size,
  kv_heads, head_dim]`, one contiguous run per block). On CPU a copy is one
  gather or scatter (memcpy). On CUDA the host buffers are pinned and copies
  run on a side stream, ordered by events: the side stream first waits for an
  event recorded on the compute stream (the blocks' K/V were written there, or
  it may still read blocks a copy overwrites); a spill gathers its blocks into
  a device staging tensor and records `kv_done`, then copies that to the host
  asynchronously; a load copies host -> staging -> blocks and records
  `kv_done`. Before the next forward the compute stream waits for `kv_done`
  only (`wait`), so it may reuse spilled blocks and read loaded ones, while a
  spill's device-to-host transfer overlaps with the forward. Staging tensors
  are allocated on the side stream, so the caching allocator reuses their
  memory only for later side-stream work, after the copies that read them.
- `KVTier` is the interface of a tier behind the pool (`match`, `store`,
  `load`, events, `check_integrity`), so a local-disk tier can follow;
  `HostOffloadTier` is the host-memory one: `capacity_bytes` of blocks keyed
  by prefix hash, evicted LRU.

The tier is inclusive: a block loaded back into the pool keeps its tier copy,
so evicting it again costs no copy. Every pool block is free, live or cached;
a hash held only by the tier is "offloaded-only" (it has no pool block).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch

from pagefleet.worker.block_pool import BlockPool


class BlockTransfer:
    """Copies whole blocks (every layer, K and V) between a device KV tensor and host buffers."""

    def __init__(self, kv_tensor: torch.Tensor) -> None:
        if kv_tensor.dim() != 6:
            raise ValueError(
                "expected a KV tensor [layers, 2, num_blocks, block_size, kv_heads, head_dim], "
                f"got {kv_tensor.dim()} dims"
            )
        self._kv = kv_tensor
        # Block-major view of the same memory: [num_blocks, layers, 2, block_size, kv_heads,
        # head_dim], so that gathering blocks gives host-layout rows in one copy.
        self._blocks = kv_tensor.movedim(2, 0)
        self.device = kv_tensor.device
        layers, two, _, block_size, kv_heads, head_dim = kv_tensor.shape
        self.block_shape: tuple[int, ...] = (layers, two, block_size, kv_heads, head_dim)
        self.bytes_per_block = kv_tensor[:, :, 0].numel() * kv_tensor.element_size()
        cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if cuda else None
        # Recorded on the side stream after the last copy that reads or writes the
        # KV tensor; the compute stream waits on it (`wait`) before its next forward.
        self._kv_done = torch.cuda.Event() if cuda else None

    def host_buffer(self, num_blocks: int) -> torch.Tensor:
        """Uninitialised host memory for `num_blocks` blocks (pinned when the KV is on CUDA)."""
        return torch.empty(
            (num_blocks, *self.block_shape),
            dtype=self._kv.dtype,
            pin_memory=self._stream is not None,
        )

    def to_host(
        self, block_ids: Sequence[int], host: torch.Tensor, host_slots: Sequence[int]
    ) -> int:
        """Copy device blocks `block_ids` into `host[host_slots]`; returns the bytes copied.

        On CUDA the copy is asynchronous: `host` is complete after `synchronize`
        (later copies on the side stream, such as `to_device`, are ordered after it).
        """
        if len(block_ids) != len(host_slots):
            raise ValueError(f"{len(block_ids)} blocks for {len(host_slots)} host slots")
        if not block_ids:
            return 0
        if self._stream is None:
            # Gather each run of slots straight into the host rows: one memcpy per block.
            ids = torch.as_tensor(list(block_ids), dtype=torch.long)
            for start, end, first in _runs(host_slots):
                torch.index_select(self._blocks, 0, ids[start:end],
                                   out=host[first : first + end - start])  # fmt: skip
            return len(block_ids) * self.bytes_per_block
        assert self._kv_done is not None
        with self._on_side_stream():
            ids = torch.as_tensor(list(block_ids), dtype=torch.long, device=self.device)
            # One gather on the device reads the blocks; from here on the pool may
            # reuse them, so the compute stream only waits for this part...
            staged = self._blocks.index_select(0, ids)
            self._kv_done.record(self._stream)
            # ... while the device-to-host copies overlap with the next forward.
            for start, end, first in _runs(host_slots):
                host[first : first + end - start].copy_(staged[start:end], non_blocking=True)
        return len(block_ids) * self.bytes_per_block

    def to_device(
        self, host: torch.Tensor, host_slots: Sequence[int], block_ids: Sequence[int]
    ) -> int:
        """Copy `host[host_slots]` into device blocks `block_ids`; returns the bytes copied."""
        if len(block_ids) != len(host_slots):
            raise ValueError(f"{len(host_slots)} host slots for {len(block_ids)} blocks")
        if not block_ids:
            return 0
        if self._stream is None:
            ids = torch.as_tensor(list(block_ids), dtype=torch.long)
            for start, end, first in _runs(host_slots):
                self._blocks.index_copy_(0, ids[start:end], host[first : first + end - start])
            return len(block_ids) * self.bytes_per_block
        assert self._kv_done is not None
        with self._on_side_stream():
            ids = torch.as_tensor(list(block_ids), dtype=torch.long, device=self.device)
            staged = torch.empty((len(block_ids), *self.block_shape), dtype=host.dtype,
                                 device=self.device)  # fmt: skip
            for start, end, first in _runs(host_slots):
                staged[start:end].copy_(host[first : first + end - start], non_blocking=True)
            self._blocks.index_copy_(0, ids, staged)
            self._kv_done.record(self._stream)  # the next forward reads these blocks
        return len(block_ids) * self.bytes_per_block

    def wait(self) -> None:
        """Make the compute stream wait until the copies issued so far are done with the KV.

        Called before each forward: a block just evicted (still being gathered
        out) may be written by it, and a block just loaded is read by it. The
        device-to-host part of a spill is not waited for (no-op on CPU).
        """
        if self._kv_done is not None:
            torch.cuda.current_stream(self.device).wait_event(self._kv_done)

    def synchronize(self) -> None:
        """Block the host until every copy issued so far has finished (no-op on CPU)."""
        if self._stream is not None:
            self._stream.synchronize()

    @contextmanager
    def _on_side_stream(self) -> Iterator[None]:
        assert self._stream is not None
        # The copy reads K/V the compute stream wrote (or overwrites blocks it may
        # still read): order it after everything queued there so far. Tensors made
        # inside are allocated on the side stream, so the caching allocator reuses
        # their memory only for later work on that stream, after these copies.
        queued = torch.cuda.Event()
        queued.record(torch.cuda.current_stream(self.device))
        self._stream.wait_event(queued)
        with torch.cuda.stream(self._stream):
            yield


def _runs(slots: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """Maximal runs of consecutive slots: (start index, end index, first slot)."""
    start = 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[i - 1] + 1:
            yield start, i, slots[start]
            start = i


@dataclass(frozen=True)
class TierStats:
    """Counters of a KV tier (blocks now; tokens and bytes since start)."""

    offload_blocks: int
    offload_capacity_blocks: int
    offload_hit_tokens: int
    offload_bytes_in: int  # tier -> pool (copied back on a hit)
    offload_bytes_out: int  # pool -> tier (spilled on eviction)
    offload_evictions: int
    # Host nanoseconds inside `store` / `load` (bookkeeping and copies; on CUDA the
    # copies are asynchronous, so this is the time to issue them).
    offload_store_ns: int
    offload_load_ns: int

    def as_dict(self) -> dict[str, int]:
        """The counters as a plain dict (merged into `KVCacheManager.stats()`)."""
        return asdict(self)


class KVTier(ABC):
    """A bounded store of KV blocks behind the pool, keyed by prefix hash."""

    @abstractmethod
    def match(self, hashes: Sequence[bytes]) -> int:
        """How many of `hashes`, from the start, the tier holds (no side effects)."""

    @abstractmethod
    def store(self, blocks: Sequence[tuple[bytes, int]]) -> None:
        """Copy pool blocks `(hash, block_id)` in before the pool reuses them."""

    @abstractmethod
    def load(self, hashes: Sequence[bytes], block_ids: Sequence[int]) -> None:
        """Copy the blocks of `hashes` (all held: see `match`) into pool blocks `block_ids`."""

    @abstractmethod
    def stats(self) -> TierStats:
        """The tier's counters now."""

    @abstractmethod
    def drain_events(self) -> list[tuple[str, bytes]]:
        """("offload_stored" | "offload_removed", hash) since the last drain, coalesced."""

    @abstractmethod
    def hashes(self) -> list[bytes]:
        """Every hash the tier holds now (for a snapshot of the worker's KV index)."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Raise AssertionError if the tier's bookkeeping is inconsistent."""


class HostOffloadTier(KVTier):
    """`capacity_bytes` of host memory holding evicted blocks, LRU, via a `BlockTransfer`."""

    def __init__(self, transfer: BlockTransfer, capacity_bytes: int, block_size: int) -> None:
        per_block = transfer.bytes_per_block
        capacity = capacity_bytes // per_block
        if capacity < 1:
            raise ValueError(
                f"kv_offload_bytes {capacity_bytes} holds no block: one block of {block_size} "
                f"tokens needs {per_block} bytes"
            )
        self.transfer = transfer
        self.block_size = block_size
        self.capacity_blocks = int(capacity)
        self.host = transfer.host_buffer(self.capacity_blocks)
        # Touch every page now (pinned memory is resident already): otherwise the
        # first-touch page faults land inside spills, on the serving path.
        self.host.zero_()
        self._slots: OrderedDict[bytes, int] = OrderedDict()  # LRU first
        self._free = list(range(self.capacity_blocks - 1, -1, -1))  # pop() gives slot 0 first
        self._events: dict[bytes, str] = {}
        self._hit_tokens = 0
        self._bytes_in = 0
        self._bytes_out = 0
        self._evictions = 0
        self._store_ns = 0
        self._load_ns = 0

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._slots

    def match(self, hashes: Sequence[bytes]) -> int:
        n = 0
        for h in hashes:
            if h not in self._slots:
                break
            n += 1
        return n

    def store(self, blocks: Sequence[tuple[bytes, int]]) -> None:
        start = time.perf_counter_ns()
        copy_blocks: list[int] = []
        copy_slots: list[int] = []
        slots = self._slots
        for h, block_id in blocks:
            if h in slots:
                slots.move_to_end(h)  # same hash, same K/V: nothing to copy
                continue
            if self._free:
                slot = self._free.pop()
            else:
                old, slot = slots.popitem(last=False)
                self._evictions += 1
                self._event("offload_removed", old)
                if slot in copy_slots:
                    # Evicting a block stored earlier in this same batch (the batch
                    # exceeds the capacity): its pending copy is dropped with it.
                    i = copy_slots.index(slot)
                    del copy_slots[i], copy_blocks[i]
            slots[h] = slot
            copy_blocks.append(block_id)
            copy_slots.append(slot)
            self._event("offload_stored", h)
        self._bytes_out += self.transfer.to_host(copy_blocks, self.host, copy_slots)
        self._store_ns += time.perf_counter_ns() - start

    def load(self, hashes: Sequence[bytes], block_ids: Sequence[int]) -> None:
        start = time.perf_counter_ns()
        slots = []
        for h in hashes:
            slot = self._slots.get(h)
            if slot is None:
                raise KeyError(f"block hash {h.hex()[:16]} is not in the offload tier")
            self._slots.move_to_end(h)
            slots.append(slot)
        self._bytes_in += self.transfer.to_device(self.host, slots, block_ids)
        self._hit_tokens += len(slots) * self.block_size
        self._load_ns += time.perf_counter_ns() - start

    def stats(self) -> TierStats:
        return TierStats(
            offload_blocks=len(self._slots),
            offload_capacity_blocks=self.capacity_blocks,
            offload_hit_tokens=self._hit_tokens,
            offload_bytes_in=self._bytes_in,
            offload_bytes_out=self._bytes_out,
            offload_evictions=self._evictions,
            offload_store_ns=self._store_ns,
            offload_load_ns=self._load_ns,
        )

    def _event(self, kind: str, block_hash: bytes) -> None:
        pending = self._events.get(block_hash)
        if pending is not None and pending != kind:
            del self._events[block_hash]  # stored then removed since the last drain
        else:
            self._events[block_hash] = kind

    def drain_events(self) -> list[tuple[str, bytes]]:
        out = [(kind, h) for h, kind in self._events.items()]
        self._events = {}
        return out

    def hashes(self) -> list[bytes]:
        return list(self._slots)

    def check_integrity(self) -> None:
        used = list(self._slots.values())
        assert len(set(used)) == len(used), "two hashes share one host slot"
        assert not set(used) & set(self._free), "a host slot is both used and free"
        assert len(used) + len(self._free) == self.capacity_blocks, (
            f"{len(used)} used + {len(self._free)} free host slots != "
            f"capacity {self.capacity_blocks}"
        )
        assert all(0 <= s < self.capacity_blocks for s in used), "host slot out of range"


def revive_offloaded(pool: BlockPool, tier: KVTier, hashes: Sequence[bytes]) -> list[int]:
    """Copy the tier's leading run of `hashes` back into fresh pool blocks.

    Call with the hashes after the pool's own prefix hit. Returns the new block
    ids (ref 1 each, registered under their hashes where the pool does not
    hold that hash already), as many as the tier holds and the pool can give.
    """
    k = min(tier.match(hashes), pool.num_allocatable)
    if k == 0:
        return []
    blocks = pool.allocate(k)
    # Allocating may have evicted pool blocks into the tier, and those may have
    # pushed some of our run out of it: keep only what is still there.
    still = tier.match(hashes[:k])
    if still < k:
        pool.free(blocks[still:])
        blocks = blocks[:still]
    tier.load(hashes[:still], blocks)
    for block_id, h in zip(blocks, hashes, strict=False):
        pool.register(block_id, h)
    return blocks
