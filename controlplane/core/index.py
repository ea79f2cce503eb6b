"""The global block index: which agents hold which block, and in which tier.

It lives in the leader's memory and is rebuilt from agents' inventories; etcd never
holds it. Keys are 16-byte chained block digests (protos.block_hash), so a prefix
lookup is a walk down the request's digests, no tree needed: a digest already names its
whole prefix.

Layout (numpy, no Python object per block): agents are interned to small ints (slots);
each distinct block is one *entry* in dense arrays: its 16-byte key (two uint64), its
parent's key (all zero: a first block, or not told), a bitmask of the agents holding it,
two bit planes giving each holder's tier as a 2-bit code (tier - 1), and when an agent
last newly took the block (a 32-bit tick of `STORED_TICK_SECONDS` on the owner's clock,
`set_clock`: the store-time evidence the tier policy falls back on for blocks no lookup
named). A chained digest
has the same parent wherever it is held, so one parent column serves every agent: the
tier policy shrinks chains from their tails with it. A hash table of 8-slot buckets maps
a key to its entry; each key has two candidate buckets (it goes into the emptier, and a
lookup reads both, never more, so deleting just empties the slot). A slot holds a 32-bit
tag (a second hash of the key; 0 is empty) and the entry id; a tag match is verified on
all 16 bytes. The per-event loops run in C where they build (index_kernel). A batch
of N events is a few dozen vectorised passes over N: packed hashes from the wire go
into the index without being split into `bytes` objects.

Memory: 60 bytes per distinct block for the entry, 4 of scratch, and 8 per table slot
at a load between 0.4 and 0.75 (11-20 bytes per block): ~70-80 bytes per replica when
every replica is a distinct block, much less when agents share blocks. Past 64 agents
each mask widens by a 64-bit word per 64 agents. Growing the table splits each bucket in
two (or more) and a key keeps its slot, so keys move bucket by bucket with no placing
again: the old table stays until all its buckets have moved, a few per key added after
(each add's keys settle first: their own old buckets move before they are probed or
placed, here and in the C loops), so no call waits for the whole move, which once held
the owner's lock ~0.5-1 s at 3M blocks. `expected_blocks` sizes the table up front. The
table never shrinks.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Collection, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np

from controlplane.core import index_kernel
from protos.tier import Tier

BLOCK_HASH_BYTES = 16
_BUCKET = 8
_EMPTY = 0
_MAX_LOAD = 0.75  # live / slots before the table is rebuilt larger
_GROWN_LOAD = 0.4  # live / slots right after a growth (or sizing up front)
_OVERSIZED_SLOTS_PER_KEY = 16  # a table this much bigger than its keys stops growing for one
_MIN_BUCKETS = 16
_SCALAR_MAX = 8  # keys left after the first vectorised round that are placed one by one
_MOVE_PER_KEY = 4  # old buckets moved per key added while a growth is under way (8 slots each)
_C1 = np.uint64(0x9E3779B97F4A7C15)
_U32 = np.uint64(0xFFFFFFFF)
_C3 = np.uint64(0x94D049BB133111EB)
_F1 = np.uint64(0xFF51AFD7ED558CCD)  # murmur3's fmix64
_F2 = np.uint64(0xC4CEB9FE1A85EC53)
_S33 = np.uint64(33)
_BYTE_SUM = np.uint64(0x0101010101010101)  # x * this >> 56: the sum of x's bytes
_BYTE_INDEX = np.uint64(0x0001020304050607)  # 2 ** (8 j) * this >> 56 == j
_TAG_LOW = np.uint32(1)
_ONE = np.uint64(1)
_V16 = np.dtype((np.void, 16))
_ZERO16 = np.zeros(1, _V16)[0]
_TIER_VALUES = tuple(int(t) for t in Tier)
# the arrays of index_kernel.KvIndex, in the order _kernel() lists them
_KVIEW_ARRAYS = "keys parents mask tlo thi tags ents free_ids counts stored old_tags old_ents moved".split()
STORED_TICK_SECONDS = 0.1  # resolution of the store stamps (2**32 ticks: 13 years)


class AgentChains(NamedTuple):
    """BlockIndex.agent_chains: one agent's blocks as parallel arrays."""

    keys: np.ndarray
    tiers: np.ndarray
    parents: np.ndarray
    replicated: np.ndarray
    stored_seconds: np.ndarray


class AgentMatch(NamedTuple):
    """How much of a prefix one agent holds: its leading `num_hit_blocks` blocks,
    `tiers[i]` being the tier of block i on that agent. (A tuple: a lookup makes one
    per agent holding the prefix, up to every agent of the fleet.)"""

    agent_id: str
    num_hit_blocks: int
    tiers: bytes

    def tier_list(self) -> list[Tier]:
        return [Tier(t) for t in self.tiers]


class PrefixHolders:
    """Who holds a prefix, with no Python object per agent: agent ids longest first (then
    in faster tiers, then by id), how many leading blocks each holds, and one row of tier values each (row k is
    `tiers[k * width : k * width + counts[k]]`). A lookup can match every agent."""

    __slots__ = ("agent_ids", "counts", "tiers", "width")

    def __init__(self, agent_ids: list[str], counts: list[int], tiers: bytes, width: int):
        self.agent_ids, self.counts, self.tiers, self.width = agent_ids, counts, tiers, width

    def __len__(self) -> int:
        return len(self.agent_ids)

    def rows(self) -> Iterator[tuple[str, int, bytes]]:
        """(agent_id, num_hit_blocks, tiers) per holder, longest first."""
        w, t = self.width, self.tiers
        for k, (agent_id, n) in enumerate(zip(self.agent_ids, self.counts, strict=True)):
            yield agent_id, n, t[k * w : k * w + n]

    def matches(self) -> list[AgentMatch]:
        return [AgentMatch(*row) for row in self.rows()]

    def only(self, agent_ids) -> PrefixHolders:
        """The holders among `agent_ids`, in the same order."""
        keep = [k for k, a in enumerate(self.agent_ids) if a in agent_ids]
        if not keep:
            return NO_HOLDERS
        w, t = self.width, self.tiers
        return PrefixHolders(
            [self.agent_ids[k] for k in keep],
            [self.counts[k] for k in keep],
            b"".join(t[k * w : (k + 1) * w] for k in keep),
            w,
        )


NO_HOLDERS = PrefixHolders([], [], b"", 0)


def as_keys(block_hashes: bytes | bytearray | memoryview | Iterable[bytes]) -> np.ndarray:
    """Packed 16-byte digests (or an iterable of them) as an (N, 2) uint64 view; ValueError
    when a digest is not 16 bytes."""
    buf: bytes | bytearray | memoryview
    if isinstance(block_hashes, np.ndarray):
        if block_hashes.dtype == np.uint64:
            return block_hashes.reshape(-1, 2)
        buf = block_hashes.tobytes()
    elif isinstance(block_hashes, bytes | bytearray | memoryview):
        buf = block_hashes
    else:
        hs = list(block_hashes)
        for h in hs:
            if len(h) != BLOCK_HASH_BYTES:
                raise ValueError(f"block hash must be {BLOCK_HASH_BYTES} bytes, got {len(h)}")
        buf = b"".join(hs)
    if len(buf) % BLOCK_HASH_BYTES:
        raise ValueError(f"packed block hashes must be a multiple of {BLOCK_HASH_BYTES} bytes, got {len(buf)}")
    if not len(buf):
        return np.zeros((0, 2), np.uint64)
    return np.frombuffer(buf, dtype=np.uint64).reshape(-1, 2)


def _parent_keys(parent_hashes, n: int) -> np.ndarray | None:
    """Parents given with n blocks, as keys (None: not given); ValueError when their number
    does not match."""
    if parent_hashes is None or (not isinstance(parent_hashes, np.ndarray) and not len(parent_hashes)):
        return None
    parents = as_keys(parent_hashes)
    if len(parents) != n:
        raise ValueError(f"{len(parents)} parent hashes for {n} block hashes")
    return parents


def _fmix(h: np.ndarray) -> np.ndarray:
    h = h ^ (h >> _S33)
    h = h * _F1
    h = h ^ (h >> _S33)
    h = h * _F2
    return h ^ (h >> _S33)


def _mix(keys: np.ndarray, seed: np.ndarray) -> np.ndarray:
    """The hash word of each key: both halves mixed on their own with a per-index secret
    seed, then combined. Digests are uniform, but engine-supplied hashes (vLLM ints,
    zero-padded) are not, and hashes are chosen by agents and engines: without the seed
    and the per-half mixing, keys built to share a word would fill their two buckets and
    the table would double without end (index_kernel.c's mix() is the same function)."""
    return _fmix(keys[:, 0] ^ seed[0]) ^ (_fmix(keys[:, 1] ^ seed[1]) * _C1)


def _second(h: np.ndarray) -> np.ndarray:
    """The word a key's second bucket is taken from (its first: the hash word itself)."""
    h2 = h * _C3
    return h2 ^ (h2 << np.uint64(29))


def _first_set_byte(x: np.ndarray) -> np.ndarray:
    """Index of the lowest non-zero byte of each (non-zero) uint64 of booleans."""
    low = x & (~x + _ONE)  # the lowest set bit: 2 ** (8 * j) for boolean byte j
    return ((low * _BYTE_INDEX) >> np.uint64(56)).astype(np.int64)  # byte j of the constant is j


def _bit_columns(words: np.ndarray) -> np.ndarray:
    """(m, W) uint64 -> (m, 64 W) uint8 of its bits, agent slot s at column s."""
    return np.unpackbits(np.ascontiguousarray(words, dtype="<u8").view(np.uint8), axis=1, bitorder="little")


def _tier_code(tier) -> int:
    t = int(tier)
    if t not in _TIER_VALUES:
        raise ValueError(f"unknown tier value {t}")
    return t - 1


class BlockIndex:
    """Replicas of blocks across agents.

    Invariants: an entry is live exactly when its key is in the table; a live entry's
    agent mask is non-zero once the call that touched it returns (a block nobody holds is
    freed); an agent's tier bits are zero where its mask bit is; `_counts[slot]` is the
    number of mask bits set for that agent. Not thread-safe: the owner (Cluster) locks.
    """

    def __init__(self, expected_blocks: int = 0, use_kernel: bool = True) -> None:
        # the C loops for per-event work where they build (index_kernel); else numpy's
        self._lib: Any = index_kernel.load() if use_kernel else None  # ctypes: typed in index_kernel
        self._seed = np.frombuffer(os.urandom(16), np.uint64).copy()  # secret: see _mix
        self.unplaced_total = 0  # keys left out of a table that would not stop growing
        self._kview: index_kernel.KvIndex | None = None  # the C view, kept while the arrays stay
        self._kview_arrays: tuple = ()
        self._slot_of: dict[str, int] = {}  # insertion order = agents()
        self._names: list[str | None] = []
        self._rank: np.ndarray | None = None  # slot -> rank of its agent id (_name_ranks)
        self._free_slots: list[int] = []
        self._W = 1  # 64-bit words per mask
        self._counts = np.zeros(64, np.int64)
        cap = max(1024, int(expected_blocks))
        self._keys = np.empty((cap, 2), np.uint64)
        self._parents = np.zeros((cap, 2), np.uint64)  # zero: no parent known (ROOT_PARENT_HASH)
        # word-major (W, cap); all-zero bits for every entry not in use (freed ones included)
        self._mask = np.zeros((1, cap), np.uint64)
        self._tlo = np.zeros((1, cap), np.uint64)
        self._thi = np.zeros((1, cap), np.uint64)
        self._scratch = np.empty(cap, np.int32)
        self._stored = np.zeros(cap, np.uint32)  # tick of the latest new holder (0: not known)
        self._epoch_seconds: float | None = None  # clock value of tick 0
        self._now_tick = 0
        self._hw = 0  # entries ever allocated (high water)
        self._free = np.empty(0, np.int64)
        self._nfree = 0
        self._live = 0
        # a growth under way (see the module docstring): the table it left, which of its
        # buckets have moved (None: no growth under way), and the next one to move
        self._old_tags: np.ndarray | None = None
        self._old_ents: np.ndarray | None = None
        self._moved: np.ndarray | None = None
        self._old_shift = np.uint64(0)
        self._move_next = 0
        nb = _MIN_BUCKETS
        while nb * _BUCKET * _GROWN_LOAD < expected_blocks:
            nb *= 2
        self._new_table(nb)

    # ---- agents ---------------------------------------------------------------------
    def _intern(self, agent_id: str) -> int:
        slot = self._slot_of.get(agent_id)
        if slot is not None:
            return slot
        if self._free_slots:
            self._free_slots.sort()
            slot = self._free_slots.pop(0)
            self._names[slot] = agent_id
        else:
            slot = len(self._names)
            if slot >= 64 * self._W:
                self._widen()
            self._names.append(agent_id)
        self._slot_of[agent_id] = slot
        self._counts[slot] = 0
        self._rank = None
        return slot

    def _widen(self) -> None:
        """One more 64-bit word per mask (agents beyond 64 * W)."""
        W = self._W + 1
        cap = len(self._keys)
        grown: dict[str, np.ndarray] = {}  # all allocated before any is swapped in: a MemoryError leaves W words
        for name in ("_mask", "_tlo", "_thi"):
            old = getattr(self, name)
            new = np.zeros((W, cap), np.uint64)
            new[: W - 1, : self._hw] = old[:, : self._hw]
            grown[name] = new
        counts = np.concatenate([self._counts, np.zeros(64, np.int64)])
        for name, new in grown.items():
            setattr(self, name, new)
        self._W, self._counts = W, counts

    @staticmethod
    def _word_bit(slot: int) -> tuple[int, np.uint64]:
        return slot >> 6, np.uint64(1 << (slot & 63))

    # ---- table ----------------------------------------------------------------------
    def _new_table(self, nb: int) -> None:
        # both allocated before anything changes: a MemoryError leaves the table it had
        tags = np.zeros((nb, _BUCKET), np.uint32)
        ents = np.zeros((nb, _BUCKET), np.int32)
        self._nb = nb
        self._shift = np.uint64(64 - (nb.bit_length() - 1))
        self._tags, self._ents = tags, ents
        self._tags_flat = self._tags.reshape(-1)
        self._ents_flat = self._ents.reshape(-1)

    def _buckets(self, h: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The two candidate buckets and the tag of each hash."""
        b1 = (h >> self._shift).astype(np.int64)
        b2 = (_second(h) >> self._shift).astype(np.int64)
        tag = (h & _U32).astype(np.uint32) | _TAG_LOW
        return b1, b2, tag

    def _match(self, rows: np.ndarray, b: np.ndarray, tag: np.ndarray, keys: np.ndarray, q: np.ndarray):
        """Entry id and flat slot of key `keys[q[i]]` in bucket `b[i]` (table rows `rows`), -1
        where it is not there. A tag match is verified on all 16 bytes."""
        m = len(b)
        e_out = np.full(m, -1, np.int64)
        l_out = np.full(m, -1, np.int64)
        x = (rows == tag[:, None]).view(np.uint64).ravel()  # 8 booleans of a bucket = one word
        r = np.flatnonzero(x)
        x = x[r]
        while r.size:
            j = _first_set_byte(x)
            flat = b[r] * _BUCKET + j
            e = self._ents_flat.take(flat).astype(np.int64)
            ke = self._keys.take(e, axis=0)
            kq = keys.take(q[r], axis=0)
            ok = (ke[:, 0] == kq[:, 0]) & (ke[:, 1] == kq[:, 1])
            e_out[r[ok]] = e[ok]
            l_out[r[ok]] = flat[ok]
            if ok.all():
                break
            bad = ~ok  # a tag collision: try the other matching slots of the bucket
            r, x = r[bad], x[bad] & ~(_ONE << (j[bad].astype(np.uint64) * np.uint64(8)))
            r, x = r[x != 0], x[x != 0]
        return e_out, l_out

    # ---- the C loops (index_kernel.c) ------------------------------------------------
    def _kernel(self) -> index_kernel.KvIndex:
        """The C view of the arrays as they are now (rebuilt when one of them was replaced
        by a larger one; the counters every time)."""
        arrays = (
            self._keys,
            self._parents,
            self._mask,
            self._tlo,
            self._thi,
            self._tags,
            self._ents,
            self._free,
            self._counts,
            self._stored,
            self._old_tags,
            self._old_ents,
            self._moved,
        )
        x = self._kview
        if x is None or any(a is not b for a, b in zip(arrays, self._kview_arrays, strict=True)):
            # a growth's arrays are None when none is under way: NULL there (moved == NULL)
            ptrs = {n: None if a is None else a.ctypes.data for n, a in zip(_KVIEW_ARRAYS, arrays, strict=True)}
            x = index_kernel.KvIndex(**ptrs)
            x.cap, x.W, x.shift = len(self._keys), self._W, int(self._shift)
            x.s0, x.s1 = int(self._seed[0]), int(self._seed[1])
            if self._moved is not None:
                x.old_shift, x.old_nb = int(self._old_shift), len(self._moved)
            self._kview, self._kview_arrays = x, arrays
        x.nfree, x.hw, x.live, x.now = self._nfree, self._hw, self._live, self._now_tick
        return x

    def _kernel_done(self, x: index_kernel.KvIndex) -> None:
        self._nfree, self._hw, self._live = x.nfree, x.hw, x.live

    def _kernel_add(self, keys: np.ndarray, parents: np.ndarray | None, slot: int, code: int) -> None:
        n = len(keys)
        self._reserve(n)
        self._grow_entries(self._hw + n)
        keys = np.ascontiguousarray(keys)  # bound to names: C reads them after this line
        parents = np.ascontiguousarray(parents) if parents is not None else None
        pp = parents.ctypes.data if parents is not None else None
        start = 0
        while True:
            x = self._kernel()
            start = self._lib.kv_add(ctypes.byref(x), keys.ctypes.data, pp, start, n, slot, code)
            self._kernel_done(x)
            if start == n:
                return
            if self._oversized(n - start):  # keys built to collide: this one stays out
                self.unplaced_total += 1
                start += 1
                continue
            self._grow(self._nb * 2)  # both buckets of a key full: rare below the max load

    def _kernel_remove(self, keys: np.ndarray, slot: int) -> None:
        n = len(keys)
        self._free_room(n)
        keys = np.ascontiguousarray(keys)
        x = self._kernel()
        self._lib.kv_remove(ctypes.byref(x), keys.ctypes.data, n, slot)
        self._kernel_done(x)

    def _find(self, keys: np.ndarray, h: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """Entry id and flat table slot of each key (-1 where absent): one look at each of
        its two buckets, never further. `h`: the keys' _mix (the numpy path's)."""
        n = len(keys)
        if n == 0 or self._live == 0:
            return np.full(n, -1, np.int64), np.full(n, -1, np.int64)
        if self._lib is not None:
            keys = np.ascontiguousarray(keys)
            ent, loc = np.empty(n, np.int64), np.empty(n, np.int64)
            x = self._kernel()
            self._lib.kv_find(ctypes.byref(x), keys.ctypes.data, n, ent.ctypes.data, loc.ctypes.data)
            return ent, loc
        if h is None:
            h = _mix(keys, self._seed)
        self._settle(h)
        b1, b2, tag = self._buckets(h)
        if n <= 4096:  # one pass over both buckets: fewer numpy calls for a lookup-sized batch
            b = np.concatenate([b1, b2])
            idx = np.arange(n)
            e, slot = self._match(np.take(self._tags, b, axis=0), b, np.concatenate([tag, tag]), keys, np.tile(idx, 2))
            first = e[:n] >= 0
            return np.where(first, e[:n], e[n:]), np.where(first, slot[:n], slot[n:])
        idx = np.arange(n)
        ent, loc = self._match(np.take(self._tags, b1, axis=0), b1, tag, keys, idx)
        miss = np.flatnonzero(ent < 0)
        if miss.size:
            bm = b2[miss]
            e, slot = self._match(np.take(self._tags, bm, axis=0), bm, tag[miss], keys, miss)
            ent[miss] = e
            loc[miss] = slot
        return ent, loc

    def _place(self, h: np.ndarray, ids: np.ndarray, keys: np.ndarray, ent: np.ndarray) -> np.ndarray:
        """Put keys into the table, each in the emptier of its two buckets: ids are
        positions into `keys` that were not found; each gets a new entry (duplicates among
        them share one), written to `ent`. Returns the positions (into ids) of keys whose
        two buckets were both full: the caller grows the table and places them again."""
        self._settle(h)
        b1, b2, tag = self._buckets(h)
        pending = np.arange(len(ids))
        failed: list[np.ndarray] = []
        first = True
        while pending.size:
            if not first and pending.size <= _SCALAR_MAX:
                # the few that lost a claim: one at a time beats another round of numpy calls
                left = [i for i in pending.tolist() if not self._place_one(i, b1, b2, tag, ids, keys, ent)]
                if left:
                    failed.append(np.array(left, np.int64))
                break
            p1, p2, tp = b1[pending], b2[pending], tag[pending]
            r1 = np.take(self._tags, p1, axis=0)
            r2 = np.take(self._tags, p2, axis=0)
            if not first:
                # a duplicate of a key placed by an earlier round of this call
                q = ids[pending]
                e, _ = self._match(r1, p1, tp, keys, q)
                e2, _ = self._match(r2, p2, tp, keys, q)
                e = np.where(e >= 0, e, e2)
                hit = e >= 0
                if hit.any():
                    ent[q[hit]] = e[hit]
                    keep = ~hit
                    pending, p1, p2, tp, r1, r2 = pending[keep], p1[keep], p2[keep], tp[keep], r1[keep], r2[keep]
                    if not pending.size:
                        break
            first = False
            x1 = (r1 == _EMPTY).view(np.uint64).ravel()
            x2 = (r2 == _EMPTY).view(np.uint64).ravel()
            second = (x2 * _BYTE_SUM >> np.uint64(56)) > (x1 * _BYTE_SUM >> np.uint64(56))  # emptier bucket
            x = np.where(second, x2, x1)
            b = np.where(second, p2, p1)
            has = x != 0
            if not has.all():
                failed.append(pending[~has])
                pending, x, b = pending[has], x[has], b[has]
                if not pending.size:
                    break
            flat = b * _BUCKET + _first_set_byte(x)
            # claim the slot: the last writer wins, the others retry next round
            self._ents_flat[flat] = pending
            won = self._ents_flat.take(flat) == pending
            wc, wf = pending[won], flat[won]
            new = self._alloc(len(wc))  # before the tags: a MemoryError leaves the slots empty
            self._ents_flat[wf] = new
            q = ids[wc]
            # 1-D views: fancy assignment to rows of a 2-D array is numpy's slow path
            self._keys.view(_V16).reshape(-1)[new] = keys.take(q, axis=0).view(_V16).reshape(-1)
            ent[q] = new
            self._live += len(wc)
            self._tags_flat[wf] = tag[wc]
            pending = pending[~won]
        return np.concatenate(failed) if failed else np.zeros(0, np.int64)

    def _place_one(self, i: int, b1, b2, tag, ids, keys, ent) -> bool:
        """_place for one key, in Python; False when both its buckets are full."""
        t = int(tag[i])
        tags, ents = self._tags_flat, self._ents_flat
        rows = []
        for b in (int(b1[i]), int(b2[i])):
            lo = b * _BUCKET
            row = tags[lo : lo + _BUCKET].tolist()
            q = int(ids[i])
            for j, tj in enumerate(row):
                if tj == t:
                    e = int(ents[lo + j])
                    if self._keys[e, 0] == keys[q, 0] and self._keys[e, 1] == keys[q, 1]:
                        ent[q] = e  # placed earlier in this call
                        return True
            rows.append((row.count(_EMPTY), lo, row))
        free, lo, row = max(rows, key=lambda r: r[0])  # the emptier; the first on a tie
        if not free:
            return False
        slot = lo + row.index(_EMPTY)
        q = int(ids[i])
        new = int(self._alloc(1)[0])  # before the tag: a MemoryError leaves the slot empty
        ents[slot] = new
        self._keys[new] = keys[q]
        ent[q] = new
        self._live += 1
        tags[slot] = t
        return True

    def _alloc(self, n: int) -> np.ndarray:
        take = min(n, self._nfree)
        rest = n - take
        if rest:  # first: a MemoryError there takes no id
            self._grow_entries(self._hw + rest)
        out = np.empty(n, np.int64)
        if take:
            out[:take] = self._free[self._nfree - take : self._nfree]
            self._nfree -= take
        if rest:
            out[take:] = np.arange(self._hw, self._hw + rest)
            self._hw += rest
        return out

    def _grow_entries(self, need: int) -> None:
        cap = len(self._keys)
        if need <= cap:
            return
        new_cap = max(need, cap * 2)
        hw = self._hw
        # all allocated before any is swapped in: a MemoryError leaves every column as it
        # was (one column grown alone: the C loops would index the others past their end)
        grown: dict[str, np.ndarray] = {"_keys": np.empty((new_cap, 2), np.uint64)}
        grown["_parents"] = np.zeros((new_cap, 2), np.uint64)
        for name in ("_mask", "_tlo", "_thi"):
            grown[name] = np.zeros((getattr(self, name).shape[0], new_cap), np.uint64)  # calloc: free until used
        grown["_stored"] = np.zeros(new_cap, np.uint32)
        scratch = np.empty(new_cap, np.int32)
        for name, new in grown.items():
            if name in ("_keys", "_parents", "_stored"):  # entry-major
                new[:hw] = getattr(self, name)[:hw]
            else:  # word-major
                new[:, :hw] = getattr(self, name)[:, :hw]
        for name, new in grown.items():
            setattr(self, name, new)
        self._scratch = scratch

    def _grow(self, nb: int) -> None:
        """Start growing the table to `nb` buckets (a power-of-two multiple of what it has):
        the keys move later, bucket by bucket (_move_buckets), the old table kept until then.
        A growth still under way finishes first (only a batch of keys larger than the table
        had, or one finding both its buckets full right after a growth, gets here before)."""
        self._finish_growth()
        moved = np.zeros(self._nb, np.uint8)
        old = self._tags, self._ents, self._shift
        self._new_table(nb)  # (a MemoryError there leaves the index as it was: no growth under way)
        self._old_tags, self._old_ents, self._old_shift = old
        self._moved, self._move_next = moved, 0

    def _move_buckets(self, b: np.ndarray) -> None:
        """Old buckets `b` (any order, repeats allowed) into the new table, those not moved
        yet. The new table's buckets are the old ones split by the hash word's next bits
        (old bucket b becomes b << k .. (b << k) + 2**k - 1), so a key goes to the one its
        own word names, at the slot j it had, which no other key can hold: only b's keys map
        there, and nothing is placed there before b moves (the keys settle first). One
        scatter, no claim rounds; index_kernel.c's move_bucket is the same, key by key."""
        moved, old_tags, old_ents = self._moved, self._old_tags, self._old_ents
        assert moved is not None and old_tags is not None and old_ents is not None, "no growth under way"
        b = b[moved[b] == 0]
        if not b.size:
            return
        b = np.unique(b)
        tags = old_tags[b]
        r, j = np.nonzero(tags)
        if r.size:
            ob = b[r]
            ents = old_ents[ob, j]
            h = _mix(self._keys.take(ents.astype(np.int64), axis=0), self._seed)
            word = np.where((h >> self._old_shift).astype(np.int64) == ob, h, _second(h))  # which of its two it sat in
            flat = (word >> self._shift).astype(np.int64) * _BUCKET + j
            # marked moved only once their keys are written (entries before tags: a slot
            # counts once its tag is): a MemoryError on the way leaves them to move again
            self._ents_flat[flat] = ents
            self._tags_flat[flat] = tags[r, j]
        moved[b] = 1

    def _settle(self, h: np.ndarray) -> None:
        """Before keys (their hash words `h`) are probed or placed during a growth: the old
        buckets of both their candidates moved."""
        if self._moved is not None:
            self._move_buckets(np.concatenate([h >> self._old_shift, _second(h) >> self._old_shift]).astype(np.int64))

    def _move_some(self, n_buckets: int) -> None:
        """Move the next `n_buckets` old buckets of a growth under way; the old table goes
        when the last has moved."""
        if self._moved is None:
            return
        first, last = self._move_next, min(self._move_next + n_buckets, len(self._moved))
        if self._lib is not None:
            self._lib.kv_move(ctypes.byref(self._kernel()), first, last)
        else:
            self._move_buckets(np.arange(first, last))
        self._move_next = last
        if last == len(self._moved):
            self._old_tags = self._old_ents = self._moved = None

    def _finish_growth(self) -> None:
        if self._moved is not None:
            self._move_some(len(self._moved))

    def _reserve(self, n_new: int) -> None:
        """Make room in the table for `n_new` more keys (growing it), and move a growth's
        next buckets: the keys added pay for it a few at a time."""
        self._move_some(_MOVE_PER_KEY * n_new)
        if self._live + n_new <= _MAX_LOAD * self._nb * _BUCKET:
            return
        nb = self._nb * 2
        while nb * _BUCKET * _GROWN_LOAD < self._live + n_new:
            nb *= 2
        self._grow(nb)

    def _find_or_insert(self, keys: np.ndarray) -> np.ndarray:
        h = _mix(keys, self._seed)
        ent, _ = self._find(keys, h)
        miss = np.flatnonzero(ent < 0)
        if miss.size:
            self._reserve(len(miss))
            while miss.size:
                left = self._place(h[miss], miss, keys, ent)
                miss = miss[left]
                if miss.size:
                    if self._oversized(len(miss)):  # keys built to collide: they stay out (-1)
                        self.unplaced_total += len(miss)
                        break
                    self._grow(self._nb * 2)
        return ent

    def _oversized(self, pending: int) -> bool:
        """Whether the table is already far bigger than its keys need: a key that still
        finds both its buckets full then is one of many built to share them, and growing
        again would double memory without end (see _mix)."""
        return self._nb * _BUCKET >= _OVERSIZED_SLOTS_PER_KEY * max(self._live + pending, 1024)

    def _placed(self, ent: np.ndarray, parents: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
        """The entries _find_or_insert placed, with their parents."""
        if ent.size and ent.min() < 0:
            keep = ent >= 0
            return ent[keep], parents[keep] if parents is not None else None
        return ent, parents

    def _distinct(self, e: np.ndarray) -> np.ndarray:
        """Mask of the first occurrence of each entry id in `e`."""
        if len(e) < 2:
            return np.ones(len(e), bool)
        pos = np.arange(len(e), dtype=np.int32)
        s = self._scratch
        s[e[::-1]] = pos[::-1]  # the last write is the first occurrence
        return s.take(e) == pos

    def _free_if_empty(self, e: np.ndarray, loc: np.ndarray | None = None) -> int:
        """Free the entries among `e` that no agent holds any more."""
        if not e.size:
            return 0
        empty = ~(np.take(self._mask, e, axis=1) != 0).any(axis=0) if self._W > 1 else self._mask[0].take(e) == 0
        if not empty.any():
            return 0
        e = e[empty]
        first = self._distinct(e)
        e = e[first]
        if loc is None:
            k = self._keys.take(e, axis=0)
            _, loc = self._find(k, _mix(k, self._seed))
        else:
            loc = loc[empty][first]
        self._tags_flat[loc] = _EMPTY
        self._parents.view(_V16).reshape(-1)[e] = _ZERO16  # a reused entry starts without a parent
        self._live -= len(e)
        self._free_room(len(e))
        self._free[self._nfree : self._nfree + len(e)] = e
        self._nfree += len(e)
        return len(e)

    def _free_room(self, n: int) -> None:
        """Room on the free-entry stack for n more ids."""
        if self._nfree + n > len(self._free):
            grown = np.empty(max(2 * len(self._free), self._nfree + n, 1024), np.int64)
            grown[: self._nfree] = self._free[: self._nfree]
            self._free = grown

    def _set_parents(self, ent: np.ndarray, parents: np.ndarray | None) -> None:
        if parents is not None:
            told = parents.view(_V16).reshape(-1)
            known = told != np.zeros((), _V16)  # a parent "not told" (zero) keeps one another agent told
            self._parents.view(_V16).reshape(-1)[ent[known]] = told[known]

    def _set_bits(self, ent: np.ndarray, slot: int, code: int) -> None:
        w, bit = self._word_bit(slot)
        nbit = ~bit
        m, lo, hi = self._mask[w], self._tlo[w], self._thi[w]
        m[ent] = m.take(ent) | bit
        lo[ent] = (lo.take(ent) | bit) if code & 1 else (lo.take(ent) & nbit)
        hi[ent] = (hi.take(ent) | bit) if code & 2 else (hi.take(ent) & nbit)

    def _clear_bits(self, ent: np.ndarray, slot: int) -> None:
        w, bit = self._word_bit(slot)
        nbit = ~bit
        for col in (self._mask[w], self._tlo[w], self._thi[w]):
            col[ent] = col.take(ent) & nbit

    def _entries_of(self, slot: int) -> np.ndarray:
        if self._lib is not None:  # one pass over the slot's mask column, no temporary
            out = np.empty(int(self._counts[slot]), np.int64)
            n = self._lib.kv_entries_of(ctypes.byref(self._kernel()), slot, out.ctypes.data, len(out))
            if n == len(out):
                return out
        w, bit = self._word_bit(slot)
        return np.flatnonzero(self._mask[w, : self._hw] & bit)

    def _tiers_of(self, ent: np.ndarray, slot: int) -> np.ndarray:
        w, bit = self._word_bit(slot)
        lo = (self._tlo[w].take(ent) & bit) != 0
        hi = (self._thi[w].take(ent) & bit) != 0
        return 1 + lo.astype(np.uint8) + 2 * hi.astype(np.uint8)

    # ---- mutation -------------------------------------------------------------------
    def set_clock(self, now_seconds: float) -> None:
        """The time the next adds happen at (the owner's clock, seconds): a block an
        agent newly holds is stamped with it. The first call fixes the stamps' epoch."""
        if self._epoch_seconds is None:
            self._epoch_seconds = now_seconds - STORED_TICK_SECONDS  # tick 0 stays "not known"
        tick = int((now_seconds - self._epoch_seconds) / STORED_TICK_SECONDS)
        self._now_tick = min(max(tick, 1), 0xFFFFFFFF)

    def _stored_seconds(self, ent: np.ndarray) -> np.ndarray:
        """When each entry was last newly held, on the owner's clock (NaN: not known)."""
        ticks = self._stored.take(ent)
        if self._epoch_seconds is None:
            return np.full(len(ent), np.nan)
        out = self._epoch_seconds + ticks * STORED_TICK_SECONDS
        out[ticks == 0] = np.nan
        return out

    def add(self, agent_id: str, block_hashes, tier: Tier, parent_hashes=b"") -> None:
        """Record that `agent_id` holds these blocks in `tier` (a tier change if already held).
        `block_hashes`: packed 16-byte digests, or an iterable of 16-byte digests;
        `parent_hashes`: their parents, the same way (empty: not told, kept as known)."""
        keys = as_keys(block_hashes)
        parents = _parent_keys(parent_hashes, len(keys))
        code = _tier_code(tier)
        slot = self._intern(agent_id)
        if not len(keys):
            return
        if self._lib is not None:
            self._kernel_add(keys, parents, slot, code)
            return
        ent, parents = self._placed(self._find_or_insert(keys), parents)
        self._set_parents(ent, parents)
        w, bit = self._word_bit(slot)
        newly = ent[(self._mask[w].take(ent) & bit) == 0]
        if newly.size:
            self._counts[slot] += int(self._distinct(newly).sum())
            self._stored[newly] = self._now_tick
        self._set_bits(ent, slot, code)

    def remove(self, agent_id: str, block_hashes) -> None:
        slot = self._slot_of.get(agent_id)
        if slot is None or self._live == 0:
            return
        keys = as_keys(block_hashes)
        if not len(keys):
            return
        if self._lib is not None:
            self._kernel_remove(keys, slot)
            return
        ent, loc = self._find(keys, _mix(keys, self._seed))
        w, bit = self._word_bit(slot)
        sel = ent >= 0
        ent, loc = ent[sel], loc[sel]
        held = (self._mask[w].take(ent) & bit) != 0
        ent, loc = ent[held], loc[held]
        if not ent.size:
            return
        self._counts[slot] -= int(self._distinct(ent).sum())
        self._clear_bits(ent, slot)
        self._free_if_empty(ent, loc)

    def drop_agent(self, agent_id: str) -> int:
        """Forget everything `agent_id` holds; returns the number of replicas dropped."""
        slot = self._slot_of.pop(agent_id, None)
        if slot is None:
            return 0
        n = int(self._counts[slot])
        if n:
            ent = self._entries_of(slot)
            self._clear_bits(ent, slot)
            self._free_if_empty(ent)
        self._counts[slot] = 0
        self._names[slot] = None
        self._rank = None
        self._free_slots.append(slot)
        return n

    def replace_agent(self, agent_id: str, blocks: dict[bytes, int]) -> None:
        """Swap in a full inventory: afterwards the agent holds exactly `blocks`."""
        by_tier: dict[int, list[bytes]] = {}
        for h, t in blocks.items():
            by_tier.setdefault(int(t), []).append(h)
        self.replace_agent_packed(agent_id, [(b"".join(hs), t) for t, hs in by_tier.items()])

    def replace_agent_packed(self, agent_id: str, groups: Sequence[tuple]) -> None:
        """Swap in a full inventory given as (packed digests, tier[, packed parents]) groups;
        a digest listed in several groups takes the tier of the last."""
        parsed = []  # every group checked before anything changes
        for packed, tier, *rest in groups:
            keys = as_keys(packed)
            parsed.append((keys, _parent_keys(rest[0] if rest else b"", len(keys)), _tier_code(tier)))
        slot = self._intern(agent_id)
        prepared = []
        for keys, parents, code in parsed:
            if len(keys):
                ent, parents = self._placed(self._find_or_insert(keys), parents)
                self._set_parents(ent, parents)
                prepared.append((ent, code))
        old = self._entries_of(slot) if self._counts[slot] else np.zeros(0, np.int64)
        w, bit = self._word_bit(slot)
        for ent, _ in prepared:  # blocks the agent did not hold before are stored now
            self._stored[ent[(self._mask[w].take(ent) & bit) == 0]] = self._now_tick
        if old.size:
            self._clear_bits(old, slot)
        for ent, code in prepared:
            self._set_bits(ent, slot, code)
        if prepared:
            allent = np.concatenate([e for e, _ in prepared])
            self._counts[slot] = int(self._distinct(allent).sum())
        else:
            self._counts[slot] = 0
        self._free_if_empty(old)

    # ---- queries --------------------------------------------------------------------
    def lookup(self, block_hashes) -> list[AgentMatch]:
        """Per agent, the number of leading blocks of the prefix it holds; longest first."""
        return self.prefix_holders(block_hashes).matches()

    def _name_ranks(self) -> np.ndarray:
        """Per agent slot, the rank of its agent id (ties of a lookup sort by id)."""
        if self._rank is None or len(self._rank) != 64 * self._W:
            names = self._names
            order = sorted(range(len(names)), key=lambda s: names[s] or "")
            rank = np.zeros(64 * self._W, np.int64)
            rank[order] = np.arange(len(order))
            self._rank = rank
        return self._rank

    def prefix_holders(self, block_hashes) -> PrefixHolders:
        """lookup() as arrays: what a Lookup answer is built from."""
        keys = as_keys(block_hashes)
        if not len(keys) or self._live == 0:
            return NO_HOLDERS
        if self._lib is not None:
            keys = np.ascontiguousarray(keys)
            ent = np.empty(len(keys), np.int64)
            x = self._kernel()
            m = self._lib.kv_prefix_gil(ctypes.byref(x), keys.ctypes.data, len(keys), ent.ctypes.data)
        else:
            ent, _ = self._find(keys, _mix(keys, self._seed))
            miss = np.flatnonzero(ent < 0)
            m = int(miss[0]) if miss.size else len(ent)
        if m == 0:
            return NO_HOLDERS
        e = ent[:m]
        if self._lib is not None:
            counts = np.zeros(64 * self._W, np.int64)
            rows = np.empty((64 * self._W, m), np.uint8)  # tiers, one row per agent slot
            if not self._lib.kv_matches_gil(ctypes.byref(x), e.ctypes.data, m, counts.ctypes.data, rows.ctypes.data):
                return NO_HOLDERS
            slots = np.flatnonzero(counts)
        else:
            # (m, W): agents holding blocks 0..i
            alive = np.bitwise_and.accumulate(np.take(self._mask, e, axis=1).T, axis=0)
            if not alive[0].any():
                return NO_HOLDERS
            counts = _bit_columns(alive).sum(axis=0, dtype=np.int64)  # per agent slot
            slots = np.flatnonzero(counts)
            lo = _bit_columns(np.take(self._tlo, e, axis=1).T)[:, slots]
            hi = _bit_columns(np.take(self._thi, e, axis=1).T)[:, slots]
            rows = np.zeros((64 * self._W, m), np.uint8)
            rows[slots] = (1 + lo + 2 * hi).T
        held = counts[slots]
        # of equal lengths, the copy in faster tiers first (a router loads it sooner): the
        # sum of its hit blocks' tiers (GPU 1 .. REMOTE 4), then by id
        if len(held) > 1 and len(np.unique(held)) < len(held):  # some lengths tie
            hit = np.arange(m)[None, :] < held[:, None]
            tier_cost = np.where(hit, rows[slots], 0).sum(axis=1, dtype=np.int64)
        else:
            tier_cost = np.zeros(len(held), np.int64)
        slots = slots[np.lexsort((self._name_ranks()[slots], tier_cost, -held))]
        return PrefixHolders(
            [self._agent_at(s) for s in slots.tolist()], counts[slots].tolist(), rows[slots].tobytes(), m
        )

    def _agent_at(self, slot: int) -> str:
        """The agent of a slot that holds blocks (a freed slot holds none: its bits are clear)."""
        name = self._names[slot]
        assert name is not None, f"slot {slot} holds blocks but has no agent"
        return name

    def holders(self, block_hash: bytes) -> dict[str, Tier]:
        keys = as_keys(block_hash)
        ent, _ = self._find(keys, _mix(keys, self._seed))
        if len(ent) != 1 or ent[0] < 0:
            return {}
        e = ent[:1]
        held = _bit_columns(np.take(self._mask, e, axis=1).T)[0]
        out: dict[str, Tier] = {}
        for slot in np.flatnonzero(held).tolist():
            out[self._agent_at(slot)] = Tier(int(self._tiers_of(e, slot)[0]))
        return out

    def agent_blocks(self, agent_id: str) -> dict[bytes, int]:
        slot = self._slot_of.get(agent_id)
        if slot is None or not self._counts[slot]:
            return {}
        ent = self._entries_of(slot)
        raw = self._keys[ent].tobytes()
        tiers = self._tiers_of(ent, slot).tolist()
        return {raw[16 * i : 16 * i + 16]: t for i, t in enumerate(tiers)}

    def agent_chains(self, agent_id: str, not_replicas: Collection[str] = ()) -> AgentChains:
        """What `agent_id` holds, copied out (safe to use once the lock is let go): its
        digests and their parents' (ROOT_PARENT_HASH where none is known) as 16-byte
        void arrays (`.tolist()` gives `bytes`), tier values (uint8), whether another
        agent holds each too (bool; the copies of agents in `not_replicas` do not count),
        and when each was last newly held by an agent (seconds on the `set_clock` clock,
        float64; NaN where not known)."""
        slot = self._slot_of.get(agent_id)
        if slot is None or not self._counts[slot]:
            empty = np.zeros(0, _V16)
            return AgentChains(empty, np.zeros(0, np.uint8), empty, np.zeros(0, bool), np.zeros(0))
        ent = self._entries_of(slot)
        w, bit = self._word_bit(slot)
        others = np.take(self._mask, ent, axis=1)
        others[w] &= ~bit
        for other in not_replicas:
            other_slot = self._slot_of.get(other)
            if other_slot is not None:
                ow, obit = self._word_bit(other_slot)
                others[ow] &= ~obit
        replicated = (others != 0).any(axis=0)
        keys = self._keys[ent].view(_V16).reshape(-1)
        parents = self._parents[ent].view(_V16).reshape(-1)
        return AgentChains(keys, self._tiers_of(ent, slot), parents, replicated, self._stored_seconds(ent))

    def tiers_held(self, agent_id: str, block_hashes) -> np.ndarray:
        """Tier value of each digest on `agent_id` (uint8; 0 where it does not hold it)."""
        keys = as_keys(block_hashes)
        out = np.zeros(len(keys), np.uint8)
        slot = self._slot_of.get(agent_id)
        if slot is None or not len(keys) or self._live == 0:
            return out
        ent, _ = self._find(keys, _mix(keys, self._seed))
        w, bit = self._word_bit(slot)
        found = np.flatnonzero(ent >= 0)
        e = ent[found]
        held = (self._mask[w].take(e) & bit) != 0
        out[found[held]] = self._tiers_of(e[held], slot)
        return out

    def parent_of(self, block_hash: bytes) -> bytes | None:
        """The parent digest of an indexed block (ROOT_PARENT_HASH: none known); None when
        the block is not indexed."""
        keys = as_keys(block_hash)
        ent, _ = self._find(keys, _mix(keys, self._seed))
        if len(ent) != 1 or ent[0] < 0:
            return None
        return self._parents[int(ent[0])].tobytes()

    def num_agent_blocks(self, agent_id: str) -> int:
        slot = self._slot_of.get(agent_id)
        return 0 if slot is None else int(self._counts[slot])

    @property
    def num_blocks(self) -> int:
        return self._live

    @property
    def num_replicas(self) -> int:
        return int(self._counts.sum())

    def agents(self) -> list[str]:
        return list(self._slot_of)

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays allocated (capacity; resident memory may be less)."""
        arrays = (
            self._keys,
            self._parents,
            self._mask,
            self._tlo,
            self._thi,
            self._scratch,
            self._stored,
            self._free,
            self._tags,
            self._ents,
            self._old_tags,
            self._old_ents,
            self._moved,
        )
        return sum(a.nbytes for a in arrays if a is not None)

    # ---- the mapping view of older code and tests (materialised; slow) --------------
    @property
    def _by_agent(self) -> dict[str, dict[bytes, int]]:
        return {a: self.agent_blocks(a) for a in self._slot_of}

    @property
    def _replicas(self) -> dict[bytes, dict[str, int]]:
        out: dict[bytes, dict[str, int]] = {}
        for a, blocks in self._by_agent.items():
            for h, t in blocks.items():
                out.setdefault(h, {})[a] = t
        return out
