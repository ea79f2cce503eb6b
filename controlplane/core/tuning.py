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
from collections import Counter
from collections.abc import Sequence
from typing import NamedTuple

from controlplane.core.access_stats import AccessStats
from protos.block_hash import ROOT_PARENT_HASH

DEFAULT_CANDIDATES = (0.0, 1.0, 2.0, 4.0)
DEFAULT_HALF_LIFE_LOOKUPS = 2000.0
# a shadow holds ~460 B a block (tracemalloc, hashes included): ~120 MiB each at most, five
# shadows (four credits, one recent-first) ~600 MiB for a cluster of 262,144 blocks or more
DEFAULT_MAX_SHADOW_BLOCKS = 1 << 18
SCAN_MARGIN = 3.0


class _Shadow:
    """A cache of `capacity_blocks` that evicts tails by the policy's priority with one
    candidate credit (`recent_first`: the most recently used tails first, no credits).
    Invariant: `nchild[h]` counts cached blocks whose parent is h; a block is evicted
    only when it has none. Keys are fixed when a block is used, so a heap with stale
    entries (skipped on pop) orders the victims."""

    def __init__(self, credit_turnovers: float, capacity_blocks: int, recent_first: bool = False) -> None:
        self.credit_turnovers = credit_turnovers
        self.recent_first = recent_first
        self.capacity_blocks = capacity_blocks
        self.key: dict[bytes, tuple[float, int]] = {}  # priority, then admission order
        self.parent: dict[bytes, bytes] = {}
        self.nchild: Counter[bytes] = Counter()
        self.heap: list[tuple[float, int, int, bytes]] = []
        self.score = 0.0
        self.ticks = 0  # admissions so far: at equal priority the older admission goes first

    def hits(self, hashes: Sequence[bytes]) -> int:
        n = 0
        for h in hashes:
            if h not in self.key:
                break
            n += 1
        return n

    def admit(self, hashes: Sequence[bytes], now: float, credit_seconds: list[float]) -> None:
        key, heap = self.key, self.heap
        self.ticks += 1
        tick = self.ticks
        parent = ROOT_PARENT_HASH
        for pos, (h, c) in enumerate(zip(hashes, credit_seconds, strict=True)):
            k = -now if self.recent_first else now + self.credit_turnovers * c
            if h not in key:
                self.parent[h] = parent
                self.nchild[parent] += 1
            key[h] = (k, tick)
            heapq.heappush(heap, (k, tick, -pos, h))  # equal keys: oldest, then deepest first
            parent = h
        waiting: dict[bytes, tuple[float, int, int, bytes]] = {}  # popped while holding children
        while len(key) > self.capacity_blocks and heap:
            item = heapq.heappop(heap)
            k, t, _, h = item
            if key.get(h) != (k, t) or h in waiting:
                continue
            if self.nchild[h]:
                waiting[h] = item
                continue
            del key[h]
            p = self.parent.pop(h)
            self.nchild[p] -= 1
            if not self.nchild[p]:
                del self.nchild[p]
                back = waiting.pop(p, None)
                if back is not None:
                    heapq.heappush(heap, back)
        for item in waiting.values():
            heapq.heappush(heap, item)
        if len(heap) > 4 * max(len(key), 1024):
            self.heap = [(k, t, 0, h) for h, (k, t) in key.items()]
            heapq.heapify(self.heap)


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
        self.shadows = [_Shadow(float(c), self.shadow_blocks) for c in candidates]
        self.scan = _Shadow(0.0, self.shadow_blocks, recent_first=True)
        self._keep = 0.5 ** (1.0 / half_life_lookups)

    def num_blocks(self) -> int:
        """Blocks held by all the shadows (each ~460 B): for the metrics."""
        return sum(len(shadow.key) for shadow in (*self.shadows, self.scan))

    def observe(self, block_hashes: Sequence[bytes], now: float, stats: AccessStats) -> None:
        """One lookup, after `stats.record_lookup(block_hashes, now)`."""
        turnover = stats.turnover_seconds(self.shadow_blocks)
        cap = self.max_reuse_credits
        credit_seconds = []
        for h in block_hashes:
            s = stats.get(h)
            credit_seconds.append(turnover * min(s.num_reuses, cap) if s is not None else 0.0)
        keep = self._keep
        for sh in (*self.shadows, self.scan):
            sh.score = sh.score * keep + sh.hits(block_hashes)
            sh.admit(block_hashes, now, credit_seconds)

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
