"""Per-sequence block tables: logical token positions -> physical KV slots.

Token `i` of a sequence lives in block `block_ids[i // block_size]` at offset
`i % block_size`, i.e. in slot `block_ids[i // block_size] * block_size + i % block_size`.
Blocks are shared between sequences by ref count (prefix hits, forks); a write
into a shared, partially filled last block copies it first (copy-on-write).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pagefleet.worker.block_pool import BlockPool


def blocks_to_finish(num_prompt_tokens: int, max_tokens: int, block_size: int) -> int:
    """Blocks a sequence holds when it has generated `max_tokens` (its most).

    The last generated token is never written to the cache, so a request of
    `num_prompt_tokens + max_tokens` tokens writes one token less.
    """
    return -(-max(num_prompt_tokens + max_tokens - 1, 1) // block_size)


def request_claim(num_prompt_tokens: int, max_tokens: int, n: int, block_size: int) -> int:
    """Blocks a request of `n` completions holds when each reaches `max_tokens`.

    The completions share the prompt's full blocks (copy-on-write forks); each
    needs its own blocks from there on.
    """
    one = blocks_to_finish(num_prompt_tokens, max_tokens, block_size)
    return one + (n - 1) * (one - num_prompt_tokens // block_size)


@dataclass(frozen=True)
class AppendResult:
    """What `BlockTable.append_slots` reserved.

    `slots` are the KV slots of the new tokens, in order. `copies` are the
    `(src_block, dst_block)` copy-on-write copies the KV tensors must perform
    before the new tokens are written.
    """

    slots: list[int]
    copies: list[tuple[int, int]] = field(default_factory=list)


class BlockTable:
    """The blocks of one sequence and its token count."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.block_ids: list[int] = []
        self.num_tokens = 0

    def __len__(self) -> int:
        return len(self.block_ids)

    def slot(self, position: int) -> int:
        """The KV slot of token `position` (0-based) of this sequence."""
        if not 0 <= position < self.num_tokens:
            raise IndexError(f"position {position} outside the sequence's {self.num_tokens} tokens")
        bs = self.block_size
        return self.block_ids[position // bs] * bs + position % bs

    def append_cached(self, block_ids: Sequence[int]) -> None:
        """Adopt full blocks returned by `pool.lookup` (their refs are already taken)."""
        if self.num_tokens % self.block_size:
            raise ValueError(
                "cached blocks can only follow full blocks; "
                f"the sequence has {self.num_tokens} tokens (block size {self.block_size})"
            )
        self.block_ids.extend(block_ids)
        self.num_tokens += len(block_ids) * self.block_size

    def _needs_cow(self) -> bool:
        return bool(self.num_tokens % self.block_size) and (
            self.pool.ref_count(self.block_ids[-1]) > 1
        )

    def blocks_needed(self, n: int) -> int:
        """How many blocks `append_slots(n)` would allocate (including a copy-on-write)."""
        if n <= 0:
            return 0
        bs = self.block_size
        used = self.num_tokens % bs
        room = bs - used if used else 0
        new = -(-max(0, n - room) // bs)
        if self._needs_cow():
            new += 1
        return new

    def append_slots(self, n: int) -> AppendResult:
        """Reserve KV slots for `n` more tokens; all-or-nothing.

        Raises `NoFreeBlocks` and changes nothing when the pool cannot supply the
        blocks. The first write into a shared, partially filled last block
        allocates a private copy, reports it in `copies` and drops one ref on the
        shared block; a full shared block stays shared.
        """
        if n < 0:
            raise ValueError(f"cannot append a negative number of tokens ({n})")
        if n == 0:
            return AppendResult(slots=[])
        cow = self._needs_cow()
        new_blocks = self.pool.allocate(self.blocks_needed(n))
        copies: list[tuple[int, int]] = []
        if cow:
            src, dst = self.block_ids[-1], new_blocks.pop(0)
            self.block_ids[-1] = dst
            copies.append((src, dst))
            self.pool.free([src])
        self.block_ids.extend(new_blocks)
        bs = self.block_size
        ids = self.block_ids
        start = self.num_tokens
        slots = [ids[p // bs] * bs + p % bs for p in range(start, start + n)]
        self.num_tokens = start + n
        return AppendResult(slots=slots, copies=copies)

    def fork(self) -> BlockTable:
        """A child sequence that shares every block of this one (for n > 1 sampling)."""
        child = BlockTable(self.pool)
        self.pool.incref(self.block_ids)
        child.block_ids = list(self.block_ids)
        child.num_tokens = self.num_tokens
        return child

    def free(self) -> None:
        """Release every block, tail first (shared heads outlive private tails); empties the table."""
        self.pool.free(reversed(self.block_ids))
        self.block_ids = []
        self.num_tokens = 0
