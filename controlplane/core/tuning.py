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
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import NamedTuple

from controlplane.core.access_stats import AccessStats
from protos.block_hash import ROOT_PARENT_HASH

DEFAULT_CANDIDATES = (0.0, 1.0, 2.0, 4.0)
DEFAULT_HALF_LIFE_LOOKUPS = 2000.0
# a shadow holds 117-147 B a block (tracemalloc; the hash is AccessStats' object, counted
# there): ~37 MiB each at most, five shadows (four credits, one recent-first) ~185 MiB for
# a cluster of 262,144 blocks or more (scripts/evidence_memory.py; 400-740 B a block before
# the shadows kept slots and runs, not a heap of tuples)
DEFAULT_MAX_SHADOW_BLOCKS = 1 << 18
SCAN_MARGIN = 3.0
_ROOT_SLOT = 0


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

    Stored compactly, in that same order: a block has a slot (`slot_of`), and per slot
    lists hold its hash (the caller's object: AccessStats' own), parent slot, number of
    cached children, key and tick. The entries of one admission with one key are a run
    in the order, so the heap holds one `(key, tick, slots)` group per run, `slots` a
    stack whose top is the run's next entry; `num_entries` counts the entries the heap
    of single entries would hold, which says when to rebuild. 117-147 B a block
    (tracemalloc, the hash not included: AccessStats holds it) instead of 400-740 B.

    Invariant: `num_children[s]` counts the cached blocks whose parent is s; a block is
    evicted only when it has none."""

    def __init__(
        self,
        credit_turnovers: float,
        capacity_blocks: int,
        recent_first: bool = False,
        numbers: list[int] | None = None,
    ) -> None:
        self.credit_turnovers = credit_turnovers
        self.recent_first = recent_first
        self.capacity_blocks = capacity_blocks
        self.slot_of: dict[bytes, int] = {}
        # per slot; slot 0 is the root's, the parent of a lookup's first block
        self.block: list[bytes] = [ROOT_PARENT_HASH]
        self.parent: list[int] = [_ROOT_SLOT]
        self.num_children: list[int] = [0]
        self.key: list[float] = [0.0]  # priority
        self.tick: list[int] = [-1]  # the admission that set the key; -1: slot not cached
        self.free: list[int] = []
        # slot numbers, shared by the tuner's shadows: one int object (28 B) for all five
        self.numbers = numbers if numbers is not None else []
        self.heap: list[tuple[float, int, list[int]]] = []
        self.num_entries = 0
        self.score = 0.0
        self.ticks = 0  # admissions so far: at equal priority the older admission goes first

    def __len__(self) -> int:
        return len(self.slot_of)

    def hits(self, hashes: Sequence[bytes]) -> int:
        n = 0
        for h in hashes:
            if h not in self.slot_of:
                break
            n += 1
        return n

    def admit(self, hashes: Sequence[bytes], now: float, credit_seconds: list[float]) -> None:
        slot_of, parent, num_children, key, tick = self.slot_of, self.parent, self.num_children, self.key, self.tick
        self.ticks += 1
        t = self.ticks
        runs: dict[float, tuple[float, list[int]]] = {}  # key -> (that key's one float object, its run)
        up = _ROOT_SLOT
        for h, c in zip(hashes, credit_seconds, strict=True):
            k = -now if self.recent_first else now + self.credit_turnovers * c
            s = slot_of.get(h)
            if s is None:
                s = self._new_slot(h)
                slot_of[h] = s
                parent[s] = up
                num_children[up] += 1
            run = runs.get(k)
            if run is None:
                run = runs[k] = (k, [])
            key[s] = run[0]
            tick[s] = t
            run[1].append(s)  # deeper blocks later: popped first
            up = s
        for k, slots in runs.values():
            heapq.heappush(self.heap, (k, t, slots))
        self.num_entries += len(hashes)
        self._evict()
        if self.num_entries > 4 * max(len(slot_of), 1024):
            self._rebuild()

    def _new_slot(self, h: bytes) -> int:
        if h == ROOT_PARENT_HASH:  # a block whose hash is the root's shares its count of children
            return _ROOT_SLOT
        if self.free:
            s = self.free.pop()
            self.block[s] = h
            return s
        n = len(self.block)
        while len(self.numbers) <= n:
            self.numbers.append(len(self.numbers))
        self.block.append(h)
        self.parent.append(_ROOT_SLOT)
        self.num_children.append(0)
        self.key.append(0.0)
        self.tick.append(-1)
        return self.numbers[n]

    def _evict(self) -> None:
        slot_of, parent, num_children, tick, heap = self.slot_of, self.parent, self.num_children, self.tick, self.heap
        waiting: dict[int, tuple[float, int, list[int]]] = {}  # popped while holding children, by slot
        # a waiting block whose last child just went: put back, it is the smallest entry (all
        # others were larger when it was popped), so it is the next one popped while the
        # eviction goes on; when the eviction ends there, it goes back with the others
        nxt = -1
        while len(slot_of) > self.capacity_blocks:
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
            del slot_of[self.block[s]]
            tick[s] = -1
            if s != _ROOT_SLOT:
                self.free.append(s)
            p = parent[s]
            num_children[p] -= 1
            if not num_children[p] and p in waiting and len(slot_of) > self.capacity_blocks:
                del waiting[p]
                nxt = p
        # back in the order: each one is smaller than every entry not popped yet, so it goes
        # on top of its run's stack, the ones popped later (larger) first
        for s, run in reversed(waiting.items()):
            if not run[2]:
                heapq.heappush(heap, run)
            run[2].append(s)
        self.num_entries += len(waiting)

    def _rebuild(self) -> None:
        """Drop the stale entries: one per cached block, ties broken by hash."""
        runs: dict[tuple[float, int], list[int]] = {}
        for s in self.slot_of.values():
            runs.setdefault((self.key[s], self.tick[s]), []).append(s)
        block = self.block
        self.heap = [(k, t, sorted(slots, key=block.__getitem__, reverse=True)) for (k, t), slots in runs.items()]
        heapq.heapify(self.heap)
        self.num_entries = len(self.slot_of)


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
        numbers: list[int] = []
        self.shadows = [_Shadow(float(c), self.shadow_blocks, numbers=numbers) for c in candidates]
        self.scan = _Shadow(0.0, self.shadow_blocks, recent_first=True, numbers=numbers)
        self._keep = 0.5 ** (1.0 / half_life_lookups)

    def num_blocks(self) -> int:
        """Blocks held by all the shadows (each ~120-150 B): for the metrics."""
        return sum(len(shadow) for shadow in (*self.shadows, self.scan))

    def observe(self, block_hashes: Sequence[bytes], now: float, stats: AccessStats) -> None:
        """One lookup, after `stats.record_lookup(block_hashes, now)`."""
        turnover = stats.turnover_seconds(self.shadow_blocks)
        cap = self.max_reuse_credits
        hashes = []  # AccessStats' objects: shadows keep these, not the lookup's copies
        credit_seconds = []
        for h in block_hashes:
            s = stats.get(h)
            if s is None:
                hashes.append(h)
                credit_seconds.append(0.0)
            else:
                hashes.append(s.block_hash)
                credit_seconds.append(turnover * min(s.num_reuses, cap))
        keep = self._keep
        for sh in (*self.shadows, self.scan):
            sh.score = sh.score * keep + sh.hits(hashes)
            sh.admit(hashes, now, credit_seconds)

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
