"""Same-host shared slabs (agent.store.shm): a memfd slab another mapping writes into,
the inode check against a reused /proc path, bounds, and slicing for a paced link."""

from __future__ import annotations

import concurrent.futures as cf
import os
import time

import pytest
import torch

from agent.core.block_moves import pair_runs
from agent.core.handoff import slices
from agent.store.memory_tier import MemoryTier
from agent.store.shm import PeerSlab, SharedSlab, host_id, split_even
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


def test_split_even_cuts_pieces_into_near_equal_shares_in_order():
    pieces = [(0, 1000, 10), (100, 2000, 3)]
    assert split_even(pieces, 2) == [[(0, 1000, 7)], [(7, 1007, 3), (100, 2000, 3)]]
    shares = split_even(pieces, 4)
    assert [sum(n for *_, n in s) for s in shares] == [4, 4, 4, 1]
    assert [t for s in shares for t in s][0] == (0, 1000, 4) and shares[-1] == [(102, 2002, 1)]
    assert split_even([(0, 0, 2)], 8) == [[(0, 0, 1)], [(1, 1, 1)]]  # never more shares than bytes
    assert split_even(pieces, 1) == [pieces]


def test_a_large_write_copied_by_several_threads_is_byte_exact():
    tier = MemoryTier(Tier.CPU, 16 << 20, 1 << 20, shared=True)
    slab = tier.shared_slab
    peer = PeerSlab(slab.path, slab.inode, tier.slab.data_ptr(), tier.slab.numel())
    src = torch.randint(0, 256, (9 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    base = tier.slab.data_ptr()
    # three destination runs of odd sizes: shares cut through pieces at arbitrary bytes
    runs = [(base + 4096, (3 << 20) + 5), (base + (5 << 20), (4 << 20) - 11), (base + (10 << 20), (2 << 20) + 6)]
    with cf.ThreadPoolExecutor(2) as copier:
        assert peer.write(pair_runs([(src.data_ptr(), 9 << 20)], runs), copier, threads=3) == 9 << 20
    got = torch.cat([tier.slab[a - base : a - base + n] for a, n in runs])
    assert torch.equal(got, src)
    assert int(tier.slab[:4096].sum()) == 0 and int(tier.slab[(3 << 20) + 4101 : 5 << 20].sum()) == 0


def test_a_write_whose_copier_refuses_a_share_leaves_no_copy_running():
    """The copier takes one share and refuses the next (shut down by a closing agent): the
    write fails, and no share it took is still copying after it returned."""
    tier = MemoryTier(Tier.CPU, 16 << 20, 1 << 20, shared=True)
    slab = tier.shared_slab
    peer = PeerSlab(slab.path, slab.inode, tier.slab.data_ptr(), tier.slab.numel())
    src = torch.full((8 << 20,), 7, dtype=torch.uint8)

    class Refusing(cf.ThreadPoolExecutor):
        def submit(self, fn, *args):
            if getattr(self, "took", False):
                raise RuntimeError("cannot schedule new futures after shutdown")
            self.took = True
            return super().submit(lambda *a: (time.sleep(0.3), fn(*a))[1], *args)  # a slow share

    copier = Refusing(2)
    with pytest.raises(RuntimeError, match="after shutdown"):
        peer.write([(src.data_ptr(), tier.slab.data_ptr(), 8 << 20)], copier, threads=3)
    copied = int(tier.slab.sum())
    copier.shutdown()  # a share still copying ends here
    assert int(tier.slab.sum()) == copied  # nothing landed after the write returned


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
