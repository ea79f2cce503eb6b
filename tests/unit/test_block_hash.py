"""Block hashing is wire contract: every process must compute the same digests, and a
change of the digest function must fail here loudly (the golden values)."""

from __future__ import annotations

import hashlib
import struct
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protos.block_hash import (
    BLOCK_HASH_BYTES,
    MAX_EXTRA_KEYS_BYTES,
    ROOT_PARENT_HASH,
    check_extra_keys,
    hash_block,
    hash_prefix,
    parents_of,
    split_hashes,
    token_array,
)

# hash_prefix("m", range(32), 16): two blocks, pinned when the contract was written.
GOLDEN_M_32_16 = "abd528944d86cd2258d0b5e9b586d42cc924913dcdaaca53f53042d41392532b"


def spec_digest(parent: bytes, model_id: str, extra_keys: tuple[str, ...], tokens: list[int]) -> bytes:
    """The digest as the module docstring specifies it, written independently."""
    data = bytearray(parent)
    data += struct.pack("<I", len(model_id.encode())) + model_id.encode()
    data += struct.pack("<I", len(extra_keys))
    for key in extra_keys:
        data += struct.pack("<I", len(key.encode())) + key.encode()
    data += struct.pack("<I", len(tokens))
    data += b"".join(struct.pack("<I", t) for t in tokens)
    return hashlib.blake2b(bytes(data), digest_size=16, person=b"kvcp.v1.block").digest()


def test_golden_value_is_pinned():
    assert hash_prefix("m", range(32), 16).hex() == GOLDEN_M_32_16


def test_golden_value_matches_the_documented_contract():
    first = spec_digest(ROOT_PARENT_HASH, "m", (), list(range(16)))
    second = spec_digest(first, "m", (), list(range(16, 32)))
    assert (first + second).hex() == GOLDEN_M_32_16


def test_documented_contract_with_extra_keys_and_unicode():
    tokens = [7, 2**32 - 1, 0, 12345]
    keys = ("lora:ä", "")
    expected = spec_digest(ROOT_PARENT_HASH, "modèle/x", keys, tokens)
    assert hash_prefix("modèle/x", tokens, 4, keys) == expected


def test_deterministic_within_a_process():
    tokens = list(range(100, 164))
    assert hash_prefix("llama", tokens, 16) == hash_prefix("llama", tokens, 16)
    assert hash_prefix("llama", tokens, 16) == hash_prefix("llama", np.array(tokens, dtype=np.int64), 16)
    assert hash_prefix("llama", tokens, 16) == hash_prefix("llama", tuple(tokens), 16)


def test_identical_across_processes():
    code = "from protos.block_hash import hash_prefix; print(hash_prefix('m', range(32), 16, ('k',)).hex())"
    outs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
        for _ in range(2)
    }
    assert outs == {hash_prefix("m", range(32), 16, ("k",)).hex()}


def test_model_id_changes_digest():
    assert hash_prefix("a", range(16), 16) != hash_prefix("b", range(16), 16)


def test_extra_keys_change_digest():
    base = hash_prefix("m", range(16), 16)
    assert hash_prefix("m", range(16), 16, ("lora1",)) != base
    assert hash_prefix("m", range(16), 16, ("lora1",)) != hash_prefix("m", range(16), 16, ("lora2",))
    # key boundaries are length-prefixed: ("ab",) is not ("a", "b")
    assert hash_prefix("m", range(16), 16, ("ab",)) != hash_prefix("m", range(16), 16, ("a", "b"))
    # an empty key is still a key
    assert hash_prefix("m", range(16), 16, ("",)) != base


def test_extra_keys_are_capped_as_hashed():
    """Every block hashes them again: their size, each key's UTF-8 and 4 bytes of length,
    is capped (one string is one key; many empty keys count too)."""
    at_cap = "k" * (MAX_EXTRA_KEYS_BYTES - 4)
    assert check_extra_keys([at_cap]) == (at_cap,) and check_extra_keys(at_cap) == (at_cap,)
    assert len(check_extra_keys([""] * (MAX_EXTRA_KEYS_BYTES // 4))) == MAX_EXTRA_KEYS_BYTES // 4
    assert len(hash_prefix("m", range(32), 16, (at_cap,))) == 2 * BLOCK_HASH_BYTES
    for over in ([at_cap + "k"], at_cap + "k", [at_cap[:-1] + "ä"], [""] * (MAX_EXTRA_KEYS_BYTES // 4 + 1)):
        with pytest.raises(ValueError, match=str(MAX_EXTRA_KEYS_BYTES)):
            check_extra_keys(over)
        with pytest.raises(ValueError, match=str(MAX_EXTRA_KEYS_BYTES)):
            hash_prefix("m", range(32), 16, over)


def test_parent_changes_digest():
    other_parent = b"\x01" * BLOCK_HASH_BYTES
    assert hash_block(ROOT_PARENT_HASH, range(4), "m") != hash_block(other_parent, range(4), "m")


@pytest.mark.parametrize("position", [0, 7, 15])
def test_one_token_changes_its_block_and_every_later_one(position):
    tokens = list(range(48))
    changed = list(tokens)
    changed[position] += 1
    a = split_hashes(hash_prefix("m", tokens, 16))
    b = split_hashes(hash_prefix("m", changed, 16))
    assert all(x != y for x, y in zip(a, b, strict=True))  # the change is in block 0


def test_token_in_a_later_block_keeps_earlier_digests():
    tokens = list(range(48))
    changed = list(tokens)
    changed[40] = 999
    a = split_hashes(hash_prefix("m", tokens, 16))
    b = split_hashes(hash_prefix("m", changed, 16))
    assert a[:2] == b[:2]
    assert a[2] != b[2]


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 31, 32, 33, 100])
@pytest.mark.parametrize("block_size", [1, 16, 7])
def test_only_full_blocks_are_hashed(n, block_size):
    out = hash_prefix("m", range(n), block_size)
    assert len(out) == BLOCK_HASH_BYTES * (n // block_size)


def test_partial_trailing_block_is_ignored():
    assert hash_prefix("m", range(40), 16) == hash_prefix("m", range(32), 16)


@pytest.mark.parametrize("block_size", [0, -1])
def test_block_size_must_be_positive(block_size):
    with pytest.raises(ValueError, match="block_size"):
        hash_prefix("m", range(16), block_size)


def test_split_hashes_roundtrip():
    packed = hash_prefix("m", range(64), 16)
    parts = split_hashes(packed)
    assert len(parts) == 4
    assert all(len(p) == BLOCK_HASH_BYTES for p in parts)
    assert b"".join(parts) == packed
    assert split_hashes(b"") == []


@pytest.mark.parametrize("length", [1, 15, 17, 31, 33])
def test_split_hashes_rejects_wrong_lengths(length):
    with pytest.raises(ValueError, match="multiple of 16"):
        split_hashes(b"\x00" * length)


def test_parents_of():
    packed = hash_prefix("m", range(48), 16)
    hs = split_hashes(packed)
    assert split_hashes(parents_of(packed)) == [ROOT_PARENT_HASH, hs[0], hs[1]]
    assert parents_of(b"") == b""


@pytest.mark.parametrize(
    "tokens",
    [[-1], [2**32], [0, 1, 2**40], [1.5, 2.0], ["1", "2"], [None], [2**70]],
    ids=["negative", "2^32", "huge", "float", "str", "none", "bigint"],
)
def test_bad_token_ids_raise_value_error(tokens):
    with pytest.raises(ValueError):
        hash_prefix("m", tokens, 1)
    with pytest.raises(ValueError):
        hash_block(ROOT_PARENT_HASH, tokens, "m")


def test_bad_numpy_token_ids_raise_value_error():
    with pytest.raises(ValueError):
        hash_prefix("m", np.array([1.0, 2.0]), 1)
    with pytest.raises(ValueError):
        hash_prefix("m", np.array([-3, 4], dtype=np.int32), 1)


def test_token_array_bounds():
    assert token_array([0, 2**32 - 1]).tolist() == [0, 2**32 - 1]
    assert token_array([]).dtype == np.dtype("<u4")


def test_parent_hash_length_checked():
    with pytest.raises(ValueError, match="16 bytes"):
        hash_block(b"short", range(4), "m")


def test_hash_prefix_equals_iterated_hash_block():
    tokens = list(range(1000, 1080))
    parent = ROOT_PARENT_HASH
    chain = b""
    for start in range(0, 80, 16):
        parent = hash_block(parent, tokens[start : start + 16], "m", ("x",))
        chain += parent
    assert hash_prefix("m", tokens, 16, ("x",)) == chain


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=80),
    block_size=st.integers(1, 9),
    k=st.integers(0, 12),
    model_id=st.text(max_size=5),
)
def test_prefix_property(tokens, block_size, k, model_id):
    full = hash_prefix(model_id, tokens, block_size)
    part = hash_prefix(model_id, tokens[: k * block_size], block_size)
    assert full.startswith(part)
    assert len(part) == BLOCK_HASH_BYTES * min(k, len(tokens) // block_size)
