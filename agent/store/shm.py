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

import ctypes
import fcntl
import mmap
import os
import weakref
from collections.abc import Sequence
from functools import cache

import torch

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

    def write(self, pieces: Sequence[tuple[int, int, int]]) -> int:
        """Copy every piece; raises ValueError (before copying anything) for a piece outside
        the slab. Returns the bytes copied."""
        self.check(pieces)
        total = 0
        for src, dst, n in pieces:
            ctypes.memmove(self.base + (dst - self.peer_base), src, n)
            total += n
        return total
