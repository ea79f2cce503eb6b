"""Blocks a restart finds on disk whose prefix was lost with a faster tier wait for it
(parked): pins restored from the pin file hold them, and a cleanup frees them too (a
review, 2026-12-06)."""

from __future__ import annotations

import dataclasses
import time

from agent.core.block_pool import BlockPool
from agent.core.pins import AgentPin
from agent.server import Agent, AgentConfig
from agent.store.disk_tier import DiskTier
from agent.store.memory_tier import MemoryTier
from agent.store.pin_file import PinFile
from protos.tier import Tier
from tests.tiers.support import BLOCK_BYTES, SPEC, disk_of, hashes, kv, make_engine, make_pool, tokens


def _crash_with_tail_on_disk(d, pin_tier: Tier | None = Tier.DISK):
    """A 4-block chain, its first two blocks in memory, its last two on disk, then kill -9.
    With `pin_tier`: pinned (a prefix pin, kept at that tier or faster, as `kvctl pin
    --min-tier disk`), the pin table saved next to the slab (as the agent's pin-saver does)."""
    pool = make_pool(d, cpu_blocks=8)
    engine = make_engine(pool)
    toks, data = tokens(4), kv(4, seed=7)
    engine.store(SPEC.model_id, toks, data)
    hs = hashes(engine, toks)
    pins = [AgentPin("keep", int(pin_tier), 0.0, "", frozenset(hs), "v1")] if pin_tier else []
    with pool.lock:
        for pin in pins:
            pool.pins.add(pin)
    assert pool.move_block(hs[3], Tier.DISK).ok and pool.move_block(hs[2], Tier.DISK).ok
    PinFile(d).save(pins, time.monotonic(), time.time())
    disk_of(pool).close()  # kill -9: the CPU tier (hs[0], hs[1]) is gone
    return toks, data, hs


def test_pinned_parked_blocks_are_not_freed_to_make_room(tmp_path):
    """A pinned tail found on disk after a kill -9 waits for its prefix (parked), and
    pins.json brings its pin back; the first store that wanted disk room freed it anyway
    (a review)."""
    d = tmp_path / "disk"
    toks, data, hs = _crash_with_tail_on_disk(d)
    probe = DiskTier(tmp_path / "probe", 1 << 20)
    footprint = probe.footprint(BLOCK_BYTES)
    probe.close()
    # the restart as kvcp-agent does it: scan, recover, then the pins of pins.json
    agent = Agent(
        AgentConfig(
            agent_id="r",
            models=[SPEC],
            cpu_capacity_bytes=2 * BLOCK_BYTES,
            disk_dir=str(d),
            disk_capacity_bytes=4 * footprint,
        )
    )
    try:
        pool = agent.pool
        assert pool.num_parked_blocks == 2
        assert "keep" in pool.pins.pins  # the pin came back from pins.json
        # an engine stores something else: the disk tier needs room
        agent.engine.store(SPEC.model_id, tokens(4, start=70_000), kv(4, seed=5))
        assert pool.num_parked_blocks == 2, "pinned parked blocks were freed to make room for unpinned ones"
    finally:
        agent.stop()  # closes its disk tier and frees its transfer engine


def test_pinned_parked_blocks_are_not_freed_when_parking_expires(tmp_path):
    """... nor after PARKED_SECONDS, while the pin holds."""
    d = tmp_path / "disk"
    toks, data, hs = _crash_with_tail_on_disk(d)
    disk2 = DiskTier(d, 1 << 20)
    pool2 = BlockPool([MemoryTier(Tier.CPU, 8 * BLOCK_BYTES, BLOCK_BYTES, device="cpu"), disk2], [SPEC])
    found, _ = disk2.scan()
    pool2.recover(disk2, found)
    for pin in PinFile(d).load():
        pool2.pins.add(pin)
    pool2._parked_until = time.monotonic() - 1.0  # PARKED_SECONDS passed
    freed = pool2.free_parked(expired_only=True)
    assert freed == 0 and pool2.num_parked_blocks == 2, f"{freed} pinned parked blocks freed"
    disk2.close()


def test_a_cleanup_after_a_restart_also_removes_parked_blocks(tmp_path):
    """`kvctl cleanup --older-than 0` (or of a namespace) right after a restart freed what
    it found; the parked blocks were not looked at, and came back (adopted, served) as soon
    as an engine stored their prefix again (a review). They count in what it freed."""
    d = tmp_path / "disk"
    toks, data, hs = _crash_with_tail_on_disk(d, pin_tier=None)
    disk2 = DiskTier(d, 1 << 20)
    pool2 = BlockPool([MemoryTier(Tier.CPU, 8 * BLOCK_BYTES, BLOCK_BYTES, device="cpu"), disk2], [SPEC])
    found, _ = disk2.scan()
    pool2.recover(disk2, found)
    assert pool2.num_parked_blocks == 2
    time.sleep(0.05)
    result = pool2.cleanup(0.0)  # every unpinned block, whatever its age
    engine2 = make_engine(pool2)
    stored = engine2.store(SPEC.model_id, toks[: 2 * SPEC.block_size], data[:2])  # the prefix is recomputed
    came_back = [h for h in hs[2:] if h in pool2.blocks]
    assert result.num_blocks == 2 and not came_back, (
        f"cleanup freed {result.num_blocks} blocks, yet {len(came_back)} blocks it should have removed "
        f"came back from disk when their prefix was stored (stored={stored})"
    )
    disk2.close()


def _restart(d):
    """The restart's scan and recovery, then the pins of pins.json, as kvcp-agent does."""
    disk2 = DiskTier(d, 1 << 20)
    pool2 = BlockPool([MemoryTier(Tier.CPU, 8 * BLOCK_BYTES, BLOCK_BYTES, device="cpu"), disk2], [SPEC])
    found, _ = disk2.scan()
    pool2.recover(disk2, found)
    with pool2.lock:
        for pin in PinFile(d).load():
            pool2.pins.add(pin)
    return pool2, disk2


def test_a_cleanup_counts_the_pinned_parked_blocks_it_skipped(tmp_path):
    """A cleanup skips pinned parked blocks and counts them as skipped, as it counts
    pinned held ones (they were neither freed nor counted: `kvctl cleanup` said 0 pinned
    blocks skipped while a pin kept two on disk)."""
    d = tmp_path / "disk"
    _crash_with_tail_on_disk(d)
    pool2, disk2 = _restart(d)
    try:
        time.sleep(0.05)
        result = pool2.cleanup(0.0, dry_run=True)
        assert result.num_skipped_pinned_blocks == 2 and result.num_blocks == 0, result
        result = pool2.cleanup(0.0)
        assert result.num_skipped_pinned_blocks == 2 and pool2.num_parked_blocks == 2, result
    finally:
        disk2.close()


def test_room_making_does_not_rescan_parked_blocks_all_pinned_until_a_pin_changes(tmp_path):
    """Room-making frees parked blocks first; when a scan found every one pinned, later
    ones skip the scan (it ran under the pool lock, over every parked block, once per
    block stored) until a pin or the parked set changes, or a pin's expiry passes."""
    d = tmp_path / "disk"
    _crash_with_tail_on_disk(d)
    pool2, disk2 = _restart(d)
    try:
        scans = []
        real = pool2._free_parked_where

        def counted(*args, **kwargs):
            scans.append(1)
            return real(*args, **kwargs)

        pool2._free_parked_where = counted
        assert pool2.free_parked(Tier.DISK) == 0 and len(scans) == 1
        assert pool2.free_parked(Tier.DISK) == 0 and len(scans) == 1, "scanned again with nothing changed"
        with pool2.lock:
            pool2.pins.add(AgentPin("short", int(Tier.DISK), time.monotonic() + 0.2, "other-ns"))
        assert pool2.free_parked(Tier.DISK) == 0 and len(scans) == 2  # a pin was added
        assert pool2.free_parked(Tier.DISK) == 0 and len(scans) == 2
        time.sleep(0.25)  # the short pin's expiry passed: the answer may differ
        assert pool2.free_parked(Tier.DISK) == 0 and len(scans) == 3
        with pool2.lock:
            pool2.pins.remove("keep")
        assert pool2.free_parked(Tier.DISK) == 2 and pool2.num_parked_blocks == 0, "unpinned parked blocks stayed"
    finally:
        disk2.close()


def test_another_agents_disk_dir_is_said_and_its_pins_are_not_loaded(tmp_path, caplog):
    """An agent started on the directory another agent left (a wrong --disk-dir, a volume
    moved to another pod) adopted its blocks and enforced its pins without a word (a
    review). The blocks are content-addressed and checked: kept; the pins were the other
    agent's: not loaded, then or at the next start; and it is said."""
    d = tmp_path / "disk"
    config = AgentConfig(
        agent_id="gpu-0", models=[SPEC], cpu_capacity_bytes=2 * BLOCK_BYTES, disk_dir=str(d), transfer_engine="none"
    )
    first = Agent(config)
    first.engine.store(SPEC.model_id, tokens(5), kv(5))
    PinFile(d).save([AgentPin("gpu0-only", 3, 0.0, "", frozenset({b"\x01" * 16}), "v")], time.monotonic(), time.time())
    first.disk.close()
    with caplog.at_level("WARNING"):
        other = Agent(dataclasses.replace(config, agent_id="gpu-1", cpu_capacity_bytes=4 * BLOCK_BYTES))
    try:
        assert "was used by agent 'gpu-0'" in caplog.text and "pins file not loaded" in caplog.text
        assert other.pool.num_parked_blocks + len(other.pool.blocks) == 4 and not other.pool.pins.pins
    finally:
        other.disk.close()
    caplog.clear()
    with caplog.at_level("WARNING"):
        again = Agent(dataclasses.replace(config, agent_id="gpu-1", cpu_capacity_bytes=4 * BLOCK_BYTES))
    try:
        assert "was used by agent" not in caplog.text and not again.pool.pins.pins  # its own now
    finally:
        again.disk.close()
