"""Prefill -> decode handoff, the pure part: reservations on the receiving agent, retry
plans, per-link limits and achieved-throughput measurement on the sending agent.

A handoff moves a prefix's blocks from a sender to a receiver in four steps: the
receiver *reserves* pages for the blocks it lacks (invisible, not in the block index),
the sender writes each block's stored payload into those pages (Transfer Engine write,
or the chunked gRPC fallback), the receiver *verifies* a checksum per block, and at the
last commit it makes the whole prefix visible at once.

Invariants (checked by tests):
- a reserved block is invisible (not in `BlockPool.blocks`) until its reservation
  commits, and a reservation commits all its blocks or none;
- the leading blocks a reservation relies on (present on the receiver) are referenced
  while it is open, so they are neither evicted nor moved away under it;
- pages of an aborted or expired reservation go back to the free list only once no
  write can still land in them: at once when the sender says its writes are quiesced,
  else after a quarantine long enough for the engine's own timeout to have fired; pages
  a same-host sender copies into itself (shared memory) stay held, past the quarantine,
  while that process lives and has not said its copy ended (a sender stopped in the
  middle of a copy finishes it when it runs again, however late), at most
  `writer_hold_max_seconds`.

Nothing here imports gRPC or the engine; agent.api and agent.store bring those.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import contextlib
import math
import os
import random
import re
import sys
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import xxhash

from agent.core import codecs as codec_names
from agent.core.block_pool import BlockPool
from agent.core.blocks import BlockMeta, PastFillLimit, PoolFull
from agent.core.tier_store import SlabStore, is_host_slab
from protos import errors
from protos.tier import Tier

SHM, ENGINE, GRPC = "shm", "engine", "grpc"
PATHS = (SHM, ENGINE, GRPC)  # the order a handoff tries them in (shm only to a peer on this host)
TRANSFERRED, PRESENT, RECOMPUTE = "transferred", "present", "recompute"
MAX_TTL_SECONDS = 600.0  # a reservation outlives no sender longer than this


VERIFY_THREADS = max(1, min(4, os.cpu_count() or 1))  # xxh3 lets go of the GIL: blocks hash side by side
VERIFY_PARALLEL_BYTES = 4 << 20  # a batch smaller than this is hashed in the calling thread
# a verify while later bytes are still on the wire hashes at this niceness: on a host whose
# cores the transfer itself keeps busy (the engine's TCP copies on both ends) it takes the
# cycles the transfer leaves, not the transfer's; the last Commit hashes at the caller's
BACKGROUND_VERIFY_NICE = 10
_verify_pools: dict[bool, cf.ThreadPoolExecutor] = {}
_verify_pool_lock = threading.Lock()


def _lower_priority() -> None:
    """A background verify thread's start: a higher niceness for this thread alone (a
    Linux thread is its own task; elsewhere the call would name a process, so it is not
    made); where that is not allowed it stays as it is."""
    if not sys.platform.startswith("linux"):
        return
    try:
        tid = threading.get_native_id()
        if os.getpriority(os.PRIO_PROCESS, tid) < BACKGROUND_VERIFY_NICE:  # never raised above the process's
            os.setpriority(os.PRIO_PROCESS, tid, BACKGROUND_VERIFY_NICE)
    except (AttributeError, OSError):  # no getpriority here, or refused (a locked-down sandbox)
        return  # the thread hashes at the process's priority: slower handoffs on a busy host, nothing wrong


def _pool(background: bool) -> cf.ThreadPoolExecutor:
    pool = _verify_pools.get(background)
    if pool is None:
        with _verify_pool_lock:
            pool = _verify_pools.get(background)
            if pool is None:
                pool = _verify_pools[background] = cf.ThreadPoolExecutor(
                    VERIFY_THREADS,
                    thread_name_prefix="verify-background" if background else "verify",
                    initializer=_lower_priority if background else None,
                )
    return pool


def _nbytes(segs) -> int:
    return sum(seg.numel() if hasattr(seg, "numel") else len(seg) for seg in segs)


def _shares(blocks: list, num_shares: int) -> list[list]:
    """`blocks` cut into up to `num_shares` runs of consecutive blocks of about equal bytes."""
    sizes = [_nbytes(segs) for segs in blocks]
    per_share = sum(sizes) / num_shares
    out: list[list] = [[]]
    done = 0
    for segs, n in zip(blocks, sizes, strict=True):
        if out[-1] and done >= per_share * len(out) and len(out) < num_shares:
            out.append([])
        out[-1].append(segs)
        done += n
    return out


def _checksums(share: list) -> list[int]:
    return [checksum(segs) for segs in share]


def checksums_of(blocks: list, background: bool = False) -> list[int]:
    """`checksum` of each block (a list of segments each), on up to VERIFY_THREADS threads
    when there is enough to hash: verifying what landed is a pass over every byte.
    `background`: on the lower-priority threads (BACKGROUND_VERIFY_NICE), whatever the size.
    In the foreground each thread hashes one run of consecutive blocks of about equal
    bytes, the caller the first run itself: with a future per block on pool threads (the
    caller only waiting) the last Commit's hash of 16 / 32 MiB took 0.8 / 1.3 ms longer
    (medians) on a 2-core host (docs/handoff.md, 2026-12-08)."""
    if not blocks:
        return []
    total = sum(_nbytes(segs) for segs in blocks)
    if not background and (VERIFY_THREADS == 1 or len(blocks) < 2 or total < VERIFY_PARALLEL_BYTES):
        return _checksums(blocks)
    if background:
        return list(_pool(True).map(checksum, blocks))
    shares = _shares(blocks, VERIFY_THREADS)
    rest = [_pool(False).submit(_checksums, share) for share in shares[1:]]
    out = _checksums(shares[0])
    for f in rest:
        out += f.result()
    return out


def checksum(segments) -> int:
    """xxh3_64 of a block's payload given as one or more contiguous uint8 tensors/buffers."""
    h = xxhash.xxh3_64()
    for seg in segments:
        h.update(memoryview(seg.numpy()) if hasattr(seg, "numpy") else seg)
    return h.intdigest()


# ---- receiver: reservations ----------------------------------------------------------


@dataclass
class Reservation:
    reservation_id: str
    model_id: str
    block_hashes: list[bytes]
    num_present: int
    present: list[BlockMeta]  # referenced while open
    handles: list  # one page list per reserved block, blocks [num_present, N)
    stored_bytes: list[int]
    codecs: list[str]
    namespaces: list[str]  # per block of the prefix
    tier: Tier
    source_agent_id: str
    created_monotonic: float
    expires_monotonic: float
    verified: dict[int, int] = field(default_factory=dict)  # prefix index -> its checksum, once it matched
    writers: int = 0  # fallback-path streams writing into its pages right now
    # (pid, start ticks) of the same-host process that copies into its pages itself (the
    # shared-memory path): no engine timeout bounds when that copy ends
    writer: tuple[int, int] | None = None
    # set once it leaves the open set (commit, abort, expiry): no fallback write lands in its
    # pages after that; `guard` is held by each write's copy and each block's verification
    closed: bool = False
    guard: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def num_blocks(self) -> int:
        return len(self.block_hashes)

    @property
    def reserved_bytes(self) -> int:
        return sum(self.stored_bytes[self.num_present :])


@dataclass(eq=False)  # compared by identity: two holds are never the same one
class _Held:
    """Pages of a reservation that a late write could still reach."""

    release_at: float
    handles: list
    reservation_id: str = ""
    writer: tuple[int, int] | None = None  # held past release_at while this process lives ...
    release_at_latest: float = math.inf  # ... but not past this


_RESERVATION_ID = re.compile(r"[A-Za-z0-9_-]{16,64}")
MAX_WRITER_DONE = 4096  # reservations whose writer said its copy ended before they closed


class ReservationError(errors.FailedPrecondition):
    """A reservation cannot be committed (unknown, expired, checksum mismatch)."""


class Reservations:
    """Open reservations of one receiving agent. `run_once(now)` expires the stale ones
    and returns quarantined pages to the pool; tests drive it with a fake clock."""

    def __init__(
        self,
        pool: BlockPool,
        tier: Tier,
        max_inbound: int = 8,
        quarantine_seconds: float = 12.0,
        clock=time.monotonic,
        writer_alive=None,
        writer_hold_max_seconds: float = 600.0,
        agent_id: str = "",
    ):
        self.pool = pool
        self.tier = tier
        # named in refusals: a sender relays them prefixed with its own id
        self.where = f"agent {agent_id}" if agent_id else "this agent"
        store = pool.store_of[tier]
        if not is_host_slab(store):
            raise ValueError(f"handoffs land in a host memory tier, not the {tier.label} tier")
        self.store: SlabStore = store
        self.max_inbound = max_inbound
        self.quarantine_seconds = quarantine_seconds
        self.clock = clock
        self._lock = threading.Lock()
        # held by a Reserve with a fill limit from its check to its pages: two drains into
        # this agent at once must not both see the same room free below the line
        self._filling = threading.Lock()
        self._open: dict[str, Reservation] = {}
        self._quarantine: list[_Held] = []
        # callable(pid, start ticks) -> whether that process still runs (None: none is
        # asked; a writer's pages are freed after the quarantine as any others)
        self._writer_alive = writer_alive
        self.writer_hold_max_seconds = writer_hold_max_seconds
        # ids whose writer said "my copy ended" while the reservation was closing, or before
        # it existed (an Abort that raced the Reserve, its commit, its expiry): their pages
        # wait out the plain quarantine, not the writer
        self._writer_done: OrderedDict[str, None] = OrderedDict()
        self._aborted_while_reserving: set[str] = set()  # Aborts that came while their Reserve found pages
        self.committed_total = 0
        self.aborted_total = 0
        self.expired_total = 0
        self.checksum_failures_total = 0

    # -- queries
    def open_count(self) -> int:
        with self._lock:
            return len(self._open)

    def reserved_bytes(self) -> int:
        with self._lock:
            return sum(r.reserved_bytes for r in self._open.values() if r is not None)

    def get(self, reservation_id: str) -> Reservation:
        with self._lock:
            r = self._open.get(reservation_id) if reservation_id else None
        if r is None:
            raise ReservationError(f"reservation {reservation_id!r} is not open here (expired, aborted or never made)")
        return r

    # -- steps
    def reserve(
        self,
        model_id: str,
        block_hashes: Sequence[bytes],
        stored_bytes: Sequence[int],
        codecs: Sequence[str],
        namespace: str | Sequence[str] = "",
        ttl_seconds: float = 10.0,
        source_agent_id: str = "",
        writer: tuple[int, int] | None = None,
        reservation_id: str = "",
        fill_limit_bytes: int = 0,
    ) -> Reservation:
        """Reserve pages for the blocks after the leading ones held here. Raises
        ResourceExhausted when too many handoffs are arriving (retry later), and
        FailedPrecondition when the blocks cannot fit (pinned/in-use blocks fill the tier),
        FillLimitReached when they would take the handoff tier and those below it past
        `fill_limit_bytes` (a drain's: it fills room, it pushes out none of this agent's
        blocks; 0: no limit)."""
        if model_id not in self.pool.models:
            raise errors.NotFound(f"model_id: {self.where} serves no model {model_id!r}")
        if reservation_id and not _RESERVATION_ID.fullmatch(reservation_id):
            raise errors.InvalidArgument("reservation_id", "16 to 64 letters, digits, - or _")
        if len(stored_bytes) != len(block_hashes) or len(codecs) != len(block_hashes):
            raise errors.InvalidArgument("stored_bytes", "give one size and one codec per block")
        namespaces = [namespace] * len(block_hashes) if isinstance(namespace, str) else list(namespace)
        if len(namespaces) != len(block_hashes):
            raise errors.InvalidArgument("namespaces", "give one namespace per block, or none")
        if not math.isfinite(ttl_seconds):
            raise errors.InvalidArgument("ttl_seconds", f"must be finite, got {ttl_seconds}")
        ttl_seconds = min(ttl_seconds, MAX_TTL_SECONDS)
        for c in set(codecs):
            try:
                codec_names.check_codec(c)
            except ValueError as exc:
                raise errors.InvalidArgument("codecs", str(exc)) from None
        # a size its codec cannot have would commit a block no read can decode
        spec = self.pool.models[model_id]
        most_of = {c: codec_names.max_payload_bytes(c, spec.block_shape, spec.torch_dtype) for c in set(codecs)}
        for i, (n, c) in enumerate(zip(stored_bytes, codecs, strict=True)):
            exact = c != "zstd"  # every other codec's size is fixed by the block's shape
            most = most_of[c]
            if (exact and n != most) or not 0 < n <= most:
                want = f"{most} B" if exact else f"1 to {most} B"
                raise errors.InvalidArgument(f"stored_bytes[{i}]", f"{n} B is not a {c} block of {model_id} ({want})")
        with self._lock:
            if len(self._open) >= self.max_inbound:
                raise errors.ResourceExhausted(
                    f"{len(self._open)} handoffs are arriving at {self.where} already (limit {self.max_inbound}); "
                    "retry shortly"
                )
            rid = reservation_id or uuid.uuid4().hex[:16]  # the sender's own: it can abort a Reserve it lost
            if rid in self._writer_done:
                raise errors.FailedPrecondition(f"reservation_id: {rid!r} was aborted by its sender already")
            if rid in self._open:
                raise errors.AlreadyExists(f"reservation_id: {rid!r} is in use here")
            self._open[rid] = None  # type: ignore[assignment]  # holds the slot while pages are found
        try:
            with self._filling if fill_limit_bytes else contextlib.nullcontext():
                num_present, present, handles = self.pool.reserve_chain(
                    model_id, list(block_hashes), list(stored_bytes), self.tier, fill_limit_bytes
                )
        except PastFillLimit as exc:
            with self._lock:
                self._open.pop(rid, None)
                self._aborted_while_reserving.discard(rid)
            raise errors.FillLimitReached(f"no room for the drain's blocks in {self.where}: {exc}") from None
        except PoolFull as exc:
            with self._lock:
                self._open.pop(rid, None)
                self._aborted_while_reserving.discard(rid)  # an Abort meanwhile: nothing is left to abort
            raise errors.FailedPrecondition(
                f"no room for the handoff in the {self.tier.label} tier of {self.where}: {exc}"
            ) from None
        except BaseException:
            with self._lock:
                self._open.pop(rid, None)
                self._aborted_while_reserving.discard(rid)
            raise
        with self._lock:
            aborted = rid in self._aborted_while_reserving
            self._aborted_while_reserving.discard(rid)
            if aborted or not handles:
                self._open.pop(rid, None)
        if aborted:  # its sender gave up on this Reserve while pages were found: none was written
            self.pool.release_reserved(handles, self.tier)
            self.pool.release_chain(present)
            with self._lock:  # (counted from several threads at once)
                self.aborted_total += 1
            raise errors.FailedPrecondition(f"reservation_id: {rid!r} was aborted by its sender while it was made")
        if not handles:  # all present: nothing to write or commit, so nothing is kept open
            self.pool.release_chain(present)
        now = self.clock()
        r = Reservation(
            rid,
            model_id,
            list(block_hashes),
            num_present,
            present,
            handles,
            list(stored_bytes),
            list(codecs),
            namespaces,
            self.tier,
            source_agent_id,
            now,
            now + max(0.1, ttl_seconds),
            writer=writer,
        )
        if handles:
            with self._lock:
                self._open[rid] = r
        return r

    def slots(self, r: Reservation) -> list[tuple[int, int]]:
        """(address, length) runs of the registered buffer where the reserved blocks go,
        one after another in prefix order (block i takes the next stored_bytes[i] bytes);
        runs that touch are merged."""
        out: list[tuple[int, int]] = []
        for i, handle in enumerate(r.handles):
            n = r.stored_bytes[r.num_present + i]
            for addr, length in self.store.byte_runs(handle, n):
                if out and out[-1][0] + out[-1][1] == addr:
                    out[-1] = (out[-1][0], out[-1][1] + length)
                else:
                    out.append((addr, length))
        return out

    def views(self, r: Reservation, index: int):
        """Slab views of block `index` (prefix index) of a reservation."""
        i = index - r.num_present
        return self.store.views(r.handles[i], r.stored_bytes[index])

    def write(self, r: Reservation, index: int, offset: int, data) -> None:
        """Fallback path: copy `data` (bytes) into block `index` at `offset`, only while the
        reservation is open and the block not yet verified (a stream still writing after its
        reservation was committed, aborted or expired would corrupt pages that now hold
        verified blocks, or another handoff's)."""
        if not r.num_present <= index < r.num_blocks:
            raise errors.InvalidArgument("block_index", f"{index} is not a reserved block of this reservation")
        size = r.stored_bytes[index]
        if offset < 0 or offset + len(data) > size:
            raise errors.InvalidArgument("offset", f"[{offset}, {offset + len(data)}) is outside the block's {size} B")
        if not data:
            return
        src = np.frombuffer(data, dtype=np.uint8)  # a read-only view of the message bytes: no copy
        with r.guard:
            if r.closed:
                raise ReservationError(
                    f"reservation {r.reservation_id!r} is no longer open (committed, aborted or expired)"
                )
            if index in r.verified:
                raise errors.FailedPrecondition(
                    f"block {index} of the reservation is verified already: not written again"
                )
            pos = 0
            for seg in self.views(r, index):
                n = seg.numel()
                lo, hi = max(offset, pos), min(offset + len(data), pos + n)
                if lo < hi:
                    seg.numpy()[lo - pos : hi - pos] = src[lo - offset : hi - offset]
                pos += n

    def _check_range(self, r: Reservation, first_block: int, checksums: Sequence[int]) -> None:
        if first_block < r.num_present or first_block + len(checksums) > r.num_blocks:
            raise errors.InvalidArgument(
                "first_block",
                f"checksums for blocks [{first_block}, {first_block + len(checksums)}) but blocks "
                f"[{r.num_present}, {r.num_blocks}) are reserved",
            )

    def _verify_blocks(
        self, r: Reservation, first_block: int, checksums: Sequence[int], committing: bool = False
    ) -> str:
        """Check blocks [first_block, first_block + len(checksums)), each with no write in
        between; '' when all match, else what did not. Only the commit verifies a closed
        reservation: a verify that lost the race to an abort would hash pages no longer its."""
        with r.guard:  # no fallback write lands in these blocks while they are hashed
            if r.closed and not committing:
                raise ReservationError(
                    f"reservation {r.reservation_id!r} is no longer open (committed, aborted or expired)"
                )
            # a block an earlier verify matched with the same checksum is not hashed again
            todo = [(first_block + k, c) for k, c in enumerate(checksums) if r.verified.get(first_block + k) != c]
            # a verify while engine writes still travel takes the cycles the transfer leaves; a
            # same-host sender's group is hashed at once, while its bytes are still in cache
            got = checksums_of([self.views(r, i) for i, _ in todo], background=not committing and r.writer is None)
            for (i, expected), g in zip(todo, got, strict=True):
                if g == expected:
                    r.verified[i] = g
        for (i, expected), g in zip(todo, got, strict=True):
            if g != expected:
                with self._lock:  # (counted from several threads at once)
                    self.checksum_failures_total += 1
                return (
                    f"checksum mismatch on block {i} ({r.block_hashes[i].hex()[:12]}): "
                    f"sent {expected:016x}, received {g:016x}; nothing was made visible"
                )
        return ""

    def verify(self, reservation_id: str, first_block: int, checksums: Sequence[int]) -> Reservation:
        """Check blocks [first_block, first_block + len(checksums)) while the rest may still
        be on the wire; a mismatch aborts the whole reservation (into quarantine: a late
        write may have caused it)."""
        r = self.get(reservation_id)
        self._check_range(r, first_block, checksums)
        mismatch = self._verify_blocks(r, first_block, checksums)
        if mismatch:
            self.abort(reservation_id, quiesced=False)
            raise ReservationError(mismatch)
        return r

    def commit(self, reservation_id: str, first_block: int, checksums: Sequence[int]) -> Reservation:
        """Close the reservation to writes, verify what is left and make every block of the
        prefix visible at once."""
        self._check_range(self.get(reservation_id), first_block, checksums)
        with self._lock:
            r = self._open.pop(reservation_id, None)
        if r is None:
            raise ReservationError(f"reservation {reservation_id!r} expired or was aborted during its commit")
        self._close(r)  # from here on what is verified stays as verified
        mismatch = self._verify_blocks(r, first_block, checksums, committing=True)
        missing = [i for i in range(r.num_present, r.num_blocks) if i not in r.verified]
        if mismatch or missing:
            self._release(r, quiesced=not mismatch and not r.writers)
            with self._lock:  # (counted from several threads at once)
                self.aborted_total += 1
            raise ReservationError(
                mismatch or f"blocks {missing[:5]} of the reservation were never verified; nothing was made visible"
            )
        try:
            self.pool.commit_reserved(
                r.model_id,
                r.block_hashes,
                r.num_present,
                r.handles,
                r.stored_bytes,
                r.codecs,
                r.tier,
                r.namespaces,
                checksums=[r.verified[i] for i in range(r.num_present, r.num_blocks)],
            )
        except ValueError as exc:
            self.pool.release_reserved(r.handles, r.tier)
            raise ReservationError(f"cannot commit: {exc}; nothing was made visible") from None
        finally:
            self.pool.release_chain(r.present)
        with self._lock:  # (counted from several threads at once)
            self.committed_total += 1
        return r

    def abort(self, reservation_id: str, quiesced: bool = False) -> bool:
        held: list[_Held] = []
        with self._lock:
            if reservation_id in self._open and self._open[reservation_id] is None:
                # its Reserve is still finding pages: it keeps the slot, and lets them go when done
                self._aborted_while_reserving.add(reservation_id)
                return True
            r = self._open.pop(reservation_id, None)
            # read with the pop: a writer attaches only to an open reservation (attach_writer)
            free_now = quiesced and r is not None and not r.writers
            if r is None and quiesced and reservation_id:
                # a same-host writer whose reservation expired under its copy: it says the
                # copy has ended, so the pages held for it are free now (and if they are not
                # held yet, closing or not made yet, they will not be held for it)
                held = self._take_held(lambda h: h.writer is not None and h.reservation_id == reservation_id)
                self._writer_done[reservation_id] = None
                while len(self._writer_done) > MAX_WRITER_DONE:
                    self._writer_done.popitem(last=False)
        if r is None:
            for h in held:
                self.pool.release_reserved(h.handles, self.tier)
            return False
        self._close(r)
        self._release(r, free_now)
        with self._lock:  # (counted from several threads at once)
            self.aborted_total += 1
        return True

    def attach_writer(self, reservation_id: str) -> Reservation:
        """The open reservation, with one more writer on it: an abort from now on sends its
        pages to quarantine instead of freeing them under the write."""
        with self._lock:
            r = self._open.get(reservation_id) if reservation_id else None
            if r is not None:
                r.writers += 1
        if r is None:
            raise ReservationError(f"reservation {reservation_id!r} is not open here (expired, aborted or never made)")
        return r

    def detach_writer(self, r: Reservation) -> None:
        with self._lock:
            r.writers -= 1

    @staticmethod
    def _close(r: Reservation) -> None:
        """No fallback write lands in `r`'s pages after this returns (one under way ends first)."""
        with r.guard:
            r.closed = True

    def _release(self, r: Reservation, quiesced: bool) -> None:
        """Give back what a reservation held: its pages now when no write can still land in
        them (`quiesced`), else after the quarantine."""
        self.pool.release_chain(r.present)
        if quiesced:
            self.pool.release_reserved(r.handles, r.tier)
        else:
            now = self.clock()
            held = _Held(now + self.quarantine_seconds, r.handles, r.reservation_id, r.writer)
            with self._lock:
                if (
                    r.writer is not None
                    and self._writer_alive is not None
                    and r.reservation_id not in self._writer_done
                ):
                    held.release_at_latest = now + max(self.quarantine_seconds, self.writer_hold_max_seconds)
                else:
                    held.writer = None
                self._quarantine.append(held)

    def run_once(self, now: float | None = None) -> int:
        """Expire reservations past their TTL (into quarantine) and free quarantined pages
        whose time is up. Returns the number of reservations expired."""
        now = self.clock() if now is None else now
        with self._lock:
            stale = [r for r in self._open.values() if r is not None and r.expires_monotonic <= now]
            for r in stale:
                del self._open[r.reservation_id]
            due = self._take_held(lambda h: self._free_now(h, now))
        for r in stale:
            self._close(r)
            self._release(r, quiesced=False)
            with self._lock:  # (counted from several threads at once)
                self.expired_total += 1
        for h in due:
            self.pool.release_reserved(h.handles, self.tier)
        return len(stale)

    def _take_held(self, which) -> list[_Held]:
        """Take the quarantined holds `which` picks out of the quarantine (lock held)."""
        taken: list[_Held] = []
        kept: list[_Held] = []
        for h in self._quarantine:
            (taken if which(h) else kept).append(h)
        self._quarantine = kept
        return taken

    def _free_now(self, h: _Held, now: float) -> bool:
        if h.release_at > now:
            return False
        return h.writer is None or now >= h.release_at_latest or not self._writer_alive(*h.writer)

    def quarantined_pages(self) -> int:
        with self._lock:
            return sum(len(p) for h in self._quarantine for p in h.handles)

    def held_for_writers(self) -> int:
        """Quarantined reservations past their time, held while their same-host writer lives."""
        now = self.clock()
        with self._lock:
            return sum(1 for h in self._quarantine if h.writer is not None and h.release_at <= now)


# ---- sender: retries, link limits, throughput -----------------------------------------


@dataclass(frozen=True)
class RetryPolicy:
    """How a handoff tries: each path in order, `attempts` times each with exponential
    backoff (base * 2^k, capped, with jitter), all within the request's deadline."""

    paths: tuple[str, ...] = PATHS
    attempts_per_path: int = 2
    backoff_base_seconds: float = 0.05
    backoff_max_seconds: float = 1.0
    busy_backoff_seconds: float = 0.05  # a busy receiver (too many handoffs arriving): wait, queue

    def backoff(self, attempt: int, rng: random.Random | None = None) -> float:
        base = min(self.backoff_max_seconds, self.backoff_base_seconds * (2**attempt))
        return base * (0.5 + (rng or random).random() / 2)


@dataclass(frozen=True)
class HandoffResult:
    outcome: str  # transferred | present | recompute
    path: str = ""
    num_blocks: int = 0  # leading blocks of the prefix visible on the destination
    num_sent_blocks: int = 0
    sent_bytes: int = 0
    seconds: float = 0.0
    attempts: int = 0
    reason: str = ""
    num_cached_tokens: int = 0
    first_path: str = ""  # the first path tried: `path` differs from it after a fallback


SMALL_TRANSFER_BYTES = 1 << 16  # transfers this small are their fixed cost, whatever the link's speed
BYTES_BOUND_TRANSFER_BYTES = 8 << 20  # transfers this large are mostly their bytes on a GB/s link
FIXED_COST_MAX_SECONDS = 0.05  # a transfer's fixed cost (round trips, a verify) is well under this


class Link:
    """One outbound link (this agent -> a peer): at most `max_concurrent` transfers at
    once, at most `bytes_per_second` (0: unlimited) over them, and what a transfer on it
    costs, fitted to recent ones: `seconds = latency_seconds + bytes * sharing /
    throughput_bytes_per_second`, where `sharing` counts the transfers on the link at once
    (each got its share of it) and the latency is the fixed part (the Reserve and Commit
    round trips, a verify). A rate measured as bytes over seconds said a link that copies
    at GB/s moved 0.07 GB/s when its transfers were small and overlapped."""

    def __init__(
        self, peer_agent_id: str, max_concurrent: int = 2, bytes_per_second: float = 0.0, clock=time.monotonic
    ):
        self.peer_agent_id = peer_agent_id
        self.max_concurrent = max(1, max_concurrent)
        self.bytes_per_second = bytes_per_second
        self.clock = clock
        self._cond = threading.Condition()
        self.inflight = 0
        self.queued = 0
        self.retired = False  # forgotten by its Links (idle): a transfer takes the new one
        self._waiting: collections.deque[object] = collections.deque()  # queued transfers, oldest first
        self._tokens = 0.0
        self._tokens_at = clock()
        self.throughput_bytes_per_second = 0.0  # the link's capacity for bytes (0: unknown)
        self.latency_seconds = 0.0  # the fixed cost of one transfer
        self._fit = (0.0, 0.0, 0.0, 0.0, 0.0)  # decayed sums of 1, x, y, x*x, x*y (x bytes*sharing, y s)
        self.transfers_total = 0
        self.failures_total = 0
        self.bytes_total = 0
        self.last_path = ""
        self.last_unix_seconds = 0.0

    def acquire(self, deadline_monotonic: float) -> bool:
        """Wait for a slot on the link (queued meanwhile, first come first served: a later
        transfer never takes a slot one queued before it waits for); False at the deadline,
        or at once when the link was forgotten (Links.acquire then takes the new one)."""
        me = object()
        with self._cond:
            if self.retired:
                return False
            self.queued += 1
            self._waiting.append(me)
            try:
                while self.inflight >= self.max_concurrent or self._waiting[0] is not me:
                    left = deadline_monotonic - self.clock()
                    if left <= 0:
                        return False
                    self._cond.wait(min(left, 0.05))
                self.inflight += 1
                return True
            finally:
                self._waiting.remove(me)
                self.queued -= 1
                self._cond.notify_all()  # the next in line may be first now

    def release(self) -> None:
        with self._cond:
            self.inflight -= 1
            self._cond.notify_all()

    def pace(self, num_bytes: int, deadline_monotonic: float) -> bool:
        """Token bucket: wait until `num_bytes` may go (False when that passes the deadline)."""
        if self.bytes_per_second <= 0:
            return True
        while True:
            with self._cond:
                now = self.clock()
                burst = self.bytes_per_second * 0.1
                self._tokens = min(burst, self._tokens + (now - self._tokens_at) * self.bytes_per_second)
                self._tokens_at = now
                if self._tokens >= 0:
                    self._tokens -= num_bytes  # may go negative: the next ones wait it off
                    return True
                wait = -self._tokens / self.bytes_per_second
            if now + wait > deadline_monotonic:
                return False
            time.sleep(min(wait, 0.05))

    def record(self, ok: bool, num_bytes: int, seconds: float, path: str, decay: float = 0.9) -> None:
        """One transfer on this link ended (called while it still holds its slot)."""
        with self._cond:
            self.transfers_total += 1
            self.last_path = path
            self.last_unix_seconds = time.time()
            if not ok:
                self.failures_total += 1
                return
            self.bytes_total += num_bytes
            if num_bytes <= 0 or seconds <= 0:
                return
            x, y = num_bytes * max(1, self.inflight), seconds
            w, sx, sy, sxx, sxy = (decay * v for v in self._fit)
            self._fit = w, sx, sy, sxx, sxy = w + 1, sx + x, sy + y, sxx + x * x, sxy + x * y
            mx, my = sx / w, sy / w
            var, cov = sxx / w - mx * mx, sxy / w - mx * my
            slope = cov / var if var > (0.1 * mx) ** 2 else 0.0  # sizes too alike to tell the two apart
            if slope > 0 and my - slope * mx >= 0:
                self.throughput_bytes_per_second, self.latency_seconds = 1 / slope, my - slope * mx
            elif mx >= BYTES_BOUND_TRANSFER_BYTES or my >= FIXED_COST_MAX_SECONDS:  # time mostly bytes
                self.throughput_bytes_per_second, self.latency_seconds = mx / my, 0.0
            elif self.throughput_bytes_per_second > 0 and mx >= SMALL_TRANSFER_BYTES:
                # sizes the fixed cost dominates, jitter hiding the slope: the rate known
                # stays, the rest is latency (all of it as rate said a 4 GB/s link was 0.1)
                self.latency_seconds = max(0.0, my - mx / self.throughput_bytes_per_second)
            else:  # they measure the fixed cost, not the link
                self.throughput_bytes_per_second, self.latency_seconds = 0.0, my


class Links:
    def __init__(self, max_concurrent: int = 2, bytes_per_second: float = 0.0):
        self.max_concurrent = max_concurrent
        self.bytes_per_second = bytes_per_second
        self._lock = threading.Lock()
        self._links: dict[str, Link] = {}

    def get(self, peer_agent_id: str) -> Link:
        with self._lock:
            link = self._links.get(peer_agent_id)
            if link is None:
                link = self._links[peer_agent_id] = Link(peer_agent_id, self.max_concurrent, self.bytes_per_second)
            return link

    def acquire(self, peer_agent_id: str, deadline_monotonic: float) -> tuple[Link, bool]:
        """The peer's link and whether a slot on it was taken by the deadline (Link.acquire).
        A link forgotten between its lookup here and the transfer queueing on it is not
        used: a transfer on it was one more than the new link's limit, and unseen in stats."""
        while True:
            link = self.get(peer_agent_id)
            if link.acquire(deadline_monotonic):
                return link, True  # (a link with a transfer on it is not forgotten)
            if not link.retired:
                return link, False
            # forgotten meanwhile (it had no transfer): look the new one up

    def all(self) -> list[Link]:
        with self._lock:
            return list(self._links.values())

    def forget(self, peer_agent_id: str) -> bool:
        """Drop an idle link (no transfer running or queued on it); whether it went. Checked
        under the link's own lock, with which a transfer queues on it: one that looked the
        link up before finds it retired and takes the new one."""
        with self._lock:
            link = self._links.get(peer_agent_id)
            if link is None:
                return False
            with link._cond:
                if link.inflight or link.queued:
                    return False
                link.retired = True
            del self._links[peer_agent_id]
            return True


def batches_of(sizes: Sequence[int], batch_bytes: int) -> list[list[int]]:
    """Indices of `sizes` (bytes per block, in order) in consecutive batches, each closed
    once it holds `batch_bytes` or more (a block is never split)."""
    out: list[list[int]] = []
    size = batch_bytes
    for j, n in enumerate(sizes):
        if size >= batch_bytes:
            out.append([])
            size = 0
        out[-1].append(j)
        size += n
    return out


VERIFIES_PER_HANDOFF = 2  # a sender's verifies of one handoff unanswered at once, at most


class LandedGroups:
    """Which landed engine batches of one handoff the sender asks the receiver to verify
    together while later ones travel, and what is left for the last Commit.

    Batches land in order (`landed`, k = 0, 1, ...). Those landed before the last window
    (the last `window` batches are on the wire together and land together: nothing is left
    to travel behind their verify) go out as groups of at least `group_bytes`, and the
    batch just before the last window closes a group whatever its size, so the last
    Commit verifies the last window only. While `max_pending` verifies have not answered
    no new one goes: the group grows instead (a handoff's verifies hold at most that many
    of the receiver's gRPC workers while its background threads hash); what cannot go
    before the last window goes with the last Commit. With `while_sending` off, all of it
    does. Every batch is in exactly one verify or the last Commit, in order.
    """

    def __init__(
        self,
        num_batches: int,
        window: int,
        group_bytes: int,
        while_sending: bool = True,
        max_pending: int = VERIFIES_PER_HANDOFF,
    ):
        self.num_batches = num_batches
        self.window = max(1, window)
        self.group_bytes = group_bytes
        self.while_sending = while_sending
        self.max_pending = max(1, max_pending)
        self._first = -1
        self._sums: list[int] = []
        self._bytes = 0

    def landed(
        self, k: int, first_block: int, checksums: Sequence[int], num_bytes: int, num_pending: int = 0
    ) -> tuple[int, list[int], int] | None:
        """Batch k landed (its first block, its blocks' checksums, its bytes; `num_pending`
        verifies of the handoff not answered yet): (first block, checksums, bytes) to
        verify now (or, for the last batch, to send with the last Commit), else None (kept
        for a later group)."""
        if not self._sums:
            self._first = first_block
        self._sums.extend(checksums)
        self._bytes += num_bytes
        last = k == self.num_batches - 1
        if not last:
            travel_left = k < self.num_batches - self.window
            closes = self._bytes >= self.group_bytes or k == self.num_batches - self.window - 1
            if not (self.while_sending and travel_left and closes and num_pending < self.max_pending):
                return None
        out = (self._first, self._sums, self._bytes)
        self._sums, self._bytes = [], 0
        return out


class RunCursor:
    """Consecutive stretches of a list of (address, length) runs: `take(n)` gives the
    runs of the next n bytes (a batch of blocks in the receiver's slots)."""

    def __init__(self, runs: Sequence[tuple[int, int]]):
        self._runs = runs
        self._i = 0
        self._off = 0

    def take(self, n: int) -> list[tuple[int, int]]:
        out: list[tuple[int, int]] = []
        while n > 0:
            if self._i >= len(self._runs):
                raise ValueError(f"the runs end {n} B short")
            addr, length = self._runs[self._i]
            k = min(n, length - self._off)
            out.append((addr + self._off, k))
            self._off += k
            n -= k
            if self._off >= length:
                self._i, self._off = self._i + 1, 0
        return out


def slices(pieces: Sequence[tuple[int, int, int]], max_bytes: int) -> Iterator[list[tuple[int, int, int]]]:
    """(src, dst, length) pieces cut into consecutive groups of at most `max_bytes`
    (a piece longer than that is split), one group at a time."""
    group: list[tuple[int, int, int]] = []
    room = max_bytes
    for src, dst, n in pieces:
        while n > 0:
            if room == 0:
                yield group
                group, room = [], max_bytes
            k = min(n, room)
            group.append((src, dst, k))
            src, dst, n, room = src + k, dst + k, n - k, room - k
    if group:
        yield group
