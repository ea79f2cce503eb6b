"""Compaction of the disk tier: a tier whose free space is split into runs too short for
a block (blocks of two sizes, every other small one freed) places it by relocating
blocks instead of pushing them out, with their bytes intact, a restart finds exactly the
live blocks once, and a reader racing a relocation reads the right bytes."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from agent.core import compaction
from agent.core.block_pool import BlockPool
from agent.core.compaction import COMPACT_TRIES_PER_ALLOCATION
from agent.core.model_spec import ModelSpec
from agent.store.disk_tier import GRANULE_BYTES, CorruptBlock, DiskTier
from protos.block_hash import ROOT_PARENT_HASH, hash_block
from protos.tier import Tier
from tests.tiers.support import SPEC, check_pool

BIG = ModelSpec("big", block_size=4, num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16")  # 4096 B
SMALL_GRANULES = 2  # a 512 B block and its header slot
BIG_GRANULES = 9  # 4096 B and its header slot
NUM_SMALL = 20
CAPACITY = NUM_SMALL * SMALL_GRANULES * GRANULE_BYTES  # full of small blocks


def block(spec: ModelSpec, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(spec.block_shape, generator=g).to(spec.torch_dtype)


def store(pool: BlockPool, spec: ModelSpec, seed: int) -> tuple[bytes, torch.Tensor]:
    """One block as a chain of its own (a root block): every such block is a leaf."""
    h = hash_block(ROOT_PARENT_HASH, [seed] * spec.block_size, spec.model_id)
    data = block(spec, seed)
    assert pool.insert_chain(spec.model_id, [h], lambda i: data).num_stored == 1
    return h, data


def fragmented(tmp_path) -> tuple[BlockPool, DiskTier, dict[bytes, torch.Tensor]]:
    """A disk-only pool full of small blocks with every other one dropped: half its bytes
    free, in runs of 2 granules (and the 7 spare granules at the slab's end), none long
    enough for a big block."""
    disk = DiskTier(tmp_path, CAPACITY)
    pool = BlockPool([disk], [SPEC, BIG])
    kept = {}
    stored = [store(pool, SPEC, i) for i in range(NUM_SMALL)]
    for i, (h, data) in enumerate(stored):
        if i % 2 == 0:
            assert pool.drop(h)
        else:
            kept[h] = data
    disk.drain()
    largest, free = disk.fragmentation()
    assert largest < BIG_GRANULES * GRANULE_BYTES <= free
    assert disk.used_bytes + BIG_GRANULES * GRANULE_BYTES <= disk.capacity_bytes
    return pool, disk, kept


def assert_intact(pool: BlockPool, blocks: dict[bytes, torch.Tensor]) -> None:
    for h, data in blocks.items():
        got = pool.read_chain([h])
        assert len(got.blocks) == 1, f"block {h.hex()[:12]} is gone"
        assert torch.equal(got.blocks[0], data)


def test_a_fragmented_tier_places_a_big_block_by_compaction_not_eviction(tmp_path):
    pool, disk, kept = fragmented(tmp_path)
    evicted_before = pool.evictions_total[Tier.DISK]
    h, data = store(pool, BIG, 1000)
    # the defect: room by bytes, but every small block went until a run was long enough
    assert pool.evictions_total[Tier.DISK] == evicted_before
    assert disk.compactions_total >= 1 and disk.relocated_bytes_total >= SMALL_GRANULES * GRANULE_BYTES
    assert_intact(pool, kept | {h: data})  # checksums verified on every read
    for meta in pool.blocks.values():  # every block in its own extent
        assert meta.tier is Tier.DISK
    extents = sorted((m.handle.offset, m.handle.offset + m.handle.footprint_bytes) for m in pool.blocks.values())
    assert all(a[1] <= b[0] for a, b in zip(extents, extents[1:], strict=False))
    pool.close()
    disk.close()


def test_background_compaction_makes_a_run_for_the_biggest_block(tmp_path):
    pool, disk, kept = fragmented(tmp_path)
    disk.largest_footprint_bytes = BIG_GRANULES * GRANULE_BYTES  # as if a big block had been placed before
    moved = 0
    for _ in range(10):
        step = pool.compact_disk(max_move_bytes=4 * SMALL_GRANULES * GRANULE_BYTES)
        if not step:
            break
        assert step <= 4 * SMALL_GRANULES * GRANULE_BYTES  # bounded per step
        moved += step
    assert moved
    largest, _ = disk.fragmentation()
    assert largest >= BIG_GRANULES * GRANULE_BYTES
    assert pool.compact_disk() == 0  # nothing left to do
    assert_intact(pool, kept)
    pool.close()
    disk.close()


def test_a_restart_after_compaction_recovers_exactly_the_live_blocks(tmp_path):
    pool, disk, kept = fragmented(tmp_path)
    h, data = store(pool, BIG, 1000)
    assert disk.compactions_total >= 1
    live = {m.block_hash: (m.handle.offset, m.handle.seq) for m in pool.blocks.values()}
    pool.close()
    disk.close()  # the freed old extents' dead records are on disk

    again = DiskTier(tmp_path, CAPACITY)
    found, corrupt = again.scan()
    assert corrupt == 0
    assert sorted(b.block_hash for b in found) == sorted(live)  # no freed copy came back, none lost
    assert {b.block_hash: (b.handle.offset, b.handle.seq) for b in found} == live
    pool2 = BlockPool([again], [SPEC, BIG])
    assert pool2.recover(again, found) == len(live)
    assert_intact(pool2, kept | {h: data})
    pool2.close()
    again.close()


def test_a_crash_before_the_old_extents_are_recorded_keeps_the_later_copy(tmp_path):
    """Killed between writing the relocated copies and recording the old extents dead:
    both copies are in the slab; the later write wins, each block is found once."""
    pool, disk, kept = fragmented(tmp_path)
    disk.drain = lambda: None  # the dead log never hears of the freed old extents
    disk._clear_wake.clear()
    plan_copies = []
    real_copy = disk.copy_extent

    def copy(old, new):
        real_copy(old, new)
        plan_copies.append(new.offset)

    disk.copy_extent = copy
    with pool.lock:
        assert pool._compact_for(disk, BIG.block_bytes) or plan_copies
    assert plan_copies
    live = {m.block_hash: m.handle.offset for m in pool.blocks.values()}
    disk.fd, fd = -1, disk.fd  # a crash: nothing more reaches the slab
    os.close(fd)
    again = DiskTier(tmp_path, CAPACITY)
    found, corrupt = again.scan()
    assert corrupt == 0
    assert {b.block_hash: b.handle.offset for b in found} == live
    pool2 = BlockPool([again], [SPEC, BIG])
    assert pool2.recover(again, found) == len(live)
    assert_intact(pool2, kept)
    again.close()


@pytest.mark.parametrize("background", [False, True])
def test_reads_racing_relocations_read_the_right_bytes(tmp_path, background):
    pool, disk, kept = fragmented(tmp_path)
    stop = threading.Event()
    errors: list[str] = []
    reads = [0]

    def reader():
        while not stop.is_set():
            for h, data in kept.items():
                got = pool.read_chain([h])
                if len(got.blocks) != 1 or not torch.equal(got.blocks[0], data):
                    errors.append(h.hex()[:12])
                reads[0] += 1

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        if background:
            disk.largest_footprint_bytes = BIG_GRANULES * GRANULE_BYTES
            for _ in range(50):  # steps of one small block each, interleaved with the reads
                if not pool.compact_disk(max_move_bytes=SMALL_GRANULES * GRANULE_BYTES):
                    break
        else:
            store(pool, BIG, 1000)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors
    assert reads[0] > 0
    assert pool.corrupt_blocks_total == 0
    assert_intact(pool, kept)
    assert disk.compactions_total >= 1
    pool.close()
    disk.close()


def test_a_relocated_copy_that_does_not_read_back_leaves_the_block_where_it_was(tmp_path):
    """The read-back of a copy failing (an EIO on the new extent) is a failed write: the
    block keeps its intact old extent; it was marked corrupt and dropped."""
    pool, disk, kept = fragmented(tmp_path)
    disk.largest_footprint_bytes = BIG_GRANULES * GRANULE_BYTES
    real_read = disk._read
    held = {m.handle.offset for m in pool.blocks.values()}

    def read(handle, segments, expect_hash):
        if handle.offset not in held:  # a relocated copy, read back
            raise CorruptBlock(f"{disk.path} at {handle.offset}: read failed: Input/output error")
        real_read(handle, segments, expect_hash)

    disk._read = read
    assert pool.compact_disk() == 0  # nothing moved
    disk._read = real_read
    assert pool.corrupt_blocks_total == 0
    assert set(pool.blocks) == set(kept)
    assert_intact(pool, kept)
    check_pool(pool)
    pool.close()
    disk.close()
    again = DiskTier(tmp_path, CAPACITY)
    found, corrupt = again.scan()
    assert corrupt == 0 and sorted(b.block_hash for b in found) == sorted(kept)
    again.close()


def test_an_allocation_plans_a_compaction_a_bounded_number_of_times(tmp_path):
    """Big blocks with a small one between each two, in holes of a small block: every
    window holds a big block, which fits no free run, so no plan finds one and the
    allocation makes room by eviction (the small blocks, least recently used, first).
    Each plan walks every free run under the lock: it is tried at most
    COMPACT_TRIES_PER_ALLOCATION times, not again after every eviction."""
    groups = 20
    disk = DiskTier(tmp_path, groups * (3 * SMALL_GRANULES + BIG_GRANULES) * GRANULE_BYTES)
    pool = BlockPool([disk], [SPEC, BIG])
    bigs, holes = {}, []
    for g in range(groups):  # hole, small, hole, big: the slab full
        holes.append(store(pool, SPEC, 3 * g)[0])
        store(pool, SPEC, 3 * g + 1)
        holes.append(store(pool, SPEC, 3 * g + 2)[0])
        h, data = store(pool, BIG, 100 + g)
        bigs[h] = data
    assert all(pool.drop(h) for h in holes)
    assert_intact(pool, bigs)  # read after the small ones: these go last
    disk.drain()
    assert disk.fragmented(BIG_GRANULES * GRANULE_BYTES)
    plans = [0]
    real_plan = disk.plan_compaction

    def plan(*args):
        plans[0] += 1
        return real_plan(*args)

    disk.plan_compaction = plan
    h, data = store(pool, BIG, 1000)
    assert pool.evictions_total[Tier.DISK] > COMPACT_TRIES_PER_ALLOCATION
    assert plans[0] <= COMPACT_TRIES_PER_ALLOCATION
    assert_intact(pool, {h: data})
    check_pool(pool)
    pool.close()
    disk.close()


def test_allocations_right_after_a_plan_that_found_no_window_evict_without_planning(tmp_path, monkeypatch):
    """A tier kept full by evictions is fragmented after most of them, and its plans mostly
    find no window (scripts/disk_fragmentation.py: 2,500 failed plans, ~1 ms each under the
    pool's lock, for 12 compactions in 3,000 requests): after one fails, the allocations of
    the next ALLOCATION_PLAN_BACKOFF_SECONDS do not plan."""
    from agent.core import compaction

    disk = DiskTier(tmp_path, 1 << 20)
    pool = BlockPool([disk], [SPEC, BIG])
    plans = [0]

    def plan(*args):
        plans[0] += 1

    monkeypatch.setattr(disk, "fragmented", lambda footprint_bytes: True)
    monkeypatch.setattr(disk, "plan_compaction", plan)
    now = [100.0]
    monkeypatch.setattr(compaction.time, "monotonic", lambda: now[0])
    assert not pool._compact_for(disk, BIG.block_bytes) and plans[0] == 1
    assert not pool._compact_for(disk, BIG.block_bytes) and plans[0] == 1  # within the backoff
    now[0] += compaction.ALLOCATION_PLAN_BACKOFF_SECONDS
    assert not pool._compact_for(disk, BIG.block_bytes) and plans[0] == 2
    pool.close()
    disk.close()


def test_background_compaction_that_finds_no_window_backs_off(tmp_path, monkeypatch):
    """No window can be emptied (every kept block is being read): the background step
    does not plan again every second (a plan walks every free run under the pool lock),
    but after a growing pause; once blocks may move it compacts again."""
    pool, disk, kept = fragmented(tmp_path)
    disk.largest_footprint_bytes = BIG_GRANULES * GRANULE_BYTES
    now = [1000.0]
    monkeypatch.setattr(compaction.time, "monotonic", lambda: now[0])
    plans = [0]
    real_plan = disk.plan_compaction

    def plan(*args):
        plans[0] += 1
        return real_plan(*args)

    disk.plan_compaction = plan
    readers = pool.acquire_chain(list(kept))
    for _ in range(10):  # the agent's thread: a step a second
        assert pool.compact_disk() == 0
        now[0] += 1.0
    assert plans[0] < 10
    pool.release_chain(readers)
    now[0] += compaction.COMPACT_BACKOFF_MAX_SECONDS
    assert pool.compact_disk() > 0
    assert_intact(pool, kept)
    pool.close()
    disk.close()
