"""Trace replay: the project's tier policy against LRU, Belady (MIN) and an infinite
cache, on a Mooncake-format trace (one JSON object a line: `timestamp` in ms,
`input_length`, `output_length`, `hash_ids` = ids of the prompt's 512-token prefix
blocks).

The policy runs as the control plane runs it, in process: every request is a lookup
against the real `BlockIndex` and is recorded in `AccessStats`; its blocks are then
stored on the one agent (in the fastest tier: the engine just used them), and whenever a
tier is above its high watermark `decide` is called and its actions are applied to the
agent's tiers and the index. Watermarks are 1.0 (a tier of N blocks holds N).

Hit semantics, the same for every cache: a request's hit blocks are its leading
`hash_ids` cached when it arrives; its hit tokens are `input_length` if all its blocks
hit, else `min(input_length, 512 * hit_blocks)`; the ratio is hit tokens over input
tokens. After a request all its blocks are cached (admitted), then the cache is brought
back to its capacity.

Baselines: LRU touches a request's blocks in order and evicts the least recently used
block as each is admitted. Belady is MIN on blocks: on admission beyond capacity it
evicts the block whose next use is farthest (never used again first; ties go to the
block earliest in its prompt), so it knows the future but not prefix structure; it is
the standard offline baseline, not an optimum for prefix hits.
"""

from __future__ import annotations

import bisect
import gzip
import heapq
import json
import math
import random
import zlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from controlplane.core.access_stats import AccessStats
from controlplane.core.index import BlockIndex
from controlplane.core.policy import (
    AgentView,
    ClusterView,
    Demote,
    Evict,
    Policy,
    Promote,
    TierPolicy,
    TierView,
    decide,
)
from controlplane.core.tuning import CreditTuner
from protos.block_hash import ROOT_PARENT_HASH
from protos.tier import Tier

BLOCK_TOKENS = 512
AGENT_ID = "replay-agent"


class TraceError(ValueError):
    """A trace line that is not a Mooncake request; the message names the line."""


@dataclass(frozen=True)
class Request:
    timestamp_ms: float
    input_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: str | Path) -> list[Request]:
    """The requests of a Mooncake-format trace (JSON lines; gzipped or not, told by its
    first bytes). TraceError names the line (or the file) of anything else."""
    out: list[Request] = []
    gzipped = False
    try:
        with open(path, "rb") as probe:
            gzipped = probe.read(2) == b"\x1f\x8b"
        opener = gzip.open if gzipped else open
        with opener(path, "rt", encoding="utf-8-sig") as f:  # a byte-order mark is tolerated
            lineno = 0
            for lineno, line in enumerate(f, 1):
                line = line.strip()
                if line:
                    out.append(_request(_json_line(line, path, lineno), path, lineno))
    except UnicodeDecodeError as exc:
        raise TraceError(f"{path}: not UTF-8 text{' (gzipped)' if gzipped else ''}: {exc}") from None
    except (OSError, EOFError, zlib.error) as exc:  # unreadable, a corrupt or truncated gzip
        raise TraceError(f"{path}: cannot be read{' as gzip' if gzipped else ''}: {exc}") from None
    if not out:
        raise TraceError(f"{path}: no requests")
    return out


def _json_line(line: str, path, lineno: int) -> dict:
    try:
        obj = json.loads(line)
    except ValueError as exc:
        raise TraceError(f"{path}:{lineno}: not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{path}:{lineno}: not a JSON object")
    return obj


def _integer(value, what: str, path, lineno: int) -> int:
    """An integer field as written (1.7, true or "123" are not quietly made one)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TraceError(f"{path}:{lineno}: {what} must be an integer, got {value!r}"[:300])
    if isinstance(value, float) and not value.is_integer():
        raise TraceError(f"{path}:{lineno}: {what} must be an integer, got {value!r}")
    return int(value)


def _request(obj: dict, path, lineno: int) -> Request:
    missing = [k for k in ("input_length", "hash_ids") if k not in obj]
    if missing:
        raise TraceError(
            f"{path}:{lineno}: not a Mooncake request (need timestamp, input_length, hash_ids): no {', '.join(missing)}"
        )
    ids = obj["hash_ids"]
    if not isinstance(ids, list):
        raise TraceError(f"{path}:{lineno}: hash_ids must be a list of integers, got {type(ids).__name__}")
    stamp = obj.get("timestamp", 0)
    if isinstance(stamp, bool) or not isinstance(stamp, int | float) or not math.isfinite(stamp):
        raise TraceError(f"{path}:{lineno}: timestamp must be a finite number, got {stamp!r}"[:300])
    req = Request(
        float(stamp),
        _integer(obj["input_length"], "input_length", path, lineno),
        tuple(_integer(x, "hash_ids", path, lineno) for x in ids),
    )
    if req.input_length < 0:
        raise TraceError(f"{path}:{lineno}: input_length must not be negative")
    if any(not -_ID_LIMIT <= x < _ID_LIMIT for x in req.hash_ids):
        raise TraceError(f"{path}:{lineno}: hash_ids must be integers of at most 128 bits")
    return req


def hit_tokens(req: Request, hit_blocks: int) -> int:
    if not req.hash_ids:  # no block to hit (all blocks of none "hit" on an empty cache)
        return 0
    if hit_blocks >= len(req.hash_ids):
        return req.input_length
    return min(req.input_length, BLOCK_TOKENS * hit_blocks)


def block_tokens(req: Request, position: int) -> int:
    """Tokens block `position` adds to a hit that reaches it (the last one may be partial;
    blocks past `input_length` add none): summed over a hit's blocks, `hit_tokens`."""
    return hit_tokens(req, position + 1) - hit_tokens(req, position)


def unique_blocks(trace: Sequence[Request]) -> int:
    return len({x for r in trace for x in r.hash_ids})


def input_tokens(trace: Sequence[Request]) -> int:
    return sum(r.input_length for r in trace)


def _ratio(hit: int, total: int) -> float:
    return hit / total if total else 0.0


def _leading(ids: Sequence[int], cached) -> int:
    n = 0
    for x in ids:
        if x not in cached:
            break
        n += 1
    return n


# ---- baselines --------------------------------------------------------------------------
def infinite_hit_ratio(trace: Sequence[Request]) -> float:
    seen: set[int] = set()
    hit = 0
    for r in trace:
        hit += hit_tokens(r, _leading(r.hash_ids, seen))
        seen.update(r.hash_ids)
    return _ratio(hit, input_tokens(trace))


def lru_hit_ratio(trace: Sequence[Request], capacity_blocks: int) -> float:
    cache: OrderedDict[int, None] = OrderedDict()
    hit = 0
    for r in trace:
        hit += hit_tokens(r, _leading(r.hash_ids, cache))
        for x in r.hash_ids:
            if x in cache:
                cache.move_to_end(x)
            else:
                cache[x] = None
                if len(cache) > capacity_blocks:
                    cache.popitem(last=False)
    return _ratio(hit, input_tokens(trace))


def next_uses(trace: Sequence[Request]) -> list[list[float]]:
    """next_uses(trace)[i][p]: index of the next request after i using block p of
    request i (math.inf: never again)."""
    nxt: list[list[float]] = [[] for _ in trace]
    upcoming: dict[int, float] = {}
    for i in range(len(trace) - 1, -1, -1):
        ids = trace[i].hash_ids
        nxt[i] = [upcoming.get(x, math.inf) for x in ids]
        for x in ids:
            upcoming[x] = i
    return nxt


def belady_hit_ratio(trace: Sequence[Request], capacity_blocks: int) -> float:
    nxt = next_uses(trace)
    cached: dict[int, float] = {}  # block -> its next use
    heap: list[tuple[float, int, int]] = []  # (-next use, position, block), stale entries skipped
    hit = 0
    for i, r in enumerate(trace):
        hit += hit_tokens(r, _leading(r.hash_ids, cached))
        # every block of the request takes its next use first, then the cache is trimmed:
        # trimmed block by block, a block of this request not yet re-stamped still said
        # "next use: now" and could not go, though its true next use was the farthest
        for p, x in enumerate(r.hash_ids):
            nu = nxt[i][p]
            cached[x] = nu
            heapq.heappush(heap, (-nu, p, x))
        while len(cached) > capacity_blocks:
            neg, _, y = heapq.heappop(heap)
            if cached.get(y) == -neg:
                del cached[y]
    return _ratio(hit, input_tokens(trace))


# ---- oracle bounds (they see the future; they say how much of Belady's lead is reachable) ---
def _ranked_cache_hit_ratio(trace: Sequence[Request], capacity_blocks: int, rank) -> float:
    """A cache that drops tails (never a parent before its children) lowest `rank` first;
    `rank(i, p, block)` is fixed when request i uses block p."""
    key: dict[int, tuple] = {}
    parent: dict[int, int | None] = {}
    nchild: dict[int | None, int] = {}
    heap: list[tuple] = []
    hit = 0
    for i, r in enumerate(trace):
        ids = r.hash_ids
        hit += hit_tokens(r, _leading(ids, key))
        prev = None
        for p, x in enumerate(ids):
            if x not in key:
                parent[x] = prev
                nchild[prev] = nchild.get(prev, 0) + 1
            k = (rank(i, p, x), -p)
            key[x] = k
            heapq.heappush(heap, (k, x))
            prev = x
        waiting = {}
        while len(key) > capacity_blocks and heap:
            k, x = heapq.heappop(heap)
            if key.get(x) != k or x in waiting:
                continue
            if nchild.get(x):
                waiting[x] = k
                continue
            del key[x]
            q = parent.pop(x)
            nchild[q] -= 1
            if not nchild[q] and q in waiting:
                heapq.heappush(heap, (waiting.pop(q), q))
        for x, k in waiting.items():
            heapq.heappush(heap, (k, x))
    return _ratio(hit, input_tokens(trace))


# the classes of the hindsight bound: a block's uses so far (1..6+), the prompt length of
# the request that last used it (short, long, very long) and its age (log-spaced buckets)
_CLASS_MAX_USES = 6
_CLASS_LENGTHS = (8_000, 32_000)
_CLASS_AGES = (0, *sorted({int(1.3**i) for i in range(1, 48)}))
_CLASS_SAMPLE = 64  # leaves looked at per eviction


def _length_class(req: Request) -> int:
    return sum(req.input_length >= n for n in _CLASS_LENGTHS)


def _class_densities(trace: Sequence[Request]) -> dict[tuple[int, int], list[float]]:
    """For each class (uses, length) and age bucket a: the chance that a block of the class
    idle for a requests is used again, over the requests that would still take on
    average (hit density per request of cache time), from the whole trace's reuse gaps."""
    gaps: dict[tuple[int, int], list[int]] = {}
    never: dict[tuple[int, int], int] = {}
    uses: dict[int, int] = {}
    nxt = next_uses(trace)
    for i, r in enumerate(trace):
        cls_len = _length_class(r)
        for p, x in enumerate(r.hash_ids):
            uses[x] = uses.get(x, 0) + 1
            c = (min(uses[x], _CLASS_MAX_USES), cls_len)
            if nxt[i][p] == math.inf:
                never[c] = never.get(c, 0) + 1
            else:
                gaps.setdefault(c, []).append(int(nxt[i][p]) - i)
    out: dict[tuple[int, int], list[float]] = {}
    for c in set(gaps) | set(never):
        g = sorted(gaps.get(c, []))
        tail = [0.0] * (len(g) + 1)
        for j in range(len(g) - 1, -1, -1):
            tail[j] = tail[j + 1] + g[j]
        row = []
        for age in _CLASS_AGES:
            j = bisect.bisect_right(g, age)
            later = len(g) - j
            if not later:
                row.append(0.0)
                continue
            wait = (tail[j] - age * later) / later
            row.append(later / (later + never.get(c, 0)) / max(wait, 1.0))
        out[c] = row
    return out


def hindsight_class_hit_ratio(trace: Sequence[Request], capacity_blocks: int, seed: int = 0) -> float:
    """The best any ranking by (uses so far, prompt length, idle time) could do, roughly:
    it evicts, among a sample of leaves, the one whose class has the lowest hit density,
    with the classes' reuse statistics fitted on the whole trace in hindsight (an online
    policy would have to learn them as it goes)."""
    dens = _class_densities(trace)
    rng = random.Random(seed)
    cached: set[int] = set()
    leaves: list[int] = []
    where: dict[int, int] = {}
    nchild: dict[int, int] = {}
    parent: dict[int, int | None] = {}
    uses: dict[int, int] = {}
    last: dict[int, int] = {}
    length: dict[int, int] = {}

    def leaf(x: int, on: bool) -> None:
        if on and x not in where:
            where[x] = len(leaves)
            leaves.append(x)
        elif not on and x in where:
            j, tail = where.pop(x), leaves.pop()
            if tail != x:
                leaves[j], where[tail] = tail, j

    hit = 0
    for i, r in enumerate(trace):
        ids = r.hash_ids
        hit += hit_tokens(r, _leading(ids, cached))
        prev = None
        for x in ids:
            uses[x] = uses.get(x, 0) + 1
            last[x], length[x] = i, _length_class(r)
            if x not in cached:
                cached.add(x)
                parent[x] = prev
                leaf(x, True)
                if prev is not None:
                    nchild[prev] = nchild.get(prev, 0) + 1
                    leaf(prev, False)
            prev = x
        while len(cached) > capacity_blocks:
            victim, lowest = leaves[0], math.inf
            for _ in range(_CLASS_SAMPLE):
                x = leaves[rng.randrange(len(leaves))]
                row = dens.get((min(uses[x], _CLASS_MAX_USES), length[x]))
                d = row[bisect.bisect_right(_CLASS_AGES, i - last[x]) - 1] if row else 0.0
                if d < lowest:
                    victim, lowest = x, d
            cached.discard(victim)
            leaf(victim, False)
            q = parent.pop(victim)
            if q is not None and q in cached:
                nchild[q] -= 1
                if not nchild[q]:
                    leaf(q, True)
    return _ratio(hit, input_tokens(trace))


def oracle_bounds(trace: Sequence[Request], capacity_blocks: int) -> dict[str, float]:
    """Policies told part of the future, all admitting everything and dropping tails
    like the project's policy: `dead_block_oracle` is LRU that knows which blocks will
    never be used again (they go first); `total_count_oracle` ranks blocks by how often
    the whole trace uses them (recency breaks ties); `hindsight_class_oracle` ranks by
    the reuse statistics of a block's class, fitted on the whole trace
    (hindsight_class_hit_ratio)."""
    nxt = next_uses(trace)
    count: dict[int, int] = {}
    for r in trace:
        for x in r.hash_ids:
            count[x] = count.get(x, 0) + 1
    return {
        "dead_block_oracle": _ranked_cache_hit_ratio(
            trace, capacity_blocks, lambda i, p, x: (nxt[i][p] != math.inf, i)
        ),
        "total_count_oracle": _ranked_cache_hit_ratio(trace, capacity_blocks, lambda i, p, x: (count[x], i)),
        "hindsight_class_oracle": hindsight_class_hit_ratio(trace, capacity_blocks),
    }


# ---- the project's policy -----------------------------------------------------------------
_ID_LIMIT = 1 << 127  # block ids become 16-byte keys (two's complement)


def _key(block_id: int) -> bytes:
    return block_id.to_bytes(16, "big", signed=True)


@dataclass
class PolicyRun:
    hit_tokens: int = 0
    tier_hit_tokens: dict[str, int] = field(default_factory=dict)
    decide_calls: int = 0
    actions: int = 0
    evicted_blocks: int = 0
    demoted_blocks: int = 0
    promoted_blocks: int = 0
    recent_first_passes: int = 0  # decide passes in recent-first order (loops larger than the cache)
    safety_net_blocks: int = 0  # moved or dropped by the agent itself: decide left a tier over (see _safety_net)


def replay_policy(**overrides) -> Policy:
    """The policy the replay runs by default: watermarks at 1.0 (a tier of N blocks
    holds N after every request), everything else as configured."""
    full = TierPolicy(low_watermark=1.0, high_watermark=1.0)
    return replace(Policy(gpu=full, cpu=full, disk=full), **overrides).validate()


EVIDENCE = ("lookups", "events", "none")


class PolicyReplay:
    """One agent with `tiers` (fastest first), the control plane's index and stats, and
    `decide`. `step(request)` serves one request and returns its hit tokens.

    `evidence` is what the control plane learns of each request: `lookups` (a router asks
    kvcp for the prefix before the engine runs, then the engine stores: the access stats
    see every request), `events` (engines only publish what they store, as a vLLM fleet's
    KV events: the policy sees no lookup, only when each block was newly stored, a hit
    refreshing nothing), `none` (neither: how the policy ranked unnamed blocks before the
    index kept store stamps)."""

    def __init__(
        self, tiers: Sequence[tuple[Tier, int]], policy: Policy | None = None, evidence: str = "lookups"
    ) -> None:
        if not tiers:
            raise ValueError("at least one tier")
        if evidence not in EVIDENCE:
            raise ValueError(f"evidence must be one of {', '.join(EVIDENCE)}, not {evidence!r}")
        self.evidence = evidence
        self.stored: dict[bytes, float] = {}  # evidence "events": when each held block was stored
        self.tiers = sorted(tiers, key=lambda t: int(t[0]))
        self.policy = policy or replay_policy()
        self.index = BlockIndex()
        self.stats = AccessStats()
        total = sum(n for _, n in self.tiers)
        self.tuner = (
            CreditTuner(
                max(total, 1),
                default=self.policy.reuse_credit_turnovers,
                max_reuse_credits=self.policy.max_reuse_credits,
            )
            if self.policy.uses_tuner and evidence == "lookups"
            else None
        )
        self.tuned: list[float] = []
        self.held: dict[Tier, dict[bytes, bytes]] = {t: {} for t, _ in self.tiers}
        self.capacity = {t: n for t, n in self.tiers}
        self.where: dict[bytes, Tier] = {}
        self.num_children: dict[bytes, int] = {}  # held blocks with held children
        self.run = PolicyRun(tier_hit_tokens={t.label: 0 for t, _ in self.tiers})
        self._top = self.tiers[0][0]

    def step(self, req: Request) -> int:
        now = req.timestamp_ms / 1000.0
        keys = [_key(x) for x in req.hash_ids]
        matches = self.index.lookup(keys)
        hit_blocks = matches[0].num_hit_blocks if matches else 0
        tokens = hit_tokens(req, hit_blocks)
        self.run.hit_tokens += tokens
        if hit_blocks:
            for p, t in enumerate(matches[0].tiers):
                self.run.tier_hit_tokens[Tier(t).label] += block_tokens(req, p)
        if self.evidence == "lookups":
            self.stats.record_lookup(keys, now)
        if self.tuner is not None:
            self.tuner.observe(keys, now, self.stats)
        self._store(keys, now)
        if any(len(self.held[t]) > self.capacity[t] for t, _ in self.tiers) or self._room_above():
            self._apply(decide(self._view(), self.policy, now))
        return tokens

    def _room_above(self) -> bool:
        return len(self.tiers) > 1 and len(self.held[self._top]) < self.capacity[self._top]

    def _store(self, keys: list[bytes], now: float) -> None:
        top = self.held[self._top]
        parent = ROOT_PARENT_HASH
        stamp = self.evidence == "events"
        for h in keys:
            t = self.where.get(h)
            if t is None:
                top[h] = parent
                if stamp:
                    self.stored[h] = now
                if parent != ROOT_PARENT_HASH:
                    self.num_children[parent] = self.num_children.get(parent, 0) + 1
            elif t is not self._top:
                top[h] = self.held[t].pop(h)
            self.where[h] = self._top
            parent = h
        self.index.add(AGENT_ID, keys, self._top)

    def _view(self) -> ClusterView:
        tiers = tuple(TierView(t, n, self.held[t]) for t, n in self.tiers)
        credit, recent_first = (
            self.tuner.choose(self.policy.tune_reuse_credits, self.policy.scan_resistance)
            if self.tuner is not None
            else (None, False)
        )
        if credit is not None:
            self.tuned.append(credit)
        self.run.recent_first_passes += recent_first
        stored = self.stored if self.evidence == "events" else None
        agent = AgentView(AGENT_ID, tiers, num_children=self.num_children, stored_seconds=stored)
        return ClusterView(agents=(agent,), stats=self.stats, reuse_credit_turnovers=credit, recent_first=recent_first)

    def _apply(self, actions: Iterable) -> None:
        run = self.run
        run.decide_calls += 1
        for a in actions:
            run.actions += 1
            if isinstance(a, Evict):
                nch = self.num_children
                for h in a.block_hashes:
                    if h in nch:
                        raise AssertionError("decide dropped a block before its children")
                    p = self.held[self.where.pop(h)].pop(h)
                    self.stored.pop(h, None)
                    if p != ROOT_PARENT_HASH:
                        if nch[p] == 1:
                            del nch[p]
                        else:
                            nch[p] -= 1
                self.index.remove(AGENT_ID, a.block_hashes)
                run.evicted_blocks += len(a.block_hashes)
            elif isinstance(a, Demote | Promote):
                to = a.to_tier
                for h in a.block_hashes:
                    frm = self.where[h]
                    if isinstance(a, Demote) and frm is not a.from_tier:
                        raise AssertionError(f"decide demoted a block from {a.from_tier.label}; it is in {frm.label}")
                    self.held[to][h] = self.held[frm].pop(h)
                    self.where[h] = to
                self.index.add(AGENT_ID, a.block_hashes, to)
                if isinstance(a, Demote):
                    run.demoted_blocks += len(a.block_hashes)
                else:
                    run.promoted_blocks += len(a.block_hashes)
        self._safety_net()

    def _safety_net(self) -> None:
        """A tier decide left over its capacity is brought back by the agent itself, as a
        real one's store into a full tier makes its room: its oldest blocks, childless
        first, go down a tier, or out from the last. Only a trace whose block ids are not
        prefix chains (a block named after another parent than before) gets here: a
        parent can then sit slower than its child and no tail is left (counted, said in
        the JSON as safety_net_blocks; was an AssertionError that ended the replay)."""
        nch = self.num_children
        for k, (t, _) in enumerate(self.tiers):
            held = self.held[t]
            while len(held) > self.capacity[t]:
                h = next((b for b in held if not nch.get(b)), next(iter(held)))
                self.run.safety_net_blocks += 1
                if k + 1 < len(self.tiers):
                    lower = self.tiers[k + 1][0]
                    self.held[lower][h] = held.pop(h)
                    self.where[h] = lower
                    self.index.add(AGENT_ID, [h], lower)
                    continue
                p = held.pop(h)
                del self.where[h]
                self.stored.pop(h, None)
                for tier_blocks in self.held.values():  # its children (if any) are roots now
                    for c, cp in tier_blocks.items():
                        if cp == h:
                            tier_blocks[c] = ROOT_PARENT_HASH
                nch.pop(h, None)
                if p != ROOT_PARENT_HASH and p in nch:
                    nch[p] -= 1
                    if not nch[p]:
                        del nch[p]
                self.index.remove(AGENT_ID, [h])
                self.run.evicted_blocks += 1


def policy_run(
    trace: Sequence[Request], tiers: Sequence[tuple[Tier, int]], policy: Policy | None = None, evidence: str = "lookups"
) -> PolicyRun:
    replay = PolicyReplay(tiers, policy, evidence)
    for r in trace:
        replay.step(r)
    return replay.run


# ---- the report ---------------------------------------------------------------------------
def _vs(value: float, baseline: float) -> float | None:
    return value / baseline if baseline else None


def _rounded(x: float | None, digits: int) -> float | None:
    return None if x is None else round(x, digits)


def _times(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}x"


@dataclass(frozen=True)
class ReplayResult:
    trace: str
    requests: int
    input_tokens: int
    unique_blocks: int
    capacity_blocks: int
    tiers: dict[str, int]
    policy_hit_ratio: float
    lru_hit_ratio: float
    belady_hit_ratio: float
    infinite_hit_ratio: float
    tier_hit_ratio: dict[str, float]
    decide_calls: int
    evicted_blocks: int
    demoted_blocks: int
    promoted_blocks: int
    seconds: dict[str, float]
    oracles: dict[str, float] = field(default_factory=dict)
    evidence: str = "lookups"
    recent_first_passes: int = 0
    safety_net_blocks: int = 0

    @property
    def policy_vs_lru(self) -> float | None:
        """None where LRU hit nothing (no ratio to state; JSON null, "n/a" in the table)."""
        return _vs(self.policy_hit_ratio, self.lru_hit_ratio)

    @property
    def policy_vs_belady(self) -> float | None:
        return _vs(self.policy_hit_ratio, self.belady_hit_ratio)

    def to_json(self) -> dict:
        return {
            "trace": self.trace,
            "requests": self.requests,
            "input_tokens": self.input_tokens,
            "unique_blocks": self.unique_blocks,
            "capacity_blocks": self.capacity_blocks,
            "tiers": self.tiers,
            "evidence": self.evidence,
            "policy_hit_ratio": round(self.policy_hit_ratio, 4),
            "lru_hit_ratio": round(self.lru_hit_ratio, 4),
            "belady_hit_ratio": round(self.belady_hit_ratio, 4),
            "infinite_hit_ratio": round(self.infinite_hit_ratio, 4),
            "policy_vs_lru": _rounded(self.policy_vs_lru, 3),
            "policy_vs_belady": _rounded(self.policy_vs_belady, 3),
            "tier_hit_ratio": {k: round(v, 4) for k, v in self.tier_hit_ratio.items()},
            "decide_calls": self.decide_calls,
            "evicted_blocks": self.evicted_blocks,
            "demoted_blocks": self.demoted_blocks,
            "promoted_blocks": self.promoted_blocks,
            "recent_first_passes": self.recent_first_passes,
            "safety_net_blocks": self.safety_net_blocks,
            "seconds": {k: round(v, 2) for k, v in self.seconds.items()},
            **{f"{k}_hit_ratio": round(v, 4) for k, v in self.oracles.items()},
        }


def replay(
    trace_path: str | Path,
    capacity_blocks: int | None = None,
    tiers: Sequence[tuple[Tier, int]] | None = None,
    policy: Policy | None = None,
    capacity_fraction: float = 1 / 16,
    trace: Sequence[Request] | None = None,
    oracles: bool = False,
    evidence: str = "lookups",
) -> ReplayResult:
    """Replay one trace at one capacity: `tiers` for a tiered agent (the baselines get
    one pool of their total size), else one tier of `capacity_blocks` (default:
    `capacity_fraction` of the trace's unique blocks)."""
    import time

    trace = trace if trace is not None else load_trace(trace_path)
    uniq = unique_blocks(trace)
    if tiers:
        capacity_blocks = sum(n for _, n in tiers)
    else:
        if capacity_blocks is None:
            capacity_blocks = max(1, round(uniq * capacity_fraction))
        tiers = [(Tier.GPU, capacity_blocks)]
    if capacity_blocks <= 0:
        raise ValueError("capacity must be at least one block")
    seconds: dict[str, float] = {}
    total = input_tokens(trace)

    def timed(name, fn, *args):
        t0 = time.perf_counter()
        out = fn(*args)
        seconds[name] = time.perf_counter() - t0
        return out

    run = timed("policy", policy_run, trace, tiers, policy, evidence)
    lru = timed("lru", lru_hit_ratio, trace, capacity_blocks)
    belady = timed("belady", belady_hit_ratio, trace, capacity_blocks)
    infinite = timed("infinite", infinite_hit_ratio, trace)
    bounds = timed("oracles", oracle_bounds, trace, capacity_blocks) if oracles else {}
    return ReplayResult(
        trace=str(trace_path),
        requests=len(trace),
        input_tokens=total,
        unique_blocks=uniq,
        capacity_blocks=capacity_blocks,
        tiers={t.label: n for t, n in sorted(tiers, key=lambda t: int(t[0]))},
        policy_hit_ratio=_ratio(run.hit_tokens, total),
        lru_hit_ratio=lru,
        belady_hit_ratio=belady,
        infinite_hit_ratio=infinite,
        tier_hit_ratio={k: _ratio(v, total) for k, v in run.tier_hit_tokens.items()},
        decide_calls=run.decide_calls,
        evicted_blocks=run.evicted_blocks,
        demoted_blocks=run.demoted_blocks,
        promoted_blocks=run.promoted_blocks,
        seconds=seconds,
        oracles=bounds,
        evidence=evidence,
        recent_first_passes=run.recent_first_passes,
        safety_net_blocks=run.safety_net_blocks,
    )


def parse_tiers(text: str) -> list[tuple[Tier, int]]:
    """`gpu=N1,cpu=N2,disk=N3` -> [(Tier.GPU, N1), ...]; ValueError names what is wrong."""
    out: dict[Tier, int] = {}
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        name, sep, num = part.partition("=")
        if not sep:
            raise ValueError(f"{part!r} is not tier=blocks (example: gpu=1000,cpu=4000)")
        tier = Tier.parse(name)
        if tier is Tier.REMOTE:
            raise ValueError("the remote tier cannot be replayed; use gpu, cpu or disk")
        if tier in out:
            raise ValueError(f"tier {tier.label} given twice")
        try:
            n = int(num)
        except ValueError:
            raise ValueError(f"{num!r} is not a number of blocks for tier {tier.label}") from None
        if n < 0:
            raise ValueError(f"tier {tier.label}: number of blocks must not be negative")
        out[tier] = n
    if not out or sum(out.values()) <= 0:
        raise ValueError("give at least one tier with blocks (example: gpu=1000,cpu=4000)")
    return sorted(out.items(), key=lambda kv: int(kv[0]))


def parse_fraction(text: str) -> float:
    """`1/16`, `0.0625` or `6.25%` -> 0.0625."""
    s = text.strip()
    try:
        if s.endswith("%"):
            v = float(s[:-1]) / 100
        elif "/" in s:
            a, b = s.split("/", 1)
            v = float(a) / float(b)
        else:
            v = float(s)
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"{text!r} is not a fraction (examples: 1/16, 0.0625, 6.25%)") from None
    if not 0 < v <= 1:
        raise ValueError(f"{text!r} must be a fraction in (0, 1]")
    return v


def format_table(results: Sequence[ReplayResult]) -> str:
    r0 = results[0]
    lines = [
        f"trace {r0.trace}: {r0.requests} requests, {r0.input_tokens} input tokens, {r0.unique_blocks} unique blocks"
        + {"lookups": "", "events": "; the policy sees store events only", "none": "; the policy sees nothing"}[
            r0.evidence
        ],
        "",
        f"{'CAPACITY':>10}  {'POLICY':>7}  {'LRU':>7}  {'BELADY':>7}  {'INFINITE':>8}  {'VS_LRU':>7}  {'VS_BELADY':>9}  TIERS",
    ]
    for r in results:
        tiers = ", ".join(f"{k}={n}:{r.tier_hit_ratio.get(k, 0.0):.4f}" for k, n in r.tiers.items())
        lines.append(
            f"{r.capacity_blocks:>10}  {r.policy_hit_ratio:>7.4f}  {r.lru_hit_ratio:>7.4f}  {r.belady_hit_ratio:>7.4f}"
            f"  {r.infinite_hit_ratio:>8.4f}  {_times(r.policy_vs_lru):>7}  {_times(r.policy_vs_belady):>9}  {tiers}"
        )
    if any(r.oracles for r in results):
        lines.append("")
        for r in results:
            bounds = ", ".join(f"{k} {v:.4f}" for k, v in r.oracles.items())
            lines.append(f"{r.capacity_blocks:>10}  oracle bounds: {bounds}")
    lines.append("")
    lines.append("hit ratio = hit tokens / input tokens; TIERS: blocks per tier and the hit ratio served from each")
    return "\n".join(lines)
