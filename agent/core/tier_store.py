"""Where a tier keeps its blocks' bytes, as the block pool sees it: the store protocols
(implemented in agent.store: `memory_tier.MemoryTier` for GPU and CPU slabs,
`disk_tier.DiskTier` for the disk) and the guards that tell the kinds apart, so a move can
take the fastest way its two stores allow (in place between slabs, vectored to or from a
file)."""

from __future__ import annotations

from typing import Protocol

import torch
from typing_extensions import TypeIs

from protos.tier import Tier


class BlockUnreadable(Exception):
    """A tier could not return a block's bytes intact (checksum, truncation, I/O)."""


class TierStore(Protocol):
    """Where one tier keeps bytes (implemented in agent.store)."""

    tier: Tier

    @property
    def capacity_bytes(self) -> int: ...  # read-only: the disk tier's shrinks with its file system
    @property
    def used_bytes(self) -> int: ...
    def footprint(self, num_bytes: int) -> int: ...
    def allocate(self, num_bytes: int, block_hash: bytes = b""): ...
    def free(self, handle) -> None: ...
    def write(self, handle, data, meta) -> None: ...  # data: a tensor, or a list of its segments
    def write_many(self, items: list) -> list: ...  # [(handle, data, meta)] -> [OSError | None]
    def read(self, handle, num_bytes: int) -> torch.Tensor: ...


class SlabStore(TierStore, Protocol):
    """A memory tier: one slab of pages on a device (agent.store.memory_tier); its blocks'
    bytes are addressable in place."""

    device: str
    slab: torch.Tensor
    page_bytes: int  # a block takes whole pages: footprint(n) is ceil(n / page_bytes) of them

    def views(self, handle, num_bytes: int) -> list[torch.Tensor]: ...
    def byte_runs(self, handle, num_bytes: int) -> list[tuple[int, int]]: ...


class FileStore(TierStore, Protocol):
    """A tier in a file (agent.store.disk_tier): read into memory the caller gives, and it
    records each model's layout in its headers."""

    layouts: dict[str, str]

    def read_many(self, items: list) -> list: ...  # [(handle, segments)] -> [BlockUnreadable | None]
    def read_into(self, handle, segments: list) -> None: ...


class CompactingStore(FileStore, Protocol):
    """A file tier whose free space can be compacted (agent.store.disk_tier): it plans
    which blocks leave a window of its file, copies each block to its new extent, and the
    pool switches the block and frees its old extent (agent.core.compaction)."""

    @property
    def largest_footprint_bytes(self) -> int: ...

    def fragmented(self, footprint_bytes: int) -> bool: ...
    def plan_compaction(self, footprint_bytes: int, movable, max_move_bytes: int): ...
    def copy_extent(self, old, new) -> None: ...
    def sync(self) -> None: ...
    def finish_compaction(self, plan, relocated: list) -> None: ...


def is_compacting(store: TierStore | None) -> TypeIs[CompactingStore]:
    return hasattr(store, "plan_compaction")


def is_slab(store: TierStore | None) -> TypeIs[SlabStore]:
    return hasattr(store, "views")


def is_host_slab(store: TierStore | None) -> TypeIs[SlabStore]:
    """A memory slab in host memory (the CPU tier's)."""
    return hasattr(store, "views") and getattr(store, "device", "") == "cpu"


def is_file(store: TierStore | None) -> TypeIs[FileStore]:
    return hasattr(store, "read_many")
