"""The block pool's moves: one block (`move_block`) or a batch (`move_blocks`) to another
tier, optionally re-encoded, each with the same guarantee: copy, verify, switch, then
free; a failure at any step leaves a block where it was, intact. Batches take the
fastest way their stores allow: copies between memory slabs merged and chunked (a GPU
copies one chunk while the next is allocated), one vectored disk call per batch, lossy
codecs run many blocks at a time on a GPU, other re-encodes on the pool's codec threads
while the blocks encoded before them are written.

`BlockMoves` is mixed into `agent.core.block_pool.BlockPool`, whose state and lock it
uses (declared below); the copy helpers are module functions the pool's demotions use
too."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from typing_extensions import TypeIs

from agent.core import codecs
from agent.core.blocks import BlockMeta, MoveOutcome, PoolFull, payload_checksum, stored_as
from agent.core.model_spec import ModelSpec
from agent.core.tier_store import BlockUnreadable, SlabStore, TierStore, is_file, is_host_slab, is_slab
from protos.tier import Tier

log = logging.getLogger(__name__)


class _Held(list):
    """The blocks a move_blocks call switched, kept marked moving (out of their new
    tier's eviction order) until the whole batch is placed; and how long a switch waits
    for a block's readers to let go."""

    def __init__(self, reader_wait_seconds: float = 5.0, making_room: bool = False) -> None:
        super().__init__()
        self.reader_wait_seconds = reader_wait_seconds
        self.making_room = making_room  # its demotions make room (capacity), not a command's


def copy_unchanged(src: TierStore, src_handle, dst: TierStore, dst_handle, num_bytes: int, header) -> None:
    """Copy a block's stored bytes between tiers with as few copies as the stores allow:
    slab pages are written to disk as they are, and disk payloads are read straight into
    slab pages (verified there); otherwise through one temporary copy."""
    if is_host_slab(src) and not is_slab(dst):
        dst.write(dst_handle, src.views(src_handle, num_bytes), header)
    elif is_file(src) and is_host_slab(dst):
        src.read_into(src_handle, dst.views(dst_handle, num_bytes))
    elif is_slab(src) and is_slab(dst):
        _copy_many([(src, src_handle, dst, dst_handle, num_bytes)])  # synchronized before the switch
    else:
        dst.write(dst_handle, src.read(src_handle, num_bytes), header)


def _grows(target: str, new_bytes: int, stored_bytes: int, store) -> bool:
    """Whether re-encoding a block in place into `target` would free none of its room in
    `store` (whole pages, disk granules: zstd shrinking an 8 KiB block to 7.4 KiB frees
    no 1 KiB page, and every load would pay its decode): zstd
    of incompressible bytes, or of a block already in a lossy codec (decoded first, so its
    raw bytes are zstd'ed), or one lossy codec into another as big. A compress keeps such a
    block as it is: growing it takes room (in a full tier, a block dropped or demoted to
    make it) for nothing, and re-quantizing loses precision for nothing. `none` (a
    decompress) is asked to grow it."""
    return target != "none" and store.footprint(new_bytes) >= store.footprint(stored_bytes)


def _kept(codec: str, target: str, new_bytes: int, stored_bytes: int) -> MoveOutcome:
    return MoveOutcome(
        True,
        reason=f"kept as {codec}: {target} would free none of its room ({new_bytes} B, now {stored_bytes} B)",
        kept=True,
    )


def _shrinks_in_place(store: TierStore, handle, num_bytes: int) -> bool:
    """Would `num_bytes` fit in fewer of a host memory block's own pages (its handle: a
    list of page numbers)? A GPU slab's copies are asynchronous and a disk's are not
    atomic: neither is rewritten in place."""
    return (
        is_host_slab(store) and isinstance(handle, list) and store.footprint(num_bytes) < len(handle) * store.page_bytes
    )


def _first_page(handle) -> int:
    """A memory slab handle's first page (a list of pages); 0 for other handles."""
    return handle[0] if isinstance(handle, list) else 0


def _batchable(src: TierStore, dst: TierStore) -> bool:
    """Moves whose I/O a batch does at once: a CPU memory slab to or from the disk (one
    call), or between memory slabs (GPU <-> CPU: every copy queued, one synchronize)."""
    if is_host_slab(src) and is_file(dst):
        return True
    if is_slab(src) and is_slab(dst):
        return True
    return is_file(src) and is_host_slab(dst)


def pair_runs(src: Sequence[tuple[int, int]], dst: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """Map a payload laid out in source runs onto destination runs (same total length):
    [(src_address, dst_address, length)], each piece contiguous on both sides."""
    out: list[tuple[int, int, int]] = []
    si = di = 0
    s_off = d_off = 0
    while si < len(src) and di < len(dst):
        s_addr, s_len = src[si]
        d_addr, d_len = dst[di]
        n = min(s_len - s_off, d_len - d_off)
        if n > 0:
            s_at, d_at = s_addr + s_off, d_addr + d_off
            if out and out[-1][0] + out[-1][2] == s_at and out[-1][1] + out[-1][2] == d_at:
                out[-1] = (out[-1][0], out[-1][1], out[-1][2] + n)  # contiguous on both sides: one piece
            else:
                out.append((s_at, d_at, n))
        s_off += n
        d_off += n
        if s_off >= s_len:
            si, s_off = si + 1, 0
        if d_off >= d_len:
            di, d_off = di + 1, 0
    return out


def _no_room(dst, lower, num_bytes: int) -> bool:
    """Neither `dst` nor the tier below it has free space for a block of num_bytes (room
    made in `dst` would then be made by dropping, not demoting)."""
    return all(s.used_bytes + s.footprint(num_bytes) > s.capacity_bytes for s in (dst, lower))


# a batch between memory slabs is allocated, copied and switched by chunks: the first of
# COPY_FIRST_CHUNK_BYTES (the DMA starts early), each next one twice the one before up to
# COPY_CHUNK_BYTES, and none over half of what is left (the last switch, which no copy
# hides, is small)
COPY_CHUNK_BYTES = 8 << 20
COPY_FIRST_CHUNK_BYTES = 2 << 20


def _chunk_bytes(k: int, left: int) -> int:
    """The size of a batch's k-th chunk (from 0) with `left` bytes still to copy."""
    return min(COPY_CHUNK_BYTES, COPY_FIRST_CHUNK_BYTES << min(k, 30), max(COPY_FIRST_CHUNK_BYTES, left // 2))


def _issue_copies(moves: list[tuple[SlabStore, object, SlabStore, object, int]]) -> bool:
    """Queue the copies of blocks between memory slabs: (source store, its handle,
    destination store, its handle, bytes) each. Pieces adjacent in both slabs are merged
    (blocks allocated in order sit back to back on both sides: one copy for the lot
    instead of one a block, each copy being a driver call on a GPU, and a DMA of 1 MiB far
    below a bulk copy's speed; sorted by source first: a batch's pages are not always
    handed out in order). Runs are plain addresses: no tensor per block. True when a GPU
    took part: the copies are queued on its stream, not waited for."""
    pieces = []
    for src, src_handle, dst, dst_handle, n in moves:
        for s_at, d_at, m in pair_runs(src.byte_runs(src_handle, n), dst.byte_runs(dst_handle, n)):
            pieces.append((s_at, d_at, m, src, dst))
    pieces.sort(key=lambda p: p[0])
    merged: list[list] = []
    for s_at, d_at, m, src, dst in pieces:
        last = merged[-1] if merged else None
        if last and last[3] is src and last[4] is dst and last[0] + last[2] == s_at and last[1] + last[2] == d_at:
            last[2] += m
        else:
            merged.append([s_at, d_at, m, src, dst])
    cuda = False
    for s_at, d_at, m, src, dst in merged:
        s0, d0 = s_at - src.slab.data_ptr(), d_at - dst.slab.data_ptr()
        dst.slab[d0 : d0 + m].copy_(src.slab[s0 : s0 + m], non_blocking=True)
        cuda = cuda or src.slab.is_cuda or dst.slab.is_cuda
    return cuda


def gpu_quiet(stores, data: tuple[torch.Tensor, ...] = ()) -> bool:
    """Whether no copy is still running into these stores' memory (from them, or from
    `data`): True at once when none is on a GPU, else after waiting for each GPU involved
    (False, logged, if that fails: the space those copies write must not be reused)."""
    devices = {torch.device(s.device) for s in stores if getattr(s, "device", "cpu") != "cpu"}
    devices |= {t.device for t in data if t.device.type == "cuda"}
    if not devices or not torch.cuda.is_initialized():
        return True
    try:
        for dev in devices:
            torch.cuda.synchronize(dev)
    except Exception as exc:  # noqa: BLE001 - a broken GPU: keep the space out of use
        log.error("waiting for the GPU's copies after a failed move failed (%s); their space is not reused", exc)
        return False
    return True


def _copy_many(moves: list[tuple[SlabStore, object, SlabStore, object, int]]) -> None:
    """_issue_copies, then one synchronize if a GPU took part: every block is copied
    before any is switched or its source freed."""
    if _issue_copies(moves):
        for dev in _cuda_devices(moves):
            torch.cuda.synchronize(dev)


def _cuda_devices(moves) -> set:
    """The CUDA devices of the slabs a batch of copies touches."""
    return {s.slab.device for m in moves for s in (m[0], m[2]) if s.slab.is_cuda}


RECODE_WRITE_BYTES = 4 << 20  # re-encoded payload written per write_many
# raw GPU blocks encoded together on the GPU (its transient memory: a few times this)
GPU_ENCODE_BATCH_BYTES = 16 << 20


def _off_host(store: TierStore) -> TypeIs[SlabStore]:
    """A memory slab off the host (a GPU's): a lossy codec encodes its raw blocks where
    they are, many at a time."""
    return is_slab(store) and store.device != "cpu"


def _slab_payload(src, handle, stored_bytes: int) -> torch.Tensor:
    """A block's stored bytes in a memory slab, where they are (a view when its pages are
    one run; the block is moving or the lock is held, so its pages stay its own)."""
    segs = src.views(handle, stored_bytes)
    return segs[0] if len(segs) == 1 else torch.cat(segs)


def _raw_block(src, handle, stored_bytes: int, spec: ModelSpec) -> torch.Tensor:
    """An uncompressed block in a memory slab as a tensor of the model's shape, where it is."""
    return _slab_payload(src, handle, stored_bytes).view(spec.torch_dtype).reshape(spec.block_shape)


@dataclass
class _Recode:
    """A block moving to a new codec: where it is and what it becomes."""

    k: int  # its place in the caller's list
    meta: BlockMeta
    src: TierStore
    handle: object
    codec: str
    stored_bytes: int
    target: str
    done: bool = False  # switched or failed: no longer this move's to undo
    one_by_one: bool = False  # its GPU batch failed: encoded alone


def _finished(result=None, error: BaseException | None = None) -> Future:
    """A future already done: a batch on the GPU did its blocks' work in place of the
    codec threads."""
    fut: Future = Future()
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)
    return fut


class BlockMoves:
    """Moves between a block pool's tiers (see the module docstring); mixed into BlockPool."""

    # the pool's state the moves use (agent.core.block_pool.BlockPool sets it)
    lock: threading.RLock
    blocks: dict[bytes, BlockMeta]
    store_of: dict[Tier, TierStore]
    tiers: list[TierStore]  # fastest first
    models: dict[str, ModelSpec]
    codec_threads: int
    _codec_pool: ThreadPoolExecutor | None
    evictions_total: dict[Tier, int]
    demotions_total: dict[Tier, int]
    commanded_demotions_total: dict[Tier, int]
    recoded_bytes_total: int
    promotions_total: int
    gpu_codec_blocks_total: dict[tuple[str, str], int]
    moved_bytes_total: dict[tuple[Tier, Tier], int]

    if TYPE_CHECKING:  # the pool's own methods the moves call (BlockPool defines them)

        def lower_of(self, tier: Tier) -> TierStore | None: ...
        def pin_tier(self, meta: BlockMeta) -> int: ...
        def _allocate(self, store: TierStore, num_bytes: int, block_hash: bytes) -> Any: ...
        def _drop_corrupt(self) -> None: ...
        def _drop_subtree(self, block_hash: bytes, removed: list[BlockMeta] | None = None) -> bool: ...
        def _enter_lru(self, meta: BlockMeta) -> None: ...
        def _entry_codec(self, tier: Tier, model_id: str, current: str) -> str: ...
        def _mark_corrupt(self, meta: BlockMeta, why: str) -> None: ...
        def _move_failed(self, reason: str) -> MoveOutcome: ...
        def _notice(self, kind: str, message: str) -> None: ...
        def _room_in_bulk(self, store: TierStore, incoming: list[tuple]) -> None: ...
        def _switch(
            self,
            meta: BlockMeta,
            tier: Tier,
            handle,
            codec: str,
            stored_bytes: int,
            checksum: int,
            lru: bool = True,
        ) -> None: ...

    def move_block(
        self,
        block_hash: bytes,
        to_tier: Tier,
        codec: str | None = None,
        wait_seconds: float = 5.0,
        held: _Held | None = None,
    ) -> MoveOutcome:
        """Move (and optionally re-encode) one block: copy, verify, switch, then free.

        A failure at any step leaves the block where it was, intact. `held`: the block,
        once switched, stays marked moving and is added there (its batch lets it go)."""
        dst = self.store_of.get(to_tier)
        if dst is None:
            return MoveOutcome(False, reason=f"this agent has no {to_tier.label} tier")
        if codec is not None:
            try:
                codecs.check_codec(codec)
            except codecs.CodecError as exc:  # a command's bad input: a failed move, not a crash
                return MoveOutcome(False, reason=str(exc))
        with self.lock:
            meta = self.blocks.get(block_hash)
            refused = self._move_refused(meta, to_tier, codec)
            if refused is not None:
                return refused
            assert meta is not None  # a block not held is refused
            meta.moving = True
            src, src_tier, src_handle, src_codec, src_stored = (
                self.store_of[meta.tier],
                meta.tier,
                meta.handle,
                meta.codec,
                meta.stored_bytes,
            )
        new_handle = None
        # the block is this move's to let go until the switch (or its refusal) let go of it:
        # from then on another move may have it marked moving, and its mark is not ours to clear
        released = False
        try:
            target = codec if codec is not None else self._entry_codec(to_tier, meta.model_id, src_codec)
            if target != src_codec:
                data, digest = self._reencode(meta.model_id, src, src_handle, src_stored, src_codec, target)
                nbytes = data.numel()
                if dst is src and _grows(target, nbytes, src_stored, dst):  # a compress in place
                    return _kept(src_codec, target, nbytes, src_stored)
            else:
                data, nbytes, digest = None, src_stored, meta.checksum
            with self.lock:
                try:
                    new_handle = self._allocate(dst, nbytes, block_hash)
                except PoolFull:  # no page free, none could be made (a tier full of pinned blocks)
                    if dst is not src or data is None or not _shrinks_in_place(dst, src_handle, nbytes):
                        raise
            if new_handle is None:  # a compress in place that fits the block's own pages
                assert data is not None and is_host_slab(dst) and isinstance(src_handle, list)
                released = True  # let go there, as by the switch
                return self._recode_in_place(meta, dst, src_handle, data, (target, nbytes, digest), wait_seconds, held)
            # what a disk header records; memory tiers take no header
            header = stored_as(meta, target, digest) if dst.tier is Tier.DISK else meta
            try:
                if data is not None:
                    dst.write(new_handle, data, header)
                else:
                    copy_unchanged(src, src_handle, dst, new_handle, nbytes, header)
            except OSError as exc:
                kind = "write_error" if dst.tier is Tier.DISK else "read_error"
                self._notice(
                    kind, f"moving a block from the {src_tier.label} to the {dst.tier.label} tier failed: {exc}"
                )
                raise
            stored = (target, nbytes, getattr(new_handle, "checksum", 0) or digest)
            new, new_handle = new_handle, None  # switched, or given back if readers hold on too long
            released = True  # the switch lets the block go (or keeps it marked for `held`, its batch)
            return self._switch_when_unread(meta, src, src_handle, dst, new, wait_seconds, stored, held)
        except BlockUnreadable as exc:
            released = True  # let go there (and removed unless read)
            return self._unreadable_source(meta, exc)
        except (PoolFull, OSError, codecs.CodecError) as exc:
            return self._move_failed(f"{type(exc).__name__}: {exc}")
        finally:
            # a write that failed part way may have GPU copies still landing in its pages
            quiet = new_handle is None or gpu_quiet([src, dst])
            with self.lock:
                if not released:
                    meta.moving = False
                if new_handle is not None and quiet:
                    dst.free(new_handle)
                self._drop_corrupt()  # (skips blocks still read or moving)

    def move_blocks(
        self,
        block_hashes: Sequence[bytes],
        to_tier: Tier | None,
        codec: str | None = None,
        *,
        from_tier: Tier | None = None,
        reader_wait_seconds: float = 5.0,
    ) -> list[MoveOutcome]:
        """Move many blocks with move_block's guarantees (copy, verify, switch, free; a
        failure leaves a block where it was), batching the I/O: blocks going between the
        CPU slab and the disk as they are (no re-encode) are read or written with one
        vectored call per run of adjacent disk extents; blocks changing codec go through
        the codec pipeline (_move_recoded). `to_tier` None: each block stays in the tier
        it is in when the move starts (a compress in place, `codec` given). `from_tier`:
        only blocks still in that tier move (the room-making's victims, chosen before).
        `reader_wait_seconds`: how long a copied block's switch waits for its readers."""
        if to_tier is None and codec is None:
            raise ValueError("a move in place needs a codec")
        dst = self.store_of.get(to_tier) if to_tier is not None else None
        if to_tier is not None and dst is None:
            return [self.move_block(h, to_tier, codec) for h in block_hashes]
        if codec is not None:
            try:
                codecs.check_codec(codec)
            except codecs.CodecError as exc:  # a command's bad input: failed moves, not a crash
                return [self._move_failed(str(exc)) for _ in block_hashes]
        out: dict[int, MoveOutcome] = {}
        jobs: list[tuple[int, BlockMeta, TierStore, object, object]] = []  # k, meta, src, src handle, new handle
        to_place: list[tuple[int, BlockMeta, TierStore]] = []  # the disk phase's, before their allocation
        in_place: list[BlockMeta] = []  # asked for where they are: the batch's room never comes from them
        # switched by the batch, held until it is placed (below); `from_tier` is given only
        # by the room-making step, whose demotions count as capacity ones
        held = _Held(reader_wait_seconds, making_room=from_tier is not None)
        slab_copies: list[tuple[int, BlockMeta, TierStore, object]] = []  # k, meta, src, src handle
        recode: dict[Tier, list[_Recode]] = {}
        singles: list[int] = []
        first: dict[bytes, int] = {}
        repeats: dict[int, int] = {}  # a hash listed again: its first listing's outcome

        def release_unstarted() -> None:  # lock held: the blocks marked so far are movable again
            self._release_recodes(recode.values())
            for m in [m for _, m, _, _ in slab_copies] + [m for _, m, _ in to_place] + in_place:
                m.moving = False

        with self.lock:
            try:
                for k, h in enumerate(block_hashes):
                    if h in first:
                        repeats[k] = first[h]
                        continue
                    first[h] = k
                    meta = self.blocks.get(h)
                    if from_tier is not None and meta is not None and meta.tier != from_tier:
                        out[k] = MoveOutcome(False, reason=f"no longer in the {from_tier.label} tier")
                        continue
                    refused = self._move_refused(meta, to_tier, codec)
                    if refused is not None:
                        out[k] = refused
                        if refused.ok and meta is not None:  # already there: kept there while the batch makes room
                            self._keep(meta, in_place)
                        continue
                    assert meta is not None  # a block not held is refused
                    tier = to_tier if to_tier is not None else meta.tier
                    src = self.store_of[meta.tier]
                    target = codec if codec is not None else self._entry_codec(tier, meta.model_id, meta.codec)
                    if target != meta.codec:
                        meta.moving = True
                        job = _Recode(k, meta, src, meta.handle, meta.codec, meta.stored_bytes, target)
                        recode.setdefault(tier, []).append(job)
                        continue
                    # a move in place (no `dst`) re-encodes every block it moves: recoded above
                    assert dst is not None
                    if not _batchable(src, dst):
                        singles.append(k)
                        continue
                    meta.moving = True  # before making room: that must not drop or demote this block
                    if is_slab(src) and is_slab(dst):
                        slab_copies.append((k, meta, src, meta.handle))  # allocated chunk by chunk
                    else:
                        to_place.append((k, meta, src))
            except BaseException:  # nothing moved: every block marked so far is movable again
                release_unstarted()
                raise
        try:
            # the room these need, made at once (one batch down) rather than block by block
            if dst is not None and (to_place or slab_copies):
                self._room_in_bulk(
                    dst, [(m, src) for _, m, src in to_place] + [(m, src) for _, m, src, _ in slab_copies]
                )
            with self.lock:
                full: PoolFull | None = None  # nothing frees room under the lock: no larger block fits after
                full_bytes = 0
                for n, (k, meta, src) in enumerate(to_place):
                    try:
                        if full is not None and meta.stored_bytes >= full_bytes:
                            raise full
                        assert dst is not None  # placed blocks have a destination (see above)
                        new_handle = self._allocate(dst, meta.stored_bytes, meta.block_hash)
                    except PoolFull as exc:
                        full, full_bytes = exc, meta.stored_bytes
                        meta.moving = False
                        out[k] = self._move_failed(f"PoolFull: {exc}")
                    except BaseException:
                        del to_place[:n]  # the ones before it are jobs (or failed) now
                        raise
                    else:
                        jobs.append((k, meta, src, meta.handle, new_handle))
                to_place.clear()
        except BaseException:  # nothing moved yet: every block stays where it was, movable
            with self.lock:
                self._abandon(jobs, dst)
                release_unstarted()
            raise
        # Every block switched stays marked moving (in `held`, out of its new tier's
        # eviction order) until the whole batch is placed: the room made for its later
        # blocks never evicts or demotes one it already moved (the least recently used in
        # its new tier). The copies between memory slabs go first: they overlap their
        # allocation with the copies, the disk phase allocates up front.
        phase = 0  # the phases before it ran (and cleaned up after themselves if they failed)
        try:
            if slab_copies:
                assert is_slab(dst)  # chosen for it above
                out.update(self._copy_between_slabs(slab_copies, dst, held))
            phase = 1
            if jobs:
                assert dst is not None  # a move in place places no job
                out.update(self._move_placed(jobs, dst, held))
            phase = 2
            while recode:  # the slowest tier first: a compress in place there frees room for the ones above
                tier = max(recode, key=int)
                out.update(self._move_recoded(recode.pop(tier), self.store_of[tier], held))
            phase = 3
            for k in singles:
                assert to_tier is not None  # a move in place has no single moves (recodes only)
                out[k] = self.move_block(block_hashes[k], to_tier, codec, held=held)
        except BaseException:  # the phases that had not started: their blocks stay where they were
            with self.lock:
                if phase < 1:
                    self._abandon(jobs, dst)
                self._release_recodes(recode.values())
            raise
        finally:  # the batch is placed (or failed): its switched blocks may move and go again
            with self.lock:
                for meta in held:
                    meta.moving = False
                    self._enter_lru(meta)
                for meta in in_place:
                    meta.moving = False
                self._drop_corrupt()  # whose removal a block of this batch (moving then) refused
        for k, j in repeats.items():
            out[k] = out[j]
        return [out[k] for k in range(len(block_hashes))]

    def _move_placed(self, jobs: list, dst: TierStore, held: _Held) -> dict[int, MoveOutcome]:
        """Move blocks as they are between a memory slab and the disk into the space
        allocated for them (k, meta, source, source handle, new handle; all marked
        moving): to the disk in one write_many, from the disk in one read_many; then
        switch them (into `held`). A failure leaves each block not yet switched where it
        was."""
        out: dict[int, MoveOutcome] = {}
        waiting: list = []
        settled: set[int] = set()
        try:
            if is_file(dst):  # stored as it is: the block's meta is its header
                errs = dst.write_many([(new, src.views(old, m.stored_bytes), m) for _, m, src, old, new in jobs])
            else:  # from the disk into a CPU slab (_batchable)
                assert is_slab(dst)
                reads = [(old, dst.views(new, m.stored_bytes)) for _, m, _, old, new in jobs]
                errs = jobs[0][2].read_many(reads)
            self._settle(jobs, errs, dst, out, waiting, settled, held)
        except BaseException:  # the blocks not switched stay where they were
            self._abandon_unswitched(jobs, settled, waiting, dst)
            raise
        return self._switch_waiting(waiting, dst, out, held)

    def _copy_between_slabs(self, copies: list, dst: SlabStore, held: _Held) -> dict[int, MoveOutcome]:
        """Move blocks as they are between memory slabs (k, meta, source, source handle;
        all marked moving) by chunks (_chunk_bytes): a chunk is allocated and its copies
        queued (_issue_copies); while a GPU copies it, the next chunk is allocated and
        queued, and each chunk is switched once its copies are done (its CUDA event) while
        the later ones still copy (into `held`). In a swap between two full tiers (the
        room for a chunk is made by demoting into the tier its sources are in) the chunks
        in flight are switched first, their sources' space taking the demoted blocks. A
        failure leaves each block not yet switched where it was."""
        out: dict[int, MoveOutcome] = {}
        waiting: list = []
        settled: set[int] = set()
        placed: list = []  # allocated so far: (k, meta, src, old, new)
        issued: deque[list] = deque()  # [chunk, its event or None] copied or copying, not yet switched
        i, n_chunks = 0, 0
        left = sum(meta.stored_bytes for _, meta, _, _ in copies)
        # a swap (GPU <-> CPU): the room made in `dst` is made by demoting into the tier
        # the batch's sources are in, which its switched chunks free
        lower = self.lower_of(dst.tier)
        swap = lower is not None and any(src is lower for _, _, src, _ in copies)
        try:
            while i < len(copies) or issued:
                drain = False  # both tiers full: switch what was copied before making room
                if i < len(copies):
                    chunk: list[tuple[int, BlockMeta, SlabStore, object, object]] = []
                    size, limit = 0, _chunk_bytes(n_chunks, left)
                    with self.lock:
                        full: PoolFull | None = None  # nothing frees room under the lock: no larger block fits
                        full_bytes = 0
                        while i < len(copies) and size < limit:
                            k, meta, src, old = copies[i]
                            if swap and (chunk or issued) and _no_room(dst, lower, meta.stored_bytes):
                                drain = True  # else making room would drop the blocks it demotes
                                break
                            try:
                                if full is not None and meta.stored_bytes >= full_bytes:
                                    raise full
                                new = self._allocate(dst, meta.stored_bytes, meta.block_hash)
                            except PoolFull as exc:
                                full, full_bytes = exc, meta.stored_bytes
                                meta.moving = False
                                out[k] = self._move_failed(f"PoolFull: {exc}")
                                new = None
                            i += 1
                            left -= meta.stored_bytes
                            if new is not None:
                                chunk.append((k, meta, src, old, new))
                                placed.append(chunk[-1])
                                size += meta.stored_bytes
                    if chunk:
                        issued.append([chunk, None])  # before queuing: a failure there abandons it
                        moves = [(src, old, dst, new, m.stored_bytes) for _, m, src, old, new in chunk]
                        if _issue_copies(moves):
                            event = issued[-1][1] = torch.cuda.Event()
                            devices = _cuda_devices(moves)  # one GPU tier per agent: its device
                            if devices:  # on the stream the copies went to, not the current device's
                                event.record(torch.cuda.current_stream(next(iter(devices))))
                            else:
                                event.record()
                        n_chunks += 1
                # switch the chunks whose copies are done: all of them once nothing is left
                # to queue (waiting on each in turn), else those already finished
                while issued and (drain or i >= len(copies) or issued[0][1] is None or issued[0][1].query()):
                    chunk, event = issued[0]
                    if event is not None:
                        event.synchronize()
                    self._settle(chunk, [None] * len(chunk), dst, out, waiting, settled, held)
                    issued.popleft()
        except BaseException:  # the blocks not switched stay where they were
            self._abandon_unswitched(placed, settled, waiting, dst)
            with self.lock:
                for _, meta, _, _ in copies[i:]:  # never allocated
                    meta.moving = False
            raise
        return self._switch_waiting(waiting, dst, out, held)

    def _switch_waiting(
        self, waiting: list, dst: TierStore, out: dict[int, MoveOutcome], held: _Held
    ) -> dict[int, MoveOutcome]:
        """Switch the copied blocks that readers held when their copies were done, once
        the readers let go (into `held`)."""
        for n, (k, meta, src, old, new) in enumerate(waiting):
            try:
                out[k] = self._switch_when_unread(meta, src, old, dst, new, held=held)
            except BaseException:  # the ones not switched yet stay where they were
                with self.lock:
                    for _, m, _, _, nw in waiting[n:]:
                        m.moving = False
                        if m.handle is not nw:
                            dst.free(nw)
                raise
        return out

    def _abandon_unswitched(self, jobs: list, settled: set[int], waiting: list, dst: TierStore) -> None:
        """After a failure: each block of a batch (k, meta, source, source handle, new
        handle) that was not switched (nor failed on its own) stays where it was, movable
        again, and its new space goes back. Copies a GPU may still be running into that
        space are waited for first; if they cannot be, the space is kept out of use
        (leaked) rather than handed to a block they would overwrite."""
        parked = {k for k, *_ in waiting}
        left = [j for j in jobs if j[0] not in settled or j[0] in parked]
        quiet = gpu_quiet([j[2] for j in left] + [dst])
        with self.lock:
            for _, meta, _, _, new in left:
                meta.moving = False
                if quiet:
                    dst.free(new)

    def _release_recodes(self, groups) -> None:
        """Re-encoding moves that did not start: their blocks are movable again."""
        for jobs in groups:
            for job in jobs:
                job.meta.moving = False

    def _settle(
        self, batch: list, errs: list, dst: TierStore, out: dict, waiting: list, settled: set, held: _Held
    ) -> None:
        """Switch (or fail) blocks whose bytes are in place or failed (k, meta, source,
        source handle, new handle; an error or None each): a switched block goes into
        `held`, one that readers hold is left in `waiting`. Switched (sources freed) from the highest source pages down:
        a memory slab's free list is a stack, so the next batch into it gets these pages
        in ascending order, back to back with its source's (one copy for the lot)."""
        done = sorted(zip(batch, errs, strict=True), key=lambda j: _first_page(j[0][3]), reverse=True)
        with self.lock:
            for (k, meta, src, old, new), err in done:
                refused = self._pinned_meanwhile(meta, dst) if err is None else None
                if refused is not None:
                    meta.moving = False
                    dst.free(new)
                    out[k] = refused
                elif err is None and meta.ref_count == 0:
                    try:
                        self._finish_move(meta, src, old, dst, new, held=held)
                    finally:  # switched, even if what followed raised: its new space is its own
                        if meta.handle is new:
                            settled.add(k)
                    out[k] = MoveOutcome(True, meta.stored_bytes)
                elif err is None:
                    waiting.append((k, meta, src, old, new))
                else:
                    meta.moving = False
                    dst.free(new)
                    if isinstance(err, BlockUnreadable):
                        out[k] = self._unreadable_source(meta, err)
                    else:
                        self._notice(
                            "write_error",
                            f"moving a block from the {meta.tier.label} to the {dst.tier.label} tier failed: {err}",
                        )
                        out[k] = self._move_failed(f"{type(err).__name__}: {err}")
                settled.add(k)  # once switched, parked or failed: a block that raised midway is still to abandon

    def _move_recoded(self, jobs: list[_Recode], dst: TierStore, held: _Held) -> dict[int, MoveOutcome]:
        """Move blocks that change codec on the way (all marked moving), with move_block's
        guarantees, as a pipeline: codec_threads threads read, decode, encode and hash the
        blocks in order while this thread allocates and writes the ones encoded before
        them, RECODE_WRITE_BYTES at a time (one write_many on the disk: one vectored call
        and one fdatasync per run of extents, instead of one per block)."""
        out: dict[int, MoveOutcome] = {}
        pending: deque[tuple[_Recode, Future]] = deque()
        batch: list[tuple[_Recode, torch.Tensor, int]] = []
        batch_bytes = 0
        deferred: list[_Recode] = []  # no room even after making room: tried again at the end
        queued = deque(jobs)
        try:
            while True:
                # encode ahead of the writes: while one batch is written (an fdatasync
                # on a durable disk), the codec threads make the next ones
                ahead = sum(job.stored_bytes for job, _ in pending)
                while queued and (ahead < 3 * RECODE_WRITE_BYTES or len(pending) < 2 * self.codec_threads):
                    on_gpu = self._gpu_batch(queued, dst) or self._gpu_decode_batch(queued, dst)
                    if on_gpu:  # encoded here, together, on the GPU
                        pending.extend(on_gpu)
                        ahead += sum(job.stored_bytes for job, _ in on_gpu)
                        continue
                    job = queued.popleft()
                    try:
                        pending.append((job, self._codecs().submit(self._recode, job)))
                    except BaseException:  # no codec thread to take it (shutting down)
                        self._recode_failed(job.meta, "the codec threads are gone")
                        raise
                    ahead += job.stored_bytes
                if not pending:
                    break
                job, fut = pending.popleft()
                try:
                    data, digest = fut.result()
                except BlockUnreadable as exc:
                    out[job.k] = self._unreadable_source(job.meta, exc)
                    continue
                except (OSError, codecs.CodecError) as exc:
                    out[job.k] = self._recode_failed(job.meta, f"{type(exc).__name__}: {exc}")
                    continue
                except BaseException:
                    self._recode_failed(job.meta, "unexpected error")
                    raise
                if job.src is dst and _grows(job.target, data.numel(), job.stored_bytes, dst):
                    with self.lock:  # a compress in place that would grow it: it stays as it is
                        job.meta.moving = False
                    out[job.k] = _kept(job.codec, job.target, data.numel(), job.stored_bytes)
                    continue
                batch.append((job, data, digest))
                batch_bytes += data.numel()
                if batch_bytes >= RECODE_WRITE_BYTES:
                    out.update(self._write_recoded(batch, dst, deferred, held))
                    batch, batch_bytes = [], 0
            out.update(self._write_recoded(batch, dst, deferred, held))
            batch = []
            out.update(self._retry_deferred(deferred, dst, held))  # the others gave their space back
        finally:  # an unexpected error: the blocks not finished stay where they were
            left = [job for job, _ in pending] + [job for job, *_ in batch if not job.done] + list(queued) + deferred
            running = [fut for _, fut in pending if not fut.cancel()]
            wait(running)  # no codec thread still reads a block that is free to move again
            with self.lock:
                for job in left:
                    job.meta.moving = False
        return out

    def _retry_deferred(self, deferred: list[_Recode], dst: TierStore, held: _Held) -> dict[int, MoveOutcome]:
        """Re-encoded blocks that found no room in `dst` on their turn (a compress in place
        of a tier full of the batch itself, say): each goes on its own (move_block) while
        the others stay held, so the room made for one never pushes out another. When not
        even one finds room (every block that could go is the batch's), the last of them
        goes down to the tier below first, as it is, and comes back re-encoded at the end,
        once the others freed their space (each takes less than it gave back); with no
        tier below (the disk), up to a faster tier with room instead; with none either, it
        is dropped (as the tier's safety net would). A block no room can be made for fails
        by name (PoolFull) and stays where it was. Jobs leave `deferred` as they are taken:
        those left there are the caller's to release."""
        out: dict[int, MoveOutcome] = {}
        lower = self.lower_of(dst.tier) or self._faster_with_room(dst)
        parked: _Recode | None = None  # sent down to make room, back at the end
        parking_tried = False
        failed: list[BlockMeta] = []  # kept from the room made for the others until the end
        try:
            while deferred:
                job = deferred.pop(0)
                with self.lock:
                    job.meta.moving = False
                result = self.move_block(job.meta.block_hash, dst.tier, job.target, held=held)
                if not result.ok and result.reason.startswith("PoolFull") and not parking_tried and deferred:
                    parking_tried = True
                    last = deferred.pop()
                    with self.lock:
                        last.meta.moving = False  # taken from the batch: kept below, if it stays
                    if self._send_down(last.meta, dst, lower):
                        if lower is None:
                            out[last.k] = self._move_failed("dropped to make room for the others")
                        else:
                            parked = last
                        result = self.move_block(job.meta.block_hash, dst.tier, job.target, held=held)
                    else:
                        out[last.k] = self._move_failed(f"PoolFull: no room in the {dst.tier.label} tier for it")
                        self._keep(last.meta, failed)
                out[job.k] = result
                if not result.ok:
                    self._keep(job.meta, failed)
            if parked is not None:
                out[parked.k] = self.move_block(parked.meta.block_hash, dst.tier, parked.target, held=held)
        finally:
            with self.lock:
                for meta in failed:
                    meta.moving = False
        return out

    def _send_down(self, meta: BlockMeta, store: TierStore, other: TierStore | None) -> bool:
        """Free a held block's space in `store` (it is let go first): moved as it is to
        `other` (the tier below, or a faster one with room), or, with none (a single tier,
        or every other one full), dropped if it may be (an unpinned leaf no one reads).
        Whether its space is free now."""
        with self.lock:
            meta.moving = False
            if other is None:
                if meta.block_hash not in self.blocks or meta.num_children or meta.ref_count or self.pin_tier(meta):
                    return False
                self._drop_subtree(meta.block_hash)
                self.evictions_total[store.tier] += 1
                return True
        moved = self.move_blocks([meta.block_hash], other.tier, reader_wait_seconds=0.0)[0]
        return moved.ok and moved.moved_bytes > 0

    def _faster_with_room(self, store: TierStore) -> TierStore | None:
        """The slowest tier faster than `store` with a free page for a raw block (a block
        parked there for a while), or None."""
        i = self.tiers.index(store)
        for faster in reversed(self.tiers[:i]):
            if faster.capacity_bytes - faster.used_bytes >= max(
                (m.block_bytes for m in self.models.values()), default=0
            ):
                return faster
        return None

    def _keep(self, meta: BlockMeta, kept: list[BlockMeta]) -> None:
        """Mark a block that stayed where it was moving again, so the room its batch makes
        for others never comes from it (released by whoever holds `kept`)."""
        with self.lock:
            if meta.block_hash in self.blocks and not meta.moving:
                meta.moving = True
                kept.append(meta)

    def _gpu_batch(self, queued: deque[_Recode], dst: TierStore) -> list[tuple[_Recode, Future]]:
        """Raw GPU blocks at the head of the queue going to a lossy codec, up to
        GPU_ENCODE_BATCH_BYTES of one model: taken off the queue and encoded in one batch
        on the GPU (codecs.encode_batch), each with its finished future. Into a memory
        slab (the pinned CPU tier) the payloads stay on the GPU until their write copies
        them straight into the slab's pages, unhashed (checksum 0, not known: hashed where
        one is needed, as a disk write does); elsewhere they come to the host with their
        checksums. [] when the head is not such a block, or the batch failed (out of GPU
        memory, say): the blocks are back in the queue and take the per-block path."""
        taken: list[_Recode] = []
        size = 0
        while queued and size < GPU_ENCODE_BATCH_BYTES:
            job = queued[0]
            first = taken[0] if taken else job
            if not (
                _off_host(job.src)
                and job.codec == "none"
                and not job.one_by_one
                and job.target in codecs.BATCHED
                and job.meta.model_id == first.meta.model_id
                and job.target == first.target
            ):
                break
            taken.append(queued.popleft())
            size += job.stored_bytes
        if not taken:
            return []
        spec = self.models[taken[0].meta.model_id]
        try:
            blocks = torch.stack([_raw_block(job.src, job.handle, job.stored_bytes, spec) for job in taken])
            to_slab = hasattr(dst, "views")
            payloads = codecs.encode_batch(taken[0].target, blocks, on_host=not to_slab)
        except (RuntimeError, codecs.CodecError) as exc:  # torch.OutOfMemoryError is a RuntimeError
            return self._one_by_one(queued, taken, "encode", exc)
        except BaseException:  # back in the queue: the move's cleanup finds them there
            queued.extendleft(reversed(taken))
            raise
        self._count_gpu_codec("encode", "batch", len(taken))
        return [
            (job, _finished((data, 0 if to_slab else payload_checksum(data))))
            for job, data in zip(taken, payloads, strict=True)
        ]

    def _gpu_decode_batch(self, queued: deque[_Recode], dst: TierStore) -> list[tuple[_Recode, Future]]:
        """Compressed host blocks at the head of the queue promoted raw into a GPU tier, up
        to GPU_ENCODE_BATCH_BYTES (uncompressed) of one model and codec: taken off the
        queue, their payloads copied to the GPU as they are (the smaller bytes cross; from
        a CPU slab straight from its pinned pages, from the disk read and verified into
        pinned memory first) and decoded there in one batch (codecs.decode_batch). Each
        comes with its finished future: the raw block on the GPU (its checksum 0, not
        known: hashed where one is needed), or why its source was unreadable. [] when the
        head is not such a block, or the batch failed (out of GPU memory, say): the blocks
        are back in the queue and take the per-block path."""
        if not _off_host(dst) or not queued:
            return []
        head = queued[0]
        spec = self.models[head.meta.model_id]
        try:
            payload_bytes = codecs.payload_bytes(head.codec, spec.block_shape, spec.torch_dtype)
        except codecs.CodecError:
            return []
        taken: list[_Recode] = []
        while queued and len(taken) * spec.block_bytes < GPU_ENCODE_BATCH_BYTES:
            job = queued[0]
            if not (
                job.target == "none"
                and job.codec in codecs.DECODE_BATCHED
                and job.codec == head.codec
                and job.meta.model_id == head.meta.model_id
                and job.stored_bytes == payload_bytes
                and not job.one_by_one
                and not _off_host(job.src)
            ):
                break
            taken.append(queued.popleft())
        if not taken:
            return []
        errors: dict[int, Exception] = {}
        try:
            payloads = torch.empty((len(taken), payload_bytes), dtype=torch.uint8, device=dst.device)
            from_disk = [(i, job.src) for i, job in enumerate(taken) if is_file(job.src)]
            if from_disk:
                staged = torch.empty(
                    (len(from_disk), payload_bytes), dtype=torch.uint8, pin_memory=torch.cuda.is_available()
                )
                reads = [(taken[i].handle, [staged[r]]) for r, (i, _) in enumerate(from_disk)]
                for (i, _), err in zip(from_disk, from_disk[0][1].read_many(reads), strict=True):
                    if err is not None:
                        errors[i] = err
                rows = torch.tensor([i for i, _ in from_disk], device=dst.device)
                payloads.index_copy_(0, rows, staged.to(dst.device, non_blocking=True))
            for i, job in enumerate(taken):
                if not is_file(job.src):  # a CPU slab's (pinned) pages, as they are
                    assert is_slab(job.src), f"a {job.src.tier.label} store that is neither a slab nor a file"
                    at = 0
                    for seg in job.src.views(job.handle, payload_bytes):
                        payloads[i, at : at + seg.numel()].copy_(seg, non_blocking=True)
                        at += seg.numel()
            blocks = codecs.decode_batch(head.codec, payloads, spec.block_shape, spec.torch_dtype)
        except (RuntimeError, codecs.CodecError) as exc:  # torch.OutOfMemoryError is a RuntimeError
            return self._one_by_one(queued, taken, "decode", exc)
        except BaseException:  # back in the queue: the move's cleanup finds them there
            queued.extendleft(reversed(taken))
            raise
        self._count_gpu_codec("decode", "batch", len(taken) - len(errors))
        return [
            (
                job,
                _finished(error=errors[i]) if i in errors else _finished((blocks[i].reshape(-1).view(torch.uint8), 0)),
            )
            for i, job in enumerate(taken)
        ]

    def _one_by_one(self, queued: deque, taken: list, op: str, exc: BaseException) -> list:
        """A batch on the GPU failed (out of its memory, say): its blocks go back to the
        head of the queue, each to take the per-block path (counted)."""
        log.warning("%s of %d blocks as one batch on the GPU failed (%s); one by one instead", op, len(taken), exc)
        self._count_gpu_codec(op, "one_by_one", len(taken))
        for job in taken:
            job.one_by_one = True
        queued.extendleft(reversed(taken))
        return []

    def _count_gpu_codec(self, op: str, path: str, num_blocks: int) -> None:
        with self.lock:
            key = (op, path)
            self.gpu_codec_blocks_total[key] = self.gpu_codec_blocks_total.get(key, 0) + num_blocks

    def _codecs(self) -> ThreadPoolExecutor:
        with self.lock:
            if self._codec_pool is None:
                self._codec_pool = ThreadPoolExecutor(self.codec_threads, thread_name_prefix="codec")
            return self._codec_pool

    def close(self) -> None:
        """Let the codec threads go (after the moves running on them); a later move that
        changes a codec starts new ones."""
        with self.lock:
            pool, self._codec_pool = self._codec_pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def _recode(self, job: _Recode) -> tuple[torch.Tensor, int]:
        """_reencode for the pipeline (a codec thread)."""
        return self._reencode(job.meta.model_id, job.src, job.handle, job.stored_bytes, job.codec, job.target)

    def _reencode(
        self, model_id: str, src: TierStore, handle, stored_bytes: int, codec: str, target: str
    ) -> tuple[torch.Tensor, int]:
        """A block's payload in codec `target` and the payload's checksum: a CPU slab block
        is decoded from its pages as they are (it is moving or the lock is held: they stay
        its own), others from a verified read (raises BlockUnreadable)."""
        spec = self.models[model_id]
        if _off_host(src) and codec == "none":
            try:  # a lossy target quantizes it on the GPU
                data = codecs.encode(target, _raw_block(src, handle, stored_bytes, spec))
                return data, payload_checksum(data)
            except torch.OutOfMemoryError as exc:  # the same bytes on the host (the C loops), not a failed move
                log.warning("encoding a block on the GPU ran out of its memory (%s); encoding it on the host", exc)
            block = codecs.decode("none", src.read(handle, stored_bytes), spec.block_shape, spec.torch_dtype)
        elif is_host_slab(src):
            block = codecs.decode(codec, _slab_payload(src, handle, stored_bytes), spec.block_shape, spec.torch_dtype)
        else:
            block = codecs.decode(codec, src.read(handle, stored_bytes), spec.block_shape, spec.torch_dtype)
        data = codecs.encode(target, block)
        return data, payload_checksum(data)

    def _unreadable_source(self, meta: BlockMeta, exc: BlockUnreadable) -> MoveOutcome:
        """A move's source failed its read: the block is marked, removed unless read now,
        and the move failed."""
        self._mark_corrupt(meta, str(exc))
        with self.lock:
            meta.moving = False  # else _drop_subtree refuses it and the corrupt block stays
            if meta.ref_count == 0:
                self._drop_subtree(meta.block_hash)
        return self._move_failed(f"source unreadable: {exc}")

    def _recode_failed(self, meta: BlockMeta, reason: str, dst: TierStore | None = None, new=None) -> MoveOutcome:
        with self.lock:
            meta.moving = False
            if new is not None and dst is not None:
                dst.free(new)
        return self._move_failed(reason)

    def _write_recoded(
        self,
        batch: list[tuple[_Recode, torch.Tensor, int]],
        dst: TierStore,
        deferred: list[_Recode],
        held: _Held,
    ) -> dict[int, MoveOutcome]:
        """Allocate, write and switch re-encoded blocks (each job leaves moving). When the
        tier has no room for the next block, the ones placed so far are written and
        switched first: their sources' space comes back (a compress in a full tier).
        Into another tier, the room they need is made at once first (_room_in_bulk)."""
        out: dict[int, MoveOutcome] = {}
        if batch and all(job.src is not dst for job, _, _ in batch):
            self._room_in_bulk(dst, [(job.meta, job.src, data.numel()) for job, data, _ in batch])
        i = 0
        while i < len(batch):
            placed: list[tuple[_Recode, torch.Tensor, int, object]] = []
            with self.lock:
                try:
                    while i < len(batch):
                        job, data, digest = batch[i]
                        if placed:  # no room made for it while placed blocks hold space to give back
                            new = dst.allocate(data.numel(), job.meta.block_hash)
                            if new is None:
                                break
                        else:
                            try:
                                new = self._allocate(dst, data.numel(), job.meta.block_hash)
                            except PoolFull:  # full of this move's blocks: once they are smaller
                                deferred.append(job)
                                i += 1
                                continue
                        placed.append((job, data, digest, new))
                        i += 1
                except BaseException:
                    for _, _, _, new in placed:
                        dst.free(new)
                    raise
            out.update(self._write_placed(placed, dst, held))
        return out

    def _write_placed(
        self, placed: list[tuple[_Recode, torch.Tensor, int, object]], dst: TierStore, held: _Held
    ) -> dict[int, MoveOutcome]:
        out: dict[int, MoveOutcome] = {}
        if not placed:
            return out
        # what a disk header records; memory tiers take no header
        headers = [
            stored_as(job.meta, job.target, digest) if dst.tier is Tier.DISK else job.meta
            for job, _, digest, _ in placed
        ]
        items = [(new, data, h) for (_, data, _, new), h in zip(placed, headers, strict=True)]
        try:
            errs = dst.write_many(items)
        except BaseException:  # nothing switched: the blocks stay, their new space goes back
            quiet = gpu_quiet([dst, *(job.src for job, *_ in placed)])  # no copy still writing there
            with self.lock:
                for job, _, _, new in placed:
                    job.meta.moving = False
                    if quiet:
                        dst.free(new)
            raise
        for (job, data, digest, new), err in zip(placed, errs, strict=True):
            if err is not None:
                kind = "write_error" if dst.tier is Tier.DISK else "read_error"
                self._notice(
                    kind, f"moving a block from the {job.meta.tier.label} to the {dst.tier.label} tier failed: {err}"
                )
                out[job.k] = self._recode_failed(job.meta, f"{type(err).__name__}: {err}", dst, new)
                job.done = True
                continue
            stored = (job.target, data.numel(), getattr(new, "checksum", 0) or digest)
            out[job.k] = self._switch_when_unread(job.meta, job.src, job.handle, dst, new, stored=stored, held=held)
            job.done = True
        return out

    def _move_refused(self, meta: BlockMeta | None, to_tier: Tier | None, codec: str | None) -> MoveOutcome | None:
        """The outcome of a move that need not or may not start (lock held), else None.
        `to_tier` None: where the block is (a move in place)."""
        if meta is None or not meta.visible:
            return MoveOutcome(False, reason="not held", gone=True)
        if to_tier is None:
            to_tier = meta.tier
        if meta.moving:
            return MoveOutcome(False, reason="already moving", busy=True)
        if meta.tier == to_tier and (codec is None or codec == meta.codec):
            return MoveOutcome(True)
        pinned = self.pin_tier(meta)
        # a pin keeps a block from going below its tier; re-encoding it where it is (below
        # a GPU pin on an agent without a GPU) takes it nowhere
        if pinned and int(to_tier) > pinned and to_tier != meta.tier:
            return MoveOutcome(False, reason=f"pinned at tier {Tier(pinned).label}", pinned_tier=pinned)
        return None

    def _pinned_meanwhile(self, meta: BlockMeta, dst: TierStore) -> MoveOutcome | None:
        """A move whose block was pinned above its destination while its bytes were on
        the way (lock held): refused at the switch, the block staying where it is."""
        pinned = self.pin_tier(meta)
        if pinned and int(dst.tier) > pinned and dst.tier != meta.tier:
            return MoveOutcome(False, reason=f"pinned at tier {Tier(pinned).label} while it moved", pinned_tier=pinned)
        return None

    def _abandon(self, jobs: list, dst: TierStore | None) -> None:
        """Undo the moves of a batch that failed as a whole (lock held): the blocks stay
        where they are, movable again, and their new space is given back (`dst` None: a
        move in place, which places no job)."""
        for _, meta, _, _, new in jobs:
            meta.moving = False
            if dst is not None:
                dst.free(new)
        jobs.clear()

    def _finish_move(
        self,
        meta: BlockMeta,
        src: TierStore,
        old,
        dst: TierStore,
        new,
        stored: tuple[str, int, int] | None = None,
        held: _Held | None = None,
    ) -> None:
        """Switch a copied block to its new place and free the old one (lock held).
        `stored`: (codec, stored bytes, checksum) of a block re-encoded on the way.
        `held`: the block stays marked moving and is added there (its batch lets it go)."""
        src_tier = meta.tier
        codec, nbytes, digest = stored or (meta.codec, meta.stored_bytes, getattr(new, "checksum", 0) or meta.checksum)
        self._switch(meta, dst.tier, new, codec, nbytes, digest, lru=held is None)
        if held is not None:
            held.append(meta)  # before anything else can raise: its batch lets it go
        src.free(old)
        meta.moving = held is not None
        if dst.tier == src_tier:  # a compress in place: no movement between tiers
            self.recoded_bytes_total += meta.stored_bytes
            return
        key = (src_tier, dst.tier)
        self.moved_bytes_total[key] = self.moved_bytes_total.get(key, 0) + meta.stored_bytes
        if int(dst.tier) < int(src_tier):
            self.promotions_total += 1
        elif held is not None and held.making_room:
            self.demotions_total[src_tier] += 1
        else:
            self.commanded_demotions_total[src_tier] += 1

    def _recode_in_place(
        self,
        meta: BlockMeta,
        store: SlabStore,
        old: list[int],
        data: torch.Tensor,
        stored: tuple[str, int, int],
        wait_seconds: float,
        held: _Held | None,
    ) -> MoveOutcome:
        """A compress in place of a host memory tier with no page free for the copy (every
        block there pinned, say: nothing could make room, and compressing is how an
        operator gets room back): once no one reads the block, its re-encoded bytes are
        written over its own first pages under the lock (no reader starts meanwhile) and
        its other pages freed. A write that failed part way leaves it corrupt: removed."""
        pages = store.footprint(data.numel()) // store.page_bytes
        if held is not None:
            wait_seconds = held.reader_wait_seconds
        deadline = time.monotonic() + wait_seconds
        while True:
            with self.lock:
                if meta.handle is not old or meta.block_hash not in self.blocks:
                    meta.moving = False
                    return self._move_failed("the block changed while it was re-encoded")
                if meta.ref_count == 0:
                    try:
                        store.write(old[:pages], data, meta)
                    except BaseException as exc:
                        meta.moving = False
                        self._mark_corrupt(meta, f"re-encoding it in place failed: {exc}")
                        self._drop_corrupt()
                        raise
                    self._finish_move(meta, store, old[pages:], store, old[:pages], stored, held)
                    return MoveOutcome(True, meta.stored_bytes)
                if time.monotonic() > deadline:
                    meta.moving = False
                    return self._move_failed("TimeoutError: readers held the block too long")
            time.sleep(0.001)

    def _switch_when_unread(
        self, meta, src, old, dst, new, wait_seconds: float = 5.0, stored=None, held: _Held | None = None
    ) -> MoveOutcome:
        if held is not None:
            wait_seconds = held.reader_wait_seconds
        deadline = time.monotonic() + wait_seconds
        while True:
            with self.lock:
                refused = self._pinned_meanwhile(meta, dst)
                if refused is not None:
                    meta.moving = False
                    dst.free(new)
                    return refused
                if meta.ref_count == 0:
                    self._finish_move(meta, src, old, dst, new, stored, held)
                    return MoveOutcome(True, meta.stored_bytes)
                if time.monotonic() > deadline:
                    meta.moving = False
                    dst.free(new)
                    return self._move_failed("TimeoutError: readers held the block too long")
            time.sleep(0.001)
