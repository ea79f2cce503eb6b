"""The disk tier: one file per block under a directory, each with a header that names
the block and a checksum of its payload, verified on every read.

    <dir>/<first two hex digits>/<block hash hex>-<write number>.kvb
    header: b"KVCPBLK1", u16 model_id length, model_id, u16 namespace length, namespace,
            16-byte block hash, 16-byte parent
            hash, 8-byte codec name, u64 uncompressed bytes, u64 payload bytes,
            u64 xxh3-64 of the payload
    payload

Files are written to a temporary name and renamed, so a crash never leaves a
half-written block under a real name; `fsync=True` also makes it durable. A block that
fails its checksum or is truncated raises CorruptBlock: the pool treats it as a miss and
removes it. `scan()` rebuilds the inventory after a restart, verifying every checksum.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import xxhash

from agent.core.block_pool import BlockUnreadable
from protos.tier import Tier

log = logging.getLogger(__name__)

MAGIC = b"KVCPBLK1"
_FIXED = struct.Struct("<16s16s8sQQQ")


class CorruptBlock(BlockUnreadable):
    pass


@dataclass(frozen=True)
class DiskHandle:
    path: str
    footprint_bytes: int


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


def checksum(buf) -> int:
    return xxhash.xxh3_64_intdigest(buf)


class DiskTier:
    tier = Tier.DISK

    def __init__(self, directory: str | os.PathLike, capacity_bytes: int, fsync: bool = False):
        self.directory = Path(directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            probe = self.directory / ".kvcp-write-probe"
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as exc:
            raise OSError(f"disk tier directory {self.directory} is not usable: {exc.strerror or exc}") from None
        if capacity_bytes <= 0:
            raise ValueError("disk capacity must be positive")
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        self.used_bytes = 0
        self.write_errors_total = 0
        # every write gets a fresh name, so freeing an old copy (unlinked in the
        # background: an unlink costs as much as reading a MiB) never hits a new one
        self._writes = itertools.count(int.from_bytes(os.urandom(4), "little"))
        self._unlink_queue: queue.Queue[str] = queue.Queue()
        self._unlinker = threading.Thread(target=self._unlink_loop, name="disk-unlink", daemon=True)
        self._unlinker.start()

    def _unlink_loop(self) -> None:
        while True:
            path = self._unlink_queue.get()
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("could not remove %s: %s", path, exc)
            finally:
                self._unlink_queue.task_done()

    def flush(self) -> None:
        """Wait until freed files are gone from the directory."""
        self._unlink_queue.join()

    def _path(self, block_hash: bytes) -> Path:
        hx = block_hash.hex()
        return self.directory / hx[:2] / f"{hx}-{next(self._writes):x}.kvb"

    @staticmethod
    def _header(meta) -> bytes:
        model = meta.model_id.encode()
        ns = meta.namespace.encode()
        return b"".join([MAGIC, struct.pack("<H", len(model)), model, struct.pack("<H", len(ns)), ns])

    def footprint(self, num_bytes: int) -> int:
        return num_bytes + 128

    def allocate(self, num_bytes: int, block_hash: bytes = b""):
        size = self.footprint(num_bytes)
        if self.used_bytes + size > self.capacity_bytes:
            return None
        self.used_bytes += size
        return DiskHandle(str(self._path(block_hash)) if block_hash else "", size)

    def free(self, handle: DiskHandle) -> None:
        self.used_bytes -= handle.footprint_bytes
        if handle.path:
            self._unlink_queue.put(handle.path)

    def write(self, handle: DiskHandle, data, meta) -> None:
        """Write header + payload to a temp file and rename it into place. `data` is a
        flat uint8 tensor or a list of them (segments of a memory tier, written without
        a staging copy)."""
        segments = [d.reshape(-1).numpy() for d in (data if isinstance(data, list) else [data])]
        h = xxhash.xxh3_64()
        for seg in segments:
            h.update(seg)
        nbytes = sum(seg.nbytes for seg in segments)
        head = self._header(meta) + _FIXED.pack(
            meta.block_hash,
            meta.parent_hash,
            meta.codec.encode().ljust(8, b"\0"),
            meta.num_bytes,
            nbytes,
            h.intdigest(),
        )
        path = Path(handle.path)
        tmp = path.with_suffix(".tmp")
        try:
            path.parent.mkdir(exist_ok=True)
            with open(tmp, "wb", buffering=0) as f:
                written = f.write(head)
                for seg in segments:
                    written += f.write(memoryview(seg))
                if self.fsync:
                    os.fsync(f.fileno())
            if written != len(head) + nbytes:  # verify before the switch
                raise OSError("short write")
            os.replace(tmp, path)
        except OSError:
            self.write_errors_total += 1
            tmp.unlink(missing_ok=True)
            raise

    def _read_file(
        self, path: str, into: list | None = None
    ) -> tuple[bytes, bytes, str, int, np.ndarray, bytes, bytes]:
        """Read and verify one block file; with `into` (uint8 tensors), the payload is
        read straight into those segments instead of a new array."""
        with open(path, "rb", buffering=0) as f:
            head = f.read(len(MAGIC) + 2)
            if len(head) < len(MAGIC) + 2 or head[: len(MAGIC)] != MAGIC:
                raise CorruptBlock(f"{path}: bad header")
            (model_len,) = struct.unpack("<H", head[len(MAGIC) :])
            model = f.read(model_len)
            ns_len_raw = f.read(2)
            if len(model) != model_len or len(ns_len_raw) != 2:
                raise CorruptBlock(f"{path}: truncated header")
            (ns_len,) = struct.unpack("<H", ns_len_raw)
            namespace = f.read(ns_len)
            fixed = f.read(_FIXED.size)
            if len(namespace) != ns_len or len(fixed) != _FIXED.size:
                raise CorruptBlock(f"{path}: truncated header")
            block_hash, parent, codec, num_bytes, payload_bytes, digest = _FIXED.unpack(fixed)
            if into is None:
                payload = np.empty(payload_bytes, dtype=np.uint8)
                segments = [payload]
            else:
                segments = [t.numpy() for t in into]
                payload = segments[0]
                if sum(s.nbytes for s in segments) != payload_bytes:
                    raise CorruptBlock(
                        f"{path}: payload is {payload_bytes} B, expected {sum(s.nbytes for s in segments)} B"
                    )
            h = xxhash.xxh3_64()
            for seg in segments:
                got = f.readinto(memoryview(seg))
                if got != seg.nbytes:
                    raise CorruptBlock(f"{path}: truncated payload")
                h.update(seg)
            if f.read(1):
                raise CorruptBlock(f"{path}: oversized payload")
        if h.intdigest() != digest:
            raise CorruptBlock(f"{path}: checksum mismatch")
        return block_hash, parent, codec.rstrip(b"\0").decode(), num_bytes, payload, model, namespace

    def read(self, handle: DiskHandle, num_bytes: int) -> torch.Tensor:
        try:
            payload = self._read_file(handle.path)[4]
        except FileNotFoundError:
            raise CorruptBlock(f"{handle.path}: missing") from None
        if payload.nbytes != num_bytes:
            raise CorruptBlock(f"{handle.path}: payload is {payload.nbytes} B, expected {num_bytes} B")
        return torch.from_numpy(payload)

    def read_into(self, handle: DiskHandle, segments: list) -> None:
        """Read a block's payload straight into `segments` (e.g. a memory tier's pages)
        and verify it there; raises CorruptBlock."""
        try:
            self._read_file(handle.path, into=segments)
        except FileNotFoundError:
            raise CorruptBlock(f"{handle.path}: missing") from None

    def scan(self) -> tuple[list[RecoveredBlock], int]:
        """Blocks found on disk with valid checksums; corrupt files are removed.
        Returns (blocks, number of corrupt files removed)."""
        found, corrupt = [], 0
        seen: set[bytes] = set()
        for path in sorted(self.directory.glob("*/*.kvb")):
            try:
                block_hash, parent, codec, num_bytes, payload, model, namespace = self._read_file(str(path))
                if path.stem.split("-")[0] != block_hash.hex():
                    raise CorruptBlock(f"{path}: name does not match its block hash")
                if block_hash in seen:  # an older copy whose removal a crash interrupted
                    path.unlink(missing_ok=True)
                    continue
                seen.add(block_hash)
            except (CorruptBlock, OSError, UnicodeDecodeError) as exc:
                log.warning("disk tier: removing %s (%s)", path, exc)
                path.unlink(missing_ok=True)
                corrupt += 1
                continue
            size = self.footprint(payload.nbytes)
            self.used_bytes += size
            found.append(
                RecoveredBlock(
                    model.decode(),
                    block_hash,
                    parent,
                    codec,
                    namespace.decode(),
                    num_bytes,
                    payload.nbytes,
                    DiskHandle(str(path), size),
                )
            )
        for tmp in self.directory.glob("*/*.tmp"):
            tmp.unlink(missing_ok=True)
        return found, corrupt
