"""CreditTuner's shadows admit a lookup of distinct blocks with numpy and any other block by
block: both give the same shadows (blocks, scores, order of eviction), and the id table
the shadows share gives up the ids no shadow caches."""

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


def block_by_block(tuner: CreditTuner) -> CreditTuner:
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
def test_vectorised_and_block_by_block_admissions_agree(capacity, repeats):
    stats = AccessStats()
    fast = CreditTuner(capacity, half_life_lookups=50.0)
    slow = block_by_block(CreditTuner(capacity, half_life_lookups=50.0))
    for n, (hashes, now) in enumerate(lookups(capacity, 600, 4 * capacity, repeats), 1):
        stats.record_lookup(hashes, now)
        fast.observe(hashes, now, stats)
        slow.observe(list(hashes), now, stats)
        for a, b in zip((*fast.shadows, fast.scan), (*slow.shadows, slow.scan), strict=True):
            assert a.cached() == b.cached() and len(a) == len(b)
            assert (a.score, a.num_entries) == (b.score, b.num_entries)
        assert (fast.best(), fast.recent_first()) == (slow.best(), slow.recent_first())
        if n % 100 == 0:
            holders_are_counted(fast)
            holders_are_counted(slow)
    assert any(sh.score > 0 for sh in fast.shadows)


def test_an_empty_lookup_changes_no_shadow():
    stats = AccessStats()
    tuner = CreditTuner(4)
    hashes = [bytes([i]) * 32 for i in range(1, 4)]
    stats.record_lookup(hashes, 1.0)
    tuner.observe(hashes, 1.0, stats)
    stats.record_lookup([], 2.0)
    tuner.observe([], 2.0, stats)
    assert all(sh.cached() == set(hashes) for sh in (*tuner.shadows, tuner.scan))
