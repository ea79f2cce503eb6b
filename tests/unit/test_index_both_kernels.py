"""BlockIndex on both paths, the C loops and numpy's (the fallback where the kernel does
not build): longest-prefix lookup, removal, and agent slots reused after a drop."""

from __future__ import annotations

import pytest

from controlplane.core.index import AgentMatch, BlockIndex
from protos.block_hash import hash_prefix, split_hashes
from protos.tier import Tier

PATHS = pytest.mark.parametrize("use_kernel", [True, False], ids=["c-loops", "numpy"])


def chain(n: int, seed: int = 0) -> list[bytes]:
    return split_hashes(hash_prefix("m", [seed * 1000 + i for i in range(n)], 1))


@PATHS
def test_lookup_is_the_longest_leading_run_each_agent_holds(use_kernel):
    idx = BlockIndex(use_kernel=use_kernel)
    hs = chain(6)
    idx.add("a", hs[:2], Tier.GPU)
    idx.add("b", hs[:5], Tier.CPU)
    idx.add("c", [hs[0], hs[1], hs[3], hs[4]], Tier.DISK)  # a hole at block 2
    idx.add("d", hs[1:], Tier.GPU)  # everything but the first block
    assert idx.lookup(hs) == [
        AgentMatch("b", 5, bytes([Tier.CPU] * 5)),
        AgentMatch("a", 2, bytes([Tier.GPU] * 2)),
        AgentMatch("c", 2, bytes([Tier.DISK] * 2)),
    ]
    # every block of the prompt known to the index, and held whole by one agent
    idx.add("e", hs, Tier.CPU)
    assert idx.lookup(hs)[0] == AgentMatch("e", 6, bytes([Tier.CPU] * 6))
    # a block nobody holds ends every match there, though later ones are held
    other = chain(3, seed=7)
    idx.add("f", [other[0], other[2]], Tier.GPU)
    assert idx.lookup(other) == [AgentMatch("f", 1, bytes([Tier.GPU]))]


@PATHS
def test_removing_blocks_an_agent_does_not_hold_changes_nothing(use_kernel):
    idx = BlockIndex(use_kernel=use_kernel)
    hs = chain(4)
    idx.add("a", hs[:2], Tier.CPU)
    idx.add("b", hs, Tier.GPU)
    idx.remove("a", hs)  # a holds only the first two
    assert idx.num_agent_blocks("a") == 0 and idx.agent_blocks("a") == {}
    assert idx.num_agent_blocks("b") == 4 and idx.num_replicas == 4 and idx.num_blocks == 4
    idx.remove("a", hs)  # again: nothing held, nothing counted
    assert idx.num_agent_blocks("b") == 4 and idx.lookup(hs) == [AgentMatch("b", 4, bytes([Tier.GPU] * 4))]
    idx.add("a", hs[:1], Tier.DISK)
    assert idx.num_agent_blocks("a") == 1
    assert idx.drop_agent("a") == 1


@PATHS
def test_an_agent_in_a_reused_slot_ties_by_its_own_id(use_kernel):
    """Ties of a lookup go by agent id: a new agent that takes a dropped agent's slot is
    ranked by its own id, not the one that held the slot before."""
    idx = BlockIndex(use_kernel=use_kernel)
    hs = chain(2)
    for a in ("a", "m"):
        idx.add(a, hs, Tier.CPU)
    assert [m.agent_id for m in idx.lookup(hs)] == ["a", "m"]
    idx.drop_agent("a")
    idx.add("z", hs, Tier.CPU)  # takes slot 0, which ranked first as "a"
    assert [m.agent_id for m in idx.lookup(hs)] == ["m", "z"]


@PATHS
def test_a_block_an_agent_holds_again_keeps_its_first_store_stamp_per_agent(use_kernel):
    """Stamps say when a block was newly held: a tier change is not a new store."""
    idx = BlockIndex(use_kernel=use_kernel)
    hs = chain(1)
    idx.set_clock(100.0)
    idx.add("a", hs, Tier.GPU)
    idx.set_clock(200.0)
    idx.add("a", hs, Tier.CPU)  # the same agent moves it: not newly held
    assert abs(float(idx.agent_chains("a").stored_seconds[0]) - 100.0) < 2.0
    idx.add("b", hs, Tier.DISK)  # another agent newly holds it: stamped now
    assert abs(float(idx.agent_chains("b").stored_seconds[0]) - 200.0) < 2.0
