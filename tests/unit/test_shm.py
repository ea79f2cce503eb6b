"""Same-host shared slabs (agent.store.shm): a memfd slab another mapping writes into,
the inode check against a reused /proc path, bounds, and slicing for a paced link."""

from __future__ import annotations

import os

import pytest
import torch

from agent.core.block_pool import pair_runs
from agent.core.handoff import slices
from agent.store.memory_tier import MemoryTier
from agent.store.shm import PeerSlab, SharedSlab, host_id
from protos.tier import Tier


def test_a_peer_mapping_writes_into_the_shared_slab():
    tier = MemoryTier(Tier.CPU, 1 << 20, 4096, shared=True)
    slab = tier.shared_slab
    assert slab is not None and tier.slab.data_ptr() == slab.tensor.data_ptr()
    assert slab.path == f"/proc/{os.getpid()}/fd/{slab.fd}" and host_id()
    src = torch.arange(256, dtype=torch.uint8).repeat(64)  # 16 KiB
    peer = PeerSlab(slab.path, slab.inode, tier.slab.data_ptr(), tier.slab.numel())
    base = tier.slab.data_ptr()
    # two destination runs, split across a source run boundary
    pieces = pair_runs([(src.data_ptr(), 16384)], [(base + 4096, 8192), (base + 65536, 8192)])
    assert peer.write(pieces) == 16384
    assert torch.equal(tier.slab[4096:12288], src[:8192]) and torch.equal(tier.slab[65536:73728], src[8192:])


def test_a_mapping_refuses_another_file_and_runs_outside_the_slab():
    slab = SharedSlab(1 << 16, "test")
    with pytest.raises(OSError, match="another file"):
        PeerSlab(slab.path, slab.inode + 1, 0x1000, 1 << 16)
    with pytest.raises(OSError, match="published"):
        PeerSlab(slab.path, slab.inode, 0x1000, 1 << 20)
    with pytest.raises(FileNotFoundError):
        PeerSlab("/proc/self/fd/99999", slab.inode, 0x1000, 1 << 16)
    peer = PeerSlab(slab.path, slab.inode, 0x1000, 1 << 16)
    src = torch.ones(64, dtype=torch.uint8)
    for dst in (0x0FFF, 0x1000 + (1 << 16) - 63):  # one byte before; one byte past the end
        with pytest.raises(ValueError, match="outside"):
            peer.write([(src.data_ptr(), 0x1000, 64), (src.data_ptr(), dst, 64)])
    assert int(slab.tensor.sum()) == 0  # nothing was copied by a refused batch


def test_a_mapping_refuses_files_that_are_not_kvcp_slabs_and_the_slab_cannot_shrink(tmp_path):
    other = tmp_path / "victim.db"
    other.write_bytes(b"A" * 65536)
    with open(other, "rb") as f:  # any open file: /proc/self/fd/N links to it
        path = f"/proc/self/fd/{f.fileno()}"
        with pytest.raises(OSError, match="not a kvcp slab"):
            PeerSlab(path, os.fstat(f.fileno()).st_ino, 0x1000, 65536)
    assert other.read_bytes() == b"A" * 65536
    slab = SharedSlab(1 << 16, "test")
    with pytest.raises(PermissionError):
        os.ftruncate(slab.fd, 0)  # sealed: a mapping can never lose its pages (SIGBUS)


def test_private_slab_without_shared_memory(monkeypatch):
    assert MemoryTier(Tier.CPU, 1 << 16, 4096).shared_slab is None  # not asked for
    monkeypatch.delattr(os, "memfd_create")
    tier = MemoryTier(Tier.CPU, 1 << 16, 4096, shared=True)
    assert tier.shared_slab is None and tier.slab.numel() == 1 << 16


def test_slices_cut_pieces_to_a_byte_budget():
    assert list(slices([(0, 100, 10), (50, 200, 3)], 4)) == [
        [(0, 100, 4)],
        [(4, 104, 4)],
        [(8, 108, 2), (50, 200, 2)],
        [(52, 202, 1)],
    ]
    assert list(slices([(0, 100, 10)], 100)) == [[(0, 100, 10)]] and list(slices([], 5)) == []


def test_closing_the_slab_stops_new_peers_and_keeps_the_tensor():
    tier = MemoryTier(Tier.CPU, 1 << 16, 4096, shared=True)
    slab = tier.shared_slab
    tier.slab[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    tier.close()
    tier.close()  # twice is fine
    assert not slab._closer.alive  # its descriptor is closed (the number may be reused at once)
    assert tier.slab[:4].tolist() == [1, 2, 3, 4]
