"""Self-tuning of the policy's reuse credit from the lookup stream.

How much a reuse says about the future depends on the workload: on shared documents
and system prompts a block asked for twice is likely to be asked for again, so reuse
credits beat LRU; on multi-turn chat a long session's prefix has been reused at every
turn and still dies with the session, so credits keep dead sessions and recency alone
(LRU from the tail) is right. No fixed credit is good on both, and the control plane
can tell which it faces: it sees every lookup, so it replays them through a few shadow
caches of the cluster's capacity, one per candidate `reuse_credit_turnovers`, with the
policy's own rules (tails first, the same priority), and uses the candidate whose
shadow had the most prefix hits recently (exponentially decayed, so a workload that
changes is followed). Shadows only ever see past lookups: no lookahead.

Loops larger than the cache (a batch job cycling through more documents than the cluster
holds) defeat every recency order: each block comes back just after it was evicted, and
LRU hits nothing. One more shadow evicts the most recently used tails first, which keeps
a fixed part of the loop resident (what Belady does on a loop). `recent_first()` says to
use that order while its shadow's recent hits are SCAN_MARGIN times those of the best
recency shadow: a loop is a landslide (recency shadows hit ~nothing), while on the traces
measured, where recency is right, the recent-first shadow sometimes leads by a little
and following it there cost hits (a margin of 1 lost 3-6 % of the policy's hits on
Mooncake's conversation trace; 3 lost none, and none on the synthetic trace).

Bounded: shadows of a cluster bigger than `max_shadow_blocks` are caches of that size,
each its own consistent model (credits in turnovers of the shadow's own capacity), so
memory stays at a few hundred thousand blocks per shadow whatever the disk tiers hold.
(Sampling prefixes by their first block, SHARDS-style, was not kept: where every request
starts with the same system prompt the sample is all requests or none.)

Pure and single-threaded like AccessStats: the lookup path calls `observe` after
`AccessStats.record_lookup` for the same lookup; the reconcile loop reads `best()`.

Cost: 3.4-4.5 µs a looked-up block for the five shadows where the C loop builds
(`scripts/evidence_memory.py speed --lookups 20000` on a loaded shared 2-core host; 6.2-7.4
µs in the same session with numpy admission, 10.0-10.8 µs in an earlier one with a dict per
shadow and a Python loop a block per shadow). The shadows share one table of block ids, so
a lookup's hashes are looked up once, and admit a lookup with one call of a C loop
(tuning_kernel.c; without a C compiler, a lookup of distinct blocks with a few numpy
calls); the heap and the evictions stay Python (the order of the lazy heap is what the
policy's figures depend on, and `scripts/evidence_equivalence.py` checks it against older
code).
"""

from __future__ import annotations

import ctypes
import heapq
from array import array
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from controlplane.core import tuning_kernel
from controlplane.core.access_stats import AccessStats
from protos.block_hash import ROOT_PARENT_HASH

DEFAULT_CANDIDATES = (0.0, 1.0, 2.0, 4.0)
DEFAULT_HALF_LIFE_LOOKUPS = 2000.0
# a shadow holds 80-107 B a block (tracemalloc; the hash is AccessStats' object, counted
# there): ~28 MiB each at most, five shadows (four credits, one recent-first) ~140 MiB for
# a cluster of 262,144 blocks or more (scripts/evidence_memory.py; 117-156 B a block with a
# dict per shadow, 400-740 B before the shadows kept slots and runs, not a heap of tuples)
DEFAULT_MAX_SHADOW_BLOCKS = 1 << 18
SCAN_MARGIN = 3.0
_ROOT_SLOT = 0


class _BlockIds:
    """The blocks the tuner's shadows cache, interned once for all of them: a block's id
    indexes every shadow's columns, so a lookup's hashes are looked up once, not once per
    shadow (twice: hits, then admission). Id 0 is the root's, the parent of a lookup's
    first block (and the id of a block whose hash is the root's).

    Invariant: `holders[i]` counts the shadows that cache block i; an id whose count
    drops to 0 is given up at the end of the lookup (`release`), its hash forgotten."""

    def __init__(self, typecode: str) -> None:
        self.typecode = typecode
        self.of: dict[bytes, int] = {ROOT_PARENT_HASH: _ROOT_SLOT}
        self.block: list[bytes | None] = [ROOT_PARENT_HASH]  # the caller's object (AccessStats')
        self.holders = array(typecode, [0])
        self.holders_v: np.ndarray = np.frombuffer(self.holders, dtype=np.int32 if typecode == "i" else np.int64)
        self.free: list[int] = []
        self.dead: list[int] = []  # ids whose last holder evicted them during this lookup
        self.shadows: list[_Shadow] = []  # their columns grow with the ids

    def intern(self, hashes: Sequence[bytes]) -> array:
        """The blocks' ids (int64: numpy indexes with them without a conversion)."""
        of, block, free = self.of, self.block, self.free
        if len(block) + len(hashes) > len(self.holders):  # room for all of them new, first: a
            self._grow(len(block) + len(hashes))  # growth that fails (no memory) interns none
        out = array("q")
        for h in hashes:
            i = of.get(h)
            if i is None:
                if free:
                    i = free.pop()
                    block[i] = h
                else:
                    i = len(block)
                    block.append(h)
                of[h] = i
            out.append(i)
        return out

    def _grow(self, n: int) -> None:
        """Columns for ids up to n: the shadows' first, then the holders, so that a growth
        that fails part way (no memory) leaves every column the C loop indexes alive (its
        views refreshed) and at least as long as the holders, which bound the ids."""
        n = max(n, len(self.holders) + max(1024, len(self.holders) >> 3))
        n = max([n, *(shadow.longest() for shadow in self.shadows)])  # after a failed growth
        for shadow in self.shadows:
            shadow.grow(n)
        dtype = self.holders_v.dtype
        del self.holders_v
        try:
            self.holders.extend(array(self.typecode, [0]) * (n - len(self.holders)))
        finally:
            self.holders_v = np.frombuffer(self.holders, dtype=dtype)
            for shadow in self.shadows:  # the holders may have moved
                shadow.c.holders = self.holders.buffer_info()[0]

    def release(self) -> None:
        holders, block, of = self.holders, self.block, self.of
        for i in self.dead:
            if not holders[i]:
                h = block[i]
                if h is not None:  # not given up already (evicted twice in this lookup)
                    del of[h]
                    block[i] = None
                    self.free.append(i)
        self.dead.clear()


class _Lookup:
    """One lookup as the shadows admit it: its blocks' ids, their reuse levels (how many
    credits each earns, up to `cap`; `missing` for a block the history does not track)
    and what its admission needs: for the C loop (`native`), the blocks' lookup counts and
    scratch columns by level; otherwise, when no block repeats and none is the root's,
    what the vectorised admission needs."""

    __slots__ = (
        "ids",
        "levels",
        "cap",
        "missing",
        "simple",
        "np_ids",
        "np_prev",
        "group_levels",
        "group_ids",
        "group_of",
        "counts",
        "c",
        "c_at",
    )

    def __init__(self, ids: array, num_lookups: list[int], cap: int, native: bool = False) -> None:
        self.ids = ids
        self.cap = cap
        self.missing = missing = max(cap, 0) + 1  # no credit
        self.np_prev: np.ndarray | None = None
        self.counts: array | None = None
        # group_levels: the lookup's distinct levels in the order they first appear; for
        # the vectorised admission, when there are several, each one's blocks (in lookup
        # order, group_ids) and each block's index among them (group_of)
        if native:  # the C loop reads each block's level off its count
            self.simple = False
            self.levels: list[int] = []
            self.group_levels = list(
                dict.fromkeys(min(n - 1, cap) if n else missing for n in dict.fromkeys(num_lookups))
            )
            self.counts = array("q", num_lookups)  # each block's lookups in AccessStats (0: not tracked)
            self.c = tuning_kernel.Lookup(ids.buffer_info()[0], self.counts.buffer_info()[0], len(ids), cap, missing)
            self.c_at = ctypes.addressof(self.c)
            return
        self.levels = levels = [min(n - 1, cap) if n else missing for n in num_lookups]
        self.simple = bool(ids) and _ROOT_SLOT not in ids and len(set(ids)) == len(ids)
        self.group_levels = list(dict.fromkeys(levels))
        if self.simple:
            self.np_ids = np.frombuffer(ids, dtype=np.int64)
            if len(self.group_levels) > 1:
                lv = np.array(levels)
                self.group_of = np.empty(len(levels), dtype=np.intp)
                self.group_ids = []
                for g, c in enumerate(self.group_levels):
                    mask = lv == c
                    self.group_of[mask] = g
                    self.group_ids.append(self.np_ids[mask].tobytes())


class _Shadow:
    """A cache of `capacity_blocks` that evicts tails by the policy's priority with one
    candidate credit (`recent_first`: the most recently used tails first, no credits).

    Victims go in the order of a min-heap of (key, tick, -position, hash) entries, one
    pushed per block each time a lookup names it (`tick` counts admissions, `position` is
    the block's place in that lookup): the oldest admission first at equal priority, then
    the deepest block. An entry whose block was named again since is stale and skipped;
    when stale entries outnumber the live ones 3 to 1 the heap is rebuilt from the live
    blocks, each entry's position then 0 (the hash breaks ties). A popped block that
    still has children waits aside until its last child goes, or until the eviction ends.

    Stored compactly, in that same order: a block is known by its id in the tuner's
    `_BlockIds` (one dict for all the shadows), and typed columns indexed by id hold its
    parent, number of cached children, key and tick (-1: not cached here). The entries of
    one admission with one key are a run in the order, so the heap holds one
    `(key, tick, ids)` group per run, `ids` a typed stack whose top is the run's next
    entry; `num_entries` counts the entries the heap of single entries would hold, which
    says when to rebuild. A lookup is admitted by one call of the C loop
    (tuning_kernel.c) where it builds; otherwise one whose blocks are distinct with a few
    numpy calls on views of the columns, and one that repeats a block (or names the
    root's hash) block by block: all three with the same result. 80-107 B a block (tracemalloc, the hash not
    included: AccessStats holds it; the columns are sized by the ids of all the shadows,
    ~2x one shadow's blocks), 117-156 B with a dict and lists per shadow.

    Invariant: `num_children[s]` counts the cached blocks whose parent is s; a block is
    evicted only when it has none."""

    def __init__(
        self,
        credit_turnovers: float,
        capacity_blocks: int,
        recent_first: bool = False,
        ids: _BlockIds | None = None,
        kernel: Any = None,  # tuning_kernel.load()'s library (ctypes: typed there)
    ) -> None:
        self.credit_turnovers = credit_turnovers
        self.recent_first = recent_first
        self.capacity_blocks = capacity_blocks
        self.ids = ids if ids is not None else _BlockIds("i")
        self.ids.shadows.append(self)
        code = self.ids.typecode
        self.dtype = np.int32 if code == "i" else np.int64
        n = len(self.ids.holders)
        self.parent = array(code, [_ROOT_SLOT]) * n
        self.num_children = array(code, [0]) * n
        self.key = array("d", [0.0]) * n  # priority
        self.tick = array("q", [-1]) * n  # the admission that set the key; -1: not cached
        # the C loop for this typecode, or None (numpy, or block by block), and its view of
        # the columns and of this admission's tables by reuse level (sized by the tuner)
        self.admit_c = None if kernel is None else kernel.tn_admit_i32 if code == "i" else kernel.tn_admit_i64
        self.c = tuning_kernel.Shadow()
        self.c_at = ctypes.addressof(self.c)
        self.level_key = array("d")  # by level: its key in this admission
        self.run_of_level = array("q")  # by level: the run its blocks go in (by key)
        self.run_counts = array("q")  # by run: its number of blocks
        self._views()
        self.size = 0
        self.heap: list[tuple[float, int, array]] = []
        self.num_entries = 0
        self.score = 0.0
        self.ticks = 0  # admissions so far: at equal priority the older admission goes first

    def _views(self) -> None:
        c = self.c  # the C loop's view, first: the columns move as they grow
        c.parent, c.num_children, c.holders = (
            a.buffer_info()[0] for a in (self.parent, self.num_children, self.ids.holders)
        )
        c.key, c.tick = self.key.buffer_info()[0], self.tick.buffer_info()[0]
        self.parent_v = np.frombuffer(self.parent, dtype=self.dtype)
        self.num_children_v = np.frombuffer(self.num_children, dtype=self.dtype)
        self.key_v = np.frombuffer(self.key, dtype=np.float64)
        self.tick_v = np.frombuffer(self.tick, dtype=np.int64)

    def grow(self, n: int) -> None:
        """Columns for ids up to n (the views let go first: a viewed array cannot grow; and
        taken again whatever happens: the C loop must never hold a column's old address)."""
        del self.parent_v, self.num_children_v, self.key_v, self.tick_v
        code = self.ids.typecode
        try:  # each to n: a column a failed growth left longer is not grown twice
            self.parent.extend(array(code, [_ROOT_SLOT]) * (n - len(self.parent)))
            self.num_children.extend(array(code, [0]) * (n - len(self.num_children)))
            self.key.extend(array("d", [0.0]) * (n - len(self.key)))
            self.tick.extend(array("q", [-1]) * (n - len(self.tick)))
        finally:
            self._views()

    def longest(self) -> int:
        """The longest column (they differ only after a growth that failed part way)."""
        return max(len(self.parent), len(self.num_children), len(self.key), len(self.tick))

    def __len__(self) -> int:
        return self.size

    def cached(self) -> set[bytes]:
        """The hashes of the blocks cached (for checks; not on the lookup path)."""
        block = self.ids.block
        return {b for i in np.flatnonzero(self.tick_v >= 0).tolist() if (b := block[i]) is not None}

    def _keys(self, lookup: _Lookup, now: float, turnover: float) -> dict[float, list[int]]:
        """The lookup's runs: key -> the indexes of the levels admitted with it (in
        `lookup.group_levels`), in order of appearance."""
        if self.recent_first:
            return {-now: list(range(len(lookup.group_levels)))}
        runs: dict[float, list[int]] = {}
        for g, c in enumerate(lookup.group_levels):
            credit_seconds = 0.0 if c == lookup.missing else turnover * c
            runs.setdefault(now + self.credit_turnovers * credit_seconds, []).append(g)
        return runs

    def admit(self, lookup: _Lookup, now: float, turnover: float) -> int:
        """Admit the lookup's blocks; returns its prefix hits (the blocks cached before)."""
        self.ticks += 1
        if lookup.counts is not None:
            hits = self._admit_native(lookup, now, turnover)
        elif lookup.simple:
            hits = self._admit_vectorised(lookup, now, turnover)
        else:
            hits = self._admit_each(lookup, now, turnover)
        self.num_entries += len(lookup.ids)
        self._evict()
        if self.num_entries > 4 * max(self.size, 1024):
            self._rebuild()
        return hits

    def _admit_native(self, lookup: _Lookup, now: float, turnover: float) -> int:
        """With the C loop (tuning_kernel.c): what `_admit_each` does, any lookup."""
        n = len(lookup.ids)
        if not n:
            return 0
        assert self.admit_c is not None
        runs = self._keys(lookup, now, turnover)
        levels, c = lookup.group_levels, self.c
        if len(self.level_key) <= lookup.missing:  # the tables by level (their size never changes)
            size = lookup.missing + 1
            self.level_key = array("d", [0.0]) * size
            self.run_of_level = array("q", [0]) * size
            self.run_counts = array("q", [0]) * size
            c.level_key, c.run_of_level, c.run_counts = (
                a.buffer_info()[0] for a in (self.level_key, self.run_of_level, self.run_counts)
            )
        level_key, run_of_level = self.level_key, self.run_of_level
        for r, (k, groups) in enumerate(runs.items()):
            for g in groups:
                level_key[levels[g]] = k
                run_of_level[levels[g]] = r
        out = lookup.ids[:]  # the blocks by run: the runs' stacks
        c.num_runs, c.t, c.out = len(runs), self.ticks, out.buffer_info()[0]
        self.admit_c(self.c_at, lookup.c_at)
        self.size += c.added
        if len(runs) == 1:
            heapq.heappush(self.heap, (next(iter(runs)), self.ticks, out))
            return c.hits
        start = 0
        for k, num in zip(runs, self.run_counts, strict=False):
            heapq.heappush(self.heap, (k, self.ticks, out[start : start + num]))  # deeper blocks later: popped first
            start += num
        return c.hits

    def _admit_vectorised(self, lookup: _Lookup, now: float, turnover: float) -> int:
        ids, t = lookup.np_ids, self.ticks
        new = self.tick_v[ids] < 0
        num_new = int(np.count_nonzero(new))
        n = len(lookup.ids)
        hits = n if not num_new else int(new.argmax())
        if num_new:
            fresh = ids[new]
            prev = lookup.np_prev
            if prev is None:  # the parents: each block's predecessor, the root's for the first
                prev = lookup.np_prev = np.empty_like(ids)
                prev[0] = _ROOT_SLOT
                prev[1:] = ids[:-1]
            up = prev[new]  # distinct: no block repeats, none is the root
            self.parent_v[fresh] = up
            self.num_children_v[up] += 1
            self.ids.holders_v[fresh] += 1
            self.size += num_new
        self.tick_v[ids] = t
        runs = self._keys(lookup, now, turnover)
        if len(runs) == 1:  # one key for all (the shadows without credits, or no turnover yet)
            ((k, _),) = runs.items()
            self.key_v[ids] = k
            heapq.heappush(self.heap, (k, t, lookup.ids[:]))
            return hits
        keys = np.empty(len(lookup.group_levels))
        for k, groups in runs.items():
            keys[groups] = k
        self.key_v[ids] = keys[lookup.group_of]
        for k, groups in runs.items():
            if len(groups) == 1:
                slots = array("q", lookup.group_ids[groups[0]])
            else:  # levels whose credits come out at one key
                slots = array("q", ids[np.isin(lookup.group_of, groups)].tobytes())
            heapq.heappush(self.heap, (k, t, slots))  # deeper blocks later: popped first
        return hits

    def _admit_each(self, lookup: _Lookup, now: float, turnover: float) -> int:
        """Block by block, for a lookup that repeats a block or names the root's hash."""
        parent, num_children, key, tick, holders = self.parent, self.num_children, self.key, self.tick, self.ids.holders
        t = self.ticks
        hits = 0
        for i in lookup.ids:
            if tick[i] < 0:
                break
            hits += 1
        credit = 0.0 if self.recent_first else self.credit_turnovers
        runs: dict[float, array] = {}
        up = _ROOT_SLOT
        for s, c in zip(lookup.ids, lookup.levels, strict=True):
            k = -now if self.recent_first else now + credit * (0.0 if c == lookup.missing else turnover * c)
            if tick[s] < 0:
                parent[s] = up
                num_children[up] += 1
                holders[s] += 1
                self.size += 1
            run = runs.get(k)
            if run is None:
                run = runs[k] = array("q")
            key[s] = k
            tick[s] = t
            run.append(s)  # deeper blocks later: popped first
            up = s
        for k, slots in runs.items():
            heapq.heappush(self.heap, (k, t, slots))
        return hits

    def _evict(self) -> None:
        parent, num_children, tick, heap = self.parent, self.num_children, self.tick, self.heap
        holders, dead = self.ids.holders, self.ids.dead
        waiting: dict[int, tuple[float, int, array]] = {}  # popped while holding children, by id
        # a waiting block whose last child just went: put back, it is the smallest entry (all
        # others were larger when it was popped), so it is the next one popped while the
        # eviction goes on; when the eviction ends there, it goes back with the others
        nxt = -1
        size, capacity = self.size, self.capacity_blocks
        while size > capacity:
            if nxt >= 0:
                s, nxt = nxt, -1
            else:
                if not heap:
                    break
                run = heap[0]
                s = run[2].pop()
                if not run[2]:
                    heapq.heappop(heap)
                self.num_entries -= 1
                if tick[s] != run[1] or s in waiting:
                    continue  # stale: named again since, or evicted
                if num_children[s]:
                    waiting[s] = run
                    continue
            size -= 1
            tick[s] = -1
            holders[s] -= 1
            if not holders[s] and s != _ROOT_SLOT:
                dead.append(s)
            p = parent[s]
            num_children[p] -= 1
            if not num_children[p] and p in waiting and size > capacity:
                del waiting[p]
                nxt = p
        self.size = size
        # back in the order: each one is smaller than every entry not popped yet, so it goes
        # on top of its run's stack, the ones popped later (larger) first
        for s, run in reversed(waiting.items()):
            if not run[2]:
                heapq.heappush(heap, run)
            run[2].append(s)
        self.num_entries += len(waiting)

    def _rebuild(self) -> None:
        """Drop the stale entries: one per cached block, ties broken by hash."""
        live = np.flatnonzero(self.tick_v >= 0)
        if not len(live):
            self.heap, self.num_entries = [], 0
            return
        keys, ticks = self.key_v[live], self.tick_v[live]
        order = np.lexsort((ticks, keys))  # runs: equal (key, tick), and in heap order
        live, keys, ticks = live[order], keys[order], ticks[order]
        firsts = np.flatnonzero(np.r_[True, (keys[1:] != keys[:-1]) | (ticks[1:] != ticks[:-1])])
        bounds = [*firsts.tolist(), len(live)]
        ids = live.tolist()
        block = self.ids.block
        # sorted by (key, tick): a heap already
        self.heap = [
            (k, t, array("q", sorted(ids[i:j], key=block.__getitem__, reverse=True)))  # type: ignore[arg-type]
            for k, t, i, j in zip(keys[firsts].tolist(), ticks[firsts].tolist(), bounds, bounds[1:], strict=False)
        ]
        self.num_entries = self.size


class TunedChoice(NamedTuple):
    """What a policy pass uses."""

    reuse_credit_turnovers: float | None  # None: the policy's own
    recent_first: bool  # evict most recent first (a scan is under way)


class CreditTuner:
    """Shadow caches, one per candidate credit, and one recent-first. `best()` is the
    candidate credit with the most recent prefix hits (the default until any shadow has
    hit); `recent_first()` whether loops larger than the cache call for evicting the most
    recently used first."""

    def __init__(
        self,
        capacity_blocks: int,
        candidates: Sequence[float] = DEFAULT_CANDIDATES,
        default: float = 2.0,
        max_reuse_credits: int = 3,
        half_life_lookups: float = DEFAULT_HALF_LIFE_LOOKUPS,
        max_shadow_blocks: int = DEFAULT_MAX_SHADOW_BLOCKS,
        use_kernel: bool = True,
    ) -> None:
        if capacity_blocks <= 0:
            raise ValueError("capacity_blocks must be positive")
        if not candidates:
            raise ValueError("at least one candidate")
        if max_shadow_blocks <= 0:
            raise ValueError("max_shadow_blocks must be positive")
        self.default = default
        self.max_reuse_credits = max_reuse_credits
        self.capacity_blocks = capacity_blocks
        self.shadow_blocks = min(capacity_blocks, max_shadow_blocks)
        # int32 ids and columns unless the shadows could hold more blocks than that counts
        self.ids = _BlockIds("i" if (len(candidates) + 2) * self.shadow_blocks < 1 << 30 else "q")
        # the C loop admits where it builds (tuning_kernel), and the levels index its tables
        kernel = tuning_kernel.load() if use_kernel and max_reuse_credits >= 0 else None
        self.native = kernel is not None
        self.shadows = [_Shadow(float(c), self.shadow_blocks, ids=self.ids, kernel=kernel) for c in candidates]
        self.scan = _Shadow(0.0, self.shadow_blocks, recent_first=True, ids=self.ids, kernel=kernel)
        self._keep = 0.5 ** (1.0 / half_life_lookups)

    def num_blocks(self) -> int:
        """Blocks held by all the shadows (each ~80-110 B): for the metrics."""
        return sum(len(shadow) for shadow in (*self.shadows, self.scan))

    def observe(self, block_hashes: Sequence[bytes], now: float, stats: AccessStats) -> None:
        """One lookup, after `stats.record_lookup(block_hashes, now)`."""
        turnover = stats.turnover_seconds(self.shadow_blocks)
        cap = self.max_reuse_credits
        # AccessStats' objects: shadows keep these, not the lookup's copies
        hashes, num_lookups = stats.lookups_of(block_hashes)
        lookup = _Lookup(self.ids.intern(hashes), num_lookups, cap, self.native)
        keep = self._keep
        for sh in (*self.shadows, self.scan):
            sh.score = sh.score * keep + sh.admit(lookup, now, turnover)
        self.ids.release()

    def scores(self) -> dict[float, float]:
        return {sh.credit_turnovers: sh.score for sh in self.shadows}

    def choose(self, tune_reuse_credits: bool, scan_resistance: bool) -> TunedChoice:
        """What a pass uses, as the policy allows."""
        return TunedChoice(self.best() if tune_reuse_credits else None, scan_resistance and self.recent_first())

    def recent_first(self) -> bool:
        top = max(sh.score for sh in self.shadows)
        return self.scan.score > 0 and self.scan.score > SCAN_MARGIN * top

    def best(self) -> float:
        top = max(self.shadows, key=lambda sh: sh.score)
        if top.score <= 0:
            return self.default
        # keep the default while it is as good as the best
        for sh in self.shadows:
            if sh.credit_turnovers == self.default and sh.score >= top.score:
                return self.default
        return top.credit_turnovers
