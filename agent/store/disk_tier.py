"""The disk tier: one slab file of 512-byte granules, each block one
contiguous extent of it that starts with a header naming the block and a checksum of its
payload, verified on every read.

    <dir>/blocks.kvslab
    extent: 512-byte header slot | payload | padding to the next granule
            (blocks of 64 KiB and more: padding to 4 KiB, and the payload starts on a
            4 KiB boundary of the file, where the kernel copies it fastest)
    header: b"KVCPSLB1", u16 header bytes, u64 write sequence, 16-byte block hash,
            16-byte parent hash, 8-byte codec name, u64 uncompressed bytes,
            u64 payload bytes, u64 xxh3-64 of the payload, u16 + model_id,
            u16 + namespace, u16 + KV layout (ModelSpec.layout; absent in older
            headers), f64 the block's last access (unix seconds) when written (absent
            in older headers: a restart keeps how long a block was idle, so a cleanup
            by age works after it), u64 xxh3-64 of the header before it

A block is written with one `pwritev` (header and payload straight from the memory
tier's pages) into space nobody else uses, and read with one `preadv` straight into
the destination pages, then verified there. The payload checksum is the one the block
carries from when it was made (`BlockMeta.checksum`), so a demotion does not hash the
bytes again and a read checks them end to end: no file is created, renamed or unlinked
per block, so a move costs what the copy costs. Every write covers its whole extent
(padding included), so no older header survives inside a newer block. A freed extent is
appended to the dead log (`<dir>/blocks.kvslab.dead`: u64 offset, u64 write sequence) by
a background thread, many in one write, before it can be allocated again; a restart
ignores (and clears) the dead headers it lists, so a freed block never comes back. The
log is compacted to the headers still in the slab when it grows. A block that fails its checksum or is
truncated raises CorruptBlock: the pool treats it as a miss and removes it. `scan()`
rebuilds the inventory after a restart by reading the slab once, verifying every
checksum; of two copies of a block (a crash between writing a new copy and freeing the
old) the later write wins. The slab is sparse (space is taken as blocks are written: a
full file system is a write error, reported, never a crash) and gives space back: once a
freed extent is in the dead log, the whole 4 KiB pages of the free run around it are
punched out of the file (fallocate PUNCH_HOLE) before it can be allocated again, so a
cleanup frees the file system's space, not only the tier's (while the tier is at most
3/4 full: one kept near its capacity reuses what it frees at once). It is locked (flock) so that
two agents cannot share a directory.

Blocks of mixed sizes (raw and compressed, several models) freed out of order split the
free space into runs too short for a block while the tier's bytes have room: compaction
(driven by agent.core.compaction) empties one window of the slab big enough for it.
`plan_compaction` chooses the window that moves the fewest bytes (only blocks the pool
says may move: held, not being read or moved; the next cheapest when its blocks find no
room outside it), holds its free runs out of the allocator
and takes the blocks' new extents, first fit; `copy_extent` copies each block whole,
header rewritten under a new write sequence, and reads it back verified; the pool makes
the copies durable (`sync`, with `fsync` only), points each block at its new extent and
frees the old one like any other, through the dead log. A crash before a dead record is on
disk leaves two copies, and the later write (the relocated one) wins; after it, the old
copy is dead: a restart finds each block once and never a freed copy. Without `fsync` that
holds for a process that dies (the page cache keeps the order written); a power loss may
persist the dead record without the copy and lose the block (never serve a corrupt one).
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import heapq
import itertools
import logging
import math
import operator
import os
import struct
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import xxhash

from agent.core.blocks import BlockMeta
from agent.core.tier_store import BlockUnreadable
from protos.tier import Tier

log = logging.getLogger(__name__)

MAGIC = b"KVCPSLB1"
GRANULE_BYTES = 512
SLAB_NAME = "blocks.kvslab"
DEAD_LOG_NAME = "blocks.kvslab.dead"  # (offset, write seq) of freed blocks, appended
OWNER_NAME = "owner"  # the id of the agent that last used the directory
DEAD_LOG_COMPACT_RECORDS = 1 << 16
_DEAD = struct.Struct("<QQ")
_SEQ = struct.Struct("<Q")
_FIXED_SEQ_AT = 10  # magic (8) + header size (2)
_FIXED_SEQ_END = _FIXED_SEQ_AT + 8
_FIXED = struct.Struct("<8sHQ16s16s8sQQQ")  # magic .. payload checksum
_CHECK = struct.Struct("<Q")
_ACCESSED = struct.Struct("<d")
HEADER_SLOT_BYTES = 512  # model id, namespace and KV layout up to 408 bytes together
ALIGNED_FROM_BYTES = 64 << 10  # extents at least this big keep their payload 4 KiB-aligned
_ALIGN_GRANULES = 4096 // GRANULE_BYTES
_SCAN_CHUNK_BYTES = 8 << 20
# states of a header the restart walk finds (BEYOND: a whole block past this capacity's
# end, a slab written under a bigger --disk-capacity)
_OK, _DEAD_BLOCK, _CORRUPT, _BEYOND = "ok", "dead", "corrupt", "beyond"
_MAGIC_U64 = np.frombuffer(MAGIC, dtype=np.uint64)[0]


class CorruptBlock(BlockUnreadable):
    pass


_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_PAGE_BYTES = 4096
# space is given back only while the tier is this full or less: a tier kept near its
# capacity (the policy's watermarks are 0.90-0.95) reuses what it frees at once, and
# punching it would make every write allocate the file system's blocks again
PUNCH_BELOW = 0.75
PUNCH_SWEEP_REARM = 0.85  # the sweep of every free run comes again once the tier was this full
REFIT_SECONDS = 5.0  # a tier cut to its file system's room looks at the room again this often
FS_MARGIN_BYTES = 1 << 20  # of the file system's free space, left to the dead log and headers' growth
COMPACT_CANDIDATES = 32  # windows a compaction weighs: from the longest free runs, and runs just before them
# the biggest extent asked for drives background compaction this long (to twice it) after
# it was last asked for: a model no longer served stops moving blocks for its size
FOOTPRINT_SECONDS = 600.0
COMPACT_WINDOW_TRIES = 4  # of them, the cheapest a plan tries to take before it gives up


def _load_fallocate():
    """libc's fallocate(2), or None where there is none (the slab then keeps its space)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.fallocate64
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fn.restype = ctypes.c_int
    return fn


_fallocate = _load_fallocate()


def punch_hole(fd: int, offset: int, length: int) -> None:
    """Give [offset, offset+length) of the file back to the file system (it reads as
    zeros after); the file's size stays. Raises OSError (EOPNOTSUPP where the file
    system cannot)."""
    if _fallocate is None:
        raise OSError(errno.EOPNOTSUPP, "fallocate is not available")
    if _fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


@dataclass
class DiskHandle:
    """A block's extent in the slab: where it starts, how many bytes it takes (a whole
    number of granules), and, once written, which write put it there and the payload's
    checksum (a read checks both)."""

    offset: int
    footprint_bytes: int
    seq: int = 0
    checksum: int = 0  # xxh3-64 of the payload written


@dataclass
class Relocation:
    """One block a compaction moves: the hash its extent was taken for and the extent it
    gets (written by copy_extent)."""

    block_hash: bytes
    new: DiskHandle


@dataclass
class CompactionPlan:
    """The free runs of the window to empty, held out of the allocator (granules: start,
    length), and the blocks to move out of it."""

    claimed: list[tuple[int, int]]
    moves: list[Relocation]


@dataclass(frozen=True)
class RecoveredBlock:
    model_id: str
    block_hash: bytes
    parent_hash: bytes
    codec: str
    namespace: str
    num_bytes: int
    stored_bytes: int
    handle: DiskHandle
    layout: str = ""  # the model's KV layout when written ("" in older slabs)
    last_access_unix_seconds: float = 0.0  # when written (0: an older slab, unknown)


@dataclass(frozen=True)
class Header:
    seq: int
    block_hash: bytes
    parent_hash: bytes
    codec: str
    num_bytes: int
    payload_bytes: int
    checksum: int
    model_id: str
    namespace: str
    layout: str = ""
    last_access_unix_seconds: float = 0.0


def checksum(buf) -> int:
    return xxhash.xxh3_64_intdigest(buf)


def _granules(num_bytes: int) -> int:
    return max(1, -(-num_bytes // GRANULE_BYTES))


def header_size(meta, layout: str = "") -> int:
    strings = len(meta.model_id.encode()) + len(meta.namespace.encode()) + len(layout.encode())
    return _FIXED.size + 2 + 2 + 2 + strings + _ACCESSED.size + _CHECK.size


def encode_header(seq: int, meta, payload_bytes: int, digest: int, layout: str = "") -> bytes:
    model, ns, lay = meta.model_id.encode(), meta.namespace.encode(), layout.encode()
    size = header_size(meta, layout)
    if size > HEADER_SLOT_BYTES:
        raise OSError(
            errno.EINVAL, f"model id and namespace too long for a block header ({size} > {HEADER_SLOT_BYTES} B)"
        )
    body = b"".join(
        [
            _FIXED.pack(
                MAGIC,
                size,
                seq,
                meta.block_hash,
                meta.parent_hash,
                meta.codec.encode().ljust(8, b"\0"),
                meta.num_bytes,
                payload_bytes,
                digest,
            ),
            struct.pack("<H", len(model)),
            model,
            struct.pack("<H", len(ns)),
            ns,
            struct.pack("<H", len(lay)),
            lay,
            _ACCESSED.pack(float(getattr(meta, "last_access_unix_seconds", 0.0) or 0.0)),
        ]
    )
    return body + _CHECK.pack(checksum(body))


def check_header(raw: bytes | bytearray | memoryview) -> tuple:
    """Verify a header's magic, size and checksum (raw may run past it) and return its
    fixed fields (magic, size, seq, hash, parent, codec, num_bytes, payload_bytes,
    payload checksum); raises CorruptBlock."""
    if len(raw) < _FIXED.size or raw[:8] != MAGIC:
        raise CorruptBlock("bad header")
    fixed = _FIXED.unpack_from(raw)
    size = fixed[1]
    if size > min(len(raw), HEADER_SLOT_BYTES) or size < _FIXED.size + 2 + 2 + _CHECK.size:
        raise CorruptBlock("truncated header")
    (got,) = _CHECK.unpack_from(raw, size - _CHECK.size)
    if got != checksum(memoryview(raw)[: size - _CHECK.size]):
        raise CorruptBlock("header checksum mismatch")
    return fixed


def decode_header(raw: bytes | memoryview) -> Header:
    """Parse and verify a whole header (raw may run past it); raises CorruptBlock."""
    raw = bytes(raw[:HEADER_SLOT_BYTES])
    _, size, seq, block_hash, parent, codec, num_bytes, payload_bytes, digest = check_header(raw)
    pos = _FIXED.size
    (model_len,) = struct.unpack_from("<H", raw, pos)
    model = raw[pos + 2 : pos + 2 + model_len]
    pos += 2 + model_len
    (ns_len,) = struct.unpack_from("<H", raw, pos)
    namespace = raw[pos + 2 : pos + 2 + ns_len]
    pos += 2 + ns_len
    layout = b""
    accessed = 0.0
    if pos + 2 <= size - _CHECK.size:  # older headers end at the namespace
        (layout_len,) = struct.unpack_from("<H", raw, pos)
        layout = raw[pos + 2 : pos + 2 + layout_len]
        pos += 2 + layout_len
        if pos + _ACCESSED.size <= size - _CHECK.size:  # and then at the layout
            (accessed,) = _ACCESSED.unpack_from(raw, pos)
    try:
        return Header(
            seq,
            block_hash,
            parent,
            codec.rstrip(b"\0").decode(),
            num_bytes,
            payload_bytes,
            digest,
            model.decode(),
            namespace.decode(),
            layout.decode(),
            accessed if math.isfinite(accessed) and accessed > 0 else 0.0,
        )
    except UnicodeDecodeError:
        raise CorruptBlock("undecodable header") from None


class ExtentAllocator:
    """Free space of the slab as sorted, merged runs of granules; first fit."""

    def __init__(self, num_granules: int):
        self.num_granules = num_granules
        self._starts: list[int] = [0] if num_granules else []
        self._lengths: dict[int, int] = {0: num_granules} if num_granules else {}
        self.free_granules = num_granules

    def allocate(self, n: int, phase: int | None = None) -> int | None:
        """First fit of n granules; with `phase`, at a start g with g % 8 == phase (the
        granules skipped before it stay free)."""
        for start in self._starts:
            length = self._lengths[start]
            s = start if phase is None else start + (phase - start) % _ALIGN_GRANULES
            if s + n <= start + length:
                if s == start:
                    self._take(start, n)
                else:
                    self.claim(s, n)
                return s
        return None

    def claim(self, start: int, n: int) -> bool:
        """Mark [start, start+n) used if it is free (recovery); False if not."""
        i = bisect.bisect_right(self._starts, start) - 1
        if i < 0:
            return False
        run = self._starts[i]
        if run + self._lengths[run] < start + n:
            return False
        length = self._lengths.pop(run)
        del self._starts[i]
        if start > run:
            self._insert(run, start - run)
        if run + length > start + n:
            self._insert(start + n, run + length - start - n)
        self.free_granules -= n
        return True

    def free(self, start: int, n: int) -> None:
        self.free_granules += n
        i = bisect.bisect_left(self._starts, start)
        # merge with the run after, then the run before
        if i < len(self._starts) and self._starts[i] == start + n:
            n += self._lengths.pop(self._starts.pop(i))
        if i > 0 and self._starts[i - 1] + self._lengths[self._starts[i - 1]] == start:
            self._lengths[self._starts[i - 1]] += n
        else:
            self._starts.insert(i, start)
            self._lengths[start] = n

    def _take(self, start: int, n: int) -> None:
        length = self._lengths.pop(start)
        self._starts.remove(start)
        if length > n:
            self._insert(start + n, length - n)
        self.free_granules -= n

    def _insert(self, start: int, length: int) -> None:
        bisect.insort(self._starts, start)
        self._lengths[start] = length

    def runs(self) -> list[tuple[int, int]]:
        return [(s, self._lengths[s]) for s in self._starts]

    def longest_runs(self, k: int) -> list[int]:
        """Starts of the k longest free runs (one pass over the runs, at C speed: a
        fragmented slab has hundreds of thousands of them)."""
        return [s for s, _ in heapq.nlargest(k, self._lengths.items(), key=operator.itemgetter(1))]

    def starts_before(self, run_start: int, n: int, k: int) -> list[int]:
        """Starts of the (at most k) free runs just before the one at `run_start` that a
        window of n granules reaching it could begin at."""
        i = bisect.bisect_left(self._starts, run_start)
        return [s for s in self._starts[max(0, i - k) : i] if s + n > run_start]

    def fits(self, n: int, phase: int) -> bool:
        """Whether some free run holds n granules from a start g with g % 8 == phase."""
        return any(
            length >= n and (phase - start) % _ALIGN_GRANULES + n <= length for start, length in self._lengths.items()
        )

    def largest_run(self) -> int:
        """Granules of the longest free run (0 when none is free)."""
        return max(self._lengths.values(), default=0)

    def run_at(self, start: int) -> int:
        """Length of the free run that starts at granule `start`; 0 if none starts there."""
        return self._lengths.get(start, 0)

    def run_around(self, granule: int) -> tuple[int, int]:
        """(start, length) of the free run holding `granule`; (granule, 0) if it is used."""
        i = bisect.bisect_right(self._starts, granule) - 1
        if i >= 0:
            start = self._starts[i]
            if granule < start + self._lengths[start]:
                return start, self._lengths[start]
        return granule, 0


def _whole_pages(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The whole 4 KiB pages inside `spans`, sorted and merged; a span holding no whole
    page gives none (punching an empty range fails, which would turn punching off)."""
    pages = sorted(
        (lo, hi)
        for lo, hi in ((-(-lo // _PAGE_BYTES) * _PAGE_BYTES, hi // _PAGE_BYTES * _PAGE_BYTES) for lo, hi in spans)
        if hi > lo
    )
    merged: list[tuple[int, int]] = []
    for lo, hi in pages:
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


class DiskTier:
    tier = Tier.DISK

    def __init__(self, directory: str | os.PathLike, capacity_bytes: int, fsync: bool = False, io_threads: int = 2):
        self._io: ThreadPoolExecutor | None = None
        self._dead_fd = -1
        self._lock = threading.Lock()  # the extents, the used bytes and the freed list
        self._drain_lock = threading.Lock()
        self._to_clear: list[tuple[int, int, int]] = []  # (offset, footprint bytes, write seq)
        self._clear_wake = threading.Event()
        self._compact_at = 0  # dead-log size past which to compact (raised after a failure)
        self._dead_log_ok = True  # False once an append could not be undone: headers are cleared instead
        self.punch_holes = True  # False once the file system refused: freed space stays in the file
        self._swept = False  # every free run punched since the tier was last above PUNCH_SWEEP_REARM
        if capacity_bytes <= 0:
            raise ValueError("disk capacity must be positive")
        self.directory = Path(directory)
        self.path = self.directory / SLAB_NAME
        self.fd = -1
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)  # owner-only, as its files
            # never through a link planted there (a directory others can write, as under /tmp)
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise OSError(f"disk tier directory {self.directory} is not usable: {exc.strerror or exc}") from None
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(self.fd)
            self.fd = -1
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise OSError(
                    f"disk tier directory {self.directory} is not usable: its slab is in use by another agent"
                ) from None
            raise OSError(f"disk tier directory {self.directory} is not usable: {exc.strerror or exc}") from None
        self.num_granules = capacity_bytes // GRANULE_BYTES
        if self.num_granules == 0:
            os.close(self.fd)  # releases the flock
            self.fd = -1
            raise ValueError(f"disk capacity {capacity_bytes} B is smaller than one {GRANULE_BYTES} B granule")
        # what --disk-capacity asked; `capacity_bytes` is less while the file system cannot
        # give that much (fit_to_file_system): the policy and the pool see the tier full
        # there, instead of demoting into it writes that fail with ENOSPC
        self.configured_capacity_bytes = self._capacity_bytes = self.num_granules * GRANULE_BYTES
        self._fitted_monotonic = 0.0
        self._enospc_monotonic = -math.inf  # when a write last found the file system full
        self.fsync = fsync
        # model_id -> its KV layout (ModelSpec.layout), written into each block's header
        # so that a restart under another layout does not adopt bytes of the old one
        self.layouts: dict[str, str] = {}
        self.write_errors_total = 0
        # big blocks' extents start 7 granules into a 4 KiB page (their header slot just
        # before it): the slab has those granules spare, so N big blocks fit in N footprints
        self.slab_bytes = (self.num_granules + _ALIGN_GRANULES - 1) * GRANULE_BYTES
        self._extents = ExtentAllocator(self.slab_bytes // GRANULE_BYTES)
        # every extent not back in the allocator (written or not, freed but not drained yet):
        # first granule -> (granules, the block hash it was taken for); compaction walks it
        self._extent_at: dict[int, tuple[int, bytes]] = {}
        # the biggest extent the tier was asked for in this period and the one before
        # (largest_footprint_bytes): one no longer asked for stops driving compaction
        self._footprints = [0, 0]
        self._footprints_since = time.monotonic()
        self.compactions_total = 0  # compaction steps that relocated at least one block
        self.relocated_blocks_total = 0
        self.relocated_bytes_total = 0  # footprints of the extents relocated
        self._used = 0
        self._seq = itertools.count(1)
        self._checked_at = -1.0
        self._lost = False
        self.io_threads = max(1, io_threads)
        self._io = (
            ThreadPoolExecutor(self.io_threads - 1, thread_name_prefix="disk-io") if self.io_threads > 1 else None
        )
        # freed extents: a background thread records them in the dead log (one append for
        # many; clearing each header would cost a small write into the slab, as much as
        # reading a block) and only then can they be reused
        self.dead_path = self.directory / DEAD_LOG_NAME
        try:
            self._dead_fd = os.open(
                self.dead_path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
            )
        except OSError as exc:
            os.close(self.fd)
            self.fd = -1
            raise OSError(f"disk tier directory {self.directory} is not usable: {exc.strerror or exc}") from None
        self._dead_records = os.fstat(self._dead_fd).st_size // _DEAD.size
        os.ftruncate(self._dead_fd, self._dead_records * _DEAD.size)  # a torn last record goes
        self._compact_at = max(DEAD_LOG_COMPACT_RECORDS, self.num_granules // 4)
        self._clearer = threading.Thread(target=self._clear_loop, name="disk-clear", daemon=True)
        self._clearer.start()
        self.fit_to_file_system()

    def fit_to_file_system(self) -> int:
        """Capacity = what was asked, or less: what the slab holds on its file system plus
        the file system's free space (less a margin for the dead log). Said in the log when
        it changes. Run at start, after a write failed for space, and every few seconds
        while below what was asked (space freed elsewhere brings it back)."""
        try:
            st = os.fstatvfs(self.fd)
            room = self.allocated_bytes() + st.f_bavail * st.f_frsize - FS_MARGIN_BYTES
        except OSError:
            return self._capacity_bytes
        fitted = max(GRANULE_BYTES, min(self.configured_capacity_bytes, room // GRANULE_BYTES * GRANULE_BYTES))
        with self._lock:
            before, self._capacity_bytes = self._capacity_bytes, fitted
            self._fitted_monotonic = time.monotonic()
        if fitted != before:
            if fitted < self.configured_capacity_bytes:
                log.warning(
                    "disk tier %s: its file system has room for %d MiB of the %d MiB asked (--disk-capacity); "
                    "the tier counts as that size until space is freed",
                    self.directory,
                    fitted >> 20,
                    self.configured_capacity_bytes >> 20,
                )
            else:
                log.info("disk tier %s: its file system has room for all %d MiB again", self.directory, fitted >> 20)
        return fitted

    # ---- space --------------------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        """What the tier may hold: --disk-capacity, or less while its file system has no
        room for that (looked at again every REFIT_SECONDS then: space freed elsewhere
        comes back into use)."""
        if self._capacity_bytes < self.configured_capacity_bytes and (
            time.monotonic() - self._fitted_monotonic > REFIT_SECONDS
        ):
            self.fit_to_file_system()
        return self._capacity_bytes

    @property
    def used_bytes(self) -> int:
        return self._used

    def footprint(self, num_bytes: int) -> int:
        """Bytes a block of `num_bytes` takes: its header slot and payload, rounded up to
        whole granules (to 4 KiB for big blocks, which keeps the next one aligned too)."""
        n = num_bytes + HEADER_SLOT_BYTES
        if n >= ALIGNED_FROM_BYTES:
            return -(-n // 4096) * 4096
        return _granules(n) * GRANULE_BYTES

    def allocate(self, num_bytes: int, block_hash: bytes = b""):
        size = self.footprint(num_bytes)
        n = size // GRANULE_BYTES
        phase = self._phase(size)
        start = self._take_extent(n, phase, block_hash)
        if start is None:  # freed space may still be on its way to the allocator: bring it now
            self.drain()
            start = self._take_extent(n, phase, block_hash)
        if start is None:
            return None
        return DiskHandle(start * GRANULE_BYTES, n * GRANULE_BYTES)

    @staticmethod
    def _phase(footprint_bytes: int) -> int | None:
        """Where a big block's extent must start within a 4 KiB page (its header slot ends
        where a page of the file begins); None for small ones."""
        return _ALIGN_GRANULES - HEADER_SLOT_BYTES // GRANULE_BYTES if footprint_bytes >= ALIGNED_FROM_BYTES else None

    def _out_of_space(self) -> None:
        """A write found the file system full. Freed space kept in the slab for reuse
        (not punched above 3/4 full) goes back to it, since a write into a hole needs the
        file system's blocks, and the capacity is fitted again. A second ENOSPC soon after
        a fit (the free runs are too fragmented for what is written) counts the tier as
        full at what it holds, until the next look a few seconds on."""
        # soon after the last ENOSPC (not after any fit: the one at start made the first
        # ENOSPC of a run count as a second, and cut the tier to the batch that failed)
        now = time.monotonic()
        again = now - self._enospc_monotonic < REFIT_SECONDS
        self._enospc_monotonic = now
        with self._lock:
            spans = _whole_pages(self._free_runs())
        self._punch(spans)
        fitted = self.fit_to_file_system()
        if again:
            with self._lock:
                self._capacity_bytes = min(fitted, max(GRANULE_BYTES, -(-self._used // GRANULE_BYTES) * GRANULE_BYTES))
                self._fitted_monotonic = time.monotonic()

    def _take_extent(self, n: int, phase: int | None, block_hash: bytes = b"") -> int | None:
        with self._lock:
            self._note_footprint(n * GRANULE_BYTES)
            if self._used + n * GRANULE_BYTES > self._capacity_bytes:
                return None
            start = self._extents.allocate(n, phase)
            if start is not None:
                self._extent_at[start] = (n, block_hash)
                self._used += n * GRANULE_BYTES
                if self._used > PUNCH_SWEEP_REARM * self._capacity_bytes:
                    self._swept = False  # seen here too: it may fall back before the next drain
            return start

    @property
    def largest_footprint_bytes(self) -> int:
        """The biggest extent the tier was asked for lately (in the last FOOTPRINT_SECONDS
        to twice that), what background compaction makes a free run for. Blocks a restart
        found do not count (of a model not served, they are never written again)."""
        with self._lock:
            self._roll_footprints()
            return max(self._footprints)

    def note_footprint(self, footprint_bytes: int) -> None:
        """An extent of `footprint_bytes` was asked for."""
        with self._lock:
            self._note_footprint(footprint_bytes)

    def _note_footprint(self, footprint_bytes: int) -> None:
        self._roll_footprints()
        self._footprints[0] = max(self._footprints[0], footprint_bytes)

    def _roll_footprints(self) -> None:
        now = time.monotonic()
        elapsed = now - self._footprints_since
        if elapsed >= FOOTPRINT_SECONDS:
            self._footprints = [0, self._footprints[0] if elapsed < 2 * FOOTPRINT_SECONDS else 0]
            self._footprints_since = now

    def free(self, handle: DiskHandle) -> None:
        """Give the extent back: its magic is cleared (so that a restart does not bring the
        block back) in the background, and then it can be allocated again."""
        with self._lock:
            self._used -= handle.footprint_bytes
            self._to_clear.append((handle.offset, handle.footprint_bytes, handle.seq))
        self._clear_wake.set()

    def drain(self) -> None:
        """Record every freed extent in the dead log (one append) and give them to the
        allocator. A block never fully written has its magic cleared instead."""
        with self._drain_lock:
            with self._lock:
                batch, self._to_clear = self._to_clear, []
            if not batch:
                return
            records = b"".join(_DEAD.pack(offset, seq) for offset, _, seq in batch if seq)
            for offset, _, seq in batch:
                if not seq:
                    self._clear(offset)
            if records and not self._dead_log_ok:
                for offset, _, _ in batch:
                    self._clear(offset)
            elif records:
                try:
                    _write_all(self._dead_fd, records)
                    if self.fsync:
                        os.fdatasync(self._dead_fd)
                    self._dead_records += len(records) // _DEAD.size
                except OSError as exc:  # no log: clear the headers themselves
                    log.warning("disk tier: could not append to %s (%s); clearing headers", self.dead_path, exc)
                    try:  # a partly written batch would shift every later record
                        os.ftruncate(self._dead_fd, self._dead_records * _DEAD.size)
                    except OSError as cut:
                        log.error(
                            "disk tier: cannot cut %s back (%s); clearing headers from now on", self.dead_path, cut
                        )
                        self._dead_log_ok = False
                    for offset, _, _ in batch:
                        self._clear(offset)
            with self._lock:
                for offset, footprint, _ in batch:
                    self._extent_at.pop(offset // GRANULE_BYTES, None)
                    self._extents.free(offset // GRANULE_BYTES, footprint // GRANULE_BYTES)
                spans = self._spans_to_punch(batch)
            self._punch(spans)
            if self._dead_records > self._compact_at:
                try:
                    self._compact_dead_log()
                    self._compact_at = max(DEAD_LOG_COMPACT_RECORDS, self.num_granules // 4, 2 * self._dead_records)
                except OSError as exc:  # the log stays as it is (still correct), retried later
                    log.warning("disk tier: compacting %s failed: %s", self.dead_path, exc)
                    self._compact_at = 2 * self._dead_records

    def _spans_to_punch(self, batch: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
        """The whole pages of the free runs that the freed extents of `batch` fell into
        (only near each extent: a page it shares with a free neighbour goes too, one it
        shares with a used block does not), while the tier is at most PUNCH_BELOW full;
        the first time below it since it was above PUNCH_SWEEP_REARM, every free run.
        Caller holds `_lock`, after the extents' dead records are on disk: a hole reads as
        zeros, which a restart skips."""
        if not self.punch_holes:
            return []
        if self._used > PUNCH_SWEEP_REARM * self._capacity_bytes:
            self._swept = False
        if self._used > PUNCH_BELOW * self._capacity_bytes:
            return []
        spans: list[tuple[int, int]] = []
        if not self._swept:  # every free run, those freed while the tier was fuller too
            self._swept = True
            spans = self._free_runs()
        else:
            for offset, footprint, _ in batch:
                start, length = self._extents.run_around(offset // GRANULE_BYTES)
                run_lo, run_hi = start * GRANULE_BYTES, (start + length) * GRANULE_BYTES
                spans.append((max(run_lo, offset - _PAGE_BYTES), min(run_hi, offset + footprint + _PAGE_BYTES)))
        return _whole_pages(spans)

    def _free_runs(self) -> list[tuple[int, int]]:
        """(start, end) bytes of every free run of the allocator (caller holds `_lock`)."""
        return [(start * GRANULE_BYTES, (start + length) * GRANULE_BYTES) for start, length in self._extents.runs()]

    def _punch(self, spans: list[tuple[int, int]]) -> None:
        """Punch each span, taking the lock for one span at a time (a sweep of a
        fragmented tier must not hold allocations up for all of it) and only if it is
        still free then: nothing is allocated (and written) in it while it is punched."""
        for lo, hi in spans:
            with self._lock:
                if not self.punch_holes or self.fd < 0:
                    return
                start, length = self._extents.run_around(lo // GRANULE_BYTES)
                if not (start * GRANULE_BYTES <= lo and hi <= (start + length) * GRANULE_BYTES):
                    continue  # taken again meanwhile
                try:
                    punch_hole(self.fd, lo, hi - lo)
                except OSError as exc:
                    self.punch_holes = False
                    log.warning(
                        "disk tier: cannot give freed space in %s back to the file system (%s); "
                        "it is reused, not returned",
                        self.path,
                        exc.strerror or exc,
                    )
                    return

    # ---- compaction -----------------------------------------------------------------------
    def fragmentation(self) -> tuple[int, int]:
        """(bytes of the longest free run, free bytes) of the slab: a tier whose longest run
        is short of its biggest block while its free bytes are not is fragmented. Freed
        extents still on their way to the allocator count in neither."""
        with self._lock:
            return self._extents.largest_run() * GRANULE_BYTES, self._extents.free_granules * GRANULE_BYTES

    def fragmented(self, footprint_bytes: int) -> bool:
        """Whether an extent of `footprint_bytes` finds no free run while the tier's bytes
        have room for it twice over (what compaction can mend). A tier with room for just
        this one is a full tier whose last eviction left a hole: the blocks of a window
        rarely find room elsewhere there, and a plan that fails costs ~1 ms under the
        pool's lock (scripts/disk_fragmentation.py: 3,430 plans for 21 compactions in
        3,000 requests before this check, 2,474 for 12 after), so the eviction goes on."""
        if self._used + 2 * footprint_bytes > self._capacity_bytes:  # about full: no walk of the runs
            return False
        n = footprint_bytes // GRANULE_BYTES
        phase = self._phase(footprint_bytes)
        with self._lock:
            largest, free = self._extents.largest_run(), self._extents.free_granules
            if free < n:
                return False
            if largest < n:
                return True
            # a big block's extent starts at one granule of each 4 KiB page: a run of up to
            # 7 granules more than it may still not hold it
            return phase is not None and largest < n + _ALIGN_GRANULES - 1 and not self._extents.fits(n, phase)

    def plan_compaction(
        self, footprint_bytes: int, movable: Callable[[bytes, int], bool], max_move_bytes: int
    ) -> CompactionPlan | None:
        """Choose a window of the slab that would hold an extent of `footprint_bytes` once
        the blocks inside it were moved out, moving at most `max_move_bytes`, and take
        their new extents (first fit: the lowest free runs outside the window). The
        window's free runs are held out of the allocator until finish_compaction, so that
        nothing else is placed there meanwhile. `movable(block_hash, offset)` says whether
        the block the extent at `offset` was taken for may move now (the block pool's
        view: held there, not read, not moving). Of the windows weighed, the cheapest whose
        blocks all find room outside it; None when none qualifies."""
        n = footprint_bytes // GRANULE_BYTES
        phase = self._phase(footprint_bytes)
        self.drain()  # freed extents join their runs first
        with self._lock:
            if self._extents.free_granules < n:
                return None
            # the pool's lock is held here: no list of every free run is built (a slab of
            # a million extents took 0.2 s a plan for it)
            windows: dict[int, tuple[int, int, list[tuple[int, int, bytes]]] | None] = {}  # first -> cost, end, extents
            for run_start in self._extents.longest_runs(COMPACT_CANDIDATES):
                for first in (run_start, *self._extents.starts_before(run_start, n, COMPACT_CANDIDATES)):
                    if first not in windows:
                        windows[first] = self._window(first, n, phase, movable, max_move_bytes)
            # the cheapest windows first: one whose blocks find no room elsewhere gives way to the next
            found = [(first, window) for first, window in windows.items() if window is not None]
            for first, (_, end, inside) in heapq.nsmallest(COMPACT_WINDOW_TRIES, found, key=lambda item: item[1][0]):
                plan = self._take_window(first, end, inside)
                if plan is not None:
                    return plan
            return None

    def _take_window(self, first: int, end: int, inside: list[tuple[int, int, bytes]]) -> CompactionPlan | None:
        """Hold the free runs of the window [first, end) out of the allocator and take a new
        extent (first fit, outside it) for each block inside; None, with nothing taken, when
        one finds none (lock held)."""
        claimed: list[tuple[int, int]] = []
        at = first
        while at < end:  # the window's free runs: held out of the allocator
            length = self._extents.run_at(at)
            if length:
                take = min(length, end - at)
                self._extents.claim(at, take)
                claimed.append((at, take))
                at += take
            else:
                at += self._extent_at[at][0]
        moves: list[Relocation] = []
        for _, length, tag in inside:
            new = self._extents.allocate(length, self._phase(length * GRANULE_BYTES))
            if new is None:  # the blocks do not fit elsewhere: nothing is taken
                for m in moves:
                    self._extents.free(m.new.offset // GRANULE_BYTES, m.new.footprint_bytes // GRANULE_BYTES)
                    del self._extent_at[m.new.offset // GRANULE_BYTES]
                for at, take in claimed:
                    self._extents.free(at, take)
                return None
            self._extent_at[new] = (length, tag)
            moves.append(Relocation(tag, DiskHandle(new * GRANULE_BYTES, length * GRANULE_BYTES)))
        self._used += sum(m.new.footprint_bytes for m in moves)  # until the old extents are freed
        return CompactionPlan(claimed, moves)

    def _window(
        self, first: int, n: int, phase: int | None, movable: Callable[[bytes, int], bool], max_move_bytes: int
    ) -> tuple[int, int, list[tuple[int, int, bytes]]] | None:
        """(bytes to move, end granule, extents to move) of the window from granule `first`
        (a free run's or an extent's start) that holds n granules at `phase`; None when it
        runs past the slab's end, into an extent that may not move, or past max_move_bytes
        (lock held)."""
        s = first if phase is None else first + (phase - first) % _ALIGN_GRANULES
        if s + n > self._extents.num_granules:
            return None
        at, cost = first, 0
        inside: list[tuple[int, int, bytes]] = []
        while at < s + n:
            length = self._extents.run_at(at)
            if length:
                at += length
                continue
            extent = self._extent_at.get(at)
            if extent is None or not movable(extent[1], at * GRANULE_BYTES):
                return None
            cost += extent[0] * GRANULE_BYTES
            if cost > max_move_bytes:
                return None
            inside.append((at, extent[0], extent[1]))
            at += extent[0]
        if not inside:  # a free run holds it already (the caller found none: raced)
            return None
        last_end = inside[-1][0] + inside[-1][1]  # an extent reaching past the window moves whole
        return cost, max(s + n, last_end), inside

    def sync(self) -> None:
        """With `fsync` (--disk-fsync), make what was written durable (fdatasync):
        relocated copies before the dead records of the extents they leave, which must
        never reach the disk first. Without it nothing is synced, as for any write of this
        tier: a process that dies leaves both in the page cache in the order written (a
        restart finds the block once), and only a power loss can lose a block, never
        serve a corrupt one (every read is verified). fdatasync flushes the whole slab's
        dirty pages (350 ms in a review's run), and an allocation compacts under the pool's
        lock."""
        if self.fsync:
            os.fdatasync(self.fd)

    def copy_extent(self, old: DiskHandle, new: DiskHandle) -> None:
        """Copy a block from its extent `old` into `new` (taken by plan_compaction) as a
        later write: its header again under a new write sequence (so that, of the two
        copies a crash may leave, a restart keeps this one), the payload as it is; then
        read it back verified. `new` learns its sequence and checksum. The caller calls
        sync() before it frees `old`. Raises CorruptBlock (the old copy is unreadable) or
        OSError (the write failed, or the copy did not read back: `new` stays unwritten,
        its magic cleared when it is freed)."""
        head = decode_header(os.pread(self.fd, HEADER_SLOT_BYTES, old.offset))
        payload = np.empty(head.payload_bytes, dtype=np.uint8)
        self._read(old, [payload], head.block_hash)  # its seq and checksum are the handle's
        seq = next(self._seq)
        # the header read names the block as encode_header wants it (hashes, codec, model,
        # namespace, last access): written again as it was, under the new sequence
        raw = encode_header(seq, head, head.payload_bytes, head.checksum, head.layout).ljust(HEADER_SLOT_BYTES, b"\0")
        used = HEADER_SLOT_BYTES + head.payload_bytes
        if used > new.footprint_bytes:
            raise OSError(
                errno.EINVAL, f"a {head.payload_bytes} B block does not fit its {new.footprint_bytes} B extent"
            )
        bufs = [memoryview(raw), payload.data.cast("B")]
        if new.footprint_bytes > used:
            bufs.append(_ZEROS[: new.footprint_bytes - used])
        try:
            self._check_file()
            _pwritev_all(self.fd, bufs, new.offset)
        except OSError as exc:
            self.write_errors_total += 1
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                self._out_of_space()
            raise
        check = DiskHandle(new.offset, new.footprint_bytes, seq, head.checksum)
        try:
            self._read(check, [payload], head.block_hash)
        except CorruptBlock as exc:  # the new copy, not the block: it stays where it is, intact
            self.write_errors_total += 1
            raise OSError(errno.EIO, f"the relocated copy does not read back: {exc}") from None
        new.seq, new.checksum = seq, head.checksum

    def finish_compaction(self, plan: CompactionPlan, relocated: list[Relocation]) -> None:
        """Give the window's held runs back and bring the extents freed since into the
        allocator (their dead records first), so the window is one free run again when
        every block inside it moved. `relocated`: the moves the caller switched (their
        old extents freed, the others' new ones)."""
        with self._lock:
            for at, take in plan.claimed:
                self._extents.free(at, take)
            if relocated:
                self.compactions_total += 1
                self.relocated_blocks_total += len(relocated)
                self.relocated_bytes_total += sum(m.new.footprint_bytes for m in relocated)
        self.drain()

    def allocated_bytes(self) -> int:
        """Bytes of the file system the slab takes now (its sparse size)."""
        return os.fstat(self.fd).st_blocks * 512

    def _dead(self) -> set[tuple[int, int]]:
        """(offset, seq) of the blocks the dead log says are gone."""
        raw = os.pread(self._dead_fd, os.fstat(self._dead_fd).st_size, 0)
        usable = len(raw) // _DEAD.size * _DEAD.size
        return set(_DEAD.iter_unpack(raw[:usable]))

    def _compact_dead_log(self) -> None:
        """Keep only the records whose dead header is still in the slab (one overwritten by
        a later block is gone for good), in a new log renamed over the old (drain lock held)."""
        kept = []
        for offset, seq in self._dead():
            head = os.pread(self.fd, _FIXED_SEQ_END, offset)
            if head[:8] == MAGIC and _SEQ.unpack_from(head, _FIXED_SEQ_AT)[0] == seq:
                kept.append(_DEAD.pack(offset, seq))
        # only now: every write seen burying a dropped record (a mover's may still be in
        # flight, its extent freed above) is on disk before the log that drops it
        os.fdatasync(self.fd)
        tmp = self.dead_path.with_suffix(".tmp")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)  # a leftover of a compaction cut short (never a link followed: O_EXCL)
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            _write_all(fd, b"".join(kept))
            os.fdatasync(fd)
            os.replace(tmp, self.dead_path)
            fsync_dir(self.dead_path.parent)  # the rename survives a crash with the records after it
        except OSError:
            os.close(fd)
            raise
        os.close(self._dead_fd)
        self._dead_fd, self._dead_records = fd, len(kept)

    def _clear_loop(self) -> None:
        while True:
            self._clear_wake.wait()
            self._clear_wake.clear()
            if self.fd < 0:
                return
            try:
                self.drain()
            except Exception:  # noqa: BLE001 - keep clearing what comes next
                log.exception("disk tier: clearing freed extents failed")

    def flush(self) -> None:
        """Clear freed extents and make what was written durable (fdatasync); with
        fsync=True every write already is."""
        self.drain()
        os.fdatasync(self.fd)

    def close(self) -> None:
        try:
            if self.fd >= 0:
                self.drain()
        finally:
            io, self._io = self._io, None
            if io is not None:
                io.shutdown(wait=True)
            if self._dead_fd >= 0:
                os.close(self._dead_fd)
                self._dead_fd = -1
            if self.fd >= 0:
                fd, self.fd = self.fd, -1
                os.close(fd)  # releases the flock
                self._clear_wake.set()  # the clearing thread ends

    def location(self, handle: DiskHandle) -> tuple[Path, int, int]:
        """(slab path, offset of the payload, payload bytes upper bound) for tools and tests."""
        return self.path, handle.offset + HEADER_SLOT_BYTES, handle.footprint_bytes - HEADER_SLOT_BYTES

    def _check_file(self) -> None:
        """Raise FileNotFoundError once the slab was removed under the agent (checked at
        most every 50 ms: an fstat per block would cost as much as the rest of a move)."""
        if self._lost:
            raise FileNotFoundError(errno.ENOENT, f"the slab file {self.path} was removed")
        now = time.monotonic()
        if now - self._checked_at < 0.05:
            return
        self._checked_at = now
        try:
            if os.fstat(self.fd).st_nlink == 0:
                self._lost = True  # for good: what is written now would vanish with the agent
                log.error("disk tier: the slab file %s was removed; the disk tier is lost until a restart", self.path)
                raise FileNotFoundError(errno.ENOENT, f"the slab file {self.path} was removed")
        except OSError as exc:
            if isinstance(exc, FileNotFoundError):
                raise
            raise OSError(exc.errno, f"the slab file {self.path} is not usable: {exc.strerror}") from None

    # ---- data ---------------------------------------------------------------------------
    def write(self, handle: DiskHandle, data, meta) -> None:
        """Write header + payload into the handle's extent with one pwritev (write_many of
        one block). `data` is a flat uint8 tensor or a list of them (segments of a memory
        tier, written without a staging copy). The handle learns its write sequence and
        checksum; raises OSError."""
        err = self.write_many([(handle, data, meta)])[0]
        if err is not None:
            raise err

    def _read(self, handle: DiskHandle, segments: list[np.ndarray], expect_hash: bytes | None) -> None:
        """Read header and payload with one preadv, the payload straight into `segments`,
        and verify both there."""
        hb = HEADER_SLOT_BYTES
        where = f"{self.path} at {handle.offset}"
        if not handle.seq:
            raise CorruptBlock(f"{where}: never written")
        head = bytearray(hb)
        want = sum(s.nbytes for s in segments)
        try:
            self._check_file()
            got = _preadv_all(self.fd, [memoryview(head), *(s.data.cast("B") for s in segments)], handle.offset)
        except FileNotFoundError:
            raise CorruptBlock(f"{self.path}: missing") from None
        except OSError as exc:
            raise CorruptBlock(f"{where}: read failed: {exc.strerror or exc}") from None
        err = self._verify(handle, head, segments, got >= hb + want, expect_hash=expect_hash)
        if err is not None:
            raise err

    # ---- batches (the mover's path): one syscall per run of adjacent extents -------------
    def write_many(self, items: list[tuple[DiskHandle, list, BlockMeta]]) -> list[OSError | None]:
        """Write several blocks, [(handle, payload segments, meta)], with one pwritev per
        run of adjacent extents (header slot, payload and padding of each, in file order:
        the whole extent, so no older header survives inside it).
        Returns per item None or the error that kept it from being written; each written
        handle learns its sequence number and checksum as with write()."""
        out: list[OSError | None] = [None] * len(items)
        prepared = []
        for k, (handle, data, meta) in enumerate(items):
            segments = [d.reshape(-1).numpy() for d in (data if isinstance(data, list) else [data])]
            nbytes = sum(seg.nbytes for seg in segments)
            digest = getattr(meta, "checksum", 0) or _xxh3(segments)  # hashed here if it carries none
            seq = next(self._seq)
            try:
                if HEADER_SLOT_BYTES + nbytes > handle.footprint_bytes:
                    raise OSError(
                        errno.EINVAL, f"a {nbytes} B block does not fit its {handle.footprint_bytes} B extent"
                    )
                head = encode_header(seq, meta, nbytes, digest, self.layouts.get(meta.model_id, "")).ljust(
                    HEADER_SLOT_BYTES, b"\0"
                )
            except OSError as exc:
                self.write_errors_total += 1
                out[k] = exc
                continue
            bufs = [memoryview(head), *(memoryview(s).cast("B") for s in segments)]
            prepared.append((handle.offset, handle.footprint_bytes, HEADER_SLOT_BYTES + nbytes, bufs, k, seq, digest))
        for run in _runs(prepared, WRITE_RUN_BYTES):
            bufs = []
            for _, footprint, used, item_bufs, *_ in run:
                bufs += item_bufs
                if footprint > used:
                    bufs.append(_ZEROS[: footprint - used])
            try:
                self._check_file()
                _pwritev_all(self.fd, bufs, run[0][0])
                if self.fsync:
                    os.fdatasync(self.fd)
            except OSError as exc:
                self.write_errors_total += len(run)
                for item in run:
                    out[item[4]] = exc
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    self._out_of_space()
                continue
            for _, _, _, _, k, seq, digest in run:
                items[k][0].seq, items[k][0].checksum = seq, digest
        return out

    def read_many(self, items: list[tuple[DiskHandle, list]]) -> list[CorruptBlock | None]:
        """Read several blocks straight into their destination segments, [(handle,
        segments)], with one preadv per run of adjacent extents, and verify each. Returns
        per item None or why it is unreadable (CorruptBlock)."""
        out: list[CorruptBlock | None] = [None] * len(items)
        prepared = []
        for k, (handle, segments) in enumerate(items):
            arrays = [t.numpy() for t in segments]
            head = bytearray(HEADER_SLOT_BYTES)
            used = HEADER_SLOT_BYTES + sum(a.nbytes for a in arrays)
            bufs = [memoryview(head), *(memoryview(a).cast("B") for a in arrays)]
            prepared.append((handle.offset, handle.footprint_bytes, used, bufs, k, head, arrays))
        pad = max([f - u for _, f, u, *_ in prepared if f > u] or [0])
        # runs of at most READ_RUN_BYTES: each block is verified while its bytes are still
        # in the CPU cache from the read
        runs = _runs(prepared, READ_RUN_BYTES)
        # the runs split between io_threads threads: a read and a checksum both let go of
        # the GIL, so one thread's read overlaps another's checksum (and uses a second core)
        io = self._io
        groups = [runs[i :: self.io_threads] for i in range(min(self.io_threads, len(runs)))] if io else [runs]
        futures, inline = [], groups[:1]
        for g in groups[1:]:
            try:
                assert io is not None  # more than one group only with I/O threads
                futures.append(io.submit(self._read_runs, g, items, out, pad))
            except RuntimeError:  # the pool is shutting down: read it here
                inline.append(g)
        try:
            for g in inline:
                self._read_runs(g, items, out, pad)
        finally:  # an error here still waits for the reads into the caller's pages (it may free them)
            wait_all(futures)
        for f in futures:
            f.result()
        return out

    def _read_runs(self, runs: list[list], items: list, out: list, pad: int) -> None:
        scratch = bytearray(pad)
        for run in runs:
            if len(run) == 1 and run[0][2] > STREAM_FROM_BYTES:  # a big block: read and hash it piece by piece
                offset, _, _, _, k, head, arrays = run[0]
                out[k] = self._read_streaming(items[k][0], head, arrays)
                continue
            bufs = []
            for _, footprint, used, item_bufs, *_ in run:
                bufs += item_bufs
                if footprint > used:
                    bufs.append(memoryview(scratch)[: footprint - used])
            try:
                self._check_file()
                got = _preadv_all(self.fd, bufs, run[0][0])
            except FileNotFoundError:
                for item in run:
                    out[item[4]] = CorruptBlock(f"{self.path}: missing")
                continue
            except OSError as exc:
                for item in run:
                    out[item[4]] = CorruptBlock(f"{self.path} at {item[0]}: read failed: {exc.strerror or exc}")
                continue
            start = run[0][0]
            for offset, _, used, _, k, head, arrays in run:
                out[k] = self._verify(items[k][0], head, arrays, got - (offset - start) >= used)

    def _read_streaming(self, handle: DiskHandle, head: bytearray, arrays: list[np.ndarray]) -> CorruptBlock | None:
        """Read one big block in pieces of READ_RUN_BYTES, hashing each while it is in cache."""
        where = f"{self.path} at {handle.offset}"
        h = xxhash.xxh3_64()
        try:
            self._check_file()
            whole = os.preadv(self.fd, [memoryview(head)], handle.offset) == len(head)
            offset = handle.offset + HEADER_SLOT_BYTES
            for a in arrays:
                view = a.data.cast("B")
                for start in range(0, len(view), READ_RUN_BYTES):
                    piece = view[start : start + READ_RUN_BYTES]
                    if whole and os.preadv(self.fd, [piece], offset) < len(piece):
                        whole = False
                    h.update(piece)
                    offset += len(piece)
        except FileNotFoundError:
            return CorruptBlock(f"{self.path}: missing")
        except OSError as exc:
            return CorruptBlock(f"{where}: read failed: {exc.strerror or exc}")
        return self._verify(handle, head, arrays, whole, h.intdigest())

    def _verify(
        self,
        handle: DiskHandle,
        head,
        arrays: list[np.ndarray],
        whole: bool,
        digest_read: int | None = None,
        expect_hash: bytes | None = None,
    ) -> CorruptBlock | None:
        """Why a block read into `head` and `arrays` is unreadable, or None: its header, that
        it is the write the handle names (and the block expected), its size, its checksum."""
        where = f"{self.path} at {handle.offset}"
        if not handle.seq:
            return CorruptBlock(f"{where}: never written")
        try:
            _, _, seq, block_hash, _, _, _, payload_bytes, digest = check_header(head)
        except CorruptBlock as exc:
            return CorruptBlock(f"{where}: {exc}")
        if expect_hash is not None and block_hash != expect_hash:
            return CorruptBlock(f"{where}: holds another block")
        if seq != handle.seq or digest != handle.checksum:
            return CorruptBlock(f"{where}: overwritten")
        want = sum(a.nbytes for a in arrays)
        if payload_bytes != want:
            return CorruptBlock(f"{where}: payload is {payload_bytes} B, expected {want} B")
        if not whole:
            return CorruptBlock(f"{where}: truncated payload")
        if (digest_read if digest_read is not None else _xxh3(arrays)) != digest:
            return CorruptBlock(f"{where}: checksum mismatch")
        return None

    def read(self, handle: DiskHandle, num_bytes: int) -> torch.Tensor:
        payload = np.empty(num_bytes, dtype=np.uint8)
        self._read(handle, [payload], None)
        return torch.from_numpy(payload)

    def read_into(self, handle: DiskHandle, segments: list) -> None:
        """Read a block's payload straight into `segments` (e.g. a memory tier's pages)
        and verify it there; raises CorruptBlock."""
        self._read(handle, [t.numpy() for t in segments], None)

    # ---- restart ------------------------------------------------------------------------
    def headers(self) -> list[tuple[int, Header | None]]:
        """Every granule of the slab that starts with the magic of a block that is not dead,
        with its header (None when the header does not verify), skipping over extents of
        valid headers. Reads the slab once, sequentially; changes nothing."""
        return [(offset, header) for offset, header, state in self._walk() if state != _DEAD_BLOCK]

    def _walk(self) -> list[tuple[int, Header | None, str]]:
        """Every header found, with its state: OK (header and payload verify; the walk
        skips the rest of its extent), DEAD (listed in the dead log) or CORRUPT (header or
        payload does not verify). The walk goes on inside the extent of a block that is not
        OK: later blocks may have reused it."""
        self.drain()
        dead = self._dead()
        size = os.fstat(self.fd).st_size  # the whole file: past the capacity too (a smaller one now)
        out: list[tuple[int, Header | None, str]] = []
        pos = 0
        while pos < size:
            chunk = os.pread(self.fd, min(_SCAN_CHUNK_BYTES, size - pos), pos)
            usable = len(chunk) // GRANULE_BYTES * GRANULE_BYTES
            if usable == 0:
                break
            heads = np.frombuffer(chunk, dtype=np.uint64, count=usable // 8)[:: GRANULE_BYTES // 8]
            skip_to = pos
            for g in np.flatnonzero(heads == _MAGIC_U64):
                offset = pos + int(g) * GRANULE_BYTES
                if offset < skip_to:
                    continue
                at = int(g) * GRANULE_BYTES
                raw: bytes | memoryview
                if at + HEADER_SLOT_BYTES <= len(chunk):
                    raw = memoryview(chunk)[at : at + HEADER_SLOT_BYTES]
                else:
                    raw = os.pread(self.fd, HEADER_SLOT_BYTES, offset)
                try:
                    header = decode_header(raw)
                except CorruptBlock:
                    out.append((offset, None, _CORRUPT))
                    continue
                if (offset, header.seq) in dead:
                    out.append((offset, header, _DEAD_BLOCK))
                    continue
                footprint = self.footprint(header.payload_bytes)
                handle = DiskHandle(offset, footprint, header.seq, header.checksum)
                if offset + footprint > self.slab_bytes:  # not read: it cannot be held at this capacity
                    out.append((offset, header, _BEYOND))
                    skip_to = offset + footprint
                    continue
                try:
                    self._read(handle, [np.empty(header.payload_bytes, dtype=np.uint8)], header.block_hash)
                except CorruptBlock as exc:
                    log.warning("disk tier: %s", exc)
                    out.append((offset, header, _CORRUPT))
                    continue
                out.append((offset, header, _OK))
                skip_to = offset + footprint
            pos = max(pos + usable, skip_to)
        return out

    def claim(self, agent_id: str) -> str:
        """Record `agent_id` as the directory's user (an owner file beside the slab, written
        whole); returns the one before it ('' for none, or an unreadable file): an agent
        started on another's directory (a wrong --disk-dir, a volume moved to another pod)
        is then said, not silent."""
        path = self.directory / OWNER_NAME
        try:
            before = path.read_text().strip()
        except (OSError, UnicodeDecodeError):
            before = ""
        if before != agent_id:
            tmp = path.with_suffix(".tmp")
            try:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(agent_id + "\n")
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
                fsync_dir(self.directory)  # the rename survives a power loss
            except OSError as exc:
                log.warning("disk tier %s: could not record its owner: %s", self.directory, exc)
        return before

    def scan(self) -> tuple[list[RecoveredBlock], int]:
        """Blocks found in the slab whose checksums verify; corrupt ones are cleared.
        Returns (blocks, number of corrupt blocks removed)."""
        found: dict[bytes, RecoveredBlock] = {}
        corrupt = 0
        beyond = [0, 0]  # blocks, bytes past a smaller --disk-capacity than the slab was written with
        seq_max = max((seq for _, seq in self._dead()), default=0)
        for offset, header, state in self._walk():
            if header is not None:
                seq_max = max(seq_max, header.seq)
            if state == _DEAD_BLOCK:  # freed before the restart: its header goes now, its record below
                self._clear(offset)
                continue
            if state == _BEYOND:  # removed, said below: kept hidden, it came back with a bigger capacity
                assert header is not None
                self._clear(offset)
                beyond[0] += 1
                beyond[1] += header.payload_bytes
                continue
            if state == _CORRUPT:
                self._clear(offset)
                corrupt += 1
                continue
            assert header is not None  # an OK block's header verified (_walk)
            n = self.footprint(header.payload_bytes) // GRANULE_BYTES
            handle = DiskHandle(offset, n * GRANULE_BYTES, header.seq, header.checksum)
            if not self._extents.claim(offset // GRANULE_BYTES, n):
                self._clear(offset)  # overlaps a block already taken: cannot be whole
                corrupt += 1
                continue
            self._used += handle.footprint_bytes
            self._extent_at[offset // GRANULE_BYTES] = (n, header.block_hash)
            seq_max = max(seq_max, header.seq)
            block = RecoveredBlock(
                header.model_id,
                header.block_hash,
                header.parent_hash,
                header.codec,
                header.namespace,
                header.num_bytes,
                header.payload_bytes,
                handle,
                header.layout,
                header.last_access_unix_seconds,
            )
            older = found.get(header.block_hash)
            if older is not None:  # a copy whose removal a crash interrupted: the later write wins
                stale = older if older.handle.seq < header.seq else block
                found[header.block_hash] = block if stale is older else older
                self._clear(stale.handle.offset)
                self._extent_at.pop(stale.handle.offset // GRANULE_BYTES, None)
                self._extents.free(stale.handle.offset // GRANULE_BYTES, stale.handle.footprint_bytes // GRANULE_BYTES)
                self._used -= stale.handle.footprint_bytes
            else:
                found[header.block_hash] = block
        self._seq = itertools.count(seq_max + 1)
        if beyond[0]:
            log.warning(
                "disk tier %s: removed %d blocks (%d bytes) that lie past --disk-capacity %d bytes (the slab "
                "was written with a bigger one)",
                self.path,
                beyond[0],
                beyond[1],
                self.slab_bytes,
            )
        os.fdatasync(self.fd)  # the clears are on disk before the records that stood for them go
        if beyond[0] or os.fstat(self.fd).st_size > self.slab_bytes:
            os.ftruncate(self.fd, self.slab_bytes)  # a smaller capacity gives the file system its space back
        os.ftruncate(self._dead_fd, 0)  # every dead header is cleared: the log starts empty
        self._dead_records = 0
        return list(found.values()), corrupt

    def _clear(self, offset: int) -> None:
        try:
            os.pwrite(self.fd, b"\0" * len(MAGIC), offset)
        except OSError as exc:
            log.warning("disk tier: could not clear offset %d: %s", offset, exc)


_ZEROS = memoryview(bytes(4096))  # padding up to the next extent (at most 4 KiB)
_IOV_MAX = 1024  # iovecs one pwritev/preadv takes (Linux)
READ_RUN_BYTES = 256 << 10  # small blocks: adjacent ones read together up to this much
WRITE_RUN_BYTES = 4 << 20  # adjacent blocks written together up to this much
STREAM_FROM_BYTES = 4 << 20  # blocks bigger than this are read and hashed in READ_RUN_BYTES pieces


def _runs(prepared: list, max_bytes: int = 1 << 62) -> list[list]:
    """Items (offset, footprint, ...) grouped into runs of adjacent extents in file order,
    each short enough for one vectored call (and at most `max_bytes`, past its first)."""
    runs: list[list] = []
    iovs = size = 0
    for item in sorted(prepared, key=lambda it: it[0]):
        n = len(item[3]) + 1
        if (
            runs
            and runs[-1][-1][0] + runs[-1][-1][1] == item[0]
            and iovs + n <= _IOV_MAX
            and size + item[1] <= max_bytes
        ):
            runs[-1].append(item)
            iovs += n
            size += item[1]
        else:
            runs.append([item])
            iovs, size = n, item[1]
    return runs


def _xxh3(arrays: list[np.ndarray]) -> int:
    """xxh3-64 of a payload given as one or more byte arrays (as if concatenated)."""
    if len(arrays) == 1:
        return xxhash.xxh3_64_intdigest(arrays[0].data)
    h = xxhash.xxh3_64()
    for a in arrays:
        h.update(a.data)
    return h.intdigest()


def fsync_dir(path) -> None:
    """Make a rename or a new file in `path` durable (fsync of the directory)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while len(view):
        n = os.write(fd, view)
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        view = view[n:]


def _vectored(call, fd: int, bufs: list[memoryview], offset: int) -> int:
    """os.preadv / os.pwritev over every buffer, IOV_MAX at a time, going on where a short
    transfer stopped; returns the bytes moved (fewer only at the end of the file)."""
    bufs = list(bufs)
    total = i = 0
    while i < len(bufs):
        n = call(fd, bufs[i : i + _IOV_MAX], offset)
        if n <= 0:
            break
        total += n
        offset += n
        while i < len(bufs) and n >= len(bufs[i]):
            n -= len(bufs[i])
            i += 1
        if i < len(bufs) and n:
            bufs[i] = bufs[i][n:]
    return total


def _preadv_all(fd: int, bufs: list[memoryview], offset: int) -> int:
    """preadv until every buffer is full or the file ends; returns the bytes read."""
    return _vectored(os.preadv, fd, bufs, offset)


def _pwritev_all(fd: int, bufs: list[memoryview], offset: int) -> None:
    """pwritev until every byte is written (a short write goes on where it stopped)."""
    if _vectored(os.pwritev, fd, bufs, offset) < sum(len(b) for b in bufs):
        raise OSError(errno.EIO, "short write")
