"""Shared-memory slabs for same-host handoff.

An agent's CPU slab can live in a memfd (anonymous shared memory, not subject to
/dev/shm's size limit, gone when the last process that maps it exits). The agent
publishes `/proc/<pid>/fd/<fd>`, the file's inode and the host's boot id; a peer on the
same host opens that path, checks the inode (a pid reused after a restart names another
file), maps the slab and copies blocks straight into the pages the receiver reserved:
one memcpy per run, no socket, no engine. The receiver still verifies every block's
checksum before anything is visible, so a mapping gone wrong can only fail a handoff.
"""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import fcntl
import mmap
import os
import weakref
from collections.abc import Sequence
from functools import cache

import torch

from agent.core.handoff import slices

NAME_PREFIX = "kvcp-"  # memfd names: /proc/<pid>/fd/<fd> links to "/memfd:kvcp-..."


@cache
def host_id() -> str:
    """This host's boot id ("" where the kernel does not say): two agents may share a slab
    only when theirs are equal."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def process_start_ticks(pid: int) -> int | None:
    """When a process started (clock ticks after boot, /proc/<pid>/stat), None when it
    is gone or a zombie (which copies nothing any more)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()
    except OSError:
        return None
    if len(fields) < 20 or fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


@cache
def own_start_ticks() -> int:
    """This process's start time, read once (0 where /proc does not say)."""
    return process_start_ticks(os.getpid()) or 0


def process_alive(pid: int, start_ticks: int) -> bool:
    """That very process still runs (stopped counts: it may run again); a pid reused by
    another process does not."""
    return process_start_ticks(pid) == start_ticks


class SharedSlab:
    """A zeroed slab of `num_bytes` in a memfd, as a uint8 tensor (`tensor`). Its size is
    sealed: a process that opens it cannot shrink it under a mapping (SIGBUS)."""

    def __init__(self, num_bytes: int, name: str) -> None:
        if not hasattr(os, "memfd_create"):
            raise OSError("memfd_create is not available on this platform")
        self.fd = os.memfd_create(NAME_PREFIX + name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, num_bytes)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            self._map = mmap.mmap(self.fd, num_bytes)
        except OSError:
            os.close(self.fd)
            raise
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        self.path = f"/proc/{os.getpid()}/fd/{self.fd}"
        self.inode = os.fstat(self.fd).st_ino
        # the memory goes when the mapping and this descriptor are both gone
        self._closer = weakref.finalize(self, os.close, self.fd)

    def close(self) -> None:
        """No new peer can open the slab (the tensor stays valid while it is referenced)."""
        self._closer()


class PeerSlab:
    """A peer's slab mapped into this process: `write(pieces)` copies
    (source address, peer address, length) pieces into it, the peer addresses being the
    peer's own (its `transfer_buffer_address` is the slab's start)."""

    def __init__(self, path: str, inode: int, peer_base: int, num_bytes: int) -> None:
        target = os.readlink(path)  # a pid reused since: the link names some other file
        if not target.startswith("/memfd:" + NAME_PREFIX):
            raise OSError(f"{path} is not a kvcp slab (it is {target})")
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            if not fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK:
                raise OSError(f"{path} is not sealed against shrinking")
            st = os.fstat(fd)
            if st.st_ino != inode:
                raise OSError(f"{path} is another file now (inode {st.st_ino}, expected {inode})")
            if st.st_size < num_bytes:
                raise OSError(f"{path} holds {st.st_size} B, the peer published {num_bytes} B")
            self._map = mmap.mmap(fd, num_bytes)
        finally:
            os.close(fd)
        self._anchor = ctypes.c_char.from_buffer(self._map)  # pins the mapping while we hold it
        self.base = ctypes.addressof(self._anchor)
        self.key = (path, inode, peer_base, num_bytes)
        self.peer_base = peer_base
        self.num_bytes = num_bytes

    def check(self, pieces: Sequence[tuple[int, int, int]]) -> None:
        """ValueError for a piece that does not lie inside the slab."""
        for _, dst, n in pieces:
            off = dst - self.peer_base
            if n < 0 or off < 0 or off + n > self.num_bytes:
                raise ValueError(f"a run of {n} B at peer address {dst:#x} lies outside its {self.num_bytes} B slab")

    def write(self, pieces: Sequence[tuple[int, int, int]], copier: cf.Executor | None = None, threads: int = 1) -> int:
        """Copy every piece; raises ValueError (before copying anything) for a piece outside
        the slab. Returns the bytes copied. With a `copier` and `threads` > 1 a large write
        is cut into that many equal shares copied side by side (this thread copies one):
        one core's copy is bound by its own cache misses, not by the memory's bandwidth."""
        self.check(pieces)
        local = [(src, self.base + (dst - self.peer_base), n) for src, dst, n in pieces]
        total = sum(n for _, _, n in local)
        if copier is None or threads < 2 or total < PARALLEL_COPY_BYTES:
            _copy(local)
            return total
        shares = split_even(local, threads)
        futures: list[cf.Future] = []
        try:
            for share in shares[1:]:
                futures.append(copier.submit(_copy, share))  # may refuse (shut down) after taking some
            _copy(shares[0])
        finally:
            cf.wait(futures)  # no copy outlives the call, even when one failed
        for f in futures:
            f.result()
        return total


PARALLEL_COPY_BYTES = 4 << 20  # below this one thread copies: the others' wake-up costs more


def _copy(pieces: Sequence[tuple[int, int, int]]) -> None:
    for src, dst, n in pieces:
        ctypes.memmove(dst, src, n)  # ctypes lets go of the GIL for the call


def split_even(pieces: Sequence[tuple[int, int, int]], parts: int) -> list[list[tuple[int, int, int]]]:
    """(src, dst, length) pieces cut into `parts` groups of nearly equal bytes, in order
    (a piece may be split between two groups); fewer groups when there are fewer bytes."""
    total = sum(n for _, _, n in pieces)
    return list(slices(pieces, max(1, -(-total // max(1, parts))))) or [list(pieces)]
