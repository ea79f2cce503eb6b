"""Compaction of the disk tier: a tier whose free space is split into runs too short for
a block (blocks of two sizes, every other small one freed) places it by relocating
blocks instead of pushing them out, with their bytes intact, a restart finds exactly the
live blocks once, and a reader racing a relocation reads the right bytes."""

from __future__ import annotations

import os
import threading
import time

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
    disk.note_footprint(BIG_GRANULES * GRANULE_BYTES)  # as if a big block had been placed before
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
            disk.note_footprint(BIG_GRANULES * GRANULE_BYTES)
            steps, deadline = 0, time.monotonic() + 30
            while steps < 50 and time.monotonic() < deadline:  # steps of one small block each, among the reads
                if pool.compact_disk(max_move_bytes=SMALL_GRANULES * GRANULE_BYTES):
                    steps += 1
                elif disk.compactions_total:
                    break  # nothing left to relocate
                else:
                    # nothing could move yet: a reader held a block of each window the step
                    # looked at (likelier on a busy machine), and the step backs off (1 s,
                    # then doubling) before it looks again, as in the agent
                    time.sleep(0.1)
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
    disk.note_footprint(BIG_GRANULES * GRANULE_BYTES)
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
    disk.note_footprint(BIG_GRANULES * GRANULE_BYTES)
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


def small_extents(disk: DiskTier, count: int, granules: int = 2) -> list:
    """`count` extents of `granules` each, first fit, tagged by their index."""
    return [disk.allocate((granules - 1) * GRANULE_BYTES, i.to_bytes(4, "big")) for i in range(count)]


def test_a_run_long_enough_but_not_4k_aligned_counts_as_fragmented(tmp_path):
    # a 64 KiB block's payload starts on a 4 KiB boundary: its 136-granule extent fits a
    # run of 136 granules only when the run starts at granule 7 of a page
    disk = DiskTier(tmp_path, 4 << 20)
    big = disk.footprint(64 << 10)
    n = big // GRANULE_BYTES
    handles = small_extents(disk, disk.capacity_bytes // (2 * GRANULE_BYTES))
    for h in handles[8 : 8 + n // 2]:  # granules [16, 16 + n): long enough, misaligned
        disk.free(h)
    for h in handles[100::2]:  # half the rest, in holes of 2 granules
        disk.free(h)
    disk.drain()
    assert disk.fragmentation()[0] == big
    assert disk.allocate(64 << 10) is None  # no run holds it
    assert disk.fragmented(big)  # what compaction mends (the defect: False, so it evicted)
    plan = disk.plan_compaction(big, lambda tag, offset: True, 1 << 20)
    assert plan is not None
    disk.close()


def test_a_plan_tries_the_next_window_when_the_cheapest_ones_blocks_fit_nowhere(tmp_path):
    # granules: holes of 2 at 0, 4, 8 (fillers between), [12, 18) free, X (4) at 18,
    # filler, [24, 27) free, Y, Z, W (2 each) at 27-33, filler to the end. For 9 granules
    # the cheapest window is [12, 22) (X moves), but X finds no run of 4 elsewhere; the
    # next, [24, 33), moves Y, Z and W into the holes
    disk = DiskTier(tmp_path, 64 * GRANULE_BYTES)

    def take(granules: int, tag: bytes):
        return disk.allocate((granules - 1) * GRANULE_BYTES, tag)

    layout = [(2, b"h"), (2, b"F"), (2, b"h"), (2, b"F"), (2, b"h"), (2, b"F"), (6, b"h"), (4, b"X")]
    layout += [(2, b"F"), (3, b"h"), (2, b"Y"), (2, b"Z"), (2, b"W")]
    handles = [(take(g, tag), tag) for g, tag in layout]
    assert [h.offset // GRANULE_BYTES for h, _ in handles][-6:] == [18, 22, 24, 27, 29, 31]
    for h, tag in handles:
        if tag == b"h":
            disk.free(h)
    disk.drain()
    assert take(disk.slab_bytes // GRANULE_BYTES - 33, b"F").offset == 33 * GRANULE_BYTES  # the rest
    plan = disk.plan_compaction(9 * GRANULE_BYTES, lambda tag, offset: tag in (b"X", b"Y", b"Z", b"W"), 1 << 20)
    assert plan is not None  # the defect: None, the cheapest window was the only one tried
    assert sorted(m.block_hash for m in plan.moves) == [b"W", b"Y", b"Z"]
    disk.finish_compaction(plan, [])
    disk.close()


def test_recovered_blocks_of_a_model_not_served_do_not_drive_background_compaction(tmp_path):
    pool, disk, kept = fragmented(tmp_path)
    h, _ = store(pool, BIG, 1000)  # placed by compaction
    pool.close()
    disk.close()

    again = DiskTier(tmp_path, CAPACITY)
    found, _ = again.scan()
    pool2 = BlockPool([again], [SPEC])  # BIG is not served now: its block is parked
    pool2.recover(again, found)
    assert pool2.num_parked_blocks == 1
    for h2 in list(kept)[::2]:  # fragmented again, for a block nobody stores now
        assert pool2.drop(h2)
    again.drain()
    assert again.largest_footprint_bytes < BIG_GRANULES * GRANULE_BYTES  # the defect: BIG's
    assert pool2.compact_disk() == 0
    assert again.relocated_blocks_total == 0
    pool2.close()
    again.close()


def test_the_biggest_footprint_asked_for_is_forgotten_once_not_asked_for(tmp_path, monkeypatch):
    from agent.store import disk_tier

    disk = DiskTier(tmp_path, CAPACITY)
    now = [1000.0]
    monkeypatch.setattr(disk_tier.time, "monotonic", lambda: now[0])
    disk._footprints_since = now[0]
    disk.note_footprint(BIG_GRANULES * GRANULE_BYTES)
    disk.note_footprint(SMALL_GRANULES * GRANULE_BYTES)
    now[0] += disk_tier.FOOTPRINT_SECONDS
    disk.note_footprint(SMALL_GRANULES * GRANULE_BYTES)
    assert disk.largest_footprint_bytes == BIG_GRANULES * GRANULE_BYTES  # asked for in the last period
    now[0] += disk_tier.FOOTPRINT_SECONDS
    assert disk.largest_footprint_bytes == SMALL_GRANULES * GRANULE_BYTES
    now[0] += 2 * disk_tier.FOOTPRINT_SECONDS
    assert disk.largest_footprint_bytes == 0
    disk.close()


def test_an_allocation_compacting_while_a_background_step_settles_leaves_the_demoted_block_whole(tmp_path, monkeypatch):
    # A (big, on disk) is found corrupt by a background step; between the step letting its
    # blocks go and dropping A, a demotion of A's child C (big, on the CPU) compacts the
    # disk for itself. Dropping A there took C, which the demotion then switched and freed
    # a second time.
    from agent.store.memory_tier import MemoryTier

    disk = DiskTier(tmp_path, 128 * GRANULE_BYTES)
    pool = BlockPool([disk], [SPEC, BIG])
    seeds = iter(range(10_000))

    def small() -> bytes:
        return store(pool, SPEC, next(seeds))[0]

    holes = [small() for _ in range(3)]  # [0, 6): free
    small()  # s1 at [6, 8): moves for the background step
    a_hash, _ = store(pool, BIG, 1)  # [8, 17)
    fillers = []
    for _ in range(12):  # holes of 2
        holes.append(small())
        fillers.append(small())
    holes.append(store(pool, BIG, 2)[0])  # [65, 74): a hole of 9
    fillers.append(small())
    holes += [small() for _ in range(3)]  # [76, 82): free
    small(), small()  # s2, s3 at [82, 86): move for C's allocation
    while disk.used_bytes < disk.capacity_bytes:
        fillers.append(small())
    assert pool.blocks[a_hash].handle.offset == 8 * GRANULE_BYTES
    for h in holes:
        assert pool.drop(h)
    pool.close()
    disk.close()

    disk = DiskTier(tmp_path, 128 * GRANULE_BYTES)
    found, _ = disk.scan()
    cpu = MemoryTier(Tier.CPU, BIG.block_bytes, BIG.block_bytes // 16, device="cpu")
    pool = BlockPool([cpu, disk], [SPEC, BIG])
    pool.recover(disk, found)
    held = pool.acquire_chain(fillers[:1]) + [m for f in fillers[1:] for m in pool.acquire_chain([f])]
    assert len(held) == len(fillers)  # they stay where they are
    c_hash = hash_block(a_hash, [7] * BIG.block_size, BIG.model_id)
    assert pool.insert_chain(BIG.model_id, [a_hash, c_hash], lambda i: block(BIG, 3)).num_stored == 1
    assert pool.blocks[c_hash].tier is Tier.CPU and pool.blocks[a_hash].tier is Tier.DISK
    assert disk.allocate(8192) is None  # a 17-granule block asked for: the background's aim

    copy = disk.copy_extent

    def copy_extent(old, new):
        if old.offset == 8 * GRANULE_BYTES:
            raise CorruptBlock("bit rot")  # A's old copy
        copy(old, new)

    real_free = disk.free
    demoted = []

    def free(handle):
        if not handle.seq and not demoted:  # the step gives A's unwritten new extent back
            demoted.append(True)
            with pool.lock:
                pool._make_room(cpu)  # an allocation in the CPU tier demotes C
        real_free(handle)

    monkeypatch.setattr(disk, "copy_extent", copy_extent)
    monkeypatch.setattr(disk, "free", free)
    pool.compact_disk()
    assert demoted
    monkeypatch.undo()
    pool.release_chain(held)
    assert a_hash not in pool.blocks and c_hash not in pool.blocks  # A was corrupt: its subtree went
    check_pool(pool)
    pool.close()
    disk.close()
