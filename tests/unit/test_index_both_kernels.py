"""BlockIndex on both paths, the C loops and numpy's (the fallback where the kernel does
not build): longest-prefix lookup, removal, agent slots reused after a drop, and the
table's growth, whose keys move a few buckets at a time."""

from __future__ import annotations

import random
import shutil

import numpy as np
import pytest

from controlplane.core import index as index_mod
from controlplane.core.index import AgentMatch, BlockIndex
from protos import native
from protos.block_hash import hash_prefix, split_hashes
from protos.tier import Tier
from tests.helpers import reference_lookup

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


def random_keys(rng: random.Random, n: int) -> list[bytes]:
    return [rng.randbytes(16) for _ in range(n)]


@PATHS
def test_a_growth_moves_the_table_a_few_buckets_at_a_time_and_every_key_stays_found(use_kernel):
    """The add that grows the table moves only its own keys' buckets and a few more; the
    old table serves the rest until later adds have moved them all, and no key is lost or
    doubled on the way (each probe moves its key's buckets first)."""
    rng = random.Random(3)
    idx = BlockIndex(use_kernel=use_kernel)
    held = random_keys(rng, 90)
    idx.add("a", held, Tier.CPU)
    while idx._moved is None:  # until an add starts a growth
        more = random_keys(rng, 8)
        idx.add("a", more, Tier.CPU)
        held += more
    old_buckets = len(idx._moved)
    assert old_buckets >= 16 and int(idx._moved.sum()) < old_buckets, "the growth moved every bucket at once"
    assert idx._nb == 2 * old_buckets and idx._old_tags is not None
    # mid-growth: lookups, holders, tier changes and removals see every key once
    assert idx.lookup(held[:5]) == [AgentMatch("a", 5, bytes([Tier.CPU] * 5))]
    assert all(idx.holders(h) == {"a": Tier.CPU} for h in held)
    gone, held = held[:10], held[10:]
    idx.remove("a", gone)
    idx.add("b", held[:20], Tier.GPU)
    assert idx.num_blocks == len(held) and idx.num_agent_blocks("a") == len(held)
    assert all(not idx.holders(h) for h in gone)
    while idx._moved is not None:  # later adds move the rest; then the old table goes
        more = random_keys(rng, 4)
        idx.add("c", more, Tier.DISK)
        held += more
    assert idx._old_tags is None and idx._old_ents is None
    assert idx.num_blocks == len(held)
    assert all(a in idx.holders(h) for h in held for a in ("a", "b", "c") if h in idx.agent_blocks(a))
    assert sum(idx.num_agent_blocks(a) for a in ("a", "b", "c")) == idx.num_replicas == len(held) + 20
    occupied = idx._tags_flat != 0
    assert int(occupied.sum()) == idx.num_blocks  # each key in one slot: none moved twice, none lost
    assert len(set(idx._ents_flat[occupied].tolist())) == idx.num_blocks


@PATHS
def test_a_batch_larger_than_the_table_finishes_one_growth_and_starts_another(use_kernel):
    rng = random.Random(5)
    idx = BlockIndex(use_kernel=use_kernel)
    first = random_keys(rng, 100)
    idx.add("a", first, Tier.CPU)
    while idx._moved is None:
        idx.add("a", random_keys(rng, 8), Tier.CPU)
    big = random_keys(rng, 20 * idx._nb * 8)  # several doublings' worth in one call
    idx.replace_agent_packed("b", [(b"".join(big), int(Tier.GPU))])
    assert idx.num_agent_blocks("b") == len(big) and idx.unplaced_total == 0
    assert all(idx.holders(h) == {"a": Tier.CPU} for h in first)
    assert idx.lookup(big[:50]) == [AgentMatch("b", 50, bytes([Tier.GPU] * 50))]


def test_both_paths_give_the_same_answers_through_many_growths(monkeypatch):
    """A randomized differential run: the C loops and numpy's, fed the same calls, against
    a dict reference, checked while growths are under way (lookups, holders, parents,
    removals and whole inventories landing in a table half moved)."""
    monkeypatch.setattr(index_mod, "_MOVE_PER_KEY", 1)  # growths last more calls
    rng = random.Random(11)
    pool = random_keys(rng, 30_000)
    parent = {h: rng.choice(pool) for h in pool}
    paths = [BlockIndex(use_kernel=True), BlockIndex(use_kernel=False)]
    if shutil.which("cc") and native.enabled("KVCP_INDEX_KERNEL"):
        assert paths[0]._lib is not None, "the C loops did not build (see the log)"
    ref: dict[str, dict[bytes, int]] = {}
    agents = [f"a{i}" for i in range(5)]
    told: set[bytes] = set()  # blocks whose parent the index was told (and still holds)
    mid_growth = 0
    for step in range(1000):
        a = rng.choice(agents)
        r = rng.random()
        if r < 0.6:
            hs = [rng.choice(pool) for _ in range(rng.randint(1, 120))]
            t = rng.choice(list(Tier))
            for idx in paths:
                idx.add(a, b"".join(hs), t, b"".join(parent[h] for h in hs))
            ref.setdefault(a, {}).update({h: int(t) for h in hs})
            told.update(hs)
        elif r < 0.85:
            hs = [rng.choice(pool) for _ in range(rng.randint(1, 100))]
            for idx in paths:
                idx.remove(a, b"".join(hs))
            for h in hs:
                ref.get(a, {}).pop(h, None)
        elif r < 0.9:
            for idx in paths:
                assert idx.drop_agent(a) == len(ref.get(a, {}))
            ref.pop(a, None)
        else:
            blocks = {rng.choice(pool): int(rng.choice(list(Tier))) for _ in range(rng.randint(0, 300))}
            for idx in paths:
                idx.replace_agent(a, blocks)
            ref[a] = blocks
        held_anywhere = set().union(*ref.values())
        told &= held_anywhere  # a block nobody holds is forgotten, parent and all
        growing = any(idx._moved is not None for idx in paths)
        if step % 20 and not growing:  # every check while a growth is under way
            continue
        mid_growth += growing
        for idx in paths:
            assert idx.num_blocks == len(held_anywhere)
            assert idx.num_replicas == sum(len(b) for b in ref.values())
        for h in rng.sample(pool, 30):
            want = {x: Tier(b[h]) for x, b in ref.items() if h in b}
            assert [idx.holders(h) for idx in paths] == [want, want]
            known = (parent[h] if h in told else bytes(16)) if want else None
            assert [idx.parent_of(h) for idx in paths] == [known, known]
        for x in agents:
            assert [idx.agent_blocks(x) for idx in paths] == [ref.get(x, {})] * 2
        for _ in range(3):
            owner = rng.choice(agents)
            chain = list(ref.get(owner, {}))[:20] + [rng.choice(pool)]
            got = [idx.lookup(b"".join(chain)) for idx in paths]
            assert got[0] == got[1] == reference_lookup(ref, chain)
    assert mid_growth >= 10, "no check fell during a growth: the test checks nothing new"


class _FailingNumpy:
    """numpy as controlplane.core.index sees it, whose `fail_at`-th zeros, empty or
    nonzero call while armed raises MemoryError: an allocation that runs out of memory
    part way through a growth of the table, of the entry columns, or a bucket's move."""

    def __init__(self, fail_at: int) -> None:
        self.fail_at, self.calls, self.armed, self.failed = fail_at, 0, False, 0

    def __getattr__(self, name: str):
        return getattr(np, name)

    def _count(self) -> None:
        if self.armed:
            self.calls += 1
            if self.calls == self.fail_at:
                self.failed += 1
                raise MemoryError("out of memory (test)")

    def zeros(self, *args, **kwargs):
        self._count()
        return np.zeros(*args, **kwargs)

    def empty(self, *args, **kwargs):
        self._count()
        return np.empty(*args, **kwargs)

    def nonzero(self, *args, **kwargs):
        self._count()
        return np.nonzero(*args, **kwargs)


@PATHS
@pytest.mark.parametrize("fail_at", [1, 2, 3, 4, 6])
def test_an_update_out_of_memory_part_way_leaves_the_index_consistent(use_kernel, fail_at, monkeypatch):
    """The update that ran out of memory fails alone (the agent's stream sends it again);
    the index it leaves answers every key it held, takes the update again, and the C
    loops never see a table or column smaller than the sizes they are given."""
    monkeypatch.setattr(index_mod, "_MOVE_PER_KEY", 1)  # growths last more calls
    failing = _FailingNumpy(fail_at)
    monkeypatch.setattr(index_mod, "np", failing)
    rng = random.Random(fail_at)
    pool = random_keys(rng, 6000)
    idx = BlockIndex(use_kernel=use_kernel)
    ref: dict[str, dict[bytes, int]] = {}
    for step in range(60):
        if step % 4 == 3:
            blocks = {h: int(Tier.DISK) for h in rng.sample(pool, rng.randint(0, 800))}

            def update(blocks=blocks):
                idx.replace_agent("b", blocks)
                ref["b"] = blocks
        else:
            hs = rng.sample(pool, rng.randint(1, 250))

            def update(hs=hs):
                idx.add("a", hs, Tier.CPU)
                ref.setdefault("a", {}).update(dict.fromkeys(hs, int(Tier.CPU)))

        failing.armed, failing.calls = True, 0
        try:
            update()
        except MemoryError:
            failing.armed = False
            update()  # sent again
        failing.armed = False
        held = set().union(*ref.values())
        assert idx.num_blocks == len(held)
        assert all(idx.agent_blocks(a) == blocks for a, blocks in ref.items())
        for h in rng.sample(sorted(held), min(40, len(held))):
            assert idx.holders(h) == {a: Tier(b[h]) for a, b in ref.items() if h in b}
    assert failing.failed >= 10, "few updates ran out of memory: the test checks little"
