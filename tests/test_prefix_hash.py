"""Chained block hashes: deterministic, collision resistant, salted per tenant."""

from __future__ import annotations

import hashlib
import struct
import subprocess
import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from pagefleet.worker.prefix_hash import (
    extend_block_hashes,
    hash_block,
    hash_token_blocks,
)

TOKENS = list(range(100, 164))  # 4 blocks of 16


def test_hash_is_32_bytes_and_deterministic() -> None:
    first = hash_block(None, [1, 2, 3])
    assert len(first) == 32
    assert first == hash_block(None, [1, 2, 3])


def test_hash_changes_when_any_token_changes() -> None:
    base = hash_block(None, TOKENS[:16])
    for i in range(16):
        changed = list(TOKENS[:16])
        changed[i] += 1
        assert hash_block(None, changed) != base


def test_hash_depends_on_parent() -> None:
    parent_a = hash_block(None, [1])
    parent_b = hash_block(None, [2])
    assert hash_block(parent_a, [5, 6]) != hash_block(parent_b, [5, 6])
    assert hash_block(parent_a, [5, 6]) != hash_block(None, [5, 6])


def test_no_extra_and_empty_extra_differ() -> None:
    assert hash_block(None, [1], None) != hash_block(None, [1], b"")


@settings(max_examples=200, deadline=None)
@given(
    a=st.tuples(
        st.one_of(st.none(), st.binary(max_size=4)),
        st.lists(st.integers(0, 2**31), max_size=4),
        st.one_of(st.none(), st.binary(max_size=4)),
    ),
    b=st.tuples(
        st.one_of(st.none(), st.binary(max_size=4)),
        st.lists(st.integers(0, 2**31), max_size=4),
        st.one_of(st.none(), st.binary(max_size=4)),
    ),
)
def test_distinct_inputs_give_distinct_hashes(
    a: tuple[bytes | None, list[int], bytes | None],
    b: tuple[bytes | None, list[int], bytes | None],
) -> None:
    # The encoding is length-prefixed, so moving bytes between fields cannot collide.
    if a != b:
        assert hash_block(*a) != hash_block(*b)


def test_only_full_blocks_are_hashed() -> None:
    assert len(hash_token_blocks(TOKENS[:47], 16)) == 2
    assert len(hash_token_blocks(TOKENS[:48], 16)) == 3
    assert hash_token_blocks(TOKENS[:15], 16) == []


def test_chain_matches_hash_block_applied_block_by_block() -> None:
    chain = hash_token_blocks(TOKENS, 16)
    parent = None
    for i, h in enumerate(chain):
        parent = hash_block(parent, TOKENS[i * 16 : (i + 1) * 16])
        assert h == parent


def test_shared_prefix_gives_shared_leading_hashes() -> None:
    other = TOKENS[:32] + [7] * 32
    a, b = hash_token_blocks(TOKENS, 16), hash_token_blocks(other, 16)
    assert a[:2] == b[:2]
    assert a[2] != b[2] and a[3] != b[3]


def test_same_salt_gives_same_hashes() -> None:
    assert hash_token_blocks(TOKENS, 16, salt="tenant-a") == hash_token_blocks(
        TOKENS, 16, salt="tenant-a"
    )


def test_different_salts_never_share_any_block() -> None:
    a = hash_token_blocks(TOKENS, 16, salt="tenant-a")
    b = hash_token_blocks(TOKENS, 16, salt="tenant-b")
    unsalted = hash_token_blocks(TOKENS, 16)
    assert not set(a) & set(b)
    assert not set(a) & set(unsalted)


def test_salt_as_str_or_utf8_bytes_is_the_same_salt() -> None:
    assert hash_token_blocks(TOKENS, 16, salt="é") == hash_token_blocks(
        TOKENS, 16, salt="é".encode()
    )


def test_adapter_id_changes_every_block() -> None:
    plain = hash_token_blocks(TOKENS, 16)
    lora = hash_token_blocks(TOKENS, 16, adapter_id="lora-1")
    assert all(p != q for p, q in zip(plain, lora, strict=True))
    assert lora == hash_token_blocks(TOKENS, 16, adapter_id="lora-1")


def test_incremental_extension_equals_hashing_everything() -> None:
    hashes: list[bytes] = []
    for end in [*range(0, len(TOKENS), 5), len(TOKENS)]:  # grow a few tokens at a time
        hashes += extend_block_hashes(hashes, TOKENS[:end], 16, salt="t", adapter_id="x")
    assert hashes == hash_token_blocks(TOKENS, 16, salt="t", adapter_id="x")


def test_hashes_are_equal_across_processes_with_different_hash_seeds() -> None:
    code = (
        "from pagefleet.worker.prefix_hash import hash_token_blocks;"
        "print(hash_token_blocks(list(range(100, 164)), 16, salt='s')[-1].hex())"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={"PYTHONHASHSEED": seed, "PYTHONPATH": ":".join(sys.path)},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert outs == {hash_token_blocks(TOKENS, 16, salt="s")[-1].hex()}


def test_encoding_is_the_documented_one() -> None:
    # Workers and routers of different releases must agree on hashes: a change of
    # the encoding must be deliberate (and this value updated with it).
    chain = hash_token_blocks(list(range(100, 132)), 16, salt="tenant-a", adapter_id="lora")
    assert chain[-1].hex() == "6dbf902e187c2244bb25b6603a65937a64af333c50507d37a979bf2b97606894"
    payload = b"\x00" + struct.pack("<I16q", 16, *range(16)) + b"\x00"
    expected = hashlib.blake2b(payload, digest_size=32, person=b"pagefleet-kv-v1").digest()
    assert hash_block(None, list(range(16))) == expected
