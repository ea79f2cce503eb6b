"""The agent's block pool: which blocks it holds, in which tier, and which go first
when a tier is full. Bytes live in tier stores (agent.store); this module only decides.

Invariants (checked by tests):
- a block's parent is held on this agent whenever the block is (any tier): held
  blocks form a forest of prefixes, so a lookup walk never skips a hole;
- `num_children` of a block is the number of held blocks whose parent it is;
- a block with `ref_count > 0` (being read or written) is never freed or moved;
- a pinned block (hook for control-plane pins) is never dropped.

Access recency is a logical clock. Every access touches a chain from its deepest block
up to the root, deepest first, so a parent is always more recent than its children and
the least recently used block of a tier is a leaf: LRU evicts leaves before parents.
"""

from __future__ import annotations

import heapq
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from agent.core.journal import REMOVED, STORED, EventBatch, EventJournal
from protos.block_hash import ROOT_PARENT_HASH
from protos.tier import Tier


class TierStore(Protocol):
    """Fixed-size slots of one tier (implemented in agent.store)."""

    tier: Tier
    slot_bytes: int
    num_slots: int

    def allocate(self) -> int | None: ...
    def free(self, slot: int) -> None: ...
    def write(self, slot: int, data) -> None: ...
    def read(self, slot: int, num_bytes: int): ...
    @property
    def num_free(self) -> int: ...


@dataclass
class BlockMeta:
    block_hash: bytes
    parent_hash: bytes
    model_id: str
    num_bytes: int
    tier: Tier
    slot: int
    last_access: int = 0
    num_children: int = 0
    ref_count: int = 0
    pinned: bool = False
    ready: bool = True  # False while its bytes are being written: invisible to readers


@dataclass(frozen=True)
class TierUsage:
    tier: Tier
    capacity_bytes: int
    used_bytes: int
    num_blocks: int


@dataclass(frozen=True)
class InventoryGroup:
    model_id: str
    tier: Tier
    block_hashes: bytes
    parent_hashes: bytes


class PoolFull(Exception):
    """No slot can be freed (everything left is pinned or in use)."""


class BlockPool:
    def __init__(self, tiers: Sequence[TierStore], journal: EventJournal | None = None):
        if not tiers:
            raise ValueError("a block pool needs at least one tier")
        self.tiers = sorted(tiers, key=lambda t: int(t.tier))  # fastest first
        self._tier_by_kind = {t.tier: t for t in self.tiers}
        self.journal = journal or EventJournal()
        self.lock = threading.RLock()
        self.blocks: dict[bytes, BlockMeta] = {}
        self._clock = 0
        self._lru: dict[Tier, list[tuple[int, bytes]]] = {t.tier: [] for t in self.tiers}
        self._count: dict[Tier, int] = {t.tier: 0 for t in self.tiers}
        self.evictions_total = 0
        self.demotions_total = 0

    # ---- queries --------------------------------------------------------------------
    def num_leading(self, block_hashes: Sequence[bytes]) -> int:
        """How many leading blocks of the chain are held (no side effects)."""
        with self.lock:
            n = 0
            for h in block_hashes:
                meta = self.blocks.get(h)
                if meta is None or not meta.ready:
                    break
                n += 1
            return n

    def touch(self, block_hashes: Sequence[bytes]) -> None:
        """Mark a held chain as used now (deepest first: parents end up most recent)."""
        with self.lock:
            for h in reversed(block_hashes):
                meta = self.blocks.get(h)
                if meta is not None:
                    self._touch(meta)

    def usage(self) -> list[TierUsage]:
        with self.lock:
            return [
                TierUsage(
                    t.tier,
                    t.num_slots * t.slot_bytes,
                    (t.num_slots - t.num_free) * t.slot_bytes,
                    self._count[t.tier],
                )
                for t in self.tiers
            ]

    # ---- writes ---------------------------------------------------------------------
    def insert_chain(
        self,
        model_id: str,
        block_hashes: Sequence[bytes],
        num_bytes: int,
        write: Callable[[int, TierStore, int], None],
    ) -> tuple[int, int]:
        """Store the chain's missing blocks into the fastest tier, evicting as needed.

        `write(i, store, slot)` copies block i's bytes into the slot. Blocks are stored
        in order and stop at the first that cannot be (a missing parent, or no room):
        the held set stays a forest of prefixes. Returns (num_stored, num_present)."""
        stored = present = 0
        top = self.tiers[0]
        held: list[BlockMeta] = []
        try:
            parent = ROOT_PARENT_HASH
            for i, h in enumerate(block_hashes):
                with self.lock:
                    meta = self.blocks.get(h)
                    if meta is not None:
                        if not meta.ready:
                            break  # another writer is storing it; its chain continues there
                        meta.ref_count += 1
                        held.append(meta)
                        present += 1
                        parent = h
                        continue
                    if parent != ROOT_PARENT_HASH and parent not in self.blocks:
                        break
                    try:
                        slot = self._allocate(top)
                    except PoolFull:
                        break
                    # reserve the hash now, visible to readers only once written
                    meta = BlockMeta(h, parent, model_id, num_bytes, top.tier, slot, ref_count=1, ready=False)
                    self.blocks[h] = meta
                    self._count[top.tier] += 1
                    held.append(meta)
                write(i, top, slot)
                with self.lock:
                    meta.ready = True
                    if parent in self.blocks:
                        self.blocks[parent].num_children += 1
                    self.journal.record(STORED, model_id, top.tier, h, parent)
                stored += 1
                parent = h
        finally:
            with self.lock:
                for meta in held:
                    meta.ref_count -= 1
                for meta in reversed(held):
                    if not meta.ready and meta.ref_count == 0:  # a write failed: undo it
                        del self.blocks[meta.block_hash]
                        self._tier_by_kind[meta.tier].free(meta.slot)
                        self._count[meta.tier] -= 1
                self.touch([m.block_hash for m in held if m.ready])
        return stored, present

    def acquire_chain(self, block_hashes: Sequence[bytes]) -> list[BlockMeta]:
        """Pin the held leading blocks for reading (ref_count + 1); release when done."""
        with self.lock:
            out = []
            for h in block_hashes:
                meta = self.blocks.get(h)
                if meta is None or not meta.ready:
                    break
                meta.ref_count += 1
                out.append(meta)
            return out

    def release_chain(self, metas: Sequence[BlockMeta]) -> None:
        with self.lock:
            for meta in metas:
                meta.ref_count -= 1
            self.touch([m.block_hash for m in metas])

    def read(self, meta: BlockMeta):
        """Copy of a block's bytes; the caller holds a reference (acquire_chain)."""
        return self._tier_by_kind[meta.tier].read(meta.slot, meta.num_bytes)

    def set_pinned(self, block_hashes: Sequence[bytes], pinned: bool) -> int:
        with self.lock:
            n = 0
            for h in block_hashes:
                meta = self.blocks.get(h)
                if meta is not None:
                    meta.pinned = pinned
                    n += 1
            return n

    def drop(self, block_hash: bytes) -> bool:
        """Remove one block and, first, every held descendant of it (keeps the forest)."""
        with self.lock:
            meta = self.blocks.get(block_hash)
            if meta is None or meta.ref_count > 0:
                return False
            if meta.num_children:
                for child in [m for m in self.blocks.values() if m.parent_hash == block_hash]:
                    if not self.drop(child.block_hash):
                        return False
            self._free(meta)
            return True

    # ---- inventory ------------------------------------------------------------------
    def inventory(self) -> tuple[int, list[InventoryGroup]]:
        """A consistent snapshot with the seq it reflects; pending events are superseded."""
        with self.lock:
            seq = self.journal.reset()
            acc: dict[tuple[str, Tier], tuple[bytearray, bytearray]] = {}
            for meta in self.blocks.values():
                if not meta.ready:
                    continue  # reported by its STORED event once written
                hs, ps = acc.setdefault((meta.model_id, meta.tier), (bytearray(), bytearray()))
                hs += meta.block_hash
                ps += meta.parent_hash
            return seq, [InventoryGroup(m, t, bytes(h), bytes(p)) for (m, t), (h, p) in acc.items()]

    def drain_events(self, max_blocks: int = 8192) -> list[EventBatch]:
        with self.lock:
            return self.journal.drain(max_blocks)

    # ---- internals ------------------------------------------------------------------
    def _touch(self, meta: BlockMeta) -> None:
        self._clock += 1
        meta.last_access = self._clock
        heap = self._lru[meta.tier]
        heapq.heappush(heap, (self._clock, meta.block_hash))
        if len(heap) > 4 * max(self._count[meta.tier], 1024):
            self._rebuild_lru(meta.tier)

    def _rebuild_lru(self, tier: Tier) -> None:
        heap = [(m.last_access, m.block_hash) for m in self.blocks.values() if m.tier == tier]
        heapq.heapify(heap)
        self._lru[tier] = heap

    def _allocate(self, store: TierStore) -> int:
        slot = store.allocate()
        while slot is None:
            self._make_room(store)
            slot = store.allocate()
        return slot

    def _victim(self, tier: Tier, must_be_leaf: bool) -> BlockMeta | None:
        heap = self._lru[tier]
        skipped = []
        victim = None
        while heap:
            tick, h = heapq.heappop(heap)
            meta = self.blocks.get(h)
            if meta is None or meta.tier != tier or meta.last_access != tick:
                continue  # stale entry
            if meta.ref_count or meta.pinned or not meta.ready or (must_be_leaf and meta.num_children):
                skipped.append((tick, h))
                continue
            victim = meta
            skipped.append((tick, h))
            break
        for item in skipped:
            heapq.heappush(heap, item)
        return victim

    def _make_room(self, store: TierStore) -> None:
        """Free one slot of `store`: demote its LRU block to the next tier, or drop an
        LRU leaf when this is the last tier. Raises PoolFull when nothing can go."""
        i = self.tiers.index(store)
        lower = self.tiers[i + 1] if i + 1 < len(self.tiers) else None
        if lower is not None:
            meta = self._victim(store.tier, must_be_leaf=False)
            if meta is not None:
                self._demote(meta, store, lower)
                return
        meta = self._victim(store.tier, must_be_leaf=True)
        if meta is None:
            raise PoolFull(f"tier {store.tier.label} is full of pinned or in-use blocks")
        self._free(meta)
        self.evictions_total += 1

    def _demote(self, meta: BlockMeta, src: TierStore, dst: TierStore) -> None:
        slot = self._allocate(dst)
        dst.write(slot, src.read(meta.slot, meta.num_bytes))  # copy, then switch, then free
        src.free(meta.slot)
        self._count[src.tier] -= 1
        self._count[dst.tier] += 1
        meta.tier, meta.slot = dst.tier, slot
        heapq.heappush(self._lru[dst.tier], (meta.last_access, meta.block_hash))
        self.demotions_total += 1
        self.journal.record(STORED, meta.model_id, dst.tier, meta.block_hash, meta.parent_hash)

    def _free(self, meta: BlockMeta) -> None:
        del self.blocks[meta.block_hash]
        self._tier_by_kind[meta.tier].free(meta.slot)
        self._count[meta.tier] -= 1
        parent = self.blocks.get(meta.parent_hash)
        if parent is not None:
            parent.num_children -= 1
        self.journal.record(REMOVED, meta.model_id, meta.tier, meta.block_hash, meta.parent_hash)
