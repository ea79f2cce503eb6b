"""BlockPool over real slabs (a memory tier, and a disk tier for parked blocks). Cleanup:
the age cut-off, a dry run that changes nothing, pinned blocks skipped and counted with
their ancestors kept, blocks being read neither freed nor reported freed. Parked blocks
wait PARKED_SECONDS for their prefix, no less. Room a reservation may count on excludes
pinned blocks."""

from __future__ import annotations

import time

from agent.core.block_pool import BlockPool
from agent.core.pins import AgentPin
from agent.store.disk_tier import DiskTier
from agent.store.memory_tier import MemoryTier
from protos.tier import Tier
from tests.unit.tiny_blocks import PAGE, SPEC, chain, insert


def make_pool(pages: int = 32) -> BlockPool:
    return BlockPool([MemoryTier(Tier.CPU, pages * PAGE, PAGE, device="cpu")], [SPEC])


def test_only_blocks_idle_for_longer_than_the_cut_off_go():
    pool = make_pool()
    hs = chain(range(3))
    insert(pool, hs)
    t = time.time()
    young = pool.cleanup(3600.0, now=t + 60.0)  # used a minute ago: kept
    assert young.num_blocks == 0 and young.freed == {} and set(pool.blocks) == set(hs)
    old = pool.cleanup(3600.0, now=t + 7200.0)  # two hours later: idle for longer
    assert old.num_blocks == 3 and old.freed[Tier.CPU][0] == 3 and pool.blocks == {}


def test_a_dry_run_reports_what_a_cleanup_frees_and_changes_nothing():
    pool = make_pool()
    a, b = chain(range(3)), chain(range(100, 102))
    insert(pool, a)
    insert(pool, b)
    pool.pins.add(AgentPin("p", int(Tier.CPU), 0.0, block_hashes=frozenset(b[1:])))
    pending = pool.journal.num_pending
    used = pool.store_of[Tier.CPU].used_bytes
    dry = pool.cleanup(0.0, dry_run=True, now=time.time() + 1)
    assert set(pool.blocks) == set(a + b)
    assert pool.store_of[Tier.CPU].used_bytes == used and pool.journal.num_pending == pending
    assert pool.cleanup_evictions_total[Tier.CPU] == 0
    real = pool.cleanup(0.0, now=time.time() + 1)
    assert (dry.num_blocks, dry.freed, dry.num_skipped_pinned_blocks) == (
        real.num_blocks,
        real.freed,
        real.num_skipped_pinned_blocks,
    )
    assert real.num_blocks == 3 and real.num_skipped_pinned_blocks == 1


def test_a_pinned_leaf_is_skipped_counted_and_keeps_its_ancestors():
    pool = make_pool()
    a, b = chain(range(4)), chain(range(200, 202))
    insert(pool, a)
    insert(pool, b)
    pool.pins.add(AgentPin("leaf", int(Tier.CPU), 0.0, block_hashes=frozenset(a[3:])))
    result = pool.cleanup(0.0, now=time.time() + 1)
    assert result.num_skipped_pinned_blocks == 1
    assert set(pool.blocks) == set(a), "a pinned block, or a parent of one, went"
    assert result.num_blocks == 2 and result.freed[Tier.CPU][0] == 2


def test_a_block_being_read_is_neither_freed_nor_reported_freed():
    pool = make_pool()
    a, b = chain(range(2)), chain(range(300, 302))
    insert(pool, a)
    insert(pool, b)
    held = pool.acquire_chain(a)  # a reader holds a
    try:
        result = pool.cleanup(0.0, now=time.time() + 1)
        assert set(pool.blocks) == set(a)
        assert result.num_blocks == 2 and result.freed[Tier.CPU][0] == 2
    finally:
        pool.release_chain(held)


def parked_pool(d) -> tuple[BlockPool, DiskTier]:
    """A 4-block chain, its tail moved to disk, then kill -9 and a restart: the tail is
    parked (its prefix was lost with the CPU tier)."""
    cpu = MemoryTier(Tier.CPU, 8 * PAGE, PAGE, device="cpu")
    pool = BlockPool([cpu, DiskTier(d, 1 << 20)], [SPEC])
    hs = chain(range(4))
    insert(pool, hs)
    assert pool.move_block(hs[3], Tier.DISK).ok and pool.move_block(hs[2], Tier.DISK).ok
    pool.store_of[Tier.DISK].close()  # kill -9: the CPU tier's prefix is lost
    disk2 = DiskTier(d, 1 << 20)
    pool2 = BlockPool([MemoryTier(Tier.CPU, 8 * PAGE, PAGE, device="cpu"), disk2], [SPEC])
    found, _ = disk2.scan()
    pool2.recover(disk2, found)
    assert pool2.num_parked_blocks == 2
    return pool2, disk2


def test_a_cleanup_leaves_parked_blocks_younger_than_its_cut_off(tmp_path):
    """Blocks a restart found on disk without their prefix (parked) are freed by a cleanup
    by age only when idle for longer than its cut-off, as held blocks are."""
    pool2, disk2 = parked_pool(tmp_path / "disk")
    t = time.time()
    assert pool2.cleanup(3600.0, now=t).num_blocks == 0 and pool2.num_parked_blocks == 2
    assert pool2.cleanup(3600.0, now=t + 7200.0).num_blocks == 2 and pool2.num_parked_blocks == 0
    disk2.close()


def test_parked_blocks_wait_their_time_before_the_sweep_frees_them(tmp_path):
    """The agent's sweep (free_parked(expired_only=True)) leaves parked blocks alone until
    PARKED_SECONDS passed since recovery (their prefix may be stored again meanwhile), then
    frees them."""
    pool2, disk2 = parked_pool(tmp_path / "disk")
    assert pool2.free_parked(expired_only=True) == 0 and pool2.num_parked_blocks == 2
    pool2._parked_until = time.monotonic() - 1.0  # PARKED_SECONDS passed
    assert pool2.free_parked(expired_only=True) == 2 and pool2.num_parked_blocks == 0
    disk2.close()


def test_pinned_blocks_are_not_room_a_reservation_can_count_on():
    pool = make_pool(pages=4)
    a = chain(range(3))
    insert(pool, a)
    assert pool.reclaimable_bytes(Tier.CPU) == 4 * PAGE
    pool.pins.add(AgentPin("p", int(Tier.CPU), 0.0, block_hashes=frozenset(a)))
    assert pool.reclaimable_bytes(Tier.CPU) == PAGE  # the one free page only
