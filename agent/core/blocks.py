"""A held block's record (`BlockMeta`) and the values the block pool answers with: what a
chain store, read or reservation did, tier usage, inventories, notices, move and cleanup
outcomes."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import NamedTuple

import torch
import xxhash

from protos.tier import Tier


@dataclass
class BlockMeta:
    block_hash: bytes
    parent_hash: bytes
    model_id: str
    num_bytes: int  # uncompressed
    tier: Tier
    handle: object
    codec: str = "none"
    stored_bytes: int = 0
    last_access: int = 0
    num_children: int = 0
    ref_count: int = 0
    pin_tier: int = 0  # local pin (set_pin): 0 none, else the slowest Tier value it may live in
    namespace: str = ""
    last_access_unix_seconds: float = 0.0
    ready: bool = True  # False while its bytes are first written: invisible to readers
    moving: bool = False
    corrupt: bool = False
    checksum: int = 0  # xxh3-64 of the stored payload, taken when it was made; 0: not known

    @property
    def visible(self) -> bool:
        return self.ready and not self.corrupt


class ChainStored(NamedTuple):
    """What insert_chain did: blocks it wrote, and leading blocks already held."""

    num_stored: int
    num_present: int


class ChainRead(NamedTuple):
    """read_chain's leading blocks, decoded, and the tier each was read from."""

    blocks: list[torch.Tensor]
    tiers: list[Tier]


class ChainReserved(NamedTuple):
    """reserve_chain's answer: the leading blocks held here (referenced: release_chain
    them) and the pages reserved for the rest, one handle a block, invisible until
    commit_reserved."""

    num_present: int
    present: list[BlockMeta]
    handles: list


class Inventory(NamedTuple):
    """A consistent snapshot of the held blocks and the journal seq it reflects."""

    seq: int
    groups: list[InventoryGroup]


class NamespaceUsage(NamedTuple):
    num_blocks: int
    uncompressed_bytes: int


@dataclass(frozen=True)
class TierUsage:
    tier: Tier
    capacity_bytes: int
    used_bytes: int
    num_blocks: int
    uncompressed_bytes: int = 0
    stored_bytes: int = 0
    # the room compression frees there: what the blocks would take raw minus what they
    # take, in the tier's own units (whole pages, disk granules); a payload a codec shrank
    # within its last page frees nothing
    saved_bytes: int = 0
    # recovered after a restart and waiting for their prefix to be stored again: their
    # bytes are in used_bytes, the blocks not in num_blocks (invisible until adopted)
    num_parked_blocks: int = 0
    # what the blocks themselves take in the tier's units: used_bytes less the pages
    # reserved for handoffs arriving and parked blocks (the control plane sizes blocks by it)
    blocks_used_bytes: int = 0


@dataclass(frozen=True)
class InventoryGroup:
    model_id: str
    tier: Tier
    block_hashes: bytes
    parent_hashes: bytes


@dataclass(frozen=True)
class Notice:
    """Something an operator should see (error events): kind is a short fixed word."""

    kind: str
    message: str
    unix_seconds: float


@dataclass(frozen=True)
class MoveOutcome:
    ok: bool
    moved_bytes: int = 0
    reason: str = ""
    pinned_tier: int = 0  # refused because a pin keeps the block at this tier or faster
    kept: bool = False  # a compress left it in its codec: the new one would free none of its room
    gone: bool = False  # not held (never, or evicted since it was named): nothing to move
    busy: bool = False  # another move had it then (a store making room, compaction, a promotion)


@dataclass(frozen=True)
class CleanupResult:
    freed: dict[Tier, tuple[int, int]]  # tier -> (blocks, bytes)
    num_skipped_pinned_blocks: int  # left in place: a pin holds them
    num_blocks: int


def payload_checksum(payload) -> int:
    """xxh3-64 of a block's stored bytes (a flat uint8 tensor or a list of them): taken
    once when the payload is made and carried with the block, so a move writes it to
    disk without hashing again and every disk read verifies the bytes end to end."""
    parts = payload if isinstance(payload, list) else [payload]
    if len(parts) == 1:
        return xxhash.xxh3_64_intdigest(parts[0].reshape(-1).numpy())
    h = xxhash.xxh3_64()
    for part in parts:
        h.update(part.reshape(-1).numpy())
    return h.intdigest()


def stored_as(meta: BlockMeta, codec: str, checksum: int) -> BlockMeta:
    """A copy of meta describing the block as a tier is about to store it (what a disk
    header records)."""
    out = copy.copy(meta)
    out.codec, out.checksum = codec, checksum
    return out


class PoolFull(Exception):
    """No room can be made (everything left is pinned, in use or moving)."""


class PastFillLimit(PoolFull):
    """Room could be made, but not within the fill limit asked for (a drain's blocks fill
    room without pushing out the agent's own)."""
