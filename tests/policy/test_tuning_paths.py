"""CreditTuner's shadows admit a lookup with the C loop (tuning_kernel.c) where it builds;
otherwise a lookup of distinct blocks with numpy and any other block by block: all three
give the same shadows (blocks, scores, order of eviction), and the id table the shadows
share gives up the ids no shadow caches."""

from __future__ import annotations

import random

import numpy as np
import pytest

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
    tuner = CreditTuner(capacity, **kwargs)
    if not tuner.native:
        pytest.skip("the C loop does not build here (no C compiler, or KVCP_TUNING_KERNEL=numpy)")
    return tuner


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
