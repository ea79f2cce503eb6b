"""BlockPool over real MemoryTier slabs (tiny CPU tensors): storing chains, LRU leaf
eviction, demotion between tiers, pins and readers' references, and the event journal.

Blocks are int8 tensors whose 16 bytes are the block's own digest, so where a block's
bytes end up after demotions is easy to check."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.core import codecs
from agent.core.block_pool import BlockPool
from agent.core.journal import REMOVED, STORED
from agent.core.model_spec import ModelSpec
from agent.store.memory_tier import MemoryTier
from protos.block_hash import ROOT_PARENT_HASH, hash_prefix, split_hashes
from protos.tier import Tier

SPEC = ModelSpec("m", block_size=1, num_layers=1, num_kv_heads=1, head_dim=8, dtype="int8")
PAGE = SPEC.block_bytes  # 16: one raw block per page


def mem(kind: Tier, num_pages: int) -> MemoryTier:
    return MemoryTier(kind, num_pages * PAGE, PAGE, device="cpu")


def make_pool(*tiers, **kwargs) -> BlockPool:
    return BlockPool(list(tiers), [SPEC], **kwargs)


def chain(tokens) -> list[bytes]:
    return split_hashes(hash_prefix("m", list(tokens), 1))


def payload(h: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(h), dtype=torch.int8).reshape(SPEC.block_shape)


def as_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().view(torch.uint8).reshape(-1).tolist())


def insert(pool: BlockPool, hs: list[bytes], check: bool = True) -> tuple[int, int]:
    def block(i: int) -> torch.Tensor:
        if check:
            check_invariants(pool, mid_write=True)
        return payload(hs[i])

    return pool.insert_chain("m", hs, block)


def held(pool: BlockPool) -> set[bytes]:
    return set(pool.blocks)


def stored_block(pool: BlockPool, h: bytes) -> bytes:
    """A held block's bytes straight from its tier (no touch, no reference)."""
    meta = pool.blocks[h]
    raw = pool.store_of[meta.tier].read(meta.handle, meta.stored_bytes)
    return as_bytes(codecs.decode(meta.codec, raw, SPEC.block_shape, SPEC.torch_dtype))


def check_invariants(pool: BlockPool, mid_write: bool = False) -> None:
    blocks = pool.blocks
    for h, meta in blocks.items():
        assert meta.block_hash == h
        # prefix-closed: the parent is held wherever the block is
        assert meta.parent_hash == ROOT_PARENT_HASH or meta.parent_hash in blocks, "a held block lost its parent"
        ready_children = sum(1 for m in blocks.values() if m.parent_hash == h and m.ready)
        assert meta.num_children == ready_children
        assert meta.ref_count >= 0
        assert not meta.moving
        if not mid_write:
            assert meta.ready and meta.ref_count == 0
    # pages: each held block owns the pages its stored bytes need, none is also free or
    # owned twice, and together they are the whole slab
    usage = {u.tier: u for u in pool.usage()}
    for store in pool.tiers:
        metas = [m for m in blocks.values() if m.tier == store.tier]
        used: list[int] = []
        for m in metas:
            pages = m.handle.tolist() if torch.is_tensor(m.handle) else list(m.handle)
            assert len(pages) == max(1, -(-m.stored_bytes // store.page_bytes))
            used += pages
        free = list(store._free)
        assert len(set(used)) == len(used), "a page is allocated twice"
        assert len(set(free)) == len(free), "a page is freed twice"
        assert not set(used) & set(free)
        assert sorted(used + free) == list(range(store.num_pages))
        u = usage[store.tier]
        assert u.num_blocks == len(metas)
        assert u.used_bytes == len(used) * store.page_bytes
        assert u.blocks_used_bytes == u.used_bytes  # nothing reserved or parked here
        assert u.capacity_bytes == store.num_pages * store.page_bytes
        assert u.uncompressed_bytes == sum(m.num_bytes for m in metas)
        assert u.stored_bytes == sum(m.stored_bytes for m in metas)


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


class GatedTier(MemoryTier):
    """A memory tier whose reads wait for `release` while `gated`: a reader caught
    in the middle of read_chain, holding its references."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gated = False
        self.entered = threading.Event()
        self.release = threading.Event()

    def read(self, handle, num_bytes: int) -> torch.Tensor:
        if self.gated and threading.current_thread() is not threading.main_thread():
            self.entered.set()
            assert self.release.wait(10)
        return super().read(handle, num_bytes)


class FailingTier(MemoryTier):
    """A memory tier whose `fail_at`-th write (0-based) raises `error`."""

    def __init__(self, *args, fail_at: int, error: Exception, **kwargs):
        super().__init__(*args, **kwargs)
        self.fail_at, self.error, self.writes = fail_at, error, 0

    def write(self, handle, data, meta=None) -> None:
        n, self.writes = self.writes, self.writes + 1
        if n == self.fail_at:
            raise self.error
        super().write(handle, data, meta)


def start_reader(pool: BlockPool, hs: list[bytes]) -> tuple[threading.Thread, list]:
    out: list = []
    t = threading.Thread(target=lambda: out.append(pool.read_chain(hs)), daemon=True)
    t.start()
    return t, out


# ---- storing -----------------------------------------------------------------------
def test_needs_a_tier():
    with pytest.raises(ValueError, match="at least one tier"):
        BlockPool([], [SPEC])


def test_unknown_tier_codec_is_rejected():
    with pytest.raises(codecs.CodecError, match="unknown codec 'lz9'"):
        make_pool(mem(Tier.CPU, 2), tier_codecs={Tier.CPU: "lz9"})


def test_insert_chain_stores_in_order_and_counts_present():
    pool = make_pool(mem(Tier.CPU, 8))
    hs = chain(range(5))
    order = []

    def block(i):
        order.append(i)
        return payload(hs[i])

    assert pool.insert_chain("m", hs[:3], block) == (3, 0)
    assert order == [0, 1, 2]
    order.clear()
    assert pool.insert_chain("m", hs, block) == (2, 3)
    assert order == [3, 4]  # present blocks are not asked for
    assert pool.num_leading(hs) == 5
    assert pool.num_leading(hs[:2] + chain([99])) == 2
    assert [m.parent_hash for m in (pool.blocks[h] for h in hs)] == [ROOT_PARENT_HASH, *hs[:4]]
    blocks, tiers = pool.read_chain(hs)
    assert [as_bytes(b) for b in blocks] == hs
    assert tiers == [Tier.CPU] * 5
    check_invariants(pool)


def test_insert_chain_stops_where_the_caller_has_no_block():
    pool = make_pool(mem(Tier.CPU, 8))
    hs = chain(range(4))
    assert pool.insert_chain("m", hs, lambda i: payload(hs[i]) if i < 2 else None) == (2, 0)
    assert held(pool) == set(hs[:2])
    check_invariants(pool)


def test_lru_evicts_leaves_first():
    pool = make_pool(mem(Tier.CPU, 4))
    a, b, c = chain(range(0, 2)), chain(range(10, 12)), chain(range(20, 22))
    insert(pool, a)
    insert(pool, b)
    assert insert(pool, c) == (2, 0)
    assert held(pool) == {*b, *c}
    assert pool.evictions_total[Tier.CPU] == 2
    check_invariants(pool)


def test_a_parent_is_never_evicted_before_its_children():
    pool = make_pool(mem(Tier.CPU, 2))
    p_c = chain(range(2))
    insert(pool, p_c)
    pool.touch([p_c[1]])  # now the parent is the least recently used block
    assert pool.blocks[p_c[0]].last_access < pool.blocks[p_c[1]].last_access
    q = chain([50])
    assert insert(pool, q) == (1, 0)
    assert held(pool) == {p_c[0], q[0]}  # the child went, the parent stayed
    check_invariants(pool)


def test_shared_system_prompt_survives_while_old_leaves_go():
    pool = make_pool(mem(Tier.CPU, 6))
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
    pool = make_pool(mem(Tier.CPU, 3))
    pinned = chain(range(2))
    insert(pool, pinned)
    assert pool.set_pin(pinned + chain([777]), Tier.CPU) == 2
    for i in range(5):
        assert insert(pool, chain([300 + i])) == (1, 0)
        assert set(pinned) <= held(pool)
        check_invariants(pool)
    assert pool.set_pin(pinned, None) == 2
    insert(pool, chain([400]))
    insert(pool, chain([401]))
    assert pinned[1] not in held(pool)


def test_everything_pinned_stores_a_partial_chain_without_corruption():
    pool = make_pool(mem(Tier.CPU, 3))
    first = chain(range(3))
    insert(pool, first)
    pool.set_pin(first, Tier.CPU)
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
    pool = make_pool(mem(Tier.CPU, 3))
    pinned = chain([9])
    insert(pool, pinned)
    pool.set_pin(pinned, Tier.CPU)
    hs = chain(range(10, 15))
    assert insert(pool, hs) == (2, 0)  # two free pages, and its own blocks cannot go
    assert pool.num_leading(hs) == 2
    check_invariants(pool)


def test_pinned_gpu_block_is_not_demoted_and_others_go_instead():
    gpu, cpu = mem(Tier.GPU, 2), mem(Tier.CPU, 4)
    pool = make_pool(gpu, cpu)
    keep, other = chain([1]), chain([2])
    insert(pool, keep)
    insert(pool, other)
    pool.set_pin(keep, Tier.GPU)
    pool.touch(other)  # `keep` is now the LRU block of the GPU tier
    insert(pool, chain([3]))
    assert pool.blocks[keep[0]].tier is Tier.GPU
    assert pool.blocks[other[0]].tier is Tier.CPU
    check_invariants(pool)


def test_a_block_below_its_pin_may_be_compressed_where_it_is():
    """A GPU pin on an agent without a GPU: the block stays in the CPU tier, under its pin's
    tier already. Re-encoding it there takes it nowhere, so the pin does not refuse it; a
    move to the disk still is refused."""
    pool = make_pool(mem(Tier.CPU, 8), codec_threads=1, tier_codecs={Tier.CPU: "zstd"})
    hs = chain(range(2))
    insert(pool, hs)
    assert all(pool.blocks[h].codec == "zstd" for h in hs)
    pool.set_pin(hs, Tier.GPU)
    out = pool.move_blocks(hs, Tier.CPU, "none")
    assert [o.ok for o in out] == [True, True], [o.reason for o in out]
    assert all(pool.blocks[h].codec == "none" and pool.blocks[h].tier is Tier.CPU for h in hs)
    out = pool.move_blocks(hs, None, "zstd")  # in place, the form kvctl compress sends
    assert [o.ok for o in out] == [True, True], [o.reason for o in out]  # kept raw: zstd would grow 16 B blocks
    check_invariants(pool)


def test_blocks_referenced_by_a_reader_are_not_evicted_until_released():
    pool = make_pool(mem(Tier.CPU, 2))
    a = chain(range(2))
    insert(pool, a)
    with pool.lock:  # a reader holds the chain, as read_chain does while it copies
        for h in a:
            pool.blocks[h].ref_count += 1
    assert insert(pool, chain([60])) == (0, 0)
    assert held(pool) == set(a)
    assert pool.drop(a[0]) is False
    assert pool.drop(a[1]) is False
    with pool.lock:
        for h in a:
            pool.blocks[h].ref_count -= 1
    assert insert(pool, chain([60])) == (1, 0)
    check_invariants(pool)


def test_a_block_being_read_is_not_freed_under_the_reader():
    cpu = GatedTier(Tier.CPU, 2 * PAGE, PAGE, device="cpu")
    pool = make_pool(cpu)
    a = chain(range(2))
    insert(pool, a)
    cpu.gated = True
    reader, out = start_reader(pool, a)
    assert cpu.entered.wait(5)
    assert all(pool.blocks[h].ref_count == 1 for h in a)
    assert insert(pool, chain([60])) == (0, 0)  # no room can be made
    assert pool.drop(a[1]) is False
    assert held(pool) == set(a)
    cpu.release.set()
    reader.join(5)
    blocks, tiers = out[0]
    assert [as_bytes(b) for b in blocks] == a and tiers == [Tier.CPU] * 2
    assert insert(pool, chain([60])) == (1, 0)
    check_invariants(pool)


def test_a_move_waits_for_the_reader_before_switching():
    gpu = GatedTier(Tier.GPU, 2 * PAGE, PAGE, device="cpu")
    pool = make_pool(gpu, mem(Tier.CPU, 2))
    a = chain(range(2))
    insert(pool, a)
    gpu.gated = True
    reader, out = start_reader(pool, a)
    assert gpu.entered.wait(5)
    moved = []
    mover = threading.Thread(target=lambda: moved.append(pool.move_block(a[1], Tier.CPU)), daemon=True)
    mover.start()
    mover.join(0.2)
    assert mover.is_alive() and pool.blocks[a[1]].tier is Tier.GPU  # copied, not switched
    gpu.release.set()
    reader.join(5)
    mover.join(5)
    assert moved[0].ok and moved[0].moved_bytes == PAGE
    assert [as_bytes(b) for b in out[0][0]] == a
    assert pool.blocks[a[1]].tier is Tier.CPU
    assert stored_block(pool, a[1]) == a[1]
    check_invariants(pool)


def test_a_move_that_outwaits_its_reader_fails_and_leaves_the_source():
    pool = make_pool(mem(Tier.GPU, 2), mem(Tier.CPU, 2))
    a = chain([1])
    insert(pool, a)
    with pool.lock:
        pool.blocks[a[0]].ref_count += 1
    outcome = pool.move_block(a[0], Tier.CPU, wait_seconds=0.05)
    assert not outcome.ok and "TimeoutError" in outcome.reason
    assert pool.move_failures_total == 1
    with pool.lock:
        pool.blocks[a[0]].ref_count -= 1
    assert pool.blocks[a[0]].tier is Tier.GPU and stored_block(pool, a[0]) == a[0]
    check_invariants(pool)  # the copy's pages went back to the CPU tier


def test_read_chain_stops_at_the_first_missing_block():
    pool = make_pool(mem(Tier.CPU, 4))
    hs = chain(range(3))
    insert(pool, hs[:2])
    assert pool.read_chain([hs[2], hs[0]]) == ([], [])
    blocks, tiers = pool.read_chain(hs)
    assert [as_bytes(b) for b in blocks] == hs[:2] and tiers == [Tier.CPU] * 2
    check_invariants(pool)  # references released


def test_failed_write_is_undone_and_noticed():
    pool = make_pool(FailingTier(Tier.CPU, 4 * PAGE, PAGE, device="cpu", fail_at=1, error=OSError("disk on fire")))
    hs = chain(range(3))
    assert insert(pool, hs) == (1, 0)
    assert held(pool) == {hs[0]}
    check_invariants(pool)
    batches = pool.drain_events()
    assert [(b.kind, b.num_blocks) for b in batches] == [(STORED, 1)]
    notices = pool.drain_notices()
    assert [n.kind for n in notices] == ["write_error"] and "disk on fire" in notices[0].message


def test_unexpected_write_error_propagates_and_is_undone():
    pool = make_pool(FailingTier(Tier.CPU, 4 * PAGE, PAGE, device="cpu", fail_at=1, error=RuntimeError("bug")))
    hs = chain(range(3))
    with pytest.raises(RuntimeError, match="bug"):
        insert(pool, hs)
    assert held(pool) == {hs[0]}
    check_invariants(pool)


def test_drop_removes_descendants_first():
    pool = make_pool(mem(Tier.CPU, 8))
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


def test_drop_refuses_a_pinned_block_and_the_ancestors_of_one():
    pool = make_pool(mem(Tier.CPU, 8))
    a = chain(range(3))
    insert(pool, a)
    pool.set_pin([a[2]], Tier.CPU)
    assert pool.drop(a[2]) is False
    assert pool.drop(a[0]) is False  # dropping it would drop the pinned descendant
    assert held(pool) == set(a)
    check_invariants(pool)
    pool.set_pin([a[2]], None)
    assert pool.drop(a[0]) is True and held(pool) == set()


# ---- tiers -------------------------------------------------------------------------
def test_full_top_tier_demotes_before_dropping():
    gpu, cpu = mem(Tier.GPU, 2), mem(Tier.CPU, 4)
    pool = make_pool(cpu, gpu)  # given slowest first: the pool sorts them
    assert [t.tier for t in pool.tiers] == [Tier.GPU, Tier.CPU]
    a, b = chain(range(2)), chain(range(10, 12))
    insert(pool, a)
    assert {pool.blocks[h].tier for h in a} == {Tier.GPU}
    insert(pool, b)
    assert {pool.blocks[h].tier for h in a} == {Tier.CPU}
    assert {pool.blocks[h].tier for h in b} == {Tier.GPU}
    assert pool.demotions_total[Tier.GPU] == 2 and sum(pool.evictions_total.values()) == 0
    assert pool.moved_bytes_total[(Tier.GPU, Tier.CPU)] == 2 * PAGE
    blocks, tiers = pool.read_chain(a)
    assert [as_bytes(x) for x in blocks] == a and tiers == [Tier.CPU] * 2  # bytes preserved
    check_invariants(pool)
    # keep going: the CPU tier fills and then drops LRU leaves
    for i in range(6):
        insert(pool, chain(range(100 + 10 * i, 102 + 10 * i)))
        check_invariants(pool)
    assert pool.evictions_total[Tier.CPU] > 0
    assert len(pool.blocks) == 6
    for h in pool.blocks:
        assert stored_block(pool, h) == h


def test_tier_codec_is_applied_on_demotion_and_usage_reports_both_sizes():
    pool = make_pool(mem(Tier.GPU, 2), mem(Tier.CPU, 8), tier_codecs={Tier.CPU: "zstd"})
    a, b = chain(range(3)), chain(range(10, 12))
    insert(pool, a)
    insert(pool, b)  # demotes all of `a`
    on_cpu = [pool.blocks[h] for h in a]
    assert all(m.tier is Tier.CPU and m.codec == "zstd" for m in on_cpu)
    assert all(pool.blocks[h].codec == "none" for h in b)
    u = {x.tier: x for x in pool.usage()}[Tier.CPU]
    assert u.uncompressed_bytes == 3 * PAGE
    assert u.stored_bytes == sum(m.stored_bytes for m in on_cpu) != u.uncompressed_bytes
    blocks, _ = pool.read_chain(a)
    assert [as_bytes(x) for x in blocks] == a  # transparent on load
    check_invariants(pool)


def test_journal_replay_equals_inventory():
    pool = make_pool(mem(Tier.GPU, 3), mem(Tier.CPU, 3))
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
    pool = make_pool(mem(Tier.CPU, 4))
    insert(pool, chain(range(2)))
    pool.drain_events()
    insert(pool, chain(range(10, 12)))
    seq, groups = pool.inventory()
    assert seq == 1
    assert pool.drain_events() == []
    assert sum(len(g.block_hashes) // 16 for g in groups) == 4


def test_a_chain_longer_than_the_top_tier_spills_to_the_lower_tier():
    """BUG (fixed): insert_chain held a reference on every block of the chain until it
    returned, and referenced blocks can be neither demoted nor dropped; so a chain longer
    than the top tier was cut at the top tier's size although the lower tier had room."""
    pool = make_pool(mem(Tier.GPU, 2), mem(Tier.CPU, 8))
    hs = chain(range(4))
    assert insert(pool, hs) == (4, 0)
    check_invariants(pool)


def test_a_top_tier_leaf_is_dropped_when_the_lower_tier_cannot_take_a_demotion():
    """BUG (fixed): _make_room demoted when there was a lower tier and raised PoolFull
    when the lower tier could not make room, without falling back to dropping an LRU leaf
    of the top tier; an insert then failed while unreferenced, unpinned leaves filled the
    top tier."""
    pool = make_pool(mem(Tier.GPU, 2), mem(Tier.CPU, 1))
    for root in (1, 2, 3):  # block [1] is demoted to the CPU tier; [2] and [3] are GPU leaves
        insert(pool, chain([root]))
    assert pool.blocks[chain([1])[0]].tier is Tier.CPU
    # extending [1]: its CPU block is referenced, so the CPU tier cannot take [2] or [3],
    # but either of them can simply be dropped from the GPU tier
    assert insert(pool, chain([1, 9])) == (1, 1)
    check_invariants(pool)


# ---- random sequences --------------------------------------------------------------
roots, tails = st.integers(0, 3), st.lists(st.integers(0, 3), min_size=1, max_size=5)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), roots, tails),
        st.tuples(st.sampled_from(["pin_gpu", "pin_cpu", "unpin"]), roots, tails),
        st.tuples(st.just("drop"), roots, tails),
        st.tuples(st.just("touch"), roots, tails),
        st.tuples(st.just("read"), roots, tails),
        st.tuples(st.sampled_from(["to_gpu", "to_cpu"]), roots, tails),
    ),
    max_size=25,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=ops,
    top=st.integers(1, 4),
    lower=st.one_of(st.none(), st.integers(1, 6)),
    cpu_codec=st.sampled_from(["none", "zstd"]),  # zstd makes 16-byte blocks take 2 pages
)
def test_random_sequences_keep_the_invariants(ops, top, lower, cpu_codec):
    tiers = [mem(Tier.GPU, top)]
    if lower is not None:
        tiers.append(mem(Tier.CPU, lower))
    pool = make_pool(*tiers, tier_codecs={Tier.CPU: cpu_codec} if lower is not None else None)
    state: dict = {}
    limit: dict[bytes, int] = {}  # pinned block -> slowest tier it may be in
    for op, root, tail in ops:
        hs = chain([1000 * root, *tail])
        pinned_before = {h for h, m in pool.blocks.items() if m.pin_tier}
        if op == "insert":
            stored, present = insert(pool, hs)
            assert stored + present <= len(hs)
            assert pool.num_leading(hs) >= stored + present
        elif op.startswith("pin"):
            pin = Tier.GPU if op == "pin_gpu" else Tier.CPU
            pool.set_pin(hs, pin)
            for h in hs:
                if h in pool.blocks:
                    limit[h] = max(int(pin), int(pool.blocks[h].tier))
        elif op == "unpin":
            pool.set_pin(hs, None)
            pinned_before -= set(hs)
            for h in hs:
                limit.pop(h, None)
        elif op == "drop":
            subtree_pinned = any(
                m.pin_tier and (m.block_hash == hs[-1] or m.block_hash in _descendants(pool, hs[-1]))
                for m in pool.blocks.values()
            )
            was_held = hs[-1] in pool.blocks
            ok = pool.drop(hs[-1])
            assert ok == (was_held and not subtree_pinned)
            assert (hs[-1] in pool.blocks) == subtree_pinned
        elif op == "touch":
            pool.touch(hs)
        elif op == "read":
            blocks, _ = pool.read_chain(hs)
            assert len(blocks) == pool.num_leading(hs)
            assert [as_bytes(b) for b in blocks] == hs[: len(blocks)]
        else:
            to = Tier.GPU if op == "to_gpu" else Tier.CPU
            outcome = pool.move_block(hs[-1], to)
            if outcome.ok:
                assert pool.blocks[hs[-1]].tier is to
            else:
                assert outcome.reason
        check_invariants(pool)
        assert pinned_before <= held(pool), "a pinned block was dropped"
        for h, slowest in limit.items():
            if h in pool.blocks:
                assert int(pool.blocks[h].tier) <= slowest, "a pinned block went below its pin's tier"
        for h in pool.blocks:  # bytes follow blocks through demotions and moves
            assert stored_block(pool, h) == h
        replay(pool, state)
    assert state == inventory_state(pool)


def _descendants(pool: BlockPool, h: bytes) -> set[bytes]:
    out, frontier = set(), [h]
    while frontier:
        p = frontier.pop()
        kids = [m.block_hash for m in pool.blocks.values() if m.parent_hash == p]
        out.update(kids)
        frontier += kids
    return out


def test_a_block_sent_to_the_tier_below_is_encoded_for_it_outside_the_pool_lock(monkeypatch):
    """The top tier held whole by pins: a store's blocks go to the tier below, whose codec
    differs; that re-encode must not run under the pool lock (every other caller waits on it)."""
    import time

    import agent.core.block_pool as block_pool
    from agent.core.pins import AgentPin

    pool = make_pool(mem(Tier.CPU, 2), mem(Tier.DISK, 16), tier_codecs={Tier.DISK: "zstd"})
    pool.pins.add(AgentPin("kb", int(Tier.CPU), time.monotonic() + 60, namespace="kb"))
    pinned = chain(range(2))
    assert pool.insert_chain("m", pinned, lambda i: payload(pinned[i]), namespace="kb") == (2, 0)
    encodes = []
    real = block_pool.codecs.encode
    monkeypatch.setattr(
        block_pool.codecs,
        "encode",
        lambda codec, data: (encodes.append((codec, pool.lock._is_owned())), real(codec, data))[1],
    )
    other = chain(range(100, 103))
    assert pool.insert_chain("m", other, lambda i: payload(other[i]), namespace="docs") == (3, 0)
    assert [pool.tier_of(h) for h in other] == [Tier.DISK] * 3
    assert ("zstd", False) in encodes and all(not held for _, held in encodes), encodes
    blocks, _ = pool.read_chain(other)
    assert [as_bytes(b) for b in blocks] == [as_bytes(payload(h)) for h in other]
    check_invariants(pool)


def test_a_top_tier_held_whole_by_pins_sends_new_blocks_to_the_tier_below():
    """A namespace pinned at the top tier that fills it (the README's demo pin outgrew
    the CPU tiers) left every store storing nothing while the tier below stood empty:
    the rest of a chain now goes to the fastest lower tier with room, parents first."""
    import time

    from agent.core.pins import AgentPin

    pool = make_pool(mem(Tier.CPU, 4), mem(Tier.DISK, 16))
    pool.pins.add(AgentPin("kb", int(Tier.CPU), time.monotonic() + 60, namespace="kb"))
    pinned = chain(range(4))
    assert pool.insert_chain("m", pinned, lambda i: payload(pinned[i]), namespace="kb") == (4, 0)
    other = chain(range(100, 103))
    assert pool.insert_chain("m", other, lambda i: payload(other[i]), namespace="docs") == (3, 0)
    assert [pool.tier_of(h) for h in pinned] == [Tier.CPU] * 4  # the pin holds
    assert [pool.tier_of(h) for h in other] == [Tier.DISK] * 3
    blocks, tiers = pool.read_chain(other)
    assert [as_bytes(b) for b in blocks] == [as_bytes(payload(h)) for h in other] and tiers == [Tier.DISK] * 3
    # a chain that starts in the top tier and runs out of room there goes on below
    pool.pins.remove("kb")
    pool.drop(pinned[-1])
    longer = chain(range(200, 203))
    pool.pins.add(AgentPin("kb2", int(Tier.CPU), time.monotonic() + 60, namespace="kb"))
    assert pool.insert_chain("m", longer, lambda i: payload(longer[i]), namespace="kb") == (3, 0)
    assert [pool.tier_of(h) for h in longer] == [Tier.CPU, Tier.DISK, Tier.DISK]
    check_invariants(pool)
