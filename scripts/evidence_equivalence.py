"""Differential check: the old AccessStats and CreditTuner (from another checkout) and the
ones on PYTHONPATH, fed the same random lookups, must agree after every lookup: the
blocks each shadow caches, each shadow's score, `best()`, `recent_first()`, and every
block's stats.

The streams are harder than real hash chains: chains that share prefixes and branch,
blocks named twice in one lookup, lists that are not prefixes of earlier ones, the root's
own hash as a block, a clock that stalls or steps back, and shadows of a few blocks,
so that the order of eviction, the blocks set aside while they hold children and the
rebuilds of the heap all matter.

    PYTHONPATH=<new checkout> python scripts/evidence_equivalence.py <old checkout> --streams 200

`--trace-lookups N` also feeds both the realistic workload of scripts/evidence_memory.py
(N lookups, shadows of `--trace-shadow-blocks`, so that they evict), comparing scores,
`best()` and `recent_first()` after every lookup and the cached blocks every 1,000.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import sys
from pathlib import Path

from controlplane.core.access_stats import AccessStats
from controlplane.core.tuning import CreditTuner
from protos.block_hash import ROOT_PARENT_HASH


def _cached(shadow) -> set[bytes]:
    """The blocks a shadow caches: `cached()` (since the shadows shared one id table), its
    slot map (since shadows kept slots), or its dict of keys (before)."""
    if hasattr(shadow, "cached"):
        return shadow.cached()
    slot_of = getattr(shadow, "slot_of", None)
    return set(slot_of if slot_of is not None else shadow.key)


def load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def stream(rng: random.Random, num_lookups: int, num_blocks: int):
    pool = [rng.randbytes(rng.choice([16, 32])) for _ in range(num_blocks)] + [ROOT_PARENT_HASH]
    chains: list[list[bytes]] = []
    now = 0.0
    for _ in range(num_lookups):
        r = rng.random()
        if chains and r < 0.5:  # extend or cut an earlier chain (a shared prefix, a branch)
            base = rng.choice(chains)
            chain = base[: rng.randint(0, len(base))] + rng.sample(pool, rng.randint(0, 6))
        elif r < 0.9:
            chain = rng.sample(pool, rng.randint(1, min(12, len(pool))))
        else:  # repeats inside one lookup
            chain = [rng.choice(pool) for _ in range(rng.randint(1, 12))]
        if not chain:
            chain = [rng.choice(pool)]
        chains.append(chain)
        if len(chains) > 30:
            chains.pop(rng.randrange(len(chains)))
        step = rng.random()
        now += 0.0 if step < 0.3 else (-rng.random() if step < 0.35 else rng.expovariate(1.0))
        # a fresh copy of every hash, as the lookup path slices them
        yield [bytes(bytearray(h)) for h in chain], now


def check(seed: int, old_stats_mod, old_tuning_mod, num_lookups: int) -> int:
    rng = random.Random(seed)
    capacity = rng.choice([1, 2, 3, 5, 8, 20, 60, 400, 1500])
    max_shadow = rng.choice([capacity, max(1, capacity // 2)])
    max_tracked = rng.choice([10, 50, 1 << 21])
    half_life = rng.choice([5.0, 3600.0])
    new_stats = AccessStats(max_tracked, half_life)
    old_stats = old_stats_mod.AccessStats(max_tracked, half_life)
    lookups_half_life = rng.choice([3.0, 2000.0])
    new = CreditTuner(capacity, max_shadow_blocks=max_shadow, half_life_lookups=lookups_half_life)
    old = old_tuning_mod.CreditTuner(capacity, max_shadow_blocks=max_shadow, half_life_lookups=lookups_half_life)
    steps = 0
    for hashes, now in stream(rng, num_lookups, rng.choice([10, 40, 200, 3000])):
        new_stats.record_lookup(hashes, now)
        old_stats.record_lookup(list(hashes), now)
        new.observe(hashes, now, new_stats)
        old.observe(list(hashes), now, old_stats)
        steps += 1
        for a, b in zip((*new.shadows, new.scan), (*old.shadows, old.scan), strict=True):
            cached = _cached(b)
            assert _cached(a) == cached, (seed, steps, "cached blocks differ")
            assert a.score == b.score, (seed, steps, "scores differ")
            assert len(a) == len(cached)
        assert new.best() == old.best() and new.recent_first() == old.recent_first(), (seed, steps)
        assert list(new_stats._blocks) == list(old_stats._blocks), (seed, steps, "stats order differs")
        for h in new_stats._blocks:  # read through get(): the stored form may differ between checkouts
            s, o = new_stats.get(h), old_stats.get(h)
            assert (s.first_seen_seconds, s.last_access_seconds, s.num_lookups, s.last_lookup) == (
                o.first_seen_seconds,
                o.last_access_seconds,
                o.num_lookups,
                o.last_lookup,
            ), (seed, steps)
        assert new_stats.turnover_seconds(capacity) == old_stats.turnover_seconds(capacity)
    return steps


def check_trace(old_stats_mod, old_tuning_mod, num_lookups: int, shadow_blocks: int) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from evidence_memory import block_hashes, make_trace, packed, sliced

    lookups, num_blocks = make_trace(num_lookups, 1)
    hashes = block_hashes(num_blocks)
    new_stats, old_stats = AccessStats(), old_stats_mod.AccessStats()
    new, old = CreditTuner(shadow_blocks), old_tuning_mod.CreditTuner(shadow_blocks)
    choices = set()
    for n, lookup in enumerate(lookups, 1):
        keys = sliced(packed(lookup, hashes))
        new_stats.record_lookup(keys, n * 0.1)
        old_stats.record_lookup(list(keys), n * 0.1)
        new.observe(keys, n * 0.1, new_stats)
        old.observe(list(keys), n * 0.1, old_stats)
        for a, b in zip((*new.shadows, new.scan), (*old.shadows, old.scan), strict=True):
            assert a.score == b.score and len(a) == len(b), (n, "scores differ")
            if n % 1000 == 0:
                assert _cached(a) == _cached(b), (n, "cached blocks differ")
        choice = (new.best(), new.recent_first())
        assert choice == (old.best(), old.recent_first()), n
        choices.add(choice)
    print(
        f"trace: {len(lookups)} lookups, shadows of {shadow_blocks} blocks: identical (choices seen: {sorted(choices)})"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("old", type=Path, help="checkout of the old code")
    p.add_argument("--streams", type=int, default=200)
    p.add_argument("--lookups", type=int, default=400)
    p.add_argument("--trace-lookups", type=int, default=0)
    p.add_argument("--trace-shadow-blocks", type=int, default=1 << 14)
    args = p.parse_args()
    old_stats = load(args.old / "controlplane/core/access_stats.py", "old_access_stats")
    old_tuning = load(args.old / "controlplane/core/tuning.py", "old_tuning")
    total = sum(check(seed, old_stats, old_tuning, args.lookups) for seed in range(args.streams))
    print(f"{args.streams} streams, {total} lookups: identical")
    if args.trace_lookups:
        check_trace(old_stats, old_tuning, args.trace_lookups, args.trace_shadow_blocks)


if __name__ == "__main__":
    main()
