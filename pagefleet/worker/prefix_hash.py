"""Chained prefix hashes of full KV blocks.

A block's hash is `H(parent_hash, token_ids_of_block, extra)` with BLAKE2b-256
over a canonical byte encoding (length-prefixed fields, little-endian int64
token ids), so it is stable across processes and machines. Python's `hash()` is
never used: it is salted per process and not collision resistant.

`extra` carries anything besides the tokens that changes the block's KV: the
tenant salt (first block only; later blocks inherit it through the parent
chain) and the adapter id (every block). Only full blocks are hashed.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

HASH_BYTES = 32
_PERSON = b"pagefleet-kv-v1"  # domain separation from any other BLAKE2b use


def _field(data: bytes | None) -> bytes:
    # Presence flag + length prefix: None, b"" and any other value encode differently.
    if data is None:
        return b"\x00"
    return b"\x01" + struct.pack("<I", len(data)) + data


def hash_block(parent: bytes | None, token_ids: Sequence[int], extra: bytes | None = None) -> bytes:
    """The 32-byte hash of one block given its parent's hash (None for the first block)."""
    n = len(token_ids)
    data = _field(parent) + struct.pack(f"<I{n}q", n, *token_ids) + _field(extra)
    return hashlib.blake2b(data, digest_size=HASH_BYTES, person=_PERSON).digest()


def _as_bytes(value: str | bytes) -> bytes:
    return value.encode("utf-8") if isinstance(value, str) else bytes(value)


def block_extra(*, salt: str | bytes | None = None, adapter_id: str | None = None) -> bytes | None:
    """The canonical `extra` bytes for a block with this salt and adapter (None if neither)."""
    if salt is None and adapter_id is None:
        return None
    return (
        b"salt"
        + _field(None if salt is None else _as_bytes(salt))
        + b"adapter"
        + _field(None if adapter_id is None else _as_bytes(adapter_id))
    )


def extend_block_hashes(
    hashes: Sequence[bytes],
    token_ids: Sequence[int],
    block_size: int,
    *,
    salt: str | bytes | None = None,
    adapter_id: str | None = None,
) -> list[bytes]:
    """Hashes of the full blocks of `token_ids` beyond the `len(hashes)` already known.

    For hashing incrementally as a sequence grows: `hashes` are the sequence's
    existing chained hashes (computed with the same salt and adapter); the new
    ones are returned, not appended.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    start = len(hashes)
    full = len(token_ids) // block_size
    if full <= start:
        return []
    parent = hashes[-1] if hashes else None
    rest_extra = block_extra(adapter_id=adapter_id)
    out: list[bytes] = []
    for i in range(start, full):
        extra = block_extra(salt=salt, adapter_id=adapter_id) if i == 0 else rest_extra
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], extra)
        out.append(parent)
    return out


def hash_token_blocks(
    token_ids: Sequence[int],
    block_size: int,
    *,
    salt: str | bytes | None = None,
    adapter_id: str | None = None,
) -> list[bytes]:
    """Chained hashes of every full block of `token_ids` (a trailing partial block is skipped).

    The tenant `salt` goes into the first block's extra, the adapter id into every
    block's, so equal tokens under different salts or adapters never share a hash.
    """
    return extend_block_hashes([], token_ids, block_size, salt=salt, adapter_id=adapter_id)
