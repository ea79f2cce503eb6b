"""BlockPool over real MemoryTier slabs (tiny CPU tensors): storing chains, LRU leaf
eviction, demotion between tiers, pins and references, and the event journal."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.core.block_pool import BlockPool
from agent.core.journal import REMOVED, STORED
from agent.store.memory_tier import MemoryTier
from protos.block_hash import ROOT_PARENT_HASH, hash_prefix, split_hashes
from protos.tier import Tier

SLOT = 16  # bytes per block: the block's own digest, so contents are easy to check


def mem(kind: Tier, num_slots: int) -> MemoryTier:
    return MemoryTier(kind, num_slots * SLOT, SLOT, device="cpu")


def chain(tokens) -> list[bytes]:
    return split_hashes(hash_prefix("m", list(tokens), 1))


def payload(h: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(h), dtype=torch.uint8)


def insert(pool: BlockPool, hs: list[bytes], check: bool = True) -> tuple[int, int]:
    def write(i: int, store, slot: int) -> None:
        if check:
            check_invariants(pool, mid_write=True)
        store.write(slot, payload(hs[i]))

    return pool.insert_chain("m", hs, SLOT, write)


def held(pool: BlockPool) -> set[bytes]:
    return set(pool.blocks)


def check_invariants(pool: BlockPool, mid_write: bool = False) -> None:
    blocks = pool.blocks
    for h, meta in blocks.items():
        assert meta.block_hash == h
        # prefix-closed: the parent is held wherever the block is
        assert meta.parent_hash == ROOT_PARENT_HASH or meta.parent_hash in blocks, "a held block lost its parent"
        ready_children = sum(1 for m in blocks.values() if m.parent_hash == h and m.ready)
        assert meta.num_children == ready_children
        assert meta.ref_count >= 0
        if not mid_write:
            assert meta.ready and meta.ref_count == 0
    # slots: each held block owns one slot of its tier, none is also free, none twice
    usage = {u.tier: u for u in pool.usage()}
    for store in pool.tiers:
        used = [m.slot for m in blocks.values() if m.tier == store.tier]
        free = list(store._free)
        assert len(set(used)) == len(used), "a slot is allocated twice"
        assert len(set(free)) == len(free), "a slot is freed twice"
        assert not set(used) & set(free)
        assert sorted(used + free) == list(range(store.num_slots))
        u = usage[store.tier]
        assert u.num_blocks == len(used)
        assert u.used_bytes == len(used) * SLOT
        assert u.capacity_bytes == store.num_slots * SLOT


def replay(pool: BlockPool, state: dict[bytes, tuple[str, Tier, bytes]]) -> None:
    for batch in pool.drain_events():
        for g in batch.groups:
            hs, ps = split_hashes(bytes(g.block_hashes)), split_hashes(bytes(g.parent_hashes))
            for h, p in zip(hs, ps, strict=True):
                if batch.kind == STORED:
                    state[h] = (g.model_id, g.tier, p)
                else:
                    assert batch.kind == REMOVED
                    state.pop(h, None)


def inventory_state(pool: BlockPool) -> dict[bytes, tuple[str, Tier, bytes]]:
    _, groups = pool.inventory()
    out = {}
    for g in groups:
        for h, p in zip(split_hashes(g.block_hashes), split_hashes(g.parent_hashes), strict=True):
            out[h] = (g.model_id, g.tier, p)
    return out


# ---- storing -----------------------------------------------------------------------
def test_needs_a_tier():
    with pytest.raises(ValueError, match="at least one tier"):
        BlockPool([])


def test_insert_chain_stores_in_order_and_counts_present():
    pool = BlockPool([mem(Tier.CPU, 8)])
    hs = chain(range(5))
    order = []

    def write(i, store, slot):
        order.append(i)
        store.write(slot, payload(hs[i]))

    assert pool.insert_chain("m", hs[:3], SLOT, write) == (3, 0)
    assert order == [0, 1, 2]
    order.clear()
    assert pool.insert_chain("m", hs, SLOT, write) == (2, 3)
    assert order == [3, 4]
    assert pool.num_leading(hs) == 5
    assert pool.num_leading(hs[:2] + chain([99])) == 2
    assert [m.parent_hash for m in (pool.blocks[h] for h in hs)] == [ROOT_PARENT_HASH, *hs[:4]]
    for h in hs:
        assert bytes(pool.read(pool.blocks[h]).tolist()) == h
    check_invariants(pool)


def test_lru_evicts_leaves_first():
    pool = BlockPool([mem(Tier.CPU, 4)])
    a, b, c = chain(range(0, 2)), chain(range(10, 12)), chain(range(20, 22))
    insert(pool, a)
    insert(pool, b)
    assert insert(pool, c) == (2, 0)
    assert held(pool) == {*b, *c}
    assert pool.evictions_total == 2
    check_invariants(pool)


def test_a_parent_is_never_evicted_before_its_children():
    pool = BlockPool([mem(Tier.CPU, 2)])
    p_c = chain(range(2))
    insert(pool, p_c)
    pool.touch([p_c[1]])  # now the parent is the least recently used block
    assert pool.blocks[p_c[0]].last_access < pool.blocks[p_c[1]].last_access
    q = chain([50])
    assert insert(pool, q) == (1, 0)
    assert held(pool) == {p_c[0], q[0]}  # the child went, the parent stayed
    check_invariants(pool)


def test_shared_system_prompt_survives_while_old_leaves_go():
    pool = BlockPool([mem(Tier.CPU, 6)])
    system = list(range(3))
    requests = [chain([*system, 100 + i, 200 + i]) for i in range(10)]
    for r in requests:
        stored, present = insert(pool, r)
        assert (stored, present) == (2, 3) or r is requests[0]
        check_invariants(pool)
    assert set(requests[0][:3]) <= held(pool)
    assert set(requests[-1]) <= held(pool)
    assert not set(requests[0][3:]) & held(pool)
    assert len(pool.blocks) == 6  # full: 3 shared blocks and the most recent users' blocks


# ---- pins and references -----------------------------------------------------------
def test_pinned_blocks_are_never_evicted():
    pool = BlockPool([mem(Tier.CPU, 3)])
    pinned = chain(range(2))
    insert(pool, pinned)
    assert pool.set_pinned(pinned + chain([777]), True) == 2
    for i in range(5):
        assert insert(pool, chain([300 + i])) == (1, 0)
        assert set(pinned) <= held(pool)
        check_invariants(pool)
    pool.set_pinned(pinned, False)
    insert(pool, chain([400]))
    insert(pool, chain([401]))
    assert pinned[1] not in held(pool)


def test_everything_pinned_stores_a_partial_chain_without_corruption():
    pool = BlockPool([mem(Tier.CPU, 3)])
    first = chain(range(3))
    insert(pool, first)
    pool.set_pinned(first, True)
    events_before = pool.journal.num_pending
    assert insert(pool, chain(range(100, 104))) == (0, 0)
    check_invariants(pool)
    assert held(pool) == set(first)
    assert pool.journal.num_pending == events_before
    # a chain sharing the pinned prefix: the prefix is present, the rest has no room
    longer = chain([0, 1, 2, 3, 4])
    assert insert(pool, longer) == (0, 3)
    check_invariants(pool)
    assert pool.num_leading(longer) == 3


def test_partial_store_when_room_runs_out_mid_chain():
    pool = BlockPool([mem(Tier.CPU, 3)])
    pinned = chain([9])
    insert(pool, pinned)
    pool.set_pinned(pinned, True)
    hs = chain(range(10, 15))
    assert insert(pool, hs) == (2, 0)  # two free slots, and its own blocks cannot go
    assert pool.num_leading(hs) == 2
    check_invariants(pool)


def test_acquired_blocks_are_not_evicted_until_released():
    pool = BlockPool([mem(Tier.CPU, 2)])
    a = chain(range(2))
    insert(pool, a)
    metas = pool.acquire_chain(a + chain([5]))
    assert [m.block_hash for m in metas] == a
    assert all(m.ref_count == 1 for m in metas)
    assert insert(pool, chain([60])) == (0, 0)
    assert held(pool) == set(a)
    assert pool.drop(a[0]) is False
    pool.release_chain(metas)
    assert all(m.ref_count == 0 for m in metas)
    assert insert(pool, chain([60])) == (1, 0)
    check_invariants(pool)


def test_acquire_stops_at_the_first_missing_block():
    pool = BlockPool([mem(Tier.CPU, 4)])
    hs = chain(range(3))
    insert(pool, hs[:2])
    assert pool.acquire_chain([hs[2], hs[0]]) == []
    metas = pool.acquire_chain(hs)
    assert len(metas) == 2
    pool.release_chain(metas)
    check_invariants(pool)


def test_failed_write_is_undone():
    pool = BlockPool([mem(Tier.CPU, 4)])
    hs = chain(range(3))

    def write(i, store, slot):
        if i == 1:
            raise OSError("disk on fire")
        store.write(slot, payload(hs[i]))

    with pytest.raises(OSError, match="disk on fire"):
        pool.insert_chain("m", hs, SLOT, write)
    assert held(pool) == {hs[0]}
    check_invariants(pool)
    batches = pool.drain_events()
    assert [(b.kind, b.num_blocks) for b in batches] == [(STORED, 1)]


def test_drop_removes_descendants_first():
    pool = BlockPool([mem(Tier.CPU, 8)])
    a = chain(range(3))
    b = chain([0, 1, 50])
    insert(pool, a)
    insert(pool, b)
    pool.drain_events()
    assert pool.drop(a[1]) is True
    assert held(pool) == {a[0]}
    check_invariants(pool)
    removed = [split_hashes(bytes(g.block_hashes)) for bt in pool.drain_events() for g in bt.groups]
    flat = [h for hs in removed for h in hs]
    assert flat[-1] == a[1] and set(flat) == {a[1], a[2], b[2]}
    assert pool.drop(b"\x05" * 16) is False


# ---- tiers -------------------------------------------------------------------------
def test_full_top_tier_demotes_before_dropping():
    gpu, cpu = MemoryTier(Tier.GPU, 2 * SLOT, SLOT, device="cpu"), mem(Tier.CPU, 4)
    pool = BlockPool([cpu, gpu])  # given slowest first: the pool sorts them
    assert [t.tier for t in pool.tiers] == [Tier.GPU, Tier.CPU]
    a, b = chain(range(2)), chain(range(10, 12))
    insert(pool, a)
    assert {pool.blocks[h].tier for h in a} == {Tier.GPU}
    insert(pool, b)
    assert {pool.blocks[h].tier for h in a} == {Tier.CPU}
    assert {pool.blocks[h].tier for h in b} == {Tier.GPU}
    assert pool.demotions_total == 2 and pool.evictions_total == 0
    metas = pool.acquire_chain(a)
    assert [bytes(pool.read(m).tolist()) for m in metas] == a  # bytes preserved
    pool.release_chain(metas)
    check_invariants(pool)
    # keep going: the CPU tier fills and then drops LRU leaves
    for i in range(6):
        insert(pool, chain(range(100 + 10 * i, 102 + 10 * i)))
        check_invariants(pool)
    assert pool.evictions_total > 0
    assert len(pool.blocks) == 6
    for h, meta in pool.blocks.items():
        assert bytes(pool.read(meta).tolist()) == h


def test_journal_replay_equals_inventory():
    pool = BlockPool([MemoryTier(Tier.GPU, 3 * SLOT, SLOT, device="cpu"), mem(Tier.CPU, 3)])
    state: dict = {}
    for i in range(8):
        insert(pool, chain([0, i, i + 1]))
        replay(pool, state)
    pool.drop(chain([0, 7])[1])
    replay(pool, state)
    seq_before = pool.journal.last_seq
    seq, _ = pool.inventory()
    assert seq == seq_before
    assert state == inventory_state(pool)


def test_inventory_supersedes_pending_events():
    pool = BlockPool([mem(Tier.CPU, 4)])
    insert(pool, chain(range(2)))
    pool.drain_events()
    insert(pool, chain(range(10, 12)))
    seq, groups = pool.inventory()
    assert seq == 1
    assert pool.drain_events() == []
    assert sum(len(g.block_hashes) // 16 for g in groups) == 4


def test_a_chain_longer_than_the_top_tier_spills_to_the_lower_tier():
    """BUG: insert_chain holds a reference on every block of the chain until it returns,
    and referenced blocks can be neither demoted nor dropped; so a chain longer than the
    top tier is cut at the top tier's size although the lower tier has room."""
    pool = BlockPool([MemoryTier(Tier.GPU, 2 * SLOT, SLOT, device="cpu"), mem(Tier.CPU, 8)])
    hs = chain(range(4))
    assert insert(pool, hs) == (4, 0)
    check_invariants(pool)


def test_a_top_tier_leaf_is_dropped_when_the_lower_tier_cannot_take_a_demotion():
    """BUG: _make_room demotes when there is a lower tier and raises PoolFull when the
    lower tier cannot make room, without falling back to dropping an LRU leaf of the
    top tier; an insert then fails while unreferenced, unpinned leaves fill the top tier."""
    pool = BlockPool([MemoryTier(Tier.GPU, 2 * SLOT, SLOT, device="cpu"), mem(Tier.CPU, 1)])
    for root in (1, 2, 3):  # block [1] is demoted to the CPU tier; [2] and [3] are GPU leaves
        insert(pool, chain([root]))
    assert pool.blocks[chain([1])[0]].tier is Tier.CPU
    # extending [1]: its CPU block is referenced, so the CPU tier cannot take [2] or [3],
    # but either of them can simply be dropped from the GPU tier
    assert insert(pool, chain([1, 9])) == (1, 1)
    check_invariants(pool)


# ---- random sequences --------------------------------------------------------------
ops = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.integers(0, 3), st.lists(st.integers(0, 3), min_size=1, max_size=5)),
        st.tuples(st.just("pin"), st.integers(0, 3), st.lists(st.integers(0, 3), min_size=1, max_size=3)),
        st.tuples(st.just("unpin"), st.integers(0, 3), st.lists(st.integers(0, 3), min_size=1, max_size=3)),
        st.tuples(st.just("drop"), st.integers(0, 3), st.lists(st.integers(0, 3), min_size=1, max_size=3)),
        st.tuples(st.just("touch"), st.integers(0, 3), st.lists(st.integers(0, 3), min_size=1, max_size=4)),
    ),
    max_size=25,
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, top=st.integers(1, 4), lower=st.one_of(st.none(), st.integers(1, 5)))
def test_random_sequences_keep_the_invariants(ops, top, lower):
    tiers = [MemoryTier(Tier.GPU, top * SLOT, SLOT, device="cpu")]
    if lower is not None:
        tiers.append(mem(Tier.CPU, lower))
    pool = BlockPool(tiers)
    state: dict = {}
    for op, root, tail in ops:
        hs = chain([1000 * root, *tail])
        if op == "insert":
            stored, present = insert(pool, hs)
            assert stored + present <= len(hs)
            assert pool.num_leading(hs) >= stored + present
        elif op in ("pin", "unpin"):
            pool.set_pinned(hs, op == "pin")
        elif op == "drop":
            pool.drop(hs[-1])
            assert hs[-1] not in pool.blocks
        else:
            pool.touch(hs)
        check_invariants(pool)
        for h, meta in pool.blocks.items():  # bytes follow blocks through demotions
            assert bytes(pool.read(meta).tolist()) == h
        replay(pool, state)
    assert state == inventory_state(pool)
