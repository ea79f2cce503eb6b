"""The agent's block pool: which blocks it holds, in which tier and codec, and which go
first when a tier is full. Bytes live in tier stores (agent.store); this module decides.

Invariants (checked by tests):
- a block's parent is held on this agent whenever the block is (any tier): held
  blocks form a forest of prefixes, so a lookup walk never skips a hole;
- `num_children` of a block is the number of held blocks whose parent it is;
- a block with `ref_count > 0` (being read) is never freed, and a move switches it to
  its new place only once no reader holds it; a block that is `moving` is neither
  evicted nor dropped, and its source stays intact until the copy is written;
- a pinned block is never dropped, and never demoted below its pin's tier.

Access recency is a logical clock. Every access touches a chain from its deepest block
up to the root, deepest first, so a parent is always more recent than its children and
the least recently used block of a tier is a leaf: LRU evicts leaves before parents.
When a tier is full, its LRU block is demoted to the next tier (copy, then switch, then
free), and only the last tier drops blocks.
"""

from __future__ import annotations

import collections
import heapq
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from agent.core import block_moves, codecs
from agent.core.block_moves import BlockMoves
from agent.core.blocks import (
    BlockMeta,
    ChainRead,
    ChainReserved,
    ChainStored,
    CleanupResult,
    Inventory,
    InventoryGroup,
    MoveOutcome,
    NamespaceUsage,
    Notice,
    PastFillLimit,
    PoolFull,
    TierUsage,
    payload_checksum,
    stored_as,
)
from agent.core.compaction import COMPACT_TRIES_PER_ALLOCATION, DiskCompaction
from agent.core.journal import REMOVED, STORED, EventBatch, EventJournal
from agent.core.model_spec import ModelSpec
from agent.core.pins import PinTable
from agent.core.tier_store import BlockUnreadable, TierStore, is_file
from protos.block_hash import ROOT_PARENT_HASH
from protos.tier import Tier

log = logging.getLogger(__name__)
NOTICE_EVERY_SECONDS = 10.0  # a repeated notice kind (write_error, ...) is said at most this often
PARKED_SECONDS = 600.0  # recovered blocks whose prefix was lost wait this long for it to be stored again
# the parent under which recovered blocks this agent cannot read as it serves now (a model
# not served, another KV layout) are parked: no block's hash, so none is ever adopted here
UNSERVED_PARENT = b"unserved"
OTHER_WRITER_WAIT_SECONDS = 2.0  # a store waits this long at most for a block another store is writing
# how many times a store waits again for a block another store placed just after it looked
# (it then stops there: the bound keeps a store from chasing other writers without end)
MAX_LOST_RACES = 8


class BlockPool(BlockMoves, DiskCompaction):
    def __init__(
        self,
        tiers: Sequence[TierStore],
        models: Sequence[ModelSpec],
        journal: EventJournal | None = None,
        tier_codecs: dict[Tier, str] | None = None,
        codec_threads: int = 2,
    ):
        if not tiers:
            raise ValueError("a block pool needs at least one tier")
        self.tiers = sorted(tiers, key=lambda t: int(t.tier))  # fastest first
        self.store_of = {t.tier: t for t in self.tiers}
        self.models = {m.model_id: m for m in models}
        for t in self.tiers:  # a tier that keeps blocks across restarts records their layout
            if is_file(t):
                t.layouts.update({m.model_id: m.layout for m in models})
        self.tier_codecs = {t.tier: "none" for t in self.tiers} | dict(tier_codecs or {})
        for c in self.tier_codecs.values():
            codecs.check_codec(c)
        self.journal = journal or EventJournal()
        self.lock = threading.RLock()
        self.blocks: dict[bytes, BlockMeta] = {}
        self._clock = 0
        self._lru: dict[Tier, list[tuple[int, bytes]]] = {t.tier: [] for t in self.tiers}
        self._count: dict[Tier, int] = {t.tier: 0 for t in self.tiers}
        self._held: dict[Tier, int] = {t.tier: 0 for t in self.tiers}  # the blocks' footprint
        self._logical: dict[Tier, int] = {t.tier: 0 for t in self.tiers}
        self._saved: dict[Tier, int] = {t.tier: 0 for t in self.tiers}
        self._stored: dict[Tier, int] = {t.tier: 0 for t in self.tiers}
        self.notices: deque[Notice] = deque(maxlen=1000)
        self._notice_said: dict[str, tuple[float, int]] = {}  # kind -> (when last said, held back since)
        self.store_refused_blocks_total = 0  # blocks of engine stores no tier had room for
        # recovered blocks whose prefix began in a faster tier, lost with the process: by the
        # parent they wait for; invisible, their extents kept, adopted when it is stored
        # again, freed first when their tier needs room and after PARKED_SECONDS
        self._parked: dict[bytes, list[BlockMeta]] = {}
        self._parked_until = 0.0  # monotonic
        # tier -> (pin changes, parked changes, first pin expiry) when a scan of its parked
        # blocks found all of them pinned: room-making skips the scan until one differs
        self._parked_held: dict[Tier, tuple[int, int, float, int]] = {}
        self._parked_changes = 0
        self.parked_adopted_total = 0
        # eviction-order entries of blocks their pins keep where they are (neither dropped
        # nor demoted): set aside by a victim search, which would otherwise pop and push
        # them all again on every search (a pinned namespace older than the rest of a full
        # tier made each new block's search O(pinned)); back in the order when a pin
        # changes or expires (the key). Bounded as the order is: a block read again enters
        # the order anew, which _touch rebuilds (clearing these) at 4x the tier's blocks
        self._pinned_aside: dict[Tier, list[tuple[int, bytes]]] = {t.tier: [] for t in self.tiers}
        self._pinned_aside_key: tuple[int, int, float] | None = None
        self._local_pin_changes = 0
        self.pins = PinTable()  # pins from the control plane (by hash or namespace)
        # by the tier a block left: for room (capacity), as commanded (a move, the control
        # plane's policy, an evict command), or by a cleanup
        self.evictions_total: dict[Tier, int] = {t.tier: 0 for t in self.tiers}
        self.demotions_total: dict[Tier, int] = {t.tier: 0 for t in self.tiers}
        self.commanded_evictions_total: dict[Tier, int] = {t.tier: 0 for t in self.tiers}
        self.commanded_demotions_total: dict[Tier, int] = {t.tier: 0 for t in self.tiers}
        self.cleanup_evictions_total: dict[Tier, int] = {t.tier: 0 for t in self.tiers}
        self.recoded_bytes_total = 0  # stored bytes re-encoded where they were (compress in place)
        self.promotions_total = 0
        self.corrupt_blocks_total = 0
        self._corrupt: set[bytes] = set()  # marked corrupt, not removed yet (read or moving then)
        self.move_failures_total = 0
        # blocks a GPU batch encoded or decoded, and those whose batch failed (out of GPU
        # memory, say) and went one by one: {(op, path): n}, op encode|decode, path batch|one_by_one
        self.gpu_codec_blocks_total: dict[tuple[str, str], int] = {}
        self.moved_bytes_total: dict[tuple[Tier, Tier], int] = {}
        # moves that re-encode a block run their codecs here (the C loops and reads let go
        # of the GIL), while the caller writes the blocks encoded before them
        self.codec_threads = max(1, codec_threads)
        self._codec_pool: ThreadPoolExecutor | None = None

    @property
    def top(self) -> TierStore:
        return self.tiers[0]

    def lower_of(self, tier: Tier) -> TierStore | None:
        i = self.tiers.index(self.store_of[tier])
        return self.tiers[i + 1] if i + 1 < len(self.tiers) else None

    # ---- queries --------------------------------------------------------------------
    def num_leading(self, block_hashes: Sequence[bytes]) -> int:
        """How many leading blocks of the chain are held and readable (no side effects)."""
        with self.lock:
            n = 0
            for h in block_hashes:
                meta = self.blocks.get(h)
                if meta is None or not meta.visible:
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
            parked = collections.Counter(m.tier for waiting in self._parked.values() for m in waiting)
            return [
                TierUsage(
                    t.tier,
                    t.capacity_bytes,
                    t.used_bytes,
                    self._count[t.tier],
                    self._logical[t.tier],
                    self._stored[t.tier],
                    self._saved[t.tier],
                    parked[t.tier],
                    self._held[t.tier],
                )
                for t in self.tiers
            ]

    def pin_tier(self, meta: BlockMeta) -> int:
        """Fastest tier any active pin (local or from the control plane) keeps the block
        at; 0 when unpinned."""
        remote = self.pins.tier_of(meta.block_hash, meta.namespace)
        if meta.pin_tier and remote:
            return min(meta.pin_tier, remote)
        return meta.pin_tier or remote

    def pin_tier_of(self, block_hash: bytes) -> int:
        """pin_tier of a held block; 0 when unpinned or not held."""
        with self.lock:
            meta = self.blocks.get(block_hash)
            return self.pin_tier(meta) if meta is not None else 0

    def tier_of(self, block_hash: bytes) -> Tier | None:
        with self.lock:
            meta = self.blocks.get(block_hash)
            return meta.tier if meta is not None else None

    def spec(self, model_id: str) -> ModelSpec:
        return self.models[model_id]

    # ---- writes ---------------------------------------------------------------------
    def _await_other_writer(self, block_hash: bytes) -> bool:
        """A block another caller is writing (two engines storing one system prompt at
        once): wait a little for it, so this caller's longer chain goes on after it
        instead of stopping there (its tail was lost, its reply saying nothing stored).
        False: it waited all it may."""
        deadline = time.monotonic() + OTHER_WRITER_WAIT_SECONDS
        while True:
            with self.lock:
                meta = self.blocks.get(block_hash)
                if meta is None or meta.ready:
                    return True  # absent, or written (readable or not: no wait helps)
                if time.monotonic() >= deadline:
                    return False
            time.sleep(0.0005)

    def insert_chain(
        self,
        model_id: str,
        block_hashes: Sequence[bytes],
        block: Callable[[int], torch.Tensor | None],
        namespace: str = "",
    ) -> ChainStored:
        """Store the chain's missing blocks into the fastest tier, making room as needed.

        `block(i)` returns block i as a tensor of the model's shape (None: not available,
        e.g. a prefix the caller skipped was evicted meanwhile). Blocks are stored in
        order and stop at the first that cannot be (a missing parent, no room, a write
        error): the held set stays a forest of prefixes. The room the new blocks need is
        made first, at once and outside the lock (_room_in_bulk)."""
        spec = self.models[model_id]
        top = self.top
        codec = self._tier_codec(top.tier, model_id)
        room_made = False  # for the new blocks, at once, before the first of them
        stored = present = 0
        no_room_at: int | None = None  # the first block no tier had room for
        chain: list[bytes] = []
        # Only the current parent is referenced while its child is written: the rest of
        # the chain may be demoted meanwhile, so a chain longer than the top tier spills.
        parent_meta: BlockMeta | None = None
        pending: BlockMeta | None = None
        try:
            parent = ROOT_PARENT_HASH
            i, lost_races = 0, 0  # (a block another caller placed first: waited for, then present)
            while i < len(block_hashes):
                h = block_hashes[i]
                waited_out = not self._await_other_writer(h)
                with self.lock:
                    meta = self.blocks.get(h)
                    if meta is not None:
                        if not meta.visible:
                            if not meta.ready and not waited_out and lost_races < MAX_LOST_RACES:
                                lost_races += 1  # another caller placed it just after the wait
                                continue
                            break  # still being written by another caller (past the wait), or unreadable
                        meta.ref_count += 1
                        if parent_meta is not None:
                            parent_meta.ref_count -= 1
                        parent_meta = meta
                        present += 1
                        chain.append(h)
                        parent = h
                        i += 1
                        continue
                    if parent != ROOT_PARENT_HASH and parent not in self.blocks:
                        break
                data = block(i)
                if data is None:
                    break
                if not room_made:  # one batch down outside the lock, not a demotion per block
                    room_made = True
                    self._room_for_chain(top, block_hashes[:i], len(block_hashes) - i, codec, spec)
                block_codec, payload = self._encode_for(codec, data)
                digest = payload_checksum(payload)
                handle = None
                while True:
                    lower = None
                    with self.lock:
                        if h in self.blocks:
                            break
                        try:
                            handle = self._allocate(top, payload.numel(), h)
                        except PoolFull:
                            lower = self.lower_of(top.tier)
                        else:
                            pending = BlockMeta(
                                h,
                                parent,
                                model_id,
                                spec.block_bytes,
                                top.tier,
                                handle,
                                block_codec,
                                payload.numel(),
                                ref_count=1,
                                ready=False,
                                namespace=namespace,
                                checksum=digest,
                            )
                            self.blocks[h] = pending
                            self._account(pending, +1)
                            break
                    if lower is None:
                        break
                    # nothing here may go (pins, loads, moves hold it all): the rest of the
                    # chain goes to the next tier down that has room, rather than nowhere (a
                    # child is never kept faster than its parent); encoded for that tier
                    # outside the lock, which an encode would hold up for every caller
                    top, codec = lower, self._tier_codec(lower.tier, model_id)
                    block_codec, payload = self._encode_for(codec, data)
                    digest = payload_checksum(payload)
                if handle is None:
                    if h in self.blocks and lost_races < MAX_LOST_RACES:
                        # another caller placed it while this one encoded it: wait for its
                        # write and go on after it, rather than stop (the tail lost)
                        lost_races += 1
                        continue
                    no_room_at = i if h not in self.blocks else None
                    break
                try:
                    top.write(handle, payload, pending)
                except OSError as exc:
                    self._notice("write_error", f"writing a block to the {top.tier.label} tier failed: {exc}")
                    break
                with self.lock:
                    meta, pending = pending, None
                    assert meta is not None  # made with its handle, above
                    meta.ready = True
                    if parent in self.blocks:
                        self.blocks[parent].num_children += 1
                    self.journal.record(STORED, model_id, top.tier, h, parent)
                    self._touch(meta)
                    if self._parked:
                        self._adopt_parked(h)
                    if parent_meta is not None:
                        parent_meta.ref_count -= 1
                    parent_meta = meta
                stored += 1
                chain.append(h)
                parent = h
                i += 1
        finally:
            # a write that failed part way may have GPU copies still landing in its pages
            quiet = pending is None or block_moves.gpu_quiet([self.store_of[pending.tier]], (payload,))
            with self.lock:
                if parent_meta is not None:
                    parent_meta.ref_count -= 1
                if pending is not None:  # a write failed: undo the reservation
                    del self.blocks[pending.block_hash]
                    self._account(pending, -1)
                    if quiet:
                        self.store_of[pending.tier].free(pending.handle)
                self.touch(chain)
        if no_room_at is not None:
            refused = len(block_hashes) - no_room_at
            with self.lock:
                self.store_refused_blocks_total += refused
            self._notice(
                "no_room",
                f"a store for {model_id} kept {no_room_at} of its {len(block_hashes)} blocks: every tier is full of "
                f"blocks that may not go (pinned, being read or moved); {refused} not stored",
            )
        return ChainStored(stored, present)

    def _room_for_chain(self, store: TierStore, leading: Sequence[bytes], num_new: int, codec: str, spec) -> None:
        """_room_in_bulk for num_new blocks of `spec` in `codec` about to be stored after
        the chain's `leading` blocks, which stay referenced meanwhile (the room is never
        made from them)."""
        size = codecs.max_payload_bytes(codec, spec.block_shape, spec.torch_dtype)
        with self.lock:
            if store.capacity_bytes - store.used_bytes >= num_new * store.footprint(size):
                return  # room enough already: nothing to reference or demote
        held = self.acquire_chain(leading)
        try:
            self._room_in_bulk(store, [(None, None, size)] * num_new)
        finally:
            self.release_chain(held)

    def read_chain(self, block_hashes: Sequence[bytes]) -> ChainRead:
        """The decoded leading blocks that are held and intact, with their tiers.

        A block that fails its checksum or does not decode ends the prefix there; it
        (and its descendants) is removed and reported, never returned."""
        with self.lock:
            metas = []
            for h in block_hashes:
                meta = self.blocks.get(h)
                if meta is None or not meta.visible:
                    break
                meta.ref_count += 1
                metas.append(meta)
        out: list[torch.Tensor] = []
        tiers: list[Tier] = []
        try:
            for meta in metas:
                spec = self.models[meta.model_id]
                try:
                    payload = self.store_of[meta.tier].read(meta.handle, meta.stored_bytes)
                    out.append(codecs.decode(meta.codec, payload, spec.block_shape, spec.torch_dtype))
                except (BlockUnreadable, codecs.CodecError, OSError) as exc:
                    self._mark_corrupt(meta, str(exc))
                    break
                tiers.append(meta.tier)
        finally:
            with self.lock:
                for meta in metas:
                    meta.ref_count -= 1
                self.touch([m.block_hash for m in metas[: len(out)]])
                for meta in metas:
                    if meta.corrupt and meta.ref_count == 0:
                        self._drop_subtree(meta.block_hash)
                self._drop_corrupt()
        return ChainRead(out, tiers)

    # ---- handoff between agents (agent.core.handoff drives these) ---------------------
    def acquire_chain(self, block_hashes: Sequence[bytes]) -> list[BlockMeta]:
        """Reference the leading visible blocks of a chain (a sender reads their pages
        while they stay referenced: never freed, and a move waits to switch them)."""
        with self.lock:
            out = []
            for h in block_hashes:
                meta = self.blocks.get(h)
                if meta is None or not meta.visible:
                    break
                meta.ref_count += 1
                out.append(meta)
            return out

    def release_chain(self, metas: Sequence[BlockMeta]) -> None:
        with self.lock:
            for meta in metas:
                meta.ref_count -= 1
            for meta in metas:  # found unreadable while held: removed now that no one reads it
                if meta.corrupt and meta.ref_count == 0 and not meta.moving:
                    self._drop_subtree(meta.block_hash)
            self._drop_corrupt()

    def reserve_chain(
        self,
        model_id: str,
        block_hashes: Sequence[bytes],
        stored_bytes: Sequence[int],
        tier: Tier,
        fill_limit_bytes: int = 0,
    ) -> ChainReserved:
        """Pages in `tier` for the blocks after the leading ones held here, making room
        as a store does. The held leading blocks are referenced (release_chain them).
        The pages belong to no block: invisible until commit_reserved. Raises PoolFull
        (and holds nothing) when they cannot all be found, PastFillLimit when they would
        take the used bytes of `tier` and the tiers below it past `fill_limit_bytes` (0: no
        limit). The room is made at once first, outside the lock (_room_in_bulk): a decode
        agent's engine is not held up by one demotion per reserved block."""
        store = self.store_of[tier]
        present = self.acquire_chain(block_hashes)  # referenced from here: never the room made
        try:
            need = sum(store.footprint(int(n)) for n in stored_bytes[len(present) :])
            if fill_limit_bytes:
                with self.lock:
                    used = sum(t.used_bytes for t in self.tiers if t.tier >= tier)
                if used + need > fill_limit_bytes:
                    raise PastFillLimit(
                        f"{need} B would take the {store.tier.label} tier and those below it to "
                        f"{used + need} B used, past the {fill_limit_bytes} B asked for"
                    )
            if need > self.reclaimable_bytes(tier):  # before anything is demoted for it
                raise PoolFull(f"{need} B do not fit: the {store.tier.label} tier can free less than that")
            self._room_in_bulk(store, [(None, None, int(n)) for n in stored_bytes[len(present) :]])
        except BaseException:
            self.release_chain(present)
            raise
        with self.lock:
            handles: list = []
            try:
                for i in range(len(present), len(block_hashes)):
                    handles.append(self._allocate(store, int(stored_bytes[i]), block_hashes[i]))
            except BaseException:  # PoolFull, or a failed demotion: nothing held
                for handle in handles:
                    store.free(handle)
                self.release_chain(present)
                raise
            return ChainReserved(len(present), present, handles)

    def commit_reserved(
        self,
        model_id: str,
        block_hashes: Sequence[bytes],
        num_present: int,
        handles: Sequence,
        stored_bytes: Sequence[int],
        block_codecs: Sequence[str],
        tier: Tier,
        namespace: str | Sequence[str] = "",
        checksums: Sequence[int] | None = None,
    ) -> int:
        """Make reserved blocks [num_present, N) visible, all at once (one lock hold).
        `namespace`: one for all, or one per block of the prefix.
        A block stored here meanwhile keeps its copy and the reserved pages are freed.
        A block another caller is writing right now (an engine's store of the same prefix)
        is waited for, outside the lock as a store waits, and its copy kept. Raises
        ValueError (and changes nothing) when one is still being written after that wait,
        is unreadable, or the leading blocks went away. Returns blocks added."""
        spec = self.models[model_id]
        store = self.store_of[tier]
        writing: bytes | None = None  # a block of the prefix another caller is writing
        lost_races = 0
        while True:
            if writing is not None:
                # an engine's store of the same prefix placed it and writes it: the handoff
                # was thrown away for it (the sender's blocks, and the tail that store lacked)
                lost_races += 1
                if not self._await_other_writer(writing):
                    raise ValueError(f"block {writing.hex()[:12]} is being written by another caller")
            with self.lock:
                for h in block_hashes[:num_present]:
                    if h not in self.blocks:
                        raise ValueError(f"leading block {h.hex()[:12]} is no longer held")
                writing = next((h for h in block_hashes[num_present:] if not self._visible_or_absent(h)), None)
                if writing is not None:
                    if self.blocks[writing].ready or lost_races >= MAX_LOST_RACES:
                        raise ValueError(f"block {writing.hex()[:12]} is being written by another caller")
                    continue  # (the lock let go) waited for above
                parent = block_hashes[num_present - 1] if num_present else ROOT_PARENT_HASH
                added = 0
                for i in range(num_present, len(block_hashes)):
                    h, handle = block_hashes[i], handles[i - num_present]
                    if h in self.blocks:
                        store.free(handle)
                        parent = h
                        continue
                    meta = BlockMeta(
                        h,
                        parent,
                        model_id,
                        spec.block_bytes,
                        tier,
                        handle,
                        block_codecs[i],
                        int(stored_bytes[i]),
                        namespace=namespace if isinstance(namespace, str) else namespace[i],
                        checksum=checksums[i - num_present] if checksums else 0,
                    )
                    self.blocks[h] = meta
                    self._account(meta, +1)
                    if parent in self.blocks:
                        self.blocks[parent].num_children += 1
                    self.journal.record(STORED, model_id, tier, h, parent)
                    if self._parked:
                        self._adopt_parked(h)
                    added += 1
                    parent = h
                self.touch(block_hashes)
                return added

    def _visible_or_absent(self, block_hash: bytes) -> bool:
        meta = self.blocks.get(block_hash)
        return meta is None or meta.visible

    def release_reserved(self, handles: Sequence, tier: Tier) -> None:
        """Give reserved pages back (an aborted or expired reservation)."""
        store = self.store_of[tier]
        with self.lock:
            for handle in handles:
                store.free(handle)

    def reclaimable_bytes(self, tier: Tier) -> int:
        """Bytes of `tier` a new block could get: free pages plus blocks that may be
        demoted or dropped (not pinned, not in use, not moving). O(blocks)."""
        store = self.store_of[tier]
        with self.lock:
            free = store.capacity_bytes - store.used_bytes
            for m in self.blocks.values():
                if m.tier == tier and m.ready and not m.ref_count and not m.moving and not self.pin_tier(m):
                    free += store.footprint(m.stored_bytes)
            return free

    def set_pin(self, block_hashes: Sequence[bytes], pin_tier: Tier | None) -> int:
        """Pin blocks at `pin_tier` (kept there or faster, never dropped); None unpins."""
        with self.lock:
            n = 0
            for h in block_hashes:
                meta = self.blocks.get(h)
                if meta is not None:
                    meta.pin_tier = int(pin_tier) if pin_tier is not None else 0
                    n += 1
            self._local_pin_changes += 1
            return n

    def drop(self, block_hash: bytes) -> bool:
        """Remove one unpinned block and, first, every held descendant of it; refused
        when it or a descendant is pinned (the descendant could not outlive it). Each
        block removed counts as a commanded eviction from its own tier."""
        with self.lock:
            meta = self.blocks.get(block_hash)
            if meta is None or any(self.pin_tier(m) for m in self._subtree(meta)):
                return False
            removed: list[BlockMeta] = []
            if not self._drop_subtree(block_hash, removed):
                return False
            for m in removed:
                self.commanded_evictions_total[m.tier] += 1
            return True

    def _subtree(self, meta: BlockMeta) -> list[BlockMeta]:
        """`meta` and every held descendant, parents before children (no recursion: a
        chain may be a long prompt's thousands of blocks). One pass over the pool finds
        the children, only for a block that has some."""
        if not meta.num_children:
            return [meta]
        children: dict[bytes, list[BlockMeta]] = collections.defaultdict(list)
        for m in self.blocks.values():
            children[m.parent_hash].append(m)
        out, seen = [meta], {meta.block_hash}
        for m in out:  # grows as it goes: breadth first
            if m.num_children:
                for c in children.get(m.block_hash, ()):
                    if c.block_hash not in seen:  # (a parent loop, which no digest makes, must not spin)
                        seen.add(c.block_hash)
                        out.append(c)
        return out

    def blocks_matching(
        self, namespace: str | None = None, model_id: str = "", tier: Tier | None = None
    ) -> list[bytes]:
        """Hashes of visible blocks in a namespace / model / tier, parents before children."""
        with self.lock:
            out = [
                m
                for m in self.blocks.values()
                if m.visible
                and (namespace is None or m.namespace == namespace)
                and (not model_id or m.model_id == model_id)
                and (tier is None or m.tier == tier)
            ]
            out.sort(key=lambda m: -m.last_access)  # parents are more recent than children
            return [m.block_hash for m in out]

    def cleanup(
        self,
        older_than_seconds: float,
        namespace: str | None = None,
        model_id: str = "",
        dry_run: bool = False,
        now: float | None = None,
    ) -> CleanupResult:
        """Drop unpinned blocks not accessed for `older_than_seconds`, leaves first (a
        parent goes only once all its held children went). Pinned blocks are skipped
        and counted. With `dry_run`, report what would go and change nothing."""
        now = time.time() if now is None else now
        cutoff = now - older_than_seconds
        with self.lock:
            candidates: dict[bytes, BlockMeta] = {}
            skipped = 0
            for m in self.blocks.values():
                if not m.visible or (namespace is not None and m.namespace != namespace):
                    continue
                if (model_id and m.model_id != model_id) or m.last_access_unix_seconds > cutoff:
                    continue
                if self.pin_tier(m):
                    skipped += 1
                    continue
                if m.ref_count or m.moving:
                    continue
                candidates[m.block_hash] = m
            children = {h: m.num_children for h, m in candidates.items()}
            ready = [h for h, n in children.items() if n == 0]
            order: list[BlockMeta] = []
            while ready:
                h = ready.pop()
                meta = candidates[h]
                order.append(meta)
                p = meta.parent_hash
                if p in children:
                    children[p] -= 1
                    if children[p] == 0:
                        ready.append(p)
            freed: dict[Tier, list[int]] = {}
            for meta in order:
                acc = freed.setdefault(meta.tier, [0, 0])
                acc[0] += 1
                acc[1] += self.store_of[meta.tier].footprint(meta.stored_bytes)
                if not dry_run and self._drop_subtree(meta.block_hash):
                    self.cleanup_evictions_total[meta.tier] += 1
            # blocks a restart found on disk that wait for their prefix count too: left,
            # they came back once it was stored again, though the cleanup had said done
            pinned_parked: list[BlockMeta] = []
            parked = self._free_parked_where(
                lambda m: (
                    (namespace is None or m.namespace == namespace)
                    and (not model_id or m.model_id == model_id)
                    and m.last_access_unix_seconds <= cutoff
                ),
                dry_run=dry_run,
                pinned=pinned_parked,
            )
            skipped += len(pinned_parked)
            for meta in parked:
                acc = freed.setdefault(meta.tier, [0, 0])
                acc[0] += 1
                acc[1] += self.store_of[meta.tier].footprint(meta.stored_bytes)
            return CleanupResult({t: (n, b) for t, (n, b) in freed.items()}, skipped, len(order) + len(parked))

    # ---- recovery and inventory -----------------------------------------------------
    def recover(self, store, found: list) -> int:
        """Adopt blocks a tier found after a restart (verified by their checksums).
        Blocks of unknown models and of a model whose KV layout changed since they were
        written (their bytes would be read in the wrong shape) are never adopted, but
        parked like the others (under UNSERVED_PARENT): a restart with a mistyped or
        missing `--model` must not wipe the cache, and one with the right model finds
        them again. They go first when their tier needs room, after PARKED_SECONDS and
        in a cleanup. Blocks whose
        chain does not reach the root or a held block (its first blocks were in a faster
        tier, lost with the process: the usual state of a disk tier, which holds tails)
        are parked: kept, invisible, until that prefix is stored again, when they are
        adopted (an engine recomputes the first blocks, the rest comes back from disk).
        Returns the number adopted now."""
        with self.lock:
            candidates = {b.block_hash: b for b in found if self._adoptable(b)}
            unserved: dict[str, list[int]] = {}  # model -> [blocks, bytes] it cannot read as it is served now
            for b in found:
                if not self._adoptable(b):
                    self._parked.setdefault(UNSERVED_PARENT, []).append(self._recovered_meta(store, b))
                    acc = unserved.setdefault(b.model_id, [0, 0])
                    acc[0] += 1
                    acc[1] += b.stored_bytes
                elif candidates[b.block_hash] is not b:
                    store.free(b.handle)  # an older copy of a block (the later write wins)
            for model_id, (n, nbytes) in unserved.items():
                spec = self.models.get(model_id)
                log.warning(
                    "%s tier: %d recovered blocks (%d bytes) of model %r cannot be used: %s; they are kept "
                    "(freed first when the tier needs room, and after %d s): restart with the model as it "
                    "was served to use them",
                    store.tier.label,
                    n,
                    nbytes,
                    model_id,
                    "this agent does not serve it (--model)"
                    if spec is None
                    else "its block size or KV layout differs from the one served now",
                    PARKED_SECONDS,
                )
            children: dict[bytes, list[bytes]] = {}
            for h, b in candidates.items():
                children.setdefault(b.parent_hash, []).append(h)
            stack = [
                h for h, b in candidates.items() if b.parent_hash == ROOT_PARENT_HASH or b.parent_hash in self.blocks
            ]
            reachable = set(stack)
            while stack:
                for c in children.get(stack.pop(), ()):
                    if c not in reachable:
                        reachable.add(c)
                        stack.append(c)
            waiting = 0
            for h in [h for h in candidates if h not in reachable]:
                b = candidates.pop(h)
                self._parked.setdefault(b.parent_hash, []).append(self._recovered_meta(store, b))
                waiting += 1
            if waiting or unserved:
                self._parked_until = time.monotonic() + PARKED_SECONDS
                self._parked_changes += 1
            if waiting:
                log.info(
                    "%s tier: %d recovered blocks wait for their prefix (lost from a faster tier) to be stored again",
                    store.tier.label,
                    waiting,
                )
            for b in candidates.values():
                meta = self._recovered_meta(store, b)
                self.blocks[b.block_hash] = meta
                self._account(meta, +1)
            for b in candidates.values():
                parent = self.blocks.get(b.parent_hash)
                if parent is not None:
                    parent.num_children += 1
            # in the order they were last used, keeping when (a cleanup by age goes on
            # working after the restart; blocks of older slabs: now)
            now = time.time()
            for b in sorted(candidates.values(), key=lambda b: getattr(b, "last_access_unix_seconds", 0.0) or now):
                meta = self.blocks[b.block_hash]
                self._touch(meta)
                accessed = getattr(b, "last_access_unix_seconds", 0.0)
                if 0 < accessed <= now:
                    meta.last_access_unix_seconds = accessed
            return len(candidates)

    @staticmethod
    def _recovered_meta(store, b) -> BlockMeta:
        meta = BlockMeta(
            b.block_hash,
            b.parent_hash,
            b.model_id,
            b.num_bytes,
            store.tier,
            b.handle,
            b.codec,
            b.stored_bytes,
            namespace=getattr(b, "namespace", ""),
            checksum=getattr(b.handle, "checksum", 0),
        )
        # when it was last used, as its header says (older slabs: now): a parked block's age
        # for a cleanup by age (recover() sets the adopted ones' again, in order)
        accessed, now = getattr(b, "last_access_unix_seconds", 0.0), time.time()
        meta.last_access_unix_seconds = accessed if 0 < accessed <= now else now
        return meta

    @property
    def num_parked_blocks(self) -> int:
        with self.lock:
            return sum(len(v) for v in self._parked.values())

    @property
    def num_unserved_parked_blocks(self) -> int:
        """Of the parked blocks, those of a model not served as they were written (no
        prefix adopts them: a restart with the model as it was served does)."""
        with self.lock:
            return len(self._parked.get(UNSERVED_PARENT, ()))

    def _adopt_parked(self, h: bytes) -> None:
        """`h` is held and visible now: the recovered blocks that waited for it (and theirs)
        are adopted, as stored in their tier (lock held)."""
        stack = [h]
        while stack and self._parked:
            parent = stack.pop()
            for meta in self._parked.pop(parent, ()):
                if meta.block_hash in self.blocks:  # stored again meanwhile: that copy stays
                    self.store_of[meta.tier].free(meta.handle)
                else:
                    self.blocks[meta.block_hash] = meta
                    self._account(meta, +1)
                    self.blocks[parent].num_children += 1
                    self.journal.record(STORED, meta.model_id, meta.tier, meta.block_hash, parent)
                    self._touch(meta)
                    self.parked_adopted_total += 1
                stack.append(meta.block_hash)

    def free_parked(self, tier: Tier | None = None, expired_only: bool = False) -> int:
        """Free parked blocks (of `tier`, or all; only once PARKED_SECONDS passed since
        recovery when `expired_only`) but those a pin holds (a pin restored from the pin
        file protects its blocks found on disk: freed, the pin held nothing); returns how
        many."""
        with self.lock:
            if not self._parked or (expired_only and time.monotonic() < self._parked_until):
                return 0
            if tier is not None and not expired_only and self._parked_held.get(tier) == self._parked_key():
                return 0  # all pinned when last scanned, and nothing changed since
            freed = len(self._free_parked_where(lambda m: tier is None or m.tier is tier))
            if tier is not None and not freed:
                self._parked_held[tier] = self._parked_key()
        if freed:
            log.info("freed %d parked blocks (their prefix was not stored again, or their model is not served)", freed)
        return freed

    def _pins_key(self) -> tuple[int, int, float]:
        """What whether a block is pinned depends on (lock held): the pin table, the local
        pins, and when the first pin expires (pins past it leave the table first: a change)."""
        if time.monotonic() >= self.pins.next_expiry():
            self.pins.expire()
        return (self.pins.changes, self._local_pin_changes, self.pins.next_expiry())

    def _parked_key(self) -> tuple[int, int, float, int]:
        """What a scan of parked blocks depends on (lock held): the pins and the parked blocks."""
        return (*self._pins_key(), self._parked_changes)

    def _free_parked_where(
        self, chosen: Callable[[BlockMeta], bool], dry_run: bool = False, pinned: list[BlockMeta] | None = None
    ) -> list[BlockMeta]:
        """Free the parked blocks `chosen` says, but pinned ones (lock held, appended to
        `pinned` when given); the freed."""
        freed: list[BlockMeta] = []
        for parent in list(self._parked):
            keep = []
            for meta in self._parked[parent]:
                if chosen(meta) and not self.pin_tier(meta):
                    if not dry_run:
                        self.store_of[meta.tier].free(meta.handle)
                    freed.append(meta)
                    if dry_run:
                        keep.append(meta)
                else:
                    if pinned is not None and chosen(meta):
                        pinned.append(meta)
                    keep.append(meta)
            if keep:
                self._parked[parent] = keep
            else:
                del self._parked[parent]
        if freed and not dry_run:
            self._parked_changes += 1
        return freed

    def record_frees(self) -> None:
        """Make the frees so far durable: a disk tier records its freed extents in its dead
        log now rather than on its background thread (a restart would bring them back)."""
        for store in self.store_of.values():
            drain = getattr(store, "drain", None)
            if drain is not None:
                drain()

    def _adoptable(self, found) -> bool:
        spec = self.models.get(found.model_id)
        if spec is None or found.num_bytes != spec.block_bytes:
            return False
        layout = getattr(found, "layout", "")
        return not layout or layout == spec.layout  # older slabs did not record it

    def namespace_usage(self) -> dict[str, NamespaceUsage]:
        """Visible blocks per namespace."""
        with self.lock:
            out: dict[str, list[int]] = {}
            for m in self.blocks.values():
                if m.visible:
                    acc = out.setdefault(m.namespace, [0, 0])
                    acc[0] += 1
                    acc[1] += m.num_bytes
            return {k: NamespaceUsage(v[0], v[1]) for k, v in out.items()}

    def inventory(self) -> Inventory:
        """A consistent snapshot with the seq it reflects; pending events are superseded."""
        with self.lock:
            seq = self.journal.reset()
            acc: dict[tuple[str, Tier], tuple[bytearray, bytearray]] = {}
            for meta in self.blocks.values():
                if not meta.visible:
                    continue  # reported by its STORED event once written
                hs, ps = acc.setdefault((meta.model_id, meta.tier), (bytearray(), bytearray()))
                hs += meta.block_hash
                ps += meta.parent_hash
            return Inventory(seq, [InventoryGroup(m, t, bytes(h), bytes(p)) for (m, t), (h, p) in acc.items()])

    def drain_events(self, max_blocks: int = 8192, generation: int | None = None) -> list[EventBatch]:
        with self.lock:
            return self.journal.drain(max_blocks, generation)

    def drain_notices(self) -> list[Notice]:
        with self.lock:
            out = list(self.notices)
            self.notices.clear()
            return out

    # ---- internals (called with the lock held) --------------------------------------
    def _encode_for(self, codec: str, data: torch.Tensor) -> tuple[str, torch.Tensor]:
        """(codec, payload) of a block entering a tier: one the tier's lossy codec cannot
        hold (values beyond its fp16 scales) is kept uncompressed, with a notice."""
        try:
            return codec, codecs.encode(codec, data)
        except codecs.CodecError as exc:
            if codec == "none":
                raise
            self._notice("codec_refused", f"a block is kept uncompressed instead of {codec}: {exc}")
            return "none", codecs.encode("none", data)

    def _notice(self, kind: str, message: str) -> None:
        """Log a notice and queue it for the control plane's events. Repeated failures
        (a full file system fails every write) are said once per kind every
        NOTICE_EVERY_SECONDS with how many were held back, not hundreds a second; each
        corrupt block is said, as it names what was lost."""
        now = time.monotonic()
        with self.lock:
            if kind != "corrupt_block":
                last, held = self._notice_said.get(kind, (-NOTICE_EVERY_SECONDS, 0))
                if now - last < NOTICE_EVERY_SECONDS:
                    self._notice_said[kind] = (last, held + 1)
                    return
                if held:
                    message += f" ({held} more like it in the last {now - last:.0f} s)"
                self._notice_said[kind] = (now, 0)
            self.notices.append(Notice(kind, message, time.time()))
        log.warning("%s: %s", kind, message)

    def _move_failed(self, reason: str) -> MoveOutcome:
        with self.lock:
            self.move_failures_total += 1
        return MoveOutcome(False, reason=reason)

    def _mark_corrupt(self, meta: BlockMeta, why: str) -> None:
        with self.lock:
            if not meta.corrupt:
                meta.corrupt = True
                self.corrupt_blocks_total += 1
                self._corrupt.add(meta.block_hash)
        self._notice(
            "corrupt_block",
            f"block {meta.block_hash.hex()[:12]} in the {meta.tier.label} tier is unreadable ({why}); removed",
        )

    def _drop_corrupt(self) -> None:
        """Remove the blocks found corrupt whose removal was refused then (a reader held
        one, or a block of its subtree was moving) and may go now (lock held)."""
        for h in list(self._corrupt):
            meta = self.blocks.get(h)
            if meta is None:
                self._corrupt.discard(h)
            elif not meta.ref_count and not meta.moving:
                self._drop_subtree(h)

    def _account(self, meta: BlockMeta, sign: int) -> None:
        self._count[meta.tier] += sign
        self._logical[meta.tier] += sign * meta.num_bytes
        self._stored[meta.tier] += sign * meta.stored_bytes
        store = self.store_of[meta.tier]
        self._held[meta.tier] += sign * store.footprint(meta.stored_bytes)
        if meta.stored_bytes != meta.num_bytes:
            self._saved[meta.tier] += sign * (store.footprint(meta.num_bytes) - store.footprint(meta.stored_bytes))

    def _switch(
        self, meta: BlockMeta, tier: Tier, handle, codec: str, stored_bytes: int, checksum: int, lru: bool = True
    ) -> None:
        """Point a block at its new place. `lru` False: not yet in its new tier's eviction
        order (a block its batch still holds; it enters when let go, _enter_lru)."""
        self._account(meta, -1)
        meta.tier, meta.handle, meta.codec, meta.stored_bytes = tier, handle, codec, stored_bytes
        meta.checksum = checksum
        self._account(meta, +1)
        if lru:
            self._enter_lru(meta)
        self.journal.record(STORED, meta.model_id, tier, meta.block_hash, meta.parent_hash)

    def _enter_lru(self, meta: BlockMeta) -> None:
        heapq.heappush(self._lru[meta.tier], (meta.last_access, meta.block_hash))

    def _touch(self, meta: BlockMeta) -> None:
        self._clock += 1
        meta.last_access = self._clock
        meta.last_access_unix_seconds = time.time()
        heap = self._lru[meta.tier]
        heapq.heappush(heap, (self._clock, meta.block_hash))
        if len(heap) > 4 * max(self._count[meta.tier], 1024):
            self._rebuild_lru(meta.tier)

    def _rebuild_lru(self, tier: Tier) -> None:
        heap = [(m.last_access, m.block_hash) for m in self.blocks.values() if m.tier == tier]
        heapq.heapify(heap)
        self._lru[tier] = heap
        self._pinned_aside[tier] = []  # every block is in the order again

    def _check_pinned_aside(self) -> None:
        """Put the entries set aside for their pins back in the eviction order when a pin
        may have changed since (lock held)."""
        key = self._pins_key()
        if key == self._pinned_aside_key:
            return
        self._pinned_aside_key = key
        for tier, aside in self._pinned_aside.items():
            if aside:
                heap = self._lru[tier]
                heap.extend(aside)
                heapq.heapify(heap)
                self._pinned_aside[tier] = []

    def _allocate(self, store: TierStore, num_bytes: int, block_hash: bytes):
        if store.footprint(num_bytes) > store.capacity_bytes:
            raise PoolFull(f"a {num_bytes} B block does not fit the {store.tier.label} tier at all")
        handle = store.allocate(num_bytes, block_hash)
        compactions = 0
        while handle is None:
            # room by bytes but no free run long enough (a fragmented disk tier): blocks
            # move aside before any is pushed out for it
            # (a failed try counts too: each plans over all the slab's free runs, under the
            # lock, and one that found no window would be tried again after every eviction)
            compactions += 1
            if compactions > COMPACT_TRIES_PER_ALLOCATION or not self._compact_for(store, num_bytes):
                self._make_room(store)
            handle = store.allocate(num_bytes, block_hash)
        return handle

    def _victim(self, tier: Tier, demote_to: Tier | None) -> BlockMeta | None:
        """LRU block of `tier` that may go: to `demote_to`, or dropped when None."""
        found = self._victims(tier, demote_to, 1)
        return found[0] if found else None

    def _victims(self, tier: Tier, demote_to: Tier | None, num_bytes: int) -> list[BlockMeta]:
        """The least recently used blocks of `tier` that may go (to `demote_to`, or
        dropped when None) whose footprints there add up to num_bytes; fewer when no
        more may go (lock held)."""
        store = self.store_of[tier]
        self._check_pinned_aside()
        heap = self._lru[tier]
        lower = self.lower_of(tier)
        aside = self._pinned_aside[tier]
        skipped = []
        victims: list[BlockMeta] = []
        chosen: set[bytes] = set()
        while heap and num_bytes > 0:
            tick, h = heapq.heappop(heap)
            meta = self.blocks.get(h)
            if meta is None or meta.tier != tier or meta.last_access != tick:
                continue  # stale entry
            pinned = self.pin_tier(meta)
            if pinned and (lower is None or int(lower.tier) > pinned):
                aside.append((tick, h))  # its pin keeps it here: not looked at again until a pin changes
                continue
            skipped.append((tick, h))
            if meta.ref_count or meta.moving or not meta.ready or h in chosen:  # (an entry twice in the heap)
                continue
            if demote_to is None and (meta.num_children or pinned):
                continue
            if demote_to is not None and pinned and int(demote_to) > pinned:
                continue
            victims.append(meta)
            chosen.add(h)
            num_bytes -= store.footprint(meta.stored_bytes)
        for item in skipped:
            heapq.heappush(heap, item)
        return victims

    def _room_in_bulk(self, store: TierStore, incoming: list[tuple]) -> None:
        """Make room in `store` for the blocks a batch brings in ((meta, its source
        store[, its bytes there]) each) by demoting the least recently used blocks there
        to the tier below as one batch (one vectored disk write, merged slab copies and
        one wait for a GPU) instead of one block at a time as each allocation would
        (_make_room: a write, or a GPU synchronize, per block, under the lock). Blocks
        coming from that tier below give their space back there only as they switch: for
        them room is made at once only as far as the tier below has room now (a swap of
        two full tiers goes chunk by chunk instead, _copy_between_slabs). Best effort: what
        it cannot demote, the allocations make room for as before. Not under the lock."""
        lower = self.lower_of(store.tier)
        if lower is None:
            return
        own = from_lower = 0
        for meta, src, *size in incoming:  # (meta None: a block not held yet, its bytes given)
            n = store.footprint(size[0] if size else meta.stored_bytes)
            if src is lower:
                from_lower += n
            else:
                own += n
        with self.lock:
            lower_free = max(lower.capacity_bytes - lower.used_bytes, 0)
            short = own + min(from_lower, lower_free) - (store.capacity_bytes - store.used_bytes)
            victims = self._victims(store.tier, lower.tier, short) if short > 0 else []
        if not victims:
            return
        # a victim moved or read since it was chosen is left alone (not waited for)
        # counted as capacity demotions where they switch (_finish_move)
        self.move_blocks([m.block_hash for m in victims], lower.tier, from_tier=store.tier, reader_wait_seconds=0.0)

    def _make_room(self, store: TierStore) -> None:
        """Free space in `store`: demote its LRU block to the next tier, or drop an LRU
        leaf when that fails or this is the last tier. Raises PoolFull when nothing can go."""
        if self._parked and self.free_parked(store.tier):
            return  # recovered blocks still waiting for their prefix go before any held one
        lower = self.lower_of(store.tier)
        if lower is not None:
            meta = self._victim(store.tier, lower.tier)
            if meta is not None and self._demote_locked(meta, store, lower):
                return
        # a block that may be dropped may also be demoted (no pin, no child, not in use):
        # when none may be demoted, a second pass over the tier would find none to drop
        meta = self._victim(store.tier, None) if lower is None or meta is not None else None
        if meta is None:
            raise PoolFull(f"the {store.tier.label} tier is full of pinned, in-use or moving blocks")
        self._drop_subtree(meta.block_hash)
        self.evictions_total[store.tier] += 1

    def _tier_codec(self, tier: Tier, model_id: str) -> str:
        """The codec a block of `model_id` takes on entering `tier`: the tier's, unless it
        is lossy and the model's KV is not floating point (an int8 KV cache), or its
        payload would be no smaller than the raw block (int8 or fp8 of an fp8 KV cache: a
        byte a value plus the scales, and precision lost): then none."""
        codec = self.tier_codecs[tier]
        if codec in codecs.LOSSY:
            spec = self.models[model_id]
            if not spec.torch_dtype.is_floating_point:
                return "none"
            if codecs.payload_bytes(codec, spec.block_shape, spec.torch_dtype) >= spec.block_bytes:
                return "none"
        return codec

    def _entry_codec(self, tier: Tier, model_id: str, current: str) -> str:
        """A block keeps its codec when it has one, else takes its new tier's."""
        return self._tier_codec(tier, model_id) if current == "none" else current

    def _demote_locked(self, meta: BlockMeta, src: TierStore, dst: TierStore) -> bool:
        """Synchronous demotion for the local safety net (lock held)."""
        codec = self._entry_codec(dst.tier, meta.model_id, meta.codec)
        handle = None
        try:
            payload, digest = None, meta.checksum
            if codec != meta.codec:
                payload, digest = self._reencode(meta.model_id, src, meta.handle, meta.stored_bytes, meta.codec, codec)
            nbytes = meta.stored_bytes if payload is None else payload.numel()
            try:
                handle = self._allocate(dst, nbytes, meta.block_hash)
            except PoolFull:
                return False
            header = stored_as(meta, codec, digest)
            try:
                if payload is None:
                    block_moves.copy_unchanged(src, meta.handle, dst, handle, nbytes, header)
                else:
                    dst.write(handle, payload, header)
            except OSError as exc:
                dst.free(handle)
                self._notice("write_error", f"demoting to the {dst.tier.label} tier failed: {exc}")
                return False
            except BaseException:  # a broken GPU copy, say: the block stays, its new space goes back
                if block_moves.gpu_quiet([src, dst]):  # no copy still writing there
                    dst.free(handle)
                raise
        except BlockUnreadable as exc:
            if handle is not None:
                dst.free(handle)
            self._mark_corrupt(meta, str(exc))
            return self._drop_subtree(meta.block_hash)  # its space is free now (unless read or moved: not yet)
        except codecs.CodecError as exc:  # not this block's codec: it is dropped instead
            log.warning("demoting %s: %s", meta.block_hash.hex(), exc)
            return False
        old_handle, old_tier = meta.handle, meta.tier
        self._switch(meta, dst.tier, handle, codec, nbytes, getattr(handle, "checksum", 0) or digest)
        src.free(old_handle)
        self.demotions_total[old_tier] += 1
        key = (old_tier, dst.tier)
        self.moved_bytes_total[key] = self.moved_bytes_total.get(key, 0) + nbytes
        return True

    def _drop_subtree(self, block_hash: bytes, removed: list[BlockMeta] | None = None) -> bool:
        """Remove a block and every held descendant, children first; all or nothing:
        False, with nothing removed, while any of them is being read or moved.
        `removed` collects what went."""
        meta = self.blocks.get(block_hash)
        if meta is None:
            return True
        subtree = self._subtree(meta)
        if any(m.ref_count or m.moving for m in subtree):
            return False
        for m in reversed(subtree):
            del self.blocks[m.block_hash]
            self._corrupt.discard(m.block_hash)
            self._account(m, -1)
            self.store_of[m.tier].free(m.handle)
            parent = self.blocks.get(m.parent_hash)
            if parent is not None:
                parent.num_children -= 1
            if m.ready:
                self.journal.record(REMOVED, m.model_id, m.tier, m.block_hash, m.parent_hash)
            if removed is not None:
                removed.append(m)
        return True
