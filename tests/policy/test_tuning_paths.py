"""CreditTuner's shadows admit a lookup with the C loop (tuning_kernel.c) where it builds;
otherwise a lookup of distinct blocks with numpy and any other block by block: all three
give the same shadows (blocks, scores, order of eviction), and the id table the shadows
share gives up the ids no shadow caches."""

from __future__ import annotations

import random
from array import array

import numpy as np
import pytest

from controlplane.core import tuning
from controlplane.core.access_stats import AccessStats
from controlplane.core.tuning import CreditTuner
from protos.block_hash import ROOT_PARENT_HASH


def lookups(seed: int, num_lookups: int, num_blocks: int, repeats: bool):
    """Chains that share prefixes and branch; with `repeats`, also blocks named twice in
    one lookup and the root's own hash as a block (what the vectorised path leaves to
    the block-by-block one)."""
    rng = random.Random(seed)
    pool = [rng.randbytes(32) for _ in range(num_blocks)]
    if repeats:
        pool.append(ROOT_PARENT_HASH)
    chains: list[list[bytes]] = []
    now = 0.0
    for _ in range(num_lookups):
        if chains and rng.random() < 0.6:
            base = rng.choice(chains)
            chain = base[: rng.randint(1, len(base))] + rng.sample(pool, rng.randint(0, min(8, len(pool))))
        else:
            chain = rng.sample(pool, rng.randint(1, min(16, len(pool))))
        if repeats and rng.random() < 0.2:
            chain.append(rng.choice(chain))
        if not repeats:
            chain = list(dict.fromkeys(chain))
        chains = [*chains[-20:], chain]
        now += rng.expovariate(1.0)
        yield [bytes(bytearray(h)) for h in chain], now


def with_c_loop(capacity: int, **kwargs) -> CreditTuner:
    """The C loop where it builds; elsewhere (no C compiler, KVCP_NATIVE=off or
    KVCP_TUNING_KERNEL=numpy) the numpy path it falls back to, so the tests still compare
    the paths that run there (not skipped: those are the only ones a host without `cc` has)."""
    return CreditTuner(capacity, **kwargs)


def block_by_block(tuner: CreditTuner) -> CreditTuner:
    assert not tuner.native
    for sh in (*tuner.shadows, tuner.scan):
        sh._admit_vectorised = sh._admit_each  # type: ignore[method-assign]
    return tuner


def holders_are_counted(tuner: CreditTuner) -> None:
    shadows = (*tuner.shadows, tuner.scan)
    ids = tuner.ids
    counted = np.zeros(len(ids.holders), dtype=np.int64)
    for sh in shadows:
        counted += sh.tick_v >= 0
    assert counted.tolist() == ids.holders.tolist()
    # an id is kept while a shadow caches its block: none is kept for nothing
    assert set(ids.of) == set().union(*(sh.cached() for sh in shadows)) | {ROOT_PARENT_HASH}


@pytest.mark.parametrize("repeats", [False, True], ids=["distinct", "repeats"])
@pytest.mark.parametrize("capacity", [3, 40, 300])
def test_c_loop_vectorised_and_block_by_block_admissions_agree(capacity, repeats):
    stats = AccessStats()
    c_loop = with_c_loop(capacity, half_life_lookups=50.0)
    fast = CreditTuner(capacity, half_life_lookups=50.0, use_kernel=False)
    slow = block_by_block(CreditTuner(capacity, half_life_lookups=50.0, use_kernel=False))
    for n, (hashes, now) in enumerate(lookups(capacity, 600, 4 * capacity, repeats), 1):
        stats.record_lookup(hashes, now)
        c_loop.observe(list(hashes), now, stats)
        fast.observe(hashes, now, stats)
        slow.observe(list(hashes), now, stats)
        for c, a, b in zip(*((*t.shadows, t.scan) for t in (c_loop, fast, slow)), strict=True):
            assert c.cached() == a.cached() == b.cached() and len(c) == len(a) == len(b)
            assert (c.score, c.num_entries) == (a.score, a.num_entries) == (b.score, b.num_entries)
            # the same heap: runs of the same (key, tick) and blocks, in the same order
            assert [(k, t, list(r)) for k, t, r in c.heap] == [(k, t, list(r)) for k, t, r in b.heap]
        assert (c_loop.best(), c_loop.recent_first()) == (fast.best(), fast.recent_first())
        assert (fast.best(), fast.recent_first()) == (slow.best(), slow.recent_first())
        if n % 100 == 0:
            for tuner in (c_loop, fast, slow):
                holders_are_counted(tuner)
    assert any(sh.score > 0 for sh in fast.shadows)


@pytest.mark.parametrize("repeats", [False, True], ids=["distinct", "repeats"])
def test_c_loop_admits_into_int64_columns(repeats):
    """Shadows of more than 2^30 / 6 blocks keep int64 columns (`tn_admit_i64`): no eviction
    at that size, so this checks admission alone."""
    stats = AccessStats()
    c_loop = with_c_loop(1 << 28, half_life_lookups=50.0, max_shadow_blocks=1 << 28)
    slow = block_by_block(CreditTuner(1 << 28, half_life_lookups=50.0, max_shadow_blocks=1 << 28, use_kernel=False))
    assert c_loop.ids.typecode == slow.ids.typecode == "q"
    for hashes, now in lookups(7, 300, 60, repeats):
        stats.record_lookup(hashes, now)
        c_loop.observe(hashes, now, stats)
        slow.observe(list(hashes), now, stats)
        for c, b in zip((*c_loop.shadows, c_loop.scan), (*slow.shadows, slow.scan), strict=True):
            assert (c.cached(), c.score, c.num_entries) == (b.cached(), b.score, b.num_entries)
            assert c.parent_v.tolist() == b.parent_v.tolist() and c.key_v.tolist() == b.key_v.tolist()
            assert c.num_children_v.tolist() == b.num_children_v.tolist()


@pytest.mark.parametrize("use_kernel", [True, False], ids=["c-loop", "python"])
def test_an_empty_lookup_changes_no_shadow(use_kernel):
    stats = AccessStats()
    tuner = CreditTuner(4, use_kernel=use_kernel)
    hashes = [bytes([i]) * 32 for i in range(1, 4)]
    stats.record_lookup(hashes, 1.0)
    tuner.observe(hashes, 1.0, stats)
    stats.record_lookup([], 2.0)
    tuner.observe([], 2.0, stats)
    assert all(sh.cached() == set(hashes) for sh in (*tuner.shadows, tuner.scan))


class _FailingAllocation:
    """`array` in controlplane.core.tuning, failing (MemoryError) the `fail_at`-th
    allocation of a column's new part while armed: a growth that runs out of memory."""

    def __init__(self, fail_at: int) -> None:
        self.fail_at, self.calls, self.armed = fail_at, 0, False

    def __call__(self, *args):
        if self.armed and len(args) == 2 and isinstance(args[1], list) and len(args[1]) == 1:
            self.calls += 1
            if self.calls == self.fail_at:
                raise MemoryError
        return array(*args)


def c_views_are_current(tuner: CreditTuner) -> None:
    """What the C loop indexes by id is alive and holds every id the interner can hand out."""
    size = len(tuner.ids.holders)
    assert len(tuner.ids.block) <= size
    for sh in (*tuner.shadows, tuner.scan):
        columns = (sh.parent, sh.num_children, sh.ids.holders, sh.key, sh.tick)
        assert [getattr(sh.c, f) for f in ("parent", "num_children", "holders", "key", "tick")] == [
            col.buffer_info()[0] for col in columns
        ]
        assert min(len(col) for col in columns) >= size


@pytest.mark.parametrize("fail_at", [1, 2, 4, 5, 7, 12, 21])
def test_a_growth_out_of_memory_leaves_the_shadows_consistent(fail_at, monkeypatch):
    """The leader's loop logs a failed pass and goes on: a lookup whose id table could not
    grow fails alone, and the next lookups admit into columns that are alive and large
    enough (no stale address, no column shorter than the ids), as if it never came."""
    stats = AccessStats()
    c_loop = with_c_loop(50, half_life_lookups=50.0)
    ref = CreditTuner(50, half_life_lookups=50.0, use_kernel=False)
    rng = random.Random(fail_at)
    pool = [rng.randbytes(32) for _ in range(100)]
    longs = [[rng.randbytes(32) for _ in range(1500)] for _ in range(3)]
    failing = _FailingAllocation(fail_at)
    monkeypatch.setattr(tuning, "array", failing)
    for step in range(60):
        hashes = longs[step // 20] if step % 20 == 10 else rng.sample(pool, rng.randint(1, 12))
        now = float(step)
        stats.record_lookup(hashes, now)
        failing.armed = step == 10
        if failing.armed:
            with pytest.raises(MemoryError):
                c_loop.observe(hashes, now, stats)
            failing.armed = False
        else:
            c_loop.observe(hashes, now, stats)
            ref.observe(hashes, now, stats)
        c_views_are_current(c_loop)
        for c, r in zip((*c_loop.shadows, c_loop.scan), (*ref.shadows, ref.scan), strict=True):
            assert (c.cached(), c.score, c.num_entries, len(c)) == (r.cached(), r.score, r.num_entries, len(r))
            assert [(k, t, list(s)) for k, t, s in c.heap] == [(k, t, list(s)) for k, t, s in r.heap]
    assert set(c_loop.ids.of) == set().union(*(sh.cached() for sh in (*c_loop.shadows, c_loop.scan))) | {
        ROOT_PARENT_HASH
    }


def stress(rng: random.Random, steps: int, pool_size: int, long_len: int):
    """Lookups for the differential test: empty ones, very long chains of new blocks (the id
    table grows in the middle of a lookup), earlier chains repeated end to end, blocks named
    twice, the root's hash, and time that stands still or jumps."""
    pool = [rng.randbytes(32) for _ in range(pool_size)] + [ROOT_PARENT_HASH]
    chains: list[list[bytes]] = []
    now = 0.0
    for step in range(steps):
        r = rng.random()
        if r < 0.04:
            chain = []
        elif r < 0.05 or step % 100 == 50:
            chain = [rng.randbytes(32) for _ in range(rng.randint(long_len // 2, long_len))]
        elif r < 0.1 and chains:
            chain = rng.choice(chains) * rng.randint(2, 3)
        elif chains and r < 0.6:
            base = rng.choice(chains)
            chain = base[: rng.randint(0, len(base))] + rng.sample(pool, rng.randint(0, 12))
        else:
            chain = [rng.choice(pool) if rng.random() < 0.7 else rng.randbytes(32) for _ in range(rng.randint(1, 40))]
        if chain and rng.random() < 0.2:
            chain.insert(rng.randrange(len(chain) + 1), rng.choice(chain))
        if chain:
            chains = [*chains[-30:], chain]
        now += rng.choice([0.0, rng.expovariate(1.0), rng.expovariate(0.01)])
        yield [bytes(bytearray(h)) for h in chain], now


def tuner_state(tuner: CreditTuner) -> list:
    """Everything a path could change: each shadow's columns, heap and figures, the id table."""
    ids = tuner.ids
    n = len(ids.holders)
    state: list = [(ids.holders.tolist(), ids.of, ids.block, ids.free, tuner.best(), tuner.recent_first())]
    for sh in (*tuner.shadows, tuner.scan):
        columns = [v[:n].tolist() for v in (sh.parent_v, sh.num_children_v, sh.key_v, sh.tick_v)]
        state.append((sh.size, sh.score, sh.num_entries, sh.ticks, [(k, t, list(r)) for k, t, r in sh.heap], columns))
    return state


@pytest.mark.parametrize(
    ("seed", "capacity", "cap", "pool", "int64"),
    [(1, 300, 3, 200, False), (2, 5, 0, 3000, False), (3, 40, 7, 300, True), (4, 1, 1, 20, False)],
)
def test_c_loop_matches_the_python_paths_under_growth_evictions_and_rebuilds(seed, capacity, cap, pool, int64):
    """All three paths, compared on all their state after every lookup, through the id
    table growing (within a lookup too), evictions, rebuilds of the heap, blocks the
    access stats forgot (no credit), int32 and int64 columns; and the C loop's view of
    the columns is their current address after every lookup."""
    rng = random.Random(seed)
    stats = AccessStats(max_tracked_blocks=400)
    size = (1 << 28) if int64 else capacity  # int64 columns: shadows that could hold 2^28
    kw = {"half_life_lookups": 30.0, "max_reuse_credits": cap, "max_shadow_blocks": size}
    c_loop = with_c_loop(size, **kw)
    tuners = (
        c_loop,
        CreditTuner(size, use_kernel=False, **kw),
        block_by_block(CreditTuner(size, use_kernel=False, **kw)),
    )
    assert c_loop.ids.typecode == ("q" if int64 else "i")
    for tuner in tuners:
        for sh in (*tuner.shadows, tuner.scan):
            sh.capacity_blocks = capacity  # int64: evict at the small capacity all the same
    for step, (hashes, now) in enumerate(stress(rng, 200, pool, 1500)):
        stats.record_lookup(hashes, now)
        for tuner in tuners:
            tuner.observe(list(hashes), now, stats)
            if step % 40 == 39:  # as when stale entries pile up (4 to 1), sooner
                for sh in (*tuner.shadows, tuner.scan):
                    sh._rebuild()
        expected = tuner_state(tuners[2])
        assert tuner_state(c_loop) == expected
        assert tuner_state(tuners[1]) == expected
        c_views_are_current(c_loop)
    holders_are_counted(c_loop)
    assert len(c_loop.ids.holders) >= 2049  # the id table grew (twice at least)
