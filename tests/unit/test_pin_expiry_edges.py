"""Pins at their edges: no pin outlives its TTL by an instant (control plane and agent),
several pins on one block hold it at the fastest tier any of them names (the agent's pin
table and the block pool over real memory slabs), and a quota stops counting a pin at
its expiry."""

from __future__ import annotations

from agent.core.block_pool import BlockPool
from agent.core.pins import AgentPin, PinTable
from agent.store.memory_tier import MemoryTier
from controlplane.core.pins import new_pin, pinned_bytes_of
from protos.tier import Tier
from tests.unit.tiny_blocks import PAGE, SPEC, chain, insert


def mem(kind: Tier, num_pages: int) -> MemoryTier:
    return MemoryTier(kind, num_pages * PAGE, PAGE, device="cpu")


# ---- TTL: not an instant longer ---------------------------------------------------------
def test_a_control_plane_pin_stops_at_its_expiry_instant():
    p = new_pin("kb", "m", b"\x01" * 16, Tier.CPU, 60.0, "", 0, "", 100, now=1000.0)
    assert p.expires_unix_seconds == 1060.0
    assert p.active(1000.0) and p.active(1059.999)
    assert not p.active(1060.0), "a pin outlived its TTL"
    # and its bytes leave the namespace's quota at the same instant
    assert pinned_bytes_of([p], "kb", 1059.999, lambda agent: 0) == 100
    assert pinned_bytes_of([p], "kb", 1060.0, lambda agent: 0) == 0


def test_an_agent_pin_stops_at_its_expiry_instant():
    h = b"\x02" * 16
    table = PinTable(clock=lambda: 0.0)
    table.add(AgentPin("p", int(Tier.CPU), 50.0, block_hashes=frozenset({h})))
    assert table.tier_of(h, "", now=49.999) == Tier.CPU
    assert table.tier_of(h, "", now=50.0) == 0
    assert table.expire(now=50.0) == ["p"]


# ---- several pins on one block: the fastest tier holds ---------------------------------
def test_two_pins_on_one_block_hold_it_at_the_faster_tier_in_either_order():
    h = b"\x03" * 16
    for first, second in ((Tier.GPU, Tier.DISK), (Tier.DISK, Tier.GPU)):
        table = PinTable(clock=lambda: 0.0)
        table.add(AgentPin("p1", int(first), 0.0, block_hashes=frozenset({h})))
        table.add(AgentPin("p2", int(second), 0.0, block_hashes=frozenset({h})))
        assert table.tier_of(h, "") == Tier.GPU
    # a prefix pin and a namespace pin together
    table = PinTable(clock=lambda: 0.0)
    table.add(AgentPin("ns", int(Tier.CPU), 0.0, namespace="kb"))
    table.add(AgentPin("p", int(Tier.DISK), 0.0, block_hashes=frozenset({h})))
    assert table.tier_of(h, "kb") == Tier.CPU
    assert table.tier_of(h, "other") == Tier.DISK
    # the faster one expired: the slower one holds on its own
    table.add(AgentPin("fast", int(Tier.GPU), 10.0, block_hashes=frozenset({h})))
    assert table.tier_of(h, "other", now=5.0) == Tier.GPU
    assert table.tier_of(h, "other", now=10.0) == Tier.DISK


def test_a_block_under_a_gpu_pin_and_a_disk_pin_is_not_demoted_from_gpu():
    """A full GPU tier: its LRU block carries a GPU pin and a DISK pin. The GPU pin binds,
    so the other block goes down to CPU instead."""
    pool = BlockPool([mem(Tier.GPU, 2), mem(Tier.CPU, 4)], [SPEC])
    keep, other = chain([1]), chain([2])
    insert(pool, keep)
    insert(pool, other)
    pool.pins.add(AgentPin("fast", int(Tier.GPU), 0.0, block_hashes=frozenset(keep)))
    pool.pins.add(AgentPin("slow", int(Tier.DISK), 0.0, block_hashes=frozenset(keep)))
    assert pool.pin_tier_of(keep[0]) == Tier.GPU
    pool.touch(other)  # `keep` is the GPU tier's least recently used block
    insert(pool, chain([3]))
    assert pool.tier_of(keep[0]) is Tier.GPU
    assert pool.tier_of(other[0]) is Tier.CPU


def test_a_local_pin_and_a_control_plane_pin_together_hold_at_the_faster_tier():
    pool = BlockPool([mem(Tier.GPU, 2), mem(Tier.CPU, 4)], [SPEC])
    keep = chain([1])
    insert(pool, keep)
    pool.set_pin(keep, Tier.GPU)
    pool.pins.add(AgentPin("slow", int(Tier.DISK), 0.0, block_hashes=frozenset(keep)))
    assert pool.pin_tier_of(keep[0]) == Tier.GPU
    pool.set_pin(keep, Tier.DISK)
    pool.pins.add(AgentPin("slow", int(Tier.CPU), 0.0, block_hashes=frozenset(keep)))
    assert pool.pin_tier_of(keep[0]) == Tier.CPU
