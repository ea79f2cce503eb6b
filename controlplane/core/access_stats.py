"""Access statistics the control plane gathers from the lookups it serves: the evidence
of future reuse that the tier policy (controlplane.core.policy) scores blocks by.

Every lookup names a whole prefix, cached or not, so the control plane sees each
block's reuse history even while no agent holds it: how often a block was asked for,
when first and last, and how fast never-seen blocks arrive (which sets the cache's
turnover time). Entries outlive the blocks' eviction (a ghost list keyed by block), so
a block that comes back is recognised as reused; the least recently asked-for entries
are forgotten beyond `max_tracked_blocks`.

Pure and single-threaded: the owner (the lookup path, or the replay benchmark) calls
`record_lookup`; `decide` only reads. Times are seconds on the caller's clock.

No Python object per block that the cyclic garbage collector walks: a block's figures
are columns of typed arrays, indexed by a slot the ordered dict maps its hash to, and
`get` builds a `BlockStats` for the caller. With one slotted object per block (up to
2,097,152 of them) every full collection walked them all, stopping every thread of the
control plane, lookups included, for 0.1-0.5 s while the history grew and ~1.8 s at
1.5M blocks (measured on a shared 2-core host).
"""

from __future__ import annotations

import math
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_MAX_TRACKED_BLOCKS = 1 << 21
DEFAULT_RATE_HALF_LIFE_SECONDS = 3600.0


@dataclass(slots=True)
class BlockStats:
    """One block's lookup history, as `AccessStats.get` reads it out (a copy: changing it
    changes nothing recorded). Invariant: `first_seen_seconds <= last_access_seconds`
    and `num_lookups >= 1` (an entry exists only once a lookup named the block)."""

    first_seen_seconds: float
    last_access_seconds: float
    num_lookups: int = 1
    # AccessStats.lookups_total at the last lookup naming the block: the order of
    # lookups, for blocks whose clock times tie (traces with coarse or no timestamps)
    last_lookup: int = 0
    # the bytes object AccessStats keys the block by: the shadow caches
    # (controlplane.core.tuning) keep this one rather than the lookup's own copy, so a
    # block's 32-byte hash is stored once however many structures track it
    block_hash: bytes = b""

    @property
    def num_reuses(self) -> int:
        """Lookups after the first one: each is evidence the block is worth keeping."""
        return self.num_lookups - 1


class AccessStats:
    """Per-block lookup history and the arrival rate of never-seen blocks.

    Invariant: `_blocks` is ordered by `last_access_seconds` (oldest first) as long as
    lookups are recorded with non-decreasing `now`; it holds at most
    `max_tracked_blocks` entries.
    """

    def __init__(
        self,
        max_tracked_blocks: int = DEFAULT_MAX_TRACKED_BLOCKS,
        rate_half_life_seconds: float = DEFAULT_RATE_HALF_LIFE_SECONDS,
    ) -> None:
        if max_tracked_blocks <= 0:
            raise ValueError("max_tracked_blocks must be positive")
        if rate_half_life_seconds <= 0:
            raise ValueError("rate_half_life_seconds must be positive")
        self.max_tracked_blocks = max_tracked_blocks
        self._decay_per_second = math.log(2.0) / rate_half_life_seconds
        # hash -> slot, least recently asked for first; a slot indexes the columns below
        self._blocks: OrderedDict[bytes, int] = OrderedDict()
        self._first_seen_seconds = array("d")
        self._last_access_seconds = array("d")
        self._num_lookups = array("q")
        self._last_lookup = array("q")
        self._hash: list[bytes] = []  # the bytes object the dict keys the slot's block by
        self._free_slots: list[int] = []  # slots of forgotten blocks, taken again first
        # exponentially decayed count of never-seen blocks and of elapsed time: their
        # ratio is the recent new-block rate (blocks per second)
        self._new_blocks_decayed = 0.0
        self._seconds_decayed = 0.0
        self._clock_seconds: float | None = None
        self.lookups_total = 0
        self.blocks_seen_total = 0

    # ---- recording ------------------------------------------------------------------
    def record_lookup(self, block_hashes: Sequence[bytes], now: float) -> None:
        """A lookup named this prefix (its whole chain, hit or not) at `now`."""
        self._advance(now)
        self.lookups_total += 1
        blocks = self._blocks
        first, last, count, order, hashes, free = (
            self._first_seen_seconds,
            self._last_access_seconds,
            self._num_lookups,
            self._last_lookup,
            self._hash,
            self._free_slots,
        )
        total = self.lookups_total
        new = 0
        for h in block_hashes:
            s = blocks.get(h)
            if s is None:
                if free:
                    s = free.pop()
                    first[s] = last[s] = now
                    count[s], order[s], hashes[s] = 1, total, h
                else:
                    s = len(hashes)
                    first.append(now)
                    last.append(now)
                    count.append(1)
                    order.append(total)
                    hashes.append(h)
                blocks[h] = s
                new += 1
            else:
                count[s] += 1
                order[s] = total
                if now > last[s]:
                    last[s] = now
                blocks.move_to_end(h)
        if new:
            self.blocks_seen_total += new
            self._new_blocks_decayed += new
            overflow = len(blocks) - self.max_tracked_blocks
            for _ in range(max(overflow, 0)):
                s = blocks.popitem(last=False)[1]
                hashes[s] = b""
                free.append(s)

    def _advance(self, now: float) -> None:
        if self._clock_seconds is None:
            self._clock_seconds = now
            return
        dt = now - self._clock_seconds
        if dt <= 0:
            return
        keep = math.exp(-self._decay_per_second * dt)
        self._new_blocks_decayed *= keep
        # integral of the decayed weight over the elapsed interval
        self._seconds_decayed = self._seconds_decayed * keep + (1.0 - keep) / self._decay_per_second
        self._clock_seconds = now

    # ---- queries --------------------------------------------------------------------
    def get(self, block_hash: bytes) -> BlockStats | None:
        s = self._blocks.get(block_hash)
        if s is None:
            return None
        return BlockStats(
            self._first_seen_seconds[s],
            self._last_access_seconds[s],
            self._num_lookups[s],
            self._last_lookup[s],
            self._hash[s],
        )

    def lookups_of(self, block_hashes: Sequence[bytes]) -> tuple[list[bytes], list[int]]:
        """Each block's hash as stored here (the caller's own where the block is not
        tracked) and its number of lookups (0: not tracked): `get`'s two figures the credit
        tuner reads, for a whole lookup without a BlockStats a block."""
        blocks, stored, counts = self._blocks, self._hash, self._num_lookups
        hashes = []
        num_lookups = []
        for h in block_hashes:
            s = blocks.get(h)
            if s is None:
                hashes.append(h)
                num_lookups.append(0)
            else:
                hashes.append(stored[s])
                num_lookups.append(counts[s])
        return hashes, num_lookups

    def __len__(self) -> int:
        return len(self._blocks)

    def new_blocks_per_second(self) -> float:
        """Recent arrival rate of blocks no lookup had named before (0 until time passes)."""
        if self._seconds_decayed <= 0:
            return 0.0
        return self._new_blocks_decayed / self._seconds_decayed

    def turnover_seconds(self, capacity_blocks: int) -> float:
        """How long `capacity_blocks` of cache takes to fill with never-seen blocks at the
        recent rate: the time scale on which an unused block must expect to be replaced.
        0 while no rate is known (the policy then ranks by recency alone)."""
        rate = self.new_blocks_per_second()
        if rate <= 0 or capacity_blocks <= 0:
            return 0.0
        return capacity_blocks / rate
