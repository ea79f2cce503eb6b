"""The disk tier on a real slab file: round trips, extents and their alignment, checksum
and truncation on the next engine load (a miss, removed, reported, counted), recovery
after a restart, unusable and shared directories, a full disk and write errors."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from agent.core.block_pool import BlockPool
from agent.core.blocks import BlockMeta
from agent.core.journal import REMOVED
from agent.server import Agent, AgentConfig
from agent.store.disk_tier import (
    DEAD_LOG_NAME,
    GRANULE_BYTES,
    MAGIC,
    SLAB_NAME,
    CorruptBlock,
    DiskTier,
    ExtentAllocator,
)
from agent.store.memory_tier import MemoryTier
from protos.block_hash import ROOT_PARENT_HASH, split_hashes
from protos.tier import Tier
from tests.tiers.support import (
    BLOCK_BYTES,
    BS,
    SPEC,
    block_on_disk,
    blocks_on_disk,
    check_pool,
    decoded,
    disk_of,
    flip_byte,
    hashes,
    kv,
    make_engine,
    make_pool,
    tokens,
)


def removed_hashes(pool: BlockPool) -> list[bytes]:
    return [
        h
        for b in pool.drain_events()
        if b.kind == REMOVED
        for g in b.groups
        for h in split_hashes(bytes(g.block_hashes))
    ]


def spill(tmp_path: Path, n: int = 5, **kwargs):
    """An engine over CPU (2 blocks) + disk with an n-block chain stored: the first
    n - 2 blocks end up on disk, the last 2 in CPU memory."""
    pool = make_pool(tmp_path / "disk", cpu_blocks=2, **kwargs)
    engine = make_engine(pool)
    toks, data = tokens(n), kv(n)
    assert engine.store(SPEC.model_id, toks, data).num_stored_blocks == n
    hs = hashes(engine, toks)
    assert [pool.tier_of(h) for h in hs] == [Tier.DISK] * (n - 2) + [Tier.CPU] * 2
    check_pool(pool)
    return pool, engine, toks, data, hs


# ---- the store itself ---------------------------------------------------------------
def test_write_read_roundtrip_and_free(tmp_path):
    disk = DiskTier(tmp_path, 1 << 20)
    h, parent = b"\x11" * 16, ROOT_PARENT_HASH
    data = torch.arange(300, dtype=torch.int64).to(torch.uint8)
    handle = disk.allocate(data.numel(), h)
    assert handle.footprint_bytes == disk.footprint(300) and disk.used_bytes == handle.footprint_bytes
    meta = BlockMeta(h, parent, "m", 600, Tier.DISK, handle, "zstd", 300)
    disk.write(handle, data, meta)
    raw = disk.path.read_bytes()
    path, payload_at, room = disk.location(handle)
    assert path == tmp_path / "blocks.kvslab" and room >= 300
    assert raw[handle.offset : handle.offset + len(MAGIC)] == MAGIC
    assert raw[payload_at : payload_at + 300] == bytes(data.numpy())
    assert torch.equal(disk.read(handle, 300), data)
    segs = [torch.empty(100, dtype=torch.uint8), torch.empty(200, dtype=torch.uint8)]
    disk.read_into(handle, segs)  # straight into memory-tier pages
    assert torch.equal(torch.cat(segs), data)
    with pytest.raises(CorruptBlock, match="expected 301"):
        disk.read(handle, 301)
    # a second copy of the same block (a re-encode) gets its own extent
    other = disk.allocate(10, h)
    assert other.offset >= handle.offset + handle.footprint_bytes
    disk.free(other)
    disk.free(handle)
    assert disk.used_bytes == 0 and blocks_on_disk(disk) == []  # freed: in the dead log
    assert disk.dead_path.stat().st_size == 16  # (offset, seq) of the one that was written
    disk.close()
    again = DiskTier(tmp_path, 1 << 20)  # a restart does not bring it back
    assert again.scan() == ([], 0) and again.dead_path.stat().st_size == 0


def test_big_blocks_keep_their_payload_page_aligned_and_small_ones_pack(tmp_path):
    disk = DiskTier(tmp_path, 64 << 20)
    small = [disk.allocate(3000) for _ in range(3)]
    assert [h.footprint_bytes for h in small] == [3584] * 3  # 3000 + the header slot, in 512 B granules
    assert small[1].offset == small[0].offset + 3584
    big = [disk.allocate(1 << 20) for _ in range(3)]
    for h in big:
        assert disk.location(h)[1] % 4096 == 0 and h.footprint_bytes == (1 << 20) + 4096
    assert big[1].offset == big[0].offset + big[0].footprint_bytes  # no gap between big ones
    odd = disk.allocate(400)  # a small one fills the gap the first big one skipped
    assert odd.offset < big[0].offset
    used = disk.used_bytes
    for h in small + big + [odd]:
        disk.free(h)
    disk.drain()
    assert used > 0 and disk.used_bytes == 0 and disk._extents.runs() == [(0, disk.slab_bytes // GRANULE_BYTES)]


def test_extent_allocator_merges_neighbours_and_fits_first():
    a = ExtentAllocator(100)
    x, y, z = a.allocate(10), a.allocate(10), a.allocate(10)
    assert (x, y, z) == (0, 10, 20) and a.free_granules == 70
    a.free(x, 10)
    a.free(z, 10)  # merges with the free tail
    assert a.runs() == [(0, 10), (20, 80)]
    assert a.allocate(15) == 20  # does not fit before y
    a.free(y, 10)
    assert a.runs() == [(0, 20), (35, 65)]
    assert a.allocate(12, phase=7) == 7 and a.runs() == [(0, 7), (19, 1), (35, 65)]
    assert a.allocate(200) is None
    assert a.free_granules == 100 - 15 - 12


def test_a_directory_in_use_by_another_agent_is_refused(tmp_path):
    first = DiskTier(tmp_path, 1 << 20)
    with pytest.raises(OSError, match="in use by another agent"):
        DiskTier(tmp_path, 1 << 20)
    first.close()
    DiskTier(tmp_path, 1 << 20).close()


def test_write_accepts_memory_segments(tmp_path):
    disk = DiskTier(tmp_path, 1 << 20)
    h = b"\x22" * 16
    parts = [torch.full((64,), 7, dtype=torch.uint8), torch.full((36,), 9, dtype=torch.uint8)]
    handle = disk.allocate(100, h)
    disk.write(handle, parts, BlockMeta(h, ROOT_PARENT_HASH, "m", 100, Tier.DISK, handle, "none", 100))
    assert torch.equal(disk.read(handle, 100), torch.cat(parts))


def test_allocation_respects_capacity(tmp_path):
    disk = DiskTier(tmp_path, 3 * DiskTier(tmp_path / "probe", 1 << 20).footprint(BLOCK_BYTES))
    handles = [disk.allocate(BLOCK_BYTES, bytes([i]) * 16) for i in range(3)]
    assert all(handles) and disk.allocate(BLOCK_BYTES, b"\x09" * 16) is None
    disk.free(handles[0])
    assert disk.allocate(BLOCK_BYTES, b"\x09" * 16) is not None


def test_a_tier_sized_to_n_big_footprints_holds_n_and_small_blocks_stay_within_it(tmp_path):
    footprint = DiskTier(tmp_path / "probe", 1 << 20).footprint(1 << 20)
    disk = DiskTier(tmp_path / "big", 4 * footprint)
    big = [disk.allocate(1 << 20, bytes([i]) * 16) for i in range(4)]
    assert all(big) and disk.used_bytes == disk.capacity_bytes  # the aligned start costs no block
    assert disk.allocate(1 << 20, b"\x09" * 16) is None and disk.allocate(100) is None
    small = DiskTier(tmp_path / "small", 8 * GRANULE_BYTES)
    handles = [small.allocate(100) for _ in range(5)]  # 2 granules each; the spare ones are not capacity
    assert all(handles[:4]) and handles[4] is None and small.used_bytes == small.capacity_bytes


def test_demoted_blocks_load_back_exactly(tmp_path):
    pool, engine, toks, data, hs = spill(tmp_path)
    res = engine.load(SPEC.model_id, toks)
    assert res.num_cached_tokens == len(toks) and torch.equal(res.kv, data)
    assert res.tiers == (Tier.DISK,) * 3 + (Tier.CPU,) * 2
    assert len(blocks_on_disk(disk_of(pool))) == 3


def test_disk_codec_is_lossless_and_reported_in_usage(tmp_path):
    pool = make_pool(tmp_path / "disk", cpu_blocks=2, tier_codecs={Tier.DISK: "zstd"})
    engine = make_engine(pool)
    toks = tokens(4)
    data = torch.zeros((4, *SPEC.block_shape), dtype=torch.float16)  # compresses well
    engine.store(SPEC.model_id, toks, data)
    disk_blocks = [pool.blocks[h] for h in hashes(engine, toks) if pool.tier_of(h) is Tier.DISK]
    assert len(disk_blocks) == 2 and {m.codec for m in disk_blocks} == {"zstd"}
    u = {x.tier: x for x in pool.usage()}[Tier.DISK]
    assert u.uncompressed_bytes == 2 * BLOCK_BYTES and u.stored_bytes < u.uncompressed_bytes / 4
    assert torch.equal(engine.load(SPEC.model_id, toks).kv, data)
    check_pool(pool)


# ---- corruption: the next load is a miss from that block on --------------------------
@pytest.mark.parametrize(
    "damage", ["last payload byte", "first payload byte", "magic", "header", "truncated", "zeroed"]
)
def test_damaged_block_is_a_miss_removed_reported_and_counted(tmp_path, damage):
    pool, engine, toks, data, hs = spill(tmp_path)
    victim = hs[1]  # on disk, with a parent before it and descendants in both tiers
    at = block_on_disk(pool, victim)
    assert block_on_disk(pool, hs[0]).offset < at.offset  # the parent's bytes come first in the file
    pool.drain_events()
    pool.drain_notices()
    if damage == "last payload byte":
        flip_byte(at.path, at.last_payload_byte)
    elif damage == "first payload byte":
        flip_byte(at.path, at.payload_offset)
    elif damage == "magic":
        flip_byte(at.path, at.offset)
    elif damage == "header":
        flip_byte(at.path, at.offset + len(MAGIC) + 12)  # inside the block hash
    elif damage == "truncated":
        os.truncate(at.path, at.payload_offset + at.payload_bytes // 2)
    else:  # a hole punched over the whole extent
        with open(at.path, "r+b") as f:
            f.seek(at.offset)
            f.write(b"\0" * (at.payload_offset - at.offset + at.payload_bytes))

    res = engine.load(SPEC.model_id, toks)
    assert res.num_cached_tokens == BS  # only the block before it
    assert torch.equal(res.kv, data[:1])
    assert set(pool.blocks) == {hs[0]}  # the block and its descendants are gone
    assert sorted(removed_hashes(pool)) == sorted(hs[1:])  # REMOVED events for all of them
    notices = pool.drain_notices()
    assert [n.kind for n in notices] == ["corrupt_block"]
    assert victim.hex()[:12] in notices[0].message and "disk" in notices[0].message
    assert pool.corrupt_blocks_total == 1
    assert engine.lookup(SPEC.model_id, toks) == BS
    check_pool(pool)  # its extent is free again and accounted so
    # storing again repairs the chain
    assert engine.store(SPEC.model_id, toks, data).num_stored_blocks == len(hs) - 1
    assert torch.equal(engine.load(SPEC.model_id, toks).kv, data)


def test_removed_events_cover_the_whole_subtree(tmp_path):
    pool, engine, toks, data, hs = spill(tmp_path)
    at = block_on_disk(pool, hs[0])
    flip_byte(at.path, at.last_payload_byte)
    pool.drain_events()
    assert engine.load(SPEC.model_id, toks).num_cached_tokens == 0
    assert sorted(removed_hashes(pool)) == sorted(hs)
    assert pool.blocks == {}


def test_corrupt_source_of_a_promotion_is_removed_not_copied(tmp_path):
    pool, engine, toks, data, hs = spill(tmp_path)
    at = block_on_disk(pool, hs[2])
    flip_byte(at.path, at.last_payload_byte)
    outcome = pool.move_block(hs[2], Tier.CPU)
    assert not outcome.ok and "unreadable" in outcome.reason
    assert set(pool.blocks) == set(hs[:2]) and pool.corrupt_blocks_total == 1
    check_pool(pool)


# ---- restart: scan and recover ------------------------------------------------------
def _write_blocks(disk: DiskTier, n: int, num_bytes: int, seed: int = 0) -> list[tuple]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        h = (seed * 100_000 + i + 1).to_bytes(16, "little")
        data = torch.randint(0, 256, (num_bytes,), dtype=torch.uint8, generator=gen)
        handle = disk.allocate(num_bytes, h)
        meta = BlockMeta(h, ROOT_PARENT_HASH, "m", num_bytes, Tier.DISK, handle, "none", num_bytes)
        disk.write(handle, data, meta)
        out.append((handle, data, meta))
    return out


def _skip_unless_holes_punch(directory: Path) -> None:
    from agent.store.disk_tier import punch_hole

    probe = directory / "punch-probe"
    probe.write_bytes(b"x" * 8192)
    fd = os.open(probe, os.O_RDWR)
    try:
        punch_hole(fd, 0, 4096)
    except OSError as exc:
        pytest.skip(f"this file system cannot punch holes: {exc}")
    finally:
        os.close(fd)
        probe.unlink()


@pytest.mark.parametrize("num_bytes", [8 << 10, 64 << 10])
def test_freed_blocks_give_their_space_back_to_the_file_system(tmp_path, num_bytes):
    """A cleanup frees disk space, not only the tier's count: the freed extents' whole
    pages are punched out of the sparse slab; the blocks kept beside them read intact and
    a restart finds exactly those."""
    _skip_unless_holes_punch(tmp_path)
    disk = DiskTier(tmp_path, 64 << 20)
    blocks = _write_blocks(disk, 200, num_bytes)
    disk.flush()
    full = disk.allocated_bytes()
    assert full >= 200 * num_bytes
    kept = blocks[::10]
    for b in blocks:
        if b not in kept:
            disk.free(b[0])
    disk.drain()
    # 180 of 200 freed: at least 80 % of their bytes go back (a page shared with a kept
    # neighbour stays)
    assert full - disk.allocated_bytes() >= 0.8 * 180 * num_bytes
    for handle, data, _ in kept:
        assert torch.equal(disk.read(handle, num_bytes), data)
    disk.close()
    again = DiskTier(tmp_path, 64 << 20)
    found, corrupt = again.scan()
    assert corrupt == 0 and {f.block_hash for f in found} == {m.block_hash for _, _, m in kept}
    for f in found:
        want = next(d for h, d, m in kept if m.block_hash == f.block_hash)
        assert torch.equal(again.read(f.handle, num_bytes), want)
    # freeing the rest gives back (nearly) all of it, and the space is used again
    for f in found:
        again.free(f.handle)
    again.drain()
    assert again.allocated_bytes() <= 2 * 4096
    more = _write_blocks(again, 50, num_bytes, seed=1)
    for handle, data, _ in more:
        assert torch.equal(again.read(handle, num_bytes), data)
    again.close()


def test_a_nearly_full_tier_keeps_freed_space_for_reuse_until_it_empties_below_three_quarters(tmp_path):
    """Churn near capacity reuses freed extents at once (punching them would make each
    write allocate again); going below 3/4 full gives back every free run, those freed
    while above included."""
    _skip_unless_holes_punch(tmp_path)
    disk = DiskTier(tmp_path, 16 << 20)
    blocks = _write_blocks(disk, 200, 64 << 10)
    disk.flush()
    full = disk.allocated_bytes()
    assert disk.used_bytes > 0.8 * disk.capacity_bytes
    for handle, _, _ in blocks[:10]:
        disk.free(handle)
    disk.drain()
    assert disk.used_bytes > 0.75 * disk.capacity_bytes and disk.allocated_bytes() == full
    for handle, _, _ in blocks[10:40]:
        disk.free(handle)
    disk.drain()
    assert disk.used_bytes < 0.75 * disk.capacity_bytes
    assert full - disk.allocated_bytes() >= 0.95 * 40 * (64 << 10)
    for handle, data, _ in blocks[40:]:
        assert torch.equal(disk.read(handle, 64 << 10), data)
    disk.close()


def test_a_tier_filled_past_085_between_two_drains_is_swept_when_it_empties(tmp_path):
    """The sweep re-arms when the tier goes above 0.85; that was seen only at a drain, so
    a tier filled past it and emptied again between two drains kept the space it had
    freed while between 3/4 and 0.85."""
    _skip_unless_holes_punch(tmp_path)
    disk = DiskTier(tmp_path, 16 << 20)
    first = _write_blocks(disk, 101, 64 << 10, seed=4)
    disk.free(first[-1][0])
    disk.drain()  # below 3/4: the first sweep
    blocks = first[:100] + _write_blocks(disk, 100, 64 << 10)
    disk.flush()
    full = disk.allocated_bytes()
    for handle, _, _ in blocks[0:20:2]:  # 10 holes between kept blocks, freed at ~0.79 full
        disk.free(handle)
    disk.drain()
    assert 0.75 * disk.capacity_bytes < disk.used_bytes < 0.85 * disk.capacity_bytes
    assert disk.allocated_bytes() == full  # kept for reuse
    more = _write_blocks(disk, 15, 128 << 10, seed=3)  # too big for the holes: past 0.85, no drain
    assert disk.used_bytes > 0.85 * disk.capacity_bytes
    for handle, _, _ in more + blocks[20:120]:
        disk.free(handle)
    disk.drain()
    assert disk.used_bytes < 0.75 * disk.capacity_bytes
    # swept: the 10 holes went back too, not only what this drain freed
    assert disk.allocated_bytes() <= disk.used_bytes + 64 * 1024
    for handle, data, _ in blocks[1:20:2] + blocks[120:]:
        assert torch.equal(disk.read(handle, 64 << 10), data)
    disk.close()


def test_a_file_system_that_cannot_punch_holes_keeps_the_space_and_says_so_once(tmp_path, monkeypatch, caplog):
    import agent.store.disk_tier as disk_tier

    calls = []

    def refuse(fd, offset, length):
        calls.append(offset)
        raise OSError(95, "Operation not supported")

    monkeypatch.setattr(disk_tier, "punch_hole", refuse)
    disk = DiskTier(tmp_path, 8 << 20)
    blocks = _write_blocks(disk, 20, 8 << 10)
    for handle, _, _ in blocks[:10]:
        disk.free(handle)
    disk.drain()
    for handle, _, _ in blocks[10:]:
        disk.free(handle)
    disk.drain()
    assert len(calls) == 1 and not disk.punch_holes
    assert sum("cannot give freed space" in r.getMessage() for r in caplog.records) == 1
    assert disk.used_bytes == 0
    again = _write_blocks(disk, 20, 8 << 10, seed=2)  # the space is reused
    assert all(torch.equal(disk.read(h, 8 << 10), d) for h, d, _ in again)
    disk.close()


def test_restart_recovers_valid_blocks_and_prunes_corrupt_and_orphans(tmp_path):
    d = tmp_path / "disk"
    pool = make_pool(d, cpu_blocks=2)
    engine = make_engine(pool)
    a_toks, a = tokens(4), kv(4, seed=1)
    b_toks, b = tokens(4, start=10_000), kv(4, seed=2)
    engine.store(SPEC.model_id, a_toks, a)
    engine.store(SPEC.model_id, b_toks, b)
    ha, hb = hashes(engine, a_toks), hashes(engine, b_toks)
    assert [pool.tier_of(h) for h in ha] == [Tier.DISK] * 4  # demoted by b
    assert [pool.tier_of(h) for h in hb] == [Tier.DISK, Tier.DISK, Tier.CPU, Tier.CPU]
    assert pool.move_block(hb[3], Tier.DISK).ok  # its parent stays in memory: an orphan after restart
    at = block_on_disk(pool, ha[2])
    flip_byte(at.path, at.last_payload_byte)  # corrupt: it and ha[3] cannot come back
    originals = {h: decoded(pool, h) for h in (*ha[:2], *hb[:2])}
    disk_of(pool).close()  # the agent stops

    # "restart": a new store and pool over the same directory
    disk2 = DiskTier(d, 1 << 20)
    pool2 = BlockPool([MemoryTier(Tier.CPU, 2 * BLOCK_BYTES, BLOCK_BYTES, device="cpu"), disk2], [SPEC])
    found, corrupt = disk2.scan()
    assert corrupt == 1
    assert {f.block_hash for f in found} == {*ha[:2], ha[3], *hb[:2], hb[3]}
    assert all(f.model_id == SPEC.model_id and f.num_bytes == BLOCK_BYTES for f in found)
    assert pool2.recover(disk2, found) == 4
    assert set(pool2.blocks) == {*ha[:2], *hb[:2]}  # ha[3] and hb[3] wait for their parents
    assert pool2.num_parked_blocks == 2
    assert all(pool2.tier_of(h) is Tier.DISK for h in pool2.blocks)
    assert pool2.blocks[ha[0]].num_children == 1 and pool2.blocks[ha[1]].num_children == 0
    check_pool(pool2)  # the corrupt block is gone from the slab, used bytes match
    engine2 = make_engine(pool2)
    res = engine2.load(SPEC.model_id, a_toks)
    assert res.num_cached_tokens == 2 * BS and torch.equal(res.kv, a[:2])
    assert torch.equal(engine2.load(SPEC.model_id, b_toks).kv, b[:2])
    for h, t in originals.items():
        assert torch.equal(decoded(pool2, h), t)
    seq, groups = pool2.inventory()
    assert {(g.tier, len(g.block_hashes) // 16) for g in groups} == {(Tier.DISK, 4)}


def test_a_restart_keeps_how_long_disk_blocks_were_idle(tmp_path):
    """A cleanup by age after a restart: the blocks' last access comes back from their
    headers (before, every recovered block counted as used at the restart, and
    `cleanup --older-than 7d` freed nothing for 7 days)."""
    d = tmp_path / "disk"
    pool, engine, toks, data, hs = spill(tmp_path)
    time.sleep(1.2)
    assert all(pool.move_block(h, Tier.DISK).ok for h in hs[3:][::-1])  # children first
    disk_of(pool).close()
    disk2 = DiskTier(d, 1 << 20)
    pool2 = BlockPool([MemoryTier(Tier.CPU, 2 * BLOCK_BYTES, BLOCK_BYTES, device="cpu"), disk2], [SPEC])
    found, _ = disk2.scan()
    assert pool2.recover(disk2, found) == 5
    freed = pool2.cleanup(1.0, dry_run=True)
    assert freed.num_blocks == 5  # idle for 1.2 s before the restart: older than 1 s
    assert pool2.cleanup(60.0, dry_run=True).num_blocks == 0


def test_a_restart_without_the_model_keeps_its_disk_blocks_for_a_restart_with_it(tmp_path, caplog):
    """A restart with a mistyped or missing --model must not wipe the cache (a review:
    the blocks were freed for good, and a restart with the right model found none). They
    are parked, invisible, said with the model and why; the next restart with the model
    adopts them, byte for byte."""
    d = tmp_path / "disk"
    pool, engine, toks, data, hs = spill(tmp_path)
    originals = {h: decoded(pool, h) for h in hs[:3]}
    disk_of(pool).close()
    disk2 = DiskTier(d, 1 << 20)
    other = SPEC.__class__("other", 4, 2, 2, 8, "float16")
    pool2 = BlockPool([MemoryTier(Tier.CPU, 2 * BLOCK_BYTES, BLOCK_BYTES, device="cpu"), disk2], [other])
    found, _ = disk2.scan()
    assert len(found) == 3
    with caplog.at_level("WARNING"):
        assert pool2.recover(disk2, found) == 0
    assert pool2.blocks == {} and pool2.inventory()[1] == []  # nothing visible, nothing reported
    assert pool2.num_parked_blocks == 3 and len(blocks_on_disk(disk2)) == 3
    assert f"3 recovered blocks ({3 * BLOCK_BYTES} bytes) of model {SPEC.model_id!r} cannot be used" in caplog.text
    assert "does not serve it" in caplog.text and "they are kept" in caplog.text
    disk2.close()
    disk3 = DiskTier(d, 1 << 20)
    pool3 = BlockPool([MemoryTier(Tier.CPU, 2 * BLOCK_BYTES, BLOCK_BYTES, device="cpu"), disk3], [SPEC])
    found, _ = disk3.scan()
    assert pool3.recover(disk3, found) == 3
    for h, t in originals.items():
        assert torch.equal(decoded(pool3, h), t)
    disk3.close()


def test_blocks_of_a_model_not_served_go_first_for_room_and_in_a_cleanup(tmp_path):
    from agent.core.engine_api import KVEngineAPI

    d = tmp_path / "disk"
    pool, *_ = spill(tmp_path)
    footprint = disk_of(pool).footprint(BLOCK_BYTES)
    disk_of(pool).close()
    other = SPEC.__class__("other", 4, 2, 2, 8, "float16")
    disk2 = DiskTier(d, 3 * footprint)  # full of the old model's blocks
    pool2 = BlockPool([MemoryTier(Tier.CPU, 2 * BLOCK_BYTES, BLOCK_BYTES, device="cpu"), disk2], [other])
    found, _ = disk2.scan()
    assert pool2.recover(disk2, found) == 0 and pool2.num_parked_blocks == 3
    assert pool2.cleanup(60.0, dry_run=True).num_blocks == 0  # used a moment ago
    assert pool2.cleanup(0.0, model_id=SPEC.model_id, dry_run=True).num_blocks == 3
    assert pool2.num_parked_blocks == 3
    assert pool2.free_parked(expired_only=True) == 0  # kept for PARKED_SECONDS
    # the model served now needs the disk: the unserved blocks make room, none of its own goes
    engine2 = KVEngineAPI(pool2, [other])
    toks = tokens(4, start=1000)
    assert engine2.store(other.model_id, toks, kv(4, spec=other)).num_stored_blocks == 4
    assert pool2.num_parked_blocks == 0 and len(pool2.blocks) == 4 and len(blocks_on_disk(disk2)) == 2
    check_pool(pool2)
    disk2.close()


@pytest.mark.parametrize(
    "layout",
    [
        dict(num_kv_heads=4, head_dim=4),  # the same bytes in another shape
        dict(dtype="bfloat16"),  # the same bytes as another dtype
        dict(head_dim=16),  # another size
    ],
)
def test_restart_under_another_kv_layout_of_the_model_never_adopts_its_blocks(tmp_path, layout):
    import dataclasses

    d = tmp_path / "disk"
    pool, *_ = spill(tmp_path)
    disk_of(pool).close()
    disk2 = DiskTier(d, 1 << 20)
    changed = dataclasses.replace(SPEC, **layout)
    pool2 = BlockPool([MemoryTier(Tier.CPU, 4 * BLOCK_BYTES, BLOCK_BYTES, device="cpu"), disk2], [changed])
    found, _ = disk2.scan()
    assert len(found) == 3 and {b.layout for b in found} == {SPEC.layout}
    assert pool2.recover(disk2, found) == 0
    assert pool2.blocks == {} and pool2.num_parked_blocks == 3  # never read in the wrong shape
    assert pool2.cleanup(0.0, model_id=SPEC.model_id).num_blocks == 3  # kvctl cleanup --model tiny frees them
    assert pool2.num_parked_blocks == 0
    assert blocks_on_disk(disk2) == [] and disk2.used_bytes == 0
    disk2.close()
    disk3 = DiskTier(d, 1 << 20)  # the freed blocks stay gone; the same layout again finds none
    assert disk3.scan()[0] == []


def test_agent_recovers_its_disk_tier_at_start(tmp_path):
    d = tmp_path / "disk"
    pool, engine, toks, data, hs = spill(tmp_path)
    at = block_on_disk(pool, hs[2])
    flip_byte(at.path, at.last_payload_byte)
    disk_of(pool).close()
    agent = Agent(AgentConfig(agent_id="r", models=[SPEC], cpu_capacity_bytes=4 * BLOCK_BYTES, disk_dir=str(d)))
    try:
        assert set(agent.pool.blocks) == set(hs[:2])
        assert agent.pool.corrupt_blocks_total == 1
        res = agent.engine.load(SPEC.model_id, toks)
        assert res.num_cached_tokens == 2 * BS and torch.equal(res.kv, data[:2])
    finally:
        agent.stop()  # closes its disk tier and frees its transfer engine


# ---- unusable directories -----------------------------------------------------------
def test_directory_under_a_regular_file_is_refused(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    with pytest.raises(OSError, match=r"disk tier directory .*not-a-dir/kv is not usable"):
        DiskTier(blocker / "kv", 1 << 20)
    with pytest.raises(OSError, match="not usable"):
        Agent(AgentConfig(agent_id="x", disk_dir=str(blocker / "kv")))


@pytest.mark.parametrize("name", [SLAB_NAME, DEAD_LOG_NAME])
def test_a_link_planted_in_the_directory_is_never_followed(tmp_path, name):
    """The slab and its dead log were opened following a link at their names: in a
    directory others can write (as under /tmp), a link planted there made the agent create
    or append to a file of the planter's choosing. Refused now; the new directory is the
    owner's only."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    kv = tmp_path / "kv"
    kv.mkdir()
    (kv / name).symlink_to(victim)
    with pytest.raises(OSError, match="not usable"):
        DiskTier(kv, 1 << 20)
    assert victim.read_bytes() == b"precious"
    fresh = DiskTier(tmp_path / "new" / "kv", 1 << 20)
    try:
        assert (tmp_path / "new" / "kv").stat().st_mode & 0o777 == 0o700
    finally:
        fresh.close()


def test_directory_that_is_a_file_is_refused(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(OSError, match="not usable"):
        DiskTier(f, 1 << 20)


def test_agent_command_with_an_unusable_disk_says_so_and_exits_non_zero(tmp_path):
    from agent.main import main

    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    result = CliRunner().invoke(
        main, ["--agent-id", "x", "--disk-dir", str(blocker / "kv"), "--metrics-listen", ""], catch_exceptions=False
    )
    assert result.exit_code == 2
    assert "not usable" in result.output and "Traceback" not in result.output


def test_non_positive_capacity_is_refused(tmp_path):
    with pytest.raises(ValueError, match="capacity"):
        DiskTier(tmp_path, 0)


# ---- a full disk ----------------------------------------------------------------------
def test_full_disk_drops_the_oldest_disk_leaves(tmp_path):
    foot = DiskTier(tmp_path / "probe", 1 << 20).footprint(BLOCK_BYTES)
    pool = make_pool(tmp_path / "disk", cpu_blocks=2, disk_bytes=3 * foot)
    engine = make_engine(pool)
    chains = []
    for i in range(4):  # two-block prompts: each pushes the previous one to disk
        toks, data = tokens(2, start=1000 * i), kv(2, seed=i)
        engine.store(SPEC.model_id, toks, data)
        chains.append((toks, data, hashes(engine, toks)))
        check_pool(pool)
    assert pool.evictions_total[Tier.DISK] > 0
    assert disk_of(pool).used_bytes <= 3 * foot
    assert len(pool.blocks) == 5  # 2 in CPU + 3 on disk
    # the newest prompt is whole; the oldest lost its leaf first (never a parent alone)
    assert engine.lookup(SPEC.model_id, chains[3][0]) == 2 * BS
    assert engine.lookup(SPEC.model_id, chains[1][0]) == BS  # its leaf went, its root stayed
    assert engine.lookup(SPEC.model_id, chains[0][0]) == 0
    for toks, data, _ in chains:
        res = engine.load(SPEC.model_id, toks)
        assert torch.equal(res.kv, data[: res.num_cached_tokens // BS])


def test_a_full_disk_of_pinned_blocks_fails_a_move_and_keeps_the_source(tmp_path):
    foot = DiskTier(tmp_path / "probe", 1 << 20).footprint(BLOCK_BYTES)
    pool = make_pool(tmp_path / "disk", cpu_blocks=2, disk_bytes=2 * foot)
    engine = make_engine(pool)
    engine.store(SPEC.model_id, tokens(4), kv(4))
    pinned = [h for h in pool.blocks if pool.tier_of(h) is Tier.DISK]
    assert len(pinned) == 2
    pool.set_pin(pinned, Tier.DISK)
    toks, data = tokens(1, start=5000), kv(1, seed=9)
    engine.store(SPEC.model_id, toks, data)
    h = hashes(engine, toks)[0]
    outcome = pool.move_block(h, Tier.DISK)
    assert not outcome.ok and "PoolFull" in outcome.reason
    assert pool.tier_of(h) is Tier.CPU and set(pinned) <= set(pool.blocks)
    assert torch.equal(engine.load(SPEC.model_id, toks).kv, data)
    check_pool(pool)


# ---- write errors -------------------------------------------------------------------
def remove_slab(pool: BlockPool) -> None:
    """Take the slab file away under the running tier: every later write fails."""
    disk = disk_of(pool)
    disk.path.unlink()
    time.sleep(0.06)  # the tier looks at its file at most every 50 ms


def test_write_error_on_a_move_is_noticed_and_leaves_the_source(tmp_path):
    pool = make_pool(tmp_path / "disk", cpu_blocks=4)
    engine = make_engine(pool)
    toks, data = tokens(2), kv(2)
    engine.store(SPEC.model_id, toks, data)
    h = hashes(engine, toks)[1]
    remove_slab(pool)
    outcome = pool.move_block(h, Tier.DISK)
    assert not outcome.ok and outcome.reason
    assert pool.tier_of(h) is Tier.CPU
    assert torch.equal(engine.load(SPEC.model_id, toks).kv, data)
    assert "write_error" in [n.kind for n in pool.drain_notices()]
    assert disk_of(pool).write_errors_total == 1 and pool.move_failures_total == 1
    check_pool(pool)


def test_write_error_on_a_demotion_is_noticed_and_the_store_goes_on(tmp_path):
    pool = make_pool(tmp_path / "disk", cpu_blocks=1)
    engine = make_engine(pool)
    first, first_kv = tokens(1), kv(1)
    engine.store(SPEC.model_id, first, first_kv)
    remove_slab(pool)
    second, second_kv = tokens(1, start=777), kv(1, seed=3)
    assert engine.store(SPEC.model_id, second, second_kv).num_stored_blocks == 1  # no crash
    assert "write_error" in [n.kind for n in pool.drain_notices()]
    # the demotion failed, so the safety net dropped the old leaf instead
    assert engine.lookup(SPEC.model_id, first) == 0
    assert torch.equal(engine.load(SPEC.model_id, second).kv, second_kv)
    assert disk_of(pool).used_bytes == 0
    check_pool(pool)


def test_disk_directory_removed_while_running(tmp_path):
    import shutil

    pool, engine, toks, data, hs = spill(tmp_path)
    shutil.rmtree(disk_of(pool).directory)
    time.sleep(0.06)  # the tier looks at its file at most every 50 ms
    res = engine.load(SPEC.model_id, toks)  # every disk block is missing: a miss, not a crash
    assert res.num_cached_tokens == 0 and pool.blocks == {}
    assert pool.corrupt_blocks_total == 1
    more, more_kv = tokens(3, start=900), kv(3, seed=4)
    assert engine.store(SPEC.model_id, more, more_kv).num_stored_blocks >= 2  # demotions fail, drops instead
    kinds = {n.kind for n in pool.drain_notices()}
    assert {"corrupt_block", "write_error"} <= kinds
    res = engine.load(SPEC.model_id, more)
    assert torch.equal(res.kv, more_kv[: res.num_cached_tokens // BS])


# ---- the dead log: freed blocks stay gone across a restart ------------------------------
def _raw_block(disk: DiskTier, h: bytes, nbytes: int, fill: int):
    handle = disk.allocate(nbytes, h)
    data = torch.full((nbytes,), fill, dtype=torch.uint8)
    disk.write(handle, data, BlockMeta(h, ROOT_PARENT_HASH, "m", nbytes, Tier.DISK, handle, "none", nbytes))
    return handle, data


def test_freed_blocks_do_not_come_back_after_a_restart(tmp_path):
    disk = DiskTier(tmp_path, 1 << 20)
    kept, kept_data = _raw_block(disk, b"\x01" * 16, 3000, 1)
    gone, _ = _raw_block(disk, b"\x02" * 16, 3000, 2)
    disk.free(gone)  # e.g. promoted to memory, then the agent stops
    disk.close()
    again = DiskTier(tmp_path, 1 << 20)
    found, corrupt = again.scan()
    assert [b.block_hash for b in found] == [b"\x01" * 16] and corrupt == 0
    assert torch.equal(again.read(found[0].handle, 3000), kept_data)
    assert again.used_bytes == again.footprint(3000)


def test_freed_blocks_past_a_smaller_capacity_do_not_come_back_at_the_old_one(tmp_path):
    """A restart with a smaller --disk-capacity reads only that much of the slab, and
    used to empty the dead log all the same: the freed blocks past it, never cleared,
    came back at a later restart with the old capacity (a cleanup undone)."""
    disk = DiskTier(tmp_path, 1 << 20)
    freed = [_raw_block(disk, bytes([i]) * 16, 3000, i)[0] for i in range(1, 4)]
    for handle in freed:
        disk.free(handle)  # e.g. a cleanup, then the agent stops
    disk.close()
    smaller = DiskTier(tmp_path, GRANULE_BYTES)  # its slab: 4 KiB, the first block and a half
    assert freed[-1].offset >= smaller.slab_bytes
    assert smaller.scan() == ([], 0)
    smaller.close()
    again = DiskTier(tmp_path, 1 << 20)
    assert again.scan() == ([], 0)
    assert again.used_bytes == 0


def test_live_blocks_past_a_smaller_capacity_are_removed_and_said_not_hidden(tmp_path, caplog):
    """A restart with a smaller --disk-capacity took a block across its end for corrupt and
    left those wholly past it hidden: nothing could free them under the small capacity, and
    a later restart at the old one brought back blocks the agent had emptied (a review).
    They are removed at that start, with a warning."""
    disk = DiskTier(tmp_path, 1 << 20)
    blocks = [_raw_block(disk, bytes([i]) * 16, 3000, i) for i in range(1, 4)]  # 3584 B extents
    disk.close()
    smaller = DiskTier(tmp_path, GRANULE_BYTES)  # 4 KiB: the first block and half the second
    assert blocks[2][0].offset >= smaller.slab_bytes
    with caplog.at_level("WARNING"):
        found, corrupt = smaller.scan()
    assert [b.block_hash for b in found] == [b"\x01" * 16] and corrupt == 0
    assert "removed 2 blocks (6000 bytes) that lie past --disk-capacity" in caplog.text
    assert os.path.getsize(smaller.path) <= smaller.slab_bytes  # the space given back
    for b in found:  # the agent empties its tier
        smaller.free(b.handle)
    smaller.close()
    again = DiskTier(tmp_path, 1 << 20)
    assert again.scan() == ([], 0)


def test_a_dead_extent_reused_at_another_offset_recovers_only_the_new_block(tmp_path):
    disk = DiskTier(tmp_path, 1 << 20)
    big, _ = _raw_block(disk, b"\x03" * 16, 8000, 3)  # 17 granules at offset 0
    disk.free(big)
    disk.drain()
    small, _ = _raw_block(disk, b"\x04" * 16, 500, 4)  # 2 granules at offset 0
    later, later_data = _raw_block(disk, b"\x05" * 16, 500, 5)  # inside the dead extent
    assert small.offset == 0 and 0 < later.offset < big.footprint_bytes
    disk.close()
    again = DiskTier(tmp_path, 1 << 20)
    found, corrupt = again.scan()
    assert sorted(b.block_hash for b in found) == [b"\x04" * 16, b"\x05" * 16] and corrupt == 0
    by_hash = {b.block_hash: b for b in found}
    assert torch.equal(again.read(by_hash[b"\x05" * 16].handle, 500), later_data)


def test_the_dead_log_is_compacted_to_headers_still_in_the_slab(tmp_path, monkeypatch):
    from agent.store import disk_tier

    monkeypatch.setattr(disk_tier, "DEAD_LOG_COMPACT_RECORDS", 8)
    disk = DiskTier(tmp_path, 64 * 1024)  # 128 granules: compaction past max(8, 32) records
    for i in range(40):  # the same extent over and over: each write buries the last one's header
        handle, _ = _raw_block(disk, bytes([i]) * 16, 1000, i)
        disk.free(handle)
        disk.drain()
    assert disk.dead_path.stat().st_size <= 33 * 16  # compacted at least once
    assert blocks_on_disk(disk) == []
    disk.close()
    again = DiskTier(tmp_path, 64 * 1024)
    assert again.scan() == ([], 0)


# ---- found in review: failures in the middle of things ---------------------------------
def test_a_torn_dead_log_append_loses_no_live_block(tmp_path, monkeypatch):
    from agent.store import disk_tier

    disk = DiskTier(tmp_path, 1 << 20)
    z, z_data = _raw_block(disk, b"\x0a" * 16, 400, 9)
    x, _ = _raw_block(disk, b"\x0b" * 16, 100, 8)
    b, _ = _raw_block(disk, b"\x0c" * 16, 3000, 2)
    real, calls = os.write, [0]

    def torn(fd, data):  # the disk fills up halfway through the first append
        if fd == disk._dead_fd:
            calls[0] += 1
            if calls[0] == 1:
                real(fd, bytes(data)[:8])
                raise OSError(28, "No space left on device")
        return real(fd, data)

    monkeypatch.setattr(disk_tier.os, "write", torn)
    disk.free(x)
    disk.drain()
    monkeypatch.undo()
    assert disk.dead_path.stat().st_size == 0  # the torn record is gone, x's header cleared instead
    disk.free(b)
    disk.drain()
    c, c_data = _raw_block(disk, b"\x0d" * 16, 100_000, 3)  # reuses b's space and more
    disk.close()
    again = DiskTier(tmp_path, 1 << 20)
    found, corrupt = again.scan()
    by_hash = {f.block_hash: f for f in found}
    assert sorted(by_hash) == [b"\x0a" * 16, b"\x0d" * 16] and corrupt == 0
    assert torch.equal(again.read(by_hash[b"\x0d" * 16].handle, 100_000), c_data)
    assert torch.equal(again.read(by_hash[b"\x0a" * 16].handle, 400), z_data)


def test_a_stale_header_does_not_hide_the_blocks_written_inside_its_extent(tmp_path):
    disk = DiskTier(tmp_path, 1 << 20)
    old, _ = _raw_block(disk, b"\x0e" * 16, 8000, 1)
    # freed without a dead-log record and without clearing (as after a crash): its header stays
    with disk._lock:
        disk._used -= old.footprint_bytes
        disk._extents.free(old.offset // GRANULE_BYTES, old.footprint_bytes // GRANULE_BYTES)
    disk.allocate(5000)  # a block that never gets written: the stale header at offset 0 survives
    inner, inner_data = _raw_block(disk, b"\x0f" * 16, 500, 7)  # lands inside the old extent
    assert old.offset < inner.offset < old.offset + old.footprint_bytes
    disk.close()
    again = DiskTier(tmp_path, 1 << 20)
    found, _ = again.scan()
    by_hash = {f.block_hash: f for f in found}
    assert b"\x0f" * 16 in by_hash  # found although the stale header before it claimed the space
    assert torch.equal(again.read(by_hash[b"\x0f" * 16].handle, 500), inner_data)


def test_read_many_reads_every_block_when_the_helper_pool_is_gone(tmp_path):
    disk = DiskTier(tmp_path, 1 << 20, io_threads=2)
    handles = [_raw_block(disk, bytes([0x20 + i]) * 16, 100_000, i)[0] for i in range(4)]
    disk._io.shutdown(wait=True)  # as while the tier closes
    outs = [torch.full((100_000,), 0xEE, dtype=torch.uint8) for _ in handles]
    assert disk.read_many([(h, [o]) for h, o in zip(handles, outs, strict=True)]) == [None] * 4
    assert [int(o[0]) for o in outs] == [0, 1, 2, 3]
    disk._io = None
    disk.close()


def test_a_tier_that_fails_to_open_releases_its_slab(tmp_path):
    with pytest.raises(ValueError, match="granule"):
        DiskTier(tmp_path, 100)
    DiskTier(tmp_path, 1 << 20).close()  # not "in use by another agent"


def test_compaction_keeps_a_record_whose_burying_write_is_not_on_disk_yet(tmp_path, monkeypatch):
    """Durable state = the slab at its last fdatasync; a write racing the compaction (a
    mover got the extent just freed) may be lost in a crash, so the freed block's record
    may go only once that write is on disk."""
    from agent.store import disk_tier

    disk = DiskTier(tmp_path, 1 << 20)
    gone, _ = _raw_block(disk, b"\xaa" * 16, 3000, 1)
    _raw_block(disk, b"\xbb" * 16, 3000, 2)
    durable, raced = {}, []
    real_sync, real_pread = os.fdatasync, os.pread

    def sync(fd):
        real_sync(fd)
        if fd == disk.fd:
            durable["slab"] = disk.path.read_bytes()

    def pread(fd, n, offset):
        if fd == disk.fd and n == disk_tier._FIXED_SEQ_END and not raced:  # compaction reads a header
            raced.append(_raw_block(disk, b"\xcc" * 16, 3000, 3)[0])  # another thread's write
        return real_pread(fd, n, offset)

    sync(disk.fd)
    disk._compact_at = 0
    monkeypatch.setattr(disk_tier.os, "fdatasync", sync)
    monkeypatch.setattr(disk_tier.os, "pread", pread)
    disk.free(gone)
    disk.drain()
    monkeypatch.undo()
    assert raced and raced[0].offset == gone.offset
    disk.close()
    disk.path.write_bytes(durable["slab"])  # the crash: what was not synced is lost
    found, _ = DiskTier(tmp_path, 1 << 20).scan()
    assert b"\xaa" * 16 not in {b.block_hash for b in found}, "a freed block came back"


def test_disk_blocks_whose_prefix_was_in_memory_come_back_when_it_is_stored_again(tmp_path):
    """A disk tier holds tails; their prefix is in memory, lost with a crash. Recovery
    dropped every such block as an orphan: a killed demo agent came back with an empty
    disk tier ("recovered 0 blocks", a newcomer's review). They wait now, parked, and are
    adopted when an engine stores the prefix again: only the lost blocks are written."""
    d = tmp_path / "disk"
    pool = make_pool(d, cpu_blocks=8)
    engine = make_engine(pool)
    toks, data = tokens(4), kv(4, seed=3)
    engine.store(SPEC.model_id, toks, data)
    hs = hashes(engine, toks)
    assert pool.move_block(hs[3], Tier.DISK).ok and pool.move_block(hs[2], Tier.DISK).ok  # tails down
    assert [pool.tier_of(h) for h in hs] == [Tier.CPU, Tier.CPU, Tier.DISK, Tier.DISK]
    disk_of(pool).close()  # kill -9: the CPU tier is gone

    disk2 = DiskTier(d, 1 << 20)
    pool2 = BlockPool([MemoryTier(Tier.CPU, 8 * BLOCK_BYTES, BLOCK_BYTES, device="cpu"), disk2], [SPEC])
    found, _ = disk2.scan()
    assert pool2.recover(disk2, found) == 0 and pool2.num_parked_blocks == 2
    check_pool(pool2)
    # their bytes are the disk tier's used bytes; its usage says why no block shows
    usage = {u.tier: u for u in pool2.usage()}
    assert (usage[Tier.DISK].num_blocks, usage[Tier.DISK].num_parked_blocks) == (0, 2)
    assert usage[Tier.DISK].used_bytes > 0 and usage[Tier.CPU].num_parked_blocks == 0
    from prometheus_client import CollectorRegistry

    from agent.metrics import AgentMetrics

    registry = CollectorRegistry()
    AgentMetrics(registry, "a1", pool2, process=False)
    assert registry.get_sample_value("kvcp_parked_blocks", {"agent_id": "a1"}) == 2
    engine2 = make_engine(pool2)
    assert engine2.load(SPEC.model_id, toks).num_cached_tokens == 0  # the prefix is gone: a miss
    stored = engine2.store(SPEC.model_id, toks, data)  # the engine recomputed it and stores it
    assert (stored.num_stored_blocks, stored.num_present_blocks) == (2, 2)  # the tail came back from disk
    assert pool2.num_parked_blocks == 0 and pool2.parked_adopted_total == 2
    assert {u.tier: (u.num_blocks, u.num_parked_blocks) for u in pool2.usage()}[Tier.DISK] == (2, 0)
    assert [pool2.tier_of(h) for h in hs] == [Tier.CPU, Tier.CPU, Tier.DISK, Tier.DISK]
    res = engine2.load(SPEC.model_id, toks)
    assert res.num_cached_tokens == 4 * BS and torch.equal(res.kv, data)
    check_pool(pool2)


def _crash_with_two_tails_on_disk(d: Path, seed: int) -> None:
    """A 3-block chain with its last two blocks on disk and its first in memory, then the
    process gone: after a restart the two wait for their prefix."""
    pool = make_pool(d, cpu_blocks=8)
    engine = make_engine(pool)
    toks = tokens(3)
    engine.store(SPEC.model_id, toks, kv(3, seed=seed))
    hs = hashes(engine, toks)
    assert pool.move_block(hs[2], Tier.DISK).ok and pool.move_block(hs[1], Tier.DISK).ok
    disk_of(pool).close()


def test_parked_blocks_give_way_when_the_tier_needs_room(tmp_path):
    d = tmp_path / "disk"
    _crash_with_two_tails_on_disk(d, seed=4)
    probe = DiskTier(tmp_path / "probe", 1 << 20)
    footprint = probe.footprint(BLOCK_BYTES)
    probe.close()
    disk2 = DiskTier(d, 3 * footprint)  # room for one more block beside the two parked
    pool2 = BlockPool([MemoryTier(Tier.CPU, 2 * BLOCK_BYTES, BLOCK_BYTES, device="cpu"), disk2], [SPEC])
    found, _ = disk2.scan()
    pool2.recover(disk2, found)
    assert pool2.num_parked_blocks == 2
    engine2 = make_engine(pool2)
    engine2.store(SPEC.model_id, tokens(4, start=70_000), kv(4, seed=5))  # needs the disk: parked go first
    assert pool2.num_parked_blocks == 0
    check_pool(pool2)


def test_parked_blocks_no_prefix_came_for_are_freed_after_a_while(tmp_path):
    d = tmp_path / "disk"
    _crash_with_two_tails_on_disk(d, seed=6)
    disk2 = DiskTier(d, 1 << 20)
    pool2 = BlockPool([MemoryTier(Tier.CPU, 2 * BLOCK_BYTES, BLOCK_BYTES, device="cpu"), disk2], [SPEC])
    found, _ = disk2.scan()
    pool2.recover(disk2, found)
    assert pool2.free_parked(expired_only=True) == 0  # not yet: PARKED_SECONDS from the recovery
    pool2._parked_until = time.monotonic() - 1.0
    assert pool2.free_parked(expired_only=True) == 2 and pool2.num_parked_blocks == 0
    check_pool(pool2)
    assert disk2.used_bytes == 0
