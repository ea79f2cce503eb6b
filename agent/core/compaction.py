"""Compaction of the disk tier's free space, as the block pool drives it: when an extent
finds no free run although the tier's bytes have room (blocks of mixed sizes freed out
of order leave holes), the blocks inside one window of the slab move to lower free runs
and the window becomes one run. The store chooses the window and copies the bytes
(agent.store.disk_tier); the pool says which blocks may move and switches each to its
new extent, with a move's guarantee: copy, verify, make durable, switch, then free the
old extent through the dead log, so that a restart finds the block exactly once.

Two callers. An allocation that fails for fragmentation (`_compact_for`, the pool lock
held) relocates at once, bounded by a few times the extent it needs, the blocks nobody
reads (the lock keeps new readers out meanwhile). `compact_disk` runs in the background
while the longest free run is shorter than the biggest block the tier holds: it marks
its blocks moving, copies them without the lock, and switches each once no reader holds
it (a reader keeps the old extent, which stays intact until then); one that stays read
keeps its old place and its new extent is freed.

`DiskCompaction` is mixed into `agent.core.block_pool.BlockPool`, whose state and lock
it uses (declared below)."""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from agent.core.blocks import BlockMeta
from agent.core.tier_store import BlockUnreadable, CompactingStore, TierStore, is_compacting

log = logging.getLogger(__name__)

COMPACT_MIN_BYTES = 1 << 20  # an allocation's compaction may move this much, or ...
COMPACT_FACTOR = 4  # ... this many times the extent it needs, if more
COMPACT_TRIES_PER_ALLOCATION = 4
COMPACT_STEP_BYTES = 8 << 20  # a background step moves at most this much
READER_WAIT_SECONDS = 0.5  # a background switch waits this long for a block's readers
# a background step that found no window to empty waits before it plans again, twice as
# long after each such step, up to this (a plan walks every free run under the lock)
COMPACT_BACKOFF_MAX_SECONDS = 64.0
# an allocation whose plan found no window lets the allocations of this long after it
# evict as they would without planning: in a tier kept full by evictions the holes are
# mostly too small for the blocks a window would move, and a failed plan costs ~1 ms under
# the pool's lock (scripts/disk_fragmentation.py: 2,474 plans for 12 compactions in 3,000
# requests without it)
ALLOCATION_PLAN_BACKOFF_SECONDS = 0.25


class DiskCompaction:
    """Compaction of a file tier (see the module docstring); mixed into BlockPool."""

    # the pool's state compaction uses (agent.core.block_pool.BlockPool sets it)
    lock: threading.RLock
    blocks: dict[bytes, BlockMeta]
    tiers: list[TierStore]
    _compact_backoff: float = 0.0  # seconds the background step waits after a plan found nothing
    _compact_retry_at: float = 0.0  # monotonic: no background plan before it
    _allocation_plan_at: float = 0.0  # monotonic: no allocation's plan before it

    if TYPE_CHECKING:  # the pool's own methods compaction calls (BlockPool defines them)

        def _drop_corrupt(self) -> None: ...
        def _mark_corrupt(self, meta: BlockMeta, why: str) -> None: ...
        def _notice(self, kind: str, message: str) -> None: ...

    def _movable_in(self, store: CompactingStore):
        """Whether the block an extent of `store` was taken for may be relocated now: held
        there at that offset, written and intact, neither read nor moving (lock held)."""
        tier = store.tier

        def movable(block_hash: bytes, offset: int) -> bool:
            meta = self.blocks.get(block_hash)
            return (
                meta is not None
                and meta.tier is tier
                and getattr(meta.handle, "offset", None) == offset
                and bool(getattr(meta.handle, "seq", 0))
                and meta.visible
                and not meta.ref_count
                and not meta.moving
            )

        return movable

    def _compact_for(self, store: TierStore, num_bytes: int) -> bool:
        """An allocation of `num_bytes` in `store` failed: when the tier's bytes have room
        but no free run is long enough, empty a window for it by relocating the blocks in
        it. True when every block of the window moved (the allocation fits now). The lock
        is held, and held across the copies: they are bounded by COMPACT_FACTOR times the
        extent needed, as a demotion's write under it is by one block."""
        if not is_compacting(store):
            return False
        need = store.footprint(num_bytes)
        if time.monotonic() < self._allocation_plan_at or not store.fragmented(need):
            return False
        limit = max(COMPACT_FACTOR * need, COMPACT_MIN_BYTES)
        plan = store.plan_compaction(need, self._movable_in(store), limit)
        if plan is None:
            self._allocation_plan_at = time.monotonic() + ALLOCATION_PLAN_BACKOFF_SECONDS
            return False
        done: list = []
        try:
            metas = [self.blocks[move.block_hash] for move in plan.moves]
            copied = self._copy_moves(store, plan, metas)
            done = self._switch_relocated(store, copied)
        finally:
            # the blocks found corrupt stay (invisible) until a later step drops them: the
            # allocation's caller may hold one of their descendants, a block it is demoting
            self._settle_plan(store, plan, done, drop_corrupt=False)
        return len(done) == len(plan.moves)

    def compact_disk(self, max_move_bytes: int = COMPACT_STEP_BYTES) -> int:
        """One bounded background step: when the longest free run of a file tier is
        shorter than the biggest extent it was asked for while its free bytes are not,
        relocate the blocks of one window (at most `max_move_bytes`) without holding the
        lock across the copies. Returns the bytes relocated (0: nothing to do, or nothing
        could move)."""
        store = next((t for t in self.tiers if is_compacting(t)), None)
        if store is None:
            return 0
        need = store.largest_footprint_bytes
        if not need or time.monotonic() < self._compact_retry_at or not store.fragmented(need):
            return 0
        with self.lock:
            plan = store.plan_compaction(need, self._movable_in(store), max_move_bytes)
            if plan is None:  # no window qualifies (its blocks read, parked, too big to move): not again at once
                self._compact_backoff = min(max(2 * self._compact_backoff, 1.0), COMPACT_BACKOFF_MAX_SECONDS)
                self._compact_retry_at = time.monotonic() + self._compact_backoff
                return 0
            self._compact_backoff = self._compact_retry_at = 0.0
            metas = [self.blocks[move.block_hash] for move in plan.moves]
            for meta in metas:
                meta.moving = True  # neither dropped, evicted nor moved meanwhile; readers still read it
        done: list = []
        try:
            copied = self._copy_moves(store, plan, metas)
            done = self._switch_relocated(store, copied, wait_seconds=READER_WAIT_SECONDS)
        finally:
            with self.lock:
                for meta in metas:
                    meta.moving = False
            self._settle_plan(store, plan, done)
        return sum(move.new.footprint_bytes for move in done)

    def _settle_plan(self, store: CompactingStore, plan, done: list, drop_corrupt: bool = True) -> None:
        """Free the new extent of every move not switched (no block points at it: one never
        written has its magic cleared, a copy gets its dead record), give the window back
        and (`drop_corrupt`) drop the blocks found corrupt, here or elsewhere, that may go."""
        switched = {id(move) for move in done}
        for move in plan.moves:
            if id(move) not in switched:
                store.free(move.new)
        store.finish_compaction(plan, done)
        if drop_corrupt:
            with self.lock:
                self._drop_corrupt()

    def _copy_moves(self, store: CompactingStore, plan, metas: list[BlockMeta]) -> list:
        """The (move, block) pairs of the plan whose block was copied to its new extent."""
        return [(move, meta) for move, meta in zip(plan.moves, metas, strict=True) if self._copy(store, meta, move)]

    def _copy(self, store: CompactingStore, meta: BlockMeta, move) -> bool:
        """Copy one block to its new extent (the caller frees it when this fails); a block
        whose old copy is unreadable is marked corrupt."""
        try:
            store.copy_extent(meta.handle, move.new)
            return True
        except BlockUnreadable as exc:
            self._mark_corrupt(meta, str(exc))
        except OSError as exc:
            self._notice("write_error", f"relocating a block in the {store.tier.label} tier failed: {exc}")
        return False

    def _switch_relocated(self, store: CompactingStore, copied: list, wait_seconds: float = 0.0) -> list:
        """Make the copies durable, then point each block at its new extent and free the
        old one (its dead record follows the copy to the disk), once no reader holds it:
        waiting up to `wait_seconds` (the lock let go meanwhile). Returns the moves
        switched; the caller frees the new extents of the others."""
        if not copied:
            return []
        try:
            store.sync()
        except OSError as exc:  # not durable: no old copy may go
            self._notice("write_error", f"relocating blocks in the {store.tier.label} tier failed: {exc}")
            return []
        done = []
        pending = list(copied)
        deadline = time.monotonic() + wait_seconds
        while True:
            with self.lock:
                waiting = []
                for move, meta in pending:
                    held = self.blocks.get(meta.block_hash)
                    if held is None or held is not meta or meta.tier is not store.tier or meta.corrupt:
                        continue
                    if meta.ref_count:  # a reader holds the old extent: it stays until the reader is done
                        waiting.append((move, meta))
                        continue
                    old, meta.handle = meta.handle, move.new
                    store.free(old)
                    done.append(move)
            if not waiting or time.monotonic() >= deadline:
                return done
            pending = waiting
            time.sleep(0.002)
