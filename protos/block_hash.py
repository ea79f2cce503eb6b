"""Block hashing: the deterministic chained digest that names a KV block everywhere.

This function is part of the wire contract (package kvcp.v1), like the .proto files:
every agent, control plane and client computes it the same way, on any machine.

    digest(block i) = BLAKE2b-128(
        key    = none, person = b"kvcp.v1.block",
        data   = parent_digest                       (16 bytes; 16 zero bytes for block 0)
               || u32le(len(model_id)) || model_id   (UTF-8)
               || u32le(len(extra_keys)) || for each key: u32le(len(key)) || key (UTF-8)
               || u32le(block_size) || token ids of the block as u32le
    )

Only full blocks are hashed: a prompt of n tokens has n // block_size blocks. Digests
travel packed, BLOCK_HASH_BYTES each, back to back, in `bytes` fields. Python's `hash()`
is never used (it is salted per process). Blocks an engine reports with its own hashes
(vLLM KV events) are indexed under this digest of their tokens where the tokens decide
their KV (agent.core.vllm_events), and otherwise under the engine's hash, truncated or
zero-padded to 16 bytes (`external_block_hash`):

    int h (vLLM with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES, or older vLLM's Python ints)
        -> u64be(h mod 2**64) || 8 zero bytes        (negative ints wrap: -1 -> ff..ff)
    bytes h (vLLM's sha256 / sha256_cbor digests, 32 bytes)
        -> h[:16] when longer, h || zero bytes up to 16 when shorter

so a client that knows vLLM's block hashes looks them up by packing these 16-byte forms
(AdminService Lookup with block_hashes). Such hashes live in the same index as kvcp's
own digests; the two never collide in practice (different functions over 128 bits).

Every block's digest hashes the extra keys again (they follow its parent's digest, so no
hashing state can be shared between blocks): a prompt's hashing costs its blocks times
its extra keys' size. The keys, as hashed (each key's 4-byte length and UTF-8 bytes),
take at most MAX_EXTRA_KEYS_BYTES, as a prompt takes at most MAX_PROMPT_TOKENS.
"""

from __future__ import annotations

import hashlib
import numbers
import struct
from collections.abc import Iterable, Sequence

import numpy as np

BLOCK_HASH_BYTES = 16
# the most of one prompt a lookup or an engine call may name (a partial block after them aside)
MAX_PROMPT_BLOCKS = 1 << 16
MAX_PROMPT_TOKENS = 1 << 20
# the most bytes a prompt's extra keys take as hashed (room for ~60 multimodal hashes of 64
# hex digits): a prompt at MAX_PROMPT_TOKENS hashes in 0.77 s with keys at this cap, 0.24 s
# without (one 70,000-character key made a lookup at the cap take 12 s, 300,000 one 46 s)
MAX_EXTRA_KEYS_BYTES = 4096
ROOT_PARENT_HASH = bytes(BLOCK_HASH_BYTES)
_PERSON = b"kvcp.v1.block"
_MAX_TOKEN_ID = 2**32 - 1


def check_extra_keys(extra_keys) -> tuple[str, ...]:
    """Extra hash keys (a LoRA adapter, a multimodal input) as the strings hashed: ints
    (as vLLM's LoRA ids) are said in decimal, one string is one key (not its characters:
    "ab" hashed as ["a", "b"], another adapter's cache); anything else is a ValueError,
    as are keys past MAX_EXTRA_KEYS_BYTES (each block hashes them: see the module)."""
    if isinstance(extra_keys, str):
        out = [extra_keys]
    elif isinstance(extra_keys, bytes | bytearray):  # (its bytes would be taken for integer ids)
        raise ValueError("extra keys must be strings (or integer ids), got bytes")
    else:
        out = []
        for key in extra_keys:
            if isinstance(key, str):
                out.append(key)
            elif isinstance(key, numbers.Integral) and not isinstance(key, bool):
                out.append(str(int(key)))
            else:
                raise ValueError(f"extra keys must be strings (or integer ids), got {type(key).__name__}")
    size = sum(4 + len(key.encode()) for key in out)
    if size > MAX_EXTRA_KEYS_BYTES:
        raise ValueError(
            f"extra keys take at most {MAX_EXTRA_KEYS_BYTES} bytes as hashed (each key's UTF-8 and 4 bytes "
            f"of length), got {size}: every block's digest hashes them again"
        )
    return tuple(out)


def _header(model_id: str, extra_keys: Sequence[str]) -> bytes:
    extra_keys = check_extra_keys(extra_keys)
    parts = [struct.pack("<I", len(model_id.encode())), model_id.encode()]
    parts.append(struct.pack("<I", len(extra_keys)))
    for key in extra_keys:
        raw = key.encode()
        parts.append(struct.pack("<I", len(raw)))
        parts.append(raw)
    return b"".join(parts)


def token_array(token_ids: Iterable[int]) -> np.ndarray:
    """Token ids as a little-endian uint32 array; raises ValueError on a bad id."""
    if hasattr(token_ids, "tolist") and not isinstance(token_ids, np.ndarray):  # a torch tensor: at once
        token_ids = token_ids.tolist()
    arr = np.asarray(list(token_ids) if not isinstance(token_ids, np.ndarray) else token_ids)
    if arr.ndim == 2 and arr.shape[0] == 1:  # an engine's input_ids [1, T]: one prompt
        arr = arr[0]
    if arr.ndim != 1:  # (a [1, T] list of one tensor was one token; [B, T] rows hashed as blocks)
        raise ValueError(f"token ids must be one prompt: a sequence or [1, T], not shape {list(arr.shape)}")
    if arr.size == 0:
        return np.zeros(0, dtype="<u4")
    if arr.dtype.kind not in "iu":
        raise ValueError("token ids must be integers")
    if int(arr.min()) < 0 or int(arr.max()) > _MAX_TOKEN_ID:
        raise ValueError(f"token ids must be in [0, {_MAX_TOKEN_ID}]")
    return arr.astype("<u4", copy=False)


def hash_block(parent_hash: bytes, token_ids: Sequence[int], model_id: str, extra_keys: Sequence[str] = ()) -> bytes:
    """Digest of one block given its parent's digest (ROOT_PARENT_HASH for the first)."""
    tokens = token_array(token_ids)
    return _digest(parent_hash, _header(model_id, extra_keys), tokens)


def _digest(parent_hash: bytes, header: bytes, tokens: np.ndarray) -> bytes:
    if len(parent_hash) != BLOCK_HASH_BYTES:
        raise ValueError(f"parent hash must be {BLOCK_HASH_BYTES} bytes")
    h = hashlib.blake2b(digest_size=BLOCK_HASH_BYTES, person=_PERSON)
    h.update(parent_hash)
    h.update(header)
    h.update(struct.pack("<I", len(tokens)))
    h.update(tokens.tobytes())
    return h.digest()


def hash_prefix(
    model_id: str,
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    extra_keys: Sequence[str] = (),
) -> bytes:
    """Packed digests of the full blocks of `token_ids` (len = 16 * (n // block_size))."""
    return hash_chain(ROOT_PARENT_HASH, model_id, token_ids, block_size, extra_keys)


def hash_chain(
    parent_hash: bytes,
    model_id: str,
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    extra_keys: Sequence[str] = (),
) -> bytes:
    """Packed digests of the full blocks of `token_ids` following the block
    `parent_hash` (ROOT_PARENT_HASH: from the prompt's start)."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    tokens = token_array(token_ids)
    header = _header(model_id, extra_keys)
    parent = parent_hash
    out = bytearray()
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = _digest(parent, header, tokens[start : start + block_size])
        out += parent
    return bytes(out)


def split_hashes(packed: bytes) -> list[bytes]:
    """Packed digests -> list of 16-byte digests; ValueError when the length is wrong."""
    if len(packed) % BLOCK_HASH_BYTES:
        raise ValueError(f"packed block hashes must be a multiple of {BLOCK_HASH_BYTES} bytes, got {len(packed)}")
    return [packed[i : i + BLOCK_HASH_BYTES] for i in range(0, len(packed), BLOCK_HASH_BYTES)]


def parents_of(packed: bytes) -> bytes:
    """Packed parent digests of a packed chain (the first block's parent is the root)."""
    return ROOT_PARENT_HASH + packed[:-BLOCK_HASH_BYTES] if packed else b""


def external_block_hash(h: int | bytes | bytearray | memoryview) -> bytes:
    """An engine's own block hash as a 16-byte digest (see the module docstring);
    ValueError for any other type."""
    if isinstance(h, bool):
        raise ValueError("a block hash must be an int or bytes, not a bool")
    if isinstance(h, int):
        return (h & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "big") + bytes(8)
    if isinstance(h, bytes | bytearray | memoryview):
        raw = bytes(h)
        return raw[:BLOCK_HASH_BYTES] if len(raw) >= BLOCK_HASH_BYTES else raw + bytes(BLOCK_HASH_BYTES - len(raw))
    raise ValueError(f"a block hash must be an int or bytes, not {type(h).__name__}")


def check_prompt_size(num_tokens: int, block_size: int, per: str, field: str = "token_ids") -> None:
    """Refuse (InvalidArgument on `field`) a prompt of more full blocks than
    min(MAX_PROMPT_BLOCKS, MAX_PROMPT_TOKENS // block_size): hashing it would hold the
    caller's server up (a 20M-token one took 9 s). `per`: "lookup", "call", "pin"..."""
    from protos import errors

    most = min(MAX_PROMPT_BLOCKS, MAX_PROMPT_TOKENS // block_size)
    if num_tokens // block_size > most:
        raise errors.InvalidArgument(
            field,
            f"at most {most} blocks ({most * block_size} tokens, and a partial block after them) per {per}; "
            f"got {num_tokens} tokens",
        )
