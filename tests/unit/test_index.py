"""BlockIndex: replicas per block and per agent, and the longest-prefix walk."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from controlplane.core.index import AgentMatch, BlockIndex
from protos.block_hash import hash_prefix, split_hashes
from protos.tier import Tier
from tests.helpers import reference_lookup


def chain(n: int, seed: int = 0) -> list[bytes]:
    return split_hashes(hash_prefix("m", [seed * 1000 + i for i in range(n)], 1))


def test_add_and_holders():
    idx = BlockIndex()
    hs = chain(3)
    idx.add("a", hs, Tier.GPU)
    idx.add("b", hs[:1], Tier.CPU)
    assert idx.holders(hs[0]) == {"a": Tier.GPU, "b": Tier.CPU}
    assert idx.holders(hs[2]) == {"a": Tier.GPU}
    assert idx.holders(b"\x09" * 16) == {}
    assert idx.num_blocks == 3
    assert idx.num_replicas == 4
    assert idx.num_agent_blocks("a") == 3
    assert sorted(idx.agents()) == ["a", "b"]


def test_add_again_changes_tier():
    idx = BlockIndex()
    hs = chain(2)
    idx.add("a", hs, Tier.GPU)
    idx.add("a", hs[1:], Tier.DISK)
    assert idx.agent_blocks("a") == {hs[0]: int(Tier.GPU), hs[1]: int(Tier.DISK)}
    assert idx.num_replicas == 2
    assert idx.lookup(hs)[0].tier_list() == [Tier.GPU, Tier.DISK]


def test_remove():
    idx = BlockIndex()
    hs = chain(3)
    idx.add("a", hs, Tier.CPU)
    idx.add("b", hs, Tier.CPU)
    idx.remove("a", [hs[2], b"\x07" * 16])  # an unknown hash is ignored
    assert idx.holders(hs[2]) == {"b": Tier.CPU}
    idx.remove("b", [hs[2]])
    assert idx.holders(hs[2]) == {}
    assert idx.num_blocks == 2
    idx.remove("nobody", hs)
    assert idx.num_replicas == 4


def test_drop_agent():
    idx = BlockIndex()
    hs = chain(3)
    idx.add("a", hs, Tier.CPU)
    idx.add("b", hs[:1], Tier.GPU)
    assert idx.drop_agent("a") == 3
    assert idx.drop_agent("a") == 0
    assert idx.num_blocks == 1
    assert idx.holders(hs[0]) == {"b": Tier.GPU}
    assert idx.agents() == ["b"]
    assert idx.agent_blocks("a") == {}


def test_replace_agent():
    idx = BlockIndex()
    old, new = chain(3, seed=1), chain(2, seed=2)
    idx.add("a", old, Tier.CPU)
    idx.add("b", old[:1], Tier.CPU)
    idx.replace_agent("a", {old[0]: int(Tier.GPU), new[0]: int(Tier.DISK), new[1]: int(Tier.DISK)})
    assert idx.agent_blocks("a") == {old[0]: int(Tier.GPU), new[0]: int(Tier.DISK), new[1]: int(Tier.DISK)}
    assert idx.holders(old[0]) == {"a": Tier.GPU, "b": Tier.CPU}
    assert idx.holders(old[1]) == {}
    assert idx.num_blocks == 3
    idx.replace_agent("a", {})
    assert idx.agent_blocks("a") == {}
    assert idx.num_blocks == 1


def test_lookup_empty():
    idx = BlockIndex()
    assert idx.lookup([]) == []
    assert idx.lookup(chain(3)) == []
    idx.add("a", chain(3)[1:], Tier.GPU)  # holds blocks 1.. but not block 0
    assert idx.lookup(chain(3)) == []


def test_longest_prefix_per_agent_with_overlap():
    idx = BlockIndex()
    hs = chain(6)
    idx.add("a", hs[:2], Tier.GPU)
    idx.add("b", hs[:5], Tier.CPU)
    idx.add("c", hs[:2], Tier.DISK)
    idx.add("c", hs[2:4], Tier.CPU)
    assert idx.lookup(hs) == [
        AgentMatch("b", 5, bytes([Tier.CPU] * 5)),
        AgentMatch("c", 4, bytes([Tier.DISK, Tier.DISK, Tier.CPU, Tier.CPU])),
        AgentMatch("a", 2, bytes([Tier.GPU] * 2)),
    ]
    assert idx.lookup(hs[:1]) == [
        AgentMatch("a", 1, bytes([Tier.GPU])),
        AgentMatch("b", 1, bytes([Tier.CPU])),
        AgentMatch("c", 1, bytes([Tier.DISK])),
    ]


def test_hole_in_chain_stops_that_agent():
    idx = BlockIndex()
    hs = chain(5)
    idx.add("a", [hs[0], hs[1], hs[3], hs[4]], Tier.GPU)  # block 2 missing
    idx.add("b", hs, Tier.CPU)
    matches = idx.lookup(hs)
    assert [(m.agent_id, m.num_hit_blocks) for m in matches] == [("b", 5), ("a", 2)]


def test_agent_joining_mid_chain_is_not_matched():
    idx = BlockIndex()
    hs = chain(4)
    idx.add("a", hs[:2], Tier.GPU)
    idx.add("b", hs[1:], Tier.GPU)  # has blocks 1..3 but not block 0
    assert [(m.agent_id, m.num_hit_blocks) for m in idx.lookup(hs)] == [("a", 2)]


def test_lookup_ties_ordered_by_agent_id():
    idx = BlockIndex()
    hs = chain(2)
    for a in ["z", "m", "a"]:
        idx.add(a, hs, Tier.CPU)
    assert [m.agent_id for m in idx.lookup(hs)] == ["a", "m", "z"]


def test_lookup_ties_go_to_the_copy_in_faster_tiers_first():
    """Of two agents holding as long a prefix, the one that loads it sooner leads (it
    went by id alone: a copy on disk was chosen over the same blocks in CPU memory)."""
    idx = BlockIndex()
    hs = chain(4)
    idx.add("a", hs, Tier.DISK)
    idx.add("b", hs, Tier.CPU)
    idx.add("c", hs[:2], Tier.GPU)
    idx.add("c", hs[2:], Tier.DISK)
    assert [m.agent_id for m in idx.lookup(hs)] == ["b", "c", "a"]  # CPU×4 (8), GPU×2+DISK×2 (8, then id), DISK×4
    idx.add("z", hs + chain(1, seed=5), Tier.DISK)
    assert idx.lookup(hs + chain(1, seed=5))[0].agent_id == "z"  # longer first, whatever its tiers


# ---- consistency against a reference model ----------------------------------------

HASHES = chain(8, seed=9)
AGENTS = ["a0", "a1", "a2"]
hash_lists = st.lists(st.sampled_from(HASHES), max_size=6)
tiers = st.sampled_from(list(Tier))


class IndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.idx = BlockIndex()
        self.ref: dict[str, dict[bytes, int]] = {}

    @rule(agent=st.sampled_from(AGENTS), hs=hash_lists, tier=tiers)
    def add(self, agent, hs, tier):
        self.idx.add(agent, hs, tier)
        self.ref.setdefault(agent, {}).update({h: int(tier) for h in hs})

    @rule(agent=st.sampled_from(AGENTS), hs=hash_lists)
    def remove(self, agent, hs):
        self.idx.remove(agent, hs)
        for h in hs:
            self.ref.get(agent, {}).pop(h, None)

    @rule(agent=st.sampled_from(AGENTS))
    def drop(self, agent):
        dropped = self.idx.drop_agent(agent)
        assert dropped == len(self.ref.pop(agent, {}))

    @rule(agent=st.sampled_from(AGENTS), blocks=st.dictionaries(st.sampled_from(HASHES), tiers.map(int), max_size=6))
    def replace(self, agent, blocks):
        self.idx.replace_agent(agent, dict(blocks))
        self.ref[agent] = dict(blocks)

    @invariant()
    def maps_agree_with_reference(self):
        holders_ref: dict[bytes, dict[str, int]] = {}
        for a, blocks in self.ref.items():
            assert self.idx.agent_blocks(a) == blocks
            for h, t in blocks.items():
                holders_ref.setdefault(h, {})[a] = t
        for h in HASHES:
            assert self.idx.holders(h) == {a: Tier(t) for a, t in holders_ref.get(h, {}).items()}
        assert self.idx.num_blocks == len(holders_ref)
        assert self.idx.num_replicas == sum(len(b) for b in self.ref.values())
        assert self.idx.num_replicas == sum(len(self.idx.holders(h)) for h in HASHES)
        # the internal maps mirror each other and keep no empty holder sets
        by_agent = {a: m for a, m in self.idx._by_agent.items() if m}
        mirrored: dict[bytes, dict[str, int]] = {}
        for a, m in by_agent.items():
            for h, t in m.items():
                mirrored.setdefault(h, {})[a] = t
        assert self.idx._replicas == mirrored

    @invariant()
    def lookup_agrees_with_reference(self):
        assert self.idx.lookup(HASHES) == reference_lookup(self.ref, HASHES)


IndexMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)
TestIndexMachine = IndexMachine.TestCase


# ---- hashes built to collide (agents and engines choose the digests they report) ------
_M64 = (1 << 64) - 1
_F1, _F2, _C1 = 0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53, 0x9E3779B97F4A7C15


def _fmix(h: int) -> int:
    h ^= h >> 33
    h = h * _F1 & _M64
    h ^= h >> 33
    h = h * _F2 & _M64
    return h ^ (h >> 33)


def _unfmix(h: int) -> int:  # x ^ (x >> 33) undoes itself on 64 bits
    h ^= h >> 33
    h = h * pow(_F2, -1, 1 << 64) & _M64
    h ^= h >> 33
    h = h * pow(_F1, -1, 1 << 64) & _M64
    return h ^ (h >> 33)


def _old_mix_collisions(n: int) -> list[bytes]:
    """Keys the unseeded mix, (k0 ^ k1 * C1) * C2, sent to one word: each took the same
    two buckets at every table size."""
    out = []
    for k1 in range(1, n + 1):
        k0 = 0x1234 ^ (k1 * _C1 & _M64)
        out.append(k0.to_bytes(8, "little") + k1.to_bytes(8, "little"))
    return out


def _collisions(idx: BlockIndex, n: int) -> list[bytes]:
    """Keys that share one hash word under this index's seed (which an attacker lacks)."""
    s0, s1 = (int(v) for v in idx._seed)
    out = []
    for k1 in range(1, n + 1):
        k0 = s0 ^ _unfmix(0x5EED ^ (_fmix(k1 ^ s1) * _C1 & _M64))
        out.append(k0.to_bytes(8, "little") + k1.to_bytes(8, "little"))
    return out


@pytest.mark.parametrize("use_kernel", [True, False])
def test_keys_built_for_the_unseeded_mix_no_longer_collide(use_kernel):
    idx = BlockIndex(use_kernel=use_kernel)
    keys = _old_mix_collisions(64)
    idx.add("a", keys, Tier.CPU)
    assert idx.num_agent_blocks("a") == 64 and idx.unplaced_total == 0
    assert all(idx.holders(k) == {"a": Tier.CPU} for k in keys)
    assert idx._nb * 8 < 64 * 1024  # the table did not grow for them


@pytest.mark.parametrize("use_kernel", [True, False])
@pytest.mark.parametrize("how", ["add", "replace"])
def test_a_collision_flood_stops_growing_and_leaves_the_rest_served(use_kernel, how):
    idx = BlockIndex(use_kernel=use_kernel)
    good = chain(50)
    idx.add("b", good, Tier.GPU)
    flood = _collisions(idx, 40)  # 16 fit in their two buckets; the rest cannot, at any size
    if how == "add":
        idx.add("a", flood, Tier.CPU)
    else:
        idx.replace_agent_packed("a", [(b"".join(flood), Tier.CPU)])
    placed = idx.num_agent_blocks("a")  # their two buckets' 16 slots, less any good key's there
    assert 8 <= placed <= 16 and idx.unplaced_total == 40 - placed
    assert idx._nb * 8 <= 16 * 1024 * 2  # bounded, not doubled until memory runs out
    assert idx.lookup(good)[0].num_hit_blocks == 50  # everyone else is served as before
    assert sum(bool(idx.holders(k)) for k in flood) == placed
