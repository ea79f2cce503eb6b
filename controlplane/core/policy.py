"""The tier policy: a pure `decide(view, policy, now) -> list[Action]` that says which
blocks each agent should demote, drop or promote so every tier stays between its low
and high watermarks. A level-triggered reconcile loop calls it with what agents hold
(`ClusterView`) and applies the actions as agent commands; a missed command is simply
decided again on the next pass. `benchmarks/replay.py` runs the same function on traces.

Rules, in the order they bind:

1. Pins: a pinned block is never dropped, and never demoted slower than its pin's tier;
   one held slower than its pin is promoted back.
2. Prefix structure: a block leaves a tier only as a tail. It is demoted only when none
   of its children on that agent sit in the same or a faster tier, and dropped only when
   the agent holds none of its children at all; a child is useless without its prefix,
   so chains shrink from the end and a lookup never meets a hole.
3. Demote before dropping: a tier above its high watermark sends its lowest-priority
   tails to the next slower tier (GPU -> CPU -> DISK, with the codec the policy names for
   the tier they land in) until it is at its low watermark; only the slowest tier drops.
   A block that would be demoted and then dropped in the same pass is just dropped.
4. Priority (who goes first), from the lookups the control plane serves
   (controlplane.core.access_stats):

       priority = last_access_seconds
                  + reuse_credit_turnovers * turnover_seconds * min(num_reuses, max_reuse_credits)
                  - (replica_discount_credits credits if another agent holds the block)

   `num_reuses` counts the lookups after a block's first: on real traces a block asked
   for twice is several times likelier to be asked for again than one asked for once,
   and most blocks are asked for once. `turnover_seconds` is how long the cluster's
   capacity takes to fill with never-seen blocks, so a credit is worth the same share
   of the cache's memory on any trace, at any request rate or capacity. A block never
   reused is ranked by recency alone (LRU among them, and first to go); each reuse buys
   it `reuse_credit_turnovers` turnovers of extra stay, up to `max_reuse_credits`, so a
   once-hot block that stops being asked for still ages out. Admission is never gated:
   much reuse is a single reuse soon after first use, which frequency-gated admission
   (TinyLFU) throws away. A copy held elsewhere is cheaper to lose. How much a reuse
   is worth depends on the workload (documents: much; multi-turn chat, where a dead
   session's prefix was reused at every turn: nothing), so the view may carry a credit
   chosen by controlplane.core.tuning.CreditTuner from shadow caches of the lookups.
   Loops larger than the cluster's capacity defeat every recency order (each block comes
   back just after it went); while the tuner's shadows say the lookups cycle like that
   (`scan_resistance`), the view asks for `recent_first`: the most recently used tails
   go first, credits aside, which keeps a fixed part of the loop resident.
   `last_access_seconds` is the later of the last lookup naming the block and the last
   time an agent newly stored it (the index stamps each block when an agent newly holds
   it): a fleet whose engines store without asking kvcp first (vLLM KV events alone)
   is ranked by store time, oldest first. Only a block with neither ranks below all.
5. Promotion of hot prefixes: a faster tier below its low watermark is topped up to it
   with the highest-priority blocks of slower tiers that were reused at least
   `promote_min_reuses` times, before an engine asks for them.

Measured against LRU and Belady (MIN) by `kvcp-bench replay`; see README.md.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, Protocol

from protos import errors
from protos.block_hash import ROOT_PARENT_HASH
from protos.kv_format import CODECS
from protos.tier import Tier

MANAGED_TIERS = (Tier.GPU, Tier.CPU, Tier.DISK)
_MAX_CREDITS = 1000


# ---- policy -----------------------------------------------------------------------------
@dataclass(frozen=True)
class TierPolicy:
    """Watermarks are fractions of the tier's capacity in blocks: above `high_watermark`
    a pass brings the tier down to `low_watermark`. `codec` is applied to blocks demoted
    into this tier ("none": as they are)."""

    low_watermark: float = 0.90
    high_watermark: float = 0.95
    codec: str = "none"


@dataclass(frozen=True)
class Policy:
    """Tunables of `decide`. Build it with `from_mapping` (flat `key=value` strings, as
    `kvctl policy set` and etcd store them) or directly, then `validate()`."""

    gpu: TierPolicy = field(default_factory=TierPolicy)
    cpu: TierPolicy = field(default_factory=TierPolicy)
    disk: TierPolicy = field(default_factory=TierPolicy)
    reuse_credit_turnovers: float = 2.0
    max_reuse_credits: int = 3
    replica_discount_credits: float = 1.0
    promote_hot: bool = True
    promote_min_reuses: int = 1
    tune_reuse_credits: bool = True
    scan_resistance: bool = True

    @property
    def uses_tuner(self) -> bool:
        """Whether passes ask controlplane.core.tuning.CreditTuner (credit, loop order)."""
        return self.tune_reuse_credits or self.scan_resistance

    def tier(self, tier: Tier) -> TierPolicy:
        if tier is Tier.GPU:
            return self.gpu
        if tier is Tier.CPU:
            return self.cpu
        if tier is Tier.DISK:
            return self.disk
        return TierPolicy()

    # ---- flat keys ----------------------------------------------------------------------
    @classmethod
    def keys(cls) -> list[str]:
        tier_keys = [f"{t.label}.{f.name}" for t in MANAGED_TIERS for f in fields(TierPolicy)]
        return tier_keys + [f.name for f in fields(cls) if f.name not in {t.label for t in MANAGED_TIERS}]

    def to_mapping(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for t in MANAGED_TIERS:
            tp = self.tier(t)
            for f in fields(TierPolicy):
                out[f"{t.label}.{f.name}"] = _format(getattr(tp, f.name))
        for f in fields(self):
            if f.name not in {t.label for t in MANAGED_TIERS}:
                out[f.name] = _format(getattr(self, f.name))
        return out

    @classmethod
    def from_mapping(cls, values: Mapping[str, object], field: str = "values", base: Policy | None = None) -> Policy:
        """Policy from flat keys (`gpu.high_watermark=0.9`, `promote_hot=false`, ...) over
        `base` (default: the defaults). Raises InvalidArgument naming `field[key]`."""
        policy = base or cls()
        tiers = {t.label: policy.tier(t) for t in MANAGED_TIERS}
        top: dict[str, Any] = {}
        known = set(cls.keys())
        for key, raw in values.items():
            name = f"{field}[{key[:80]}{'...' if len(key) > 80 else ''}]"  # (a long key cut off why)
            if key not in known:
                raise errors.InvalidArgument(name, f"unknown policy key (known: {', '.join(sorted(known))})")
            if "." in key:
                label, attr = key.split(".", 1)
                tiers[label] = replace(tiers[label], **{attr: _parse(TierPolicy, attr, raw, name)})
            else:
                top[key] = _parse(cls, key, raw, name)
        by_label: dict[str, Any] = dict(tiers)
        policy = replace(policy, **by_label, **top)
        return policy.validate(field=field, bracket=True)

    def validate(self, field: str = "policy", bracket: bool = False) -> Policy:
        """Raise InvalidArgument naming the first out-of-range value; return self."""

        def name(key: str) -> str:
            return f"{field}[{key}]" if bracket else f"{field}.{key}"

        for t in MANAGED_TIERS:
            tp = self.tier(t)
            low, high = tp.low_watermark, tp.high_watermark
            for attr, v in (("low_watermark", low), ("high_watermark", high)):
                if not (isinstance(v, int | float) and math.isfinite(v) and 0.0 < v <= 1.0):
                    raise errors.InvalidArgument(name(f"{t.label}.{attr}"), f"must be a fraction in (0, 1], got {v!r}")
            if low > high:
                raise errors.InvalidArgument(
                    name(f"{t.label}.low_watermark"),
                    f"must not exceed {t.label}.high_watermark ({_format(high)}), got {_format(low)}; "
                    f"moving one past the other: set both in one call ({t.label}.high_watermark=H "
                    f"{t.label}.low_watermark=L)",
                )
            if tp.codec not in CODECS:
                raise errors.InvalidArgument(
                    name(f"{t.label}.codec"), f"unknown codec {tp.codec!r} (expected one of {'|'.join(CODECS)})"
                )
        for attr, lo, hi in (
            ("reuse_credit_turnovers", 0.0, float(_MAX_CREDITS)),
            ("replica_discount_credits", 0.0, float(_MAX_CREDITS)),
        ):
            v = getattr(self, attr)
            if not (isinstance(v, int | float) and math.isfinite(v) and lo <= v <= hi):
                raise errors.InvalidArgument(name(attr), f"must be a number in [{lo:g}, {hi:g}], got {v!r}")
        for attr, lo, hi in (("max_reuse_credits", 0, _MAX_CREDITS), ("promote_min_reuses", 0, 1 << 20)):
            v = getattr(self, attr)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise errors.InvalidArgument(name(attr), f"must be an integer in [{lo}, {hi}], got {v!r}")
        for attr in ("promote_hot", "tune_reuse_credits", "scan_resistance"):
            if not isinstance(getattr(self, attr), bool):
                raise errors.InvalidArgument(name(attr), f"must be true or false, got {getattr(self, attr)!r}")
        return self


def _format(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        short = f"{v:g}"
        return short if float(short) == v else repr(v)  # short, but never rounded (0.9999999 is not 1)
    return str(v)


def _parse(cls: type, attr: str, raw: object, name: str) -> Any:
    kind = {f.name: str(f.type) for f in fields(cls)}[attr]  # annotations are strings here
    text: Any = raw.strip() if isinstance(raw, str) else raw
    try:
        if kind == "bool":
            if isinstance(text, bool):
                return text
            s = str(text).lower()
            if s in ("true", "1", "yes", "on"):
                return True
            if s in ("false", "0", "no", "off"):
                return False
            raise ValueError
        if kind == "int":
            if isinstance(text, bool) or (isinstance(text, float) and not text.is_integer()):
                raise ValueError
            return int(text)
        if kind == "float":
            if isinstance(text, bool):
                raise ValueError
            return float(text)
        return str(text).lower()
    except (TypeError, ValueError):
        expected = {"bool": "true or false", "int": "an integer", "float": "a number"}[kind]
        raise errors.InvalidArgument(name, f"must be {expected}, got {raw!r}") from None


# ---- actions ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Demote:
    """Move blocks of `agent_id` from `from_tier` to the slower `to_tier` (children before
    parents), re-encoding them with `codec` ("none": unchanged)."""

    agent_id: str
    block_hashes: tuple[bytes, ...]
    from_tier: Tier
    to_tier: Tier
    codec: str = "none"


@dataclass(frozen=True)
class Evict:
    """Drop blocks from `agent_id` entirely, in this order (children before parents)."""

    agent_id: str
    block_hashes: tuple[bytes, ...]


@dataclass(frozen=True)
class Promote:
    """Move blocks of `agent_id` up to the faster `to_tier` (parents before children)."""

    agent_id: str
    block_hashes: tuple[bytes, ...]
    to_tier: Tier


Action = Demote | Evict | Promote


# ---- the view -------------------------------------------------------------------------------
@dataclass(frozen=True)
class TierView:
    """One tier of one agent: its capacity and the blocks it holds, each with its parent
    (ROOT_PARENT_HASH for the first block of a prompt; None where the parent is not
    known, which the pass treats like a first block)."""

    tier: Tier
    capacity_blocks: int
    blocks: Mapping[bytes, bytes | None]

    @property
    def used_blocks(self) -> int:
        return len(self.blocks)

    @classmethod
    def from_bytes(
        cls, tier: Tier, capacity_bytes: int, block_bytes: int, blocks: Mapping[bytes, bytes | None]
    ) -> TierView:
        """A tier sized in bytes, for agents that report bytes (fixed-size blocks)."""
        return cls(tier, capacity_bytes // max(block_bytes, 1), blocks)


@dataclass(frozen=True)
class AgentView:
    """What one agent holds. Invariant (the agent keeps it): a block is held in at most
    one tier, and its parent is held on the same agent, in some tier, unless it is the
    first block of a prompt. `num_children`, when given, maps each held block that has
    held children to their number (blocks without children are absent), as the agent's
    block pool keeps it; it spares the pass a count over every block. `stored_seconds`,
    when given, says when an agent last newly stored each block (the index's stamp): the
    evidence the pass ranks a block by when no lookup named it."""

    agent_id: str
    tiers: tuple[TierView, ...]
    num_children: Mapping[bytes, int] | None = None
    stored_seconds: Mapping[bytes, float] | None = None


@dataclass(frozen=True)
class Pins:
    """Active pins, resolved to the slowest tier each block may sit in: per block, and
    per namespace (with `block_namespaces` saying which namespace a block belongs to).
    Where both apply the faster tier wins."""

    blocks: Mapping[bytes, Tier] = field(default_factory=dict)
    namespaces: Mapping[str, Tier] = field(default_factory=dict)
    block_namespaces: Mapping[bytes, str] = field(default_factory=dict)

    def min_tier(self, block_hash: bytes) -> Tier | None:
        t = self.blocks.get(block_hash)
        if self.namespaces:
            ns = self.block_namespaces.get(block_hash)
            nt = self.namespaces.get(ns) if ns is not None else None
            if nt is not None and (t is None or nt < t):
                t = nt
        return t

    def __bool__(self) -> bool:
        return bool(self.blocks) or bool(self.namespaces)


class StatsReader(Protocol):
    """What `decide` reads of controlplane.core.access_stats.AccessStats."""

    def get(self, block_hash: bytes): ...
    def turnover_seconds(self, capacity_blocks: int) -> float: ...


@dataclass(frozen=True)
class ClusterView:
    """Everything `decide` looks at. `replicas` (holders per block across agents) is
    derived from `agents` when not given; `turnover_seconds`, when given, overrides the
    one derived from the stats and the cluster's total capacity;
    `reuse_credit_turnovers`, when given (by controlplane.core.tuning.CreditTuner), is
    used instead of the policy's unless the policy turns tuning off."""

    agents: tuple[AgentView, ...]
    stats: StatsReader
    pins: Pins = field(default_factory=Pins)
    replicas: Mapping[bytes, int] | None = None
    turnover_seconds: float | None = None
    reuse_credit_turnovers: float | None = None
    recent_first: bool = False  # the tuner saw loops larger than the cache: newest tails go first


# ---- scoring --------------------------------------------------------------------------------
def block_priority(
    stats,
    turnover_seconds: float,
    policy: Policy,
    replicated: bool,
    now: float,
    stored_seconds: float | None = None,
    recent_first: bool = False,
) -> float:
    """Higher stays longer. `stats` is the block's BlockStats (None: never looked up);
    `stored_seconds` when an agent last newly stored it (None: not known). A store is a
    use (an engine computed or received the block), so it counts as an access; a block
    with neither ranks below everything. `recent_first`: the older the last use, the
    longer it stays (loops larger than the cache). See the module docstring for the rule."""
    if stored_seconds is not None and math.isnan(stored_seconds):
        stored_seconds = None
    if stats is None:
        if stored_seconds is None:
            return -math.inf
        last, credits = stored_seconds, 0.0
    else:
        last = stats.last_access_seconds
        if stored_seconds is not None and stored_seconds > last:
            last = stored_seconds
        credits = float(min(stats.num_reuses, policy.max_reuse_credits))
    if recent_first:
        return -min(last, now)
    if replicated:
        credits -= policy.replica_discount_credits
    bonus = policy.reuse_credit_turnovers * turnover_seconds * credits if credits else 0.0
    if not math.isfinite(bonus):  # an unbounded turnover (no new blocks for weeks): never NaN
        bonus = 0.0 if math.isnan(bonus) else math.copysign(1e300, bonus)
    return min(last, now) + bonus


def total_capacity_blocks(agents: Iterable[AgentView]) -> int:
    return sum(tv.capacity_blocks for a in agents for tv in a.tiers)


def room_without_drops_bytes(tiers: Iterable[Any], policy: Policy) -> int:
    """What an agent can take in through handoffs (they land in its CPU tier; `tiers`: its
    reported usage, each with tier, capacity_bytes and used_bytes) before a pass drops any
    of its blocks: its drop line (drop_line_bytes) less what its CPU tier and the tiers
    below it hold."""
    tiers = list(tiers)
    used = sum(t.used_bytes for t in tiers if Tier(t.tier) >= Tier.CPU and t.capacity_bytes > 0)
    return max(0, drop_line_bytes(tiers, policy) - used)


def drop_line_bytes(tiers: Iterable[Any], policy: Policy) -> int:
    """The used bytes of an agent's CPU tier and the tiers below it, summed, past which a
    pass drops some of its blocks (0: it has no such tier). A pass brings a tier over its
    high watermark down to its low one by demoting into the tier below, and only the
    slowest tier drops. So those tiers hold, without a drop, up to the low watermark of
    each but the slowest and the high watermark of that one. A GPU tier's room is none of
    it; a GPU tier over its high watermark takes from it what the next pass demotes (down
    to its low one), which lands in the same CPU tier. (One under its high moves nothing
    until the engine fills it further: the workload's own growth is no drain's to
    foresee.) The agent itself holds a drain's blocks to it as its tiers stand at each
    handoff (ReserveRequest.fill_limit_bytes)."""
    tiers = list(tiers)
    landing = sorted((t for t in tiers if Tier(t.tier) >= Tier.CPU and t.capacity_bytes > 0), key=lambda t: t.tier)
    if not landing:
        return 0
    line = 0
    for t in tiers:
        if Tier(t.tier) < Tier.CPU and t.capacity_bytes > 0:
            tp = policy.tier(Tier(t.tier))
            if t.used_bytes > math.floor(tp.high_watermark * t.capacity_bytes + 1e-9):
                line -= t.used_bytes - math.floor(tp.low_watermark * t.capacity_bytes + 1e-9)
    for t in landing:
        tp = policy.tier(Tier(t.tier))
        fraction = tp.high_watermark if t is landing[-1] else tp.low_watermark
        line += math.floor(fraction * t.capacity_bytes + 1e-9)
    return max(0, line)


def _threshold(fraction: float, capacity_blocks: int) -> int:
    return int(math.floor(fraction * capacity_blocks + 1e-9))


# ---- decide ---------------------------------------------------------------------------------
def decide(view: ClusterView, policy: Policy, now: float) -> list[Action]:
    """The actions that bring every agent's tiers within their watermarks (see the module
    docstring). Reads `view` and never changes it; the same inputs give the same list."""
    if view.reuse_credit_turnovers is not None and policy.tune_reuse_credits:
        policy = replace(policy, reuse_credit_turnovers=view.reuse_credit_turnovers)
    actions: list[Action] = []
    turnover: float | None = view.turnover_seconds
    replicas = dict(view.replicas) if view.replicas is not None else None
    for agent in view.agents:
        tiers = sorted((tv for tv in agent.tiers if tv.tier in MANAGED_TIERS), key=lambda tv: int(tv.tier))
        if not tiers:
            continue
        over = any(tv.used_blocks > _threshold(policy.tier(tv.tier).high_watermark, tv.capacity_blocks) for tv in tiers)
        if not over and not _may_promote(tiers, policy, view.pins):
            continue
        if turnover is None:
            turnover = view.stats.turnover_seconds(total_capacity_blocks(view.agents))
        if replicas is None:
            replicas = dict(_replica_counts(view.agents)) if len(view.agents) > 1 else {}
        decided = _AgentPass(agent, tiers, view, policy, now, turnover, replicas).run()
        copies_dropped(replicas, decided)
        actions.extend(decided)
    return actions


def copies_dropped(replicas: dict[bytes, int], actions: Iterable[Action]) -> None:
    """Count the copies `actions` drop out of `replicas`: a block another agent holds is
    cheaper to lose only while that copy stays, so the next agent of the same pass no
    longer discounts a block whose other copy was just dropped (each holder dropping it
    as held elsewhere lost every copy of a hot shared prefix at once)."""
    for a in actions:
        if isinstance(a, Evict):
            for h in a.block_hashes:
                if h in replicas:
                    replicas[h] -= 1


def _may_promote(tiers: list[TierView], policy: Policy, pins: Pins) -> bool:
    if pins:
        return True  # a pinned block may sit below its pin's tier
    if not policy.promote_hot or len(tiers) < 2:
        return False
    free = any(tv.used_blocks < _threshold(policy.tier(tv.tier).low_watermark, tv.capacity_blocks) for tv in tiers[:-1])
    return free and any(tv.used_blocks for tv in tiers[1:])


def _replica_counts(agents: Iterable[AgentView]) -> Mapping[bytes, int]:
    counts: Counter[bytes] = Counter()
    for a in agents:
        held: set[bytes] = set()
        for tv in a.tiers:
            held.update(tv.blocks)
        counts.update(held)
    return counts


class _AgentPass:
    """One agent's pass over its tiers, fastest (level 0) first. `content[i]` is the set
    of blocks at level i as the pass moves them; `origin` remembers where a moved block
    started. Bulk work is set and Counter arithmetic, so a pass over a large tier costs
    little more than scoring its tails."""

    def __init__(self, agent, tiers, view, policy, now, turnover, replicas):
        self.agent_id = agent.agent_id
        self.num_children = agent.num_children
        self.stored = agent.stored_seconds or {}
        self.tiers = tiers
        self.policy = policy
        self.pins = view.pins
        self.stats = view.stats
        self.now = now
        self.turnover = turnover
        self.replicas = replicas
        self.recent_first = view.recent_first and policy.scan_resistance
        self.parent: Mapping[bytes, bytes]
        if len(tiers) == 1:
            self.parent = tiers[0].blocks  # read only: no copy
        else:
            self.parent = {}
            for tv in tiers:
                self.parent.update(tv.blocks)
        self.content: list[set[bytes]] = [set(tv.blocks) for tv in tiers]
        self.origin: dict[bytes, int] = {}  # level before the pass, of blocks it moves
        self.moved_in: list[tuple[bytes, int]] = []  # (block, level) of each move, in order
        self.dropped: list[bytes] = []

    def priority(self, h: bytes) -> tuple[float, int, int, bytes]:
        """Heap key, lowest goes first: the priority, then (at equal priority) a copy held
        elsewhere first, then the block whose last lookup came first (clock times tie on
        traces with coarse or no timestamps), then the hash so that passes are
        deterministic."""
        replicated = self.replicas.get(h, 1) > 1 if self.replicas else False
        s = self.stats.get(h)
        p = block_priority(s, self.turnover, self.policy, replicated, self.now, self.stored.get(h), self.recent_first)
        return (p, 0 if replicated else 1, getattr(s, "last_lookup", -1), h)

    def pin_allows(self, h: bytes, target: int | None) -> bool:
        """May `h` go to level `target` (None: dropped)?"""
        if not self.pins:
            return True
        pin = self.pins.min_tier(h)
        if pin is None:
            return True
        return target is not None and self.tiers[target].tier <= pin

    def run(self) -> list[Action]:
        # pins first (a repaired pin may push a tier over, and the shrink makes room),
        # then hot prefixes into room below low watermarks, then every tier over its
        # high watermark down to its low one, fastest first so demotions cascade
        self._repair_pins()
        if self.policy.promote_hot:
            self._promote_hot()
        last = len(self.tiers) - 1
        for _ in range(3):  # again after an undo: what it put back may free a victim it held
            for i, tv in enumerate(self.tiers):
                tp = self.policy.tier(tv.tier)
                if len(self.content[i]) > _threshold(tp.high_watermark, tv.capacity_blocks):
                    self._shrink(i, len(self.content[i]) - _threshold(tp.low_watermark, tv.capacity_blocks), i == last)
            if not self._fit_capacities():
                break
        return self._actions()

    def _fit_capacities(self) -> bool:
        """Undo the pass's latest moves into a tier it leaves over its capacity (blocks
        there that may not leave it: pinned at that tier), most recent first, until every
        tier fits: an agent cannot carry such moves out, and the same failing moves came
        back every pass. Undoing the latest first takes a demoted chain back parents first
        and a promoted one children first, so no block ends slower than its child.
        Returns whether it undid any."""
        undid = False
        while True:
            over = [k for k, tv in enumerate(self.tiers) if len(self.content[k]) > tv.capacity_blocks]
            if not over:
                return undid
            for idx in range(len(self.moved_in) - 1, -1, -1):
                h, k = self.moved_in[idx]
                if k in over and h in self.content[k]:
                    # back where this move took it from: its previous move's level, or its origin
                    back = next((lv for b, lv in reversed(self.moved_in[:idx]) if b == h), self.origin[h])
                    del self.moved_in[idx]
                    self.content[k].discard(h)
                    self.content[back].add(h)
                    undid = True
                    break
            else:
                return undid  # over before the pass: nothing of this pass to undo

    def _shrink(self, i: int, need: int, is_last: bool) -> None:
        """Move `need` tails out of level i: down one level, or out of the agent."""
        parent, content = self.parent, self.content[i]
        # children that hold a block in place: any held child when dropping; when
        # demoting, children at this level or a faster one
        if is_last:
            # nothing has been dropped yet (only the last tier drops): every held child
            if self.num_children is not None:
                blockers: Counter[bytes] = Counter()
                blockers.update(self.num_children)  # a copy: the pass counts down
            else:
                blockers = Counter(parent.values())
        else:
            blockers = Counter()
            for lv in self.content[: i + 1]:
                blockers.update(map(parent.__getitem__, lv))
        target = None if is_last else i + 1
        heap = [self.priority(h) for h in content.difference(blockers) if self.pin_allows(h, target)]
        heapq.heapify(heap)
        while need > 0 and heap:
            h = heapq.heappop(heap)[-1]
            content.discard(h)
            self.origin.setdefault(h, i)
            if is_last:
                self.dropped.append(h)
            else:
                self.content[i + 1].add(h)
                self.moved_in.append((h, i + 1))
            need -= 1
            p = parent[h]
            n = blockers.get(p)
            if n is not None:
                blockers[p] = n - 1
                if n == 1 and p in content and self.pin_allows(p, target):
                    heapq.heappush(heap, self.priority(p))

    def _level(self, h: bytes) -> int | None:
        for i, lv in enumerate(self.content):
            if h in lv:
                return i
        return None

    def _repair_pins(self) -> None:
        """Pinned blocks held slower than their pin go back up (parents first), as far as
        the tier they go to can hold them: its capacity less the blocks pinned there that
        cannot leave it. The shrink that follows makes the room; a tier full of such
        blocks takes none (a promotion there fails on the agent, pass after pass: an idle
        agent spun a core on it), and the pin holds where it can."""
        if not self.pins:
            return
        tiers = self.tiers
        last = len(tiers) - 1
        budget: dict[int, int] = {}

        def room(k: int) -> int:
            if k not in budget:
                below = k + 1 if k < last else None
                stuck = sum(1 for b in self.content[k] if not self.pin_allows(b, below))
                budget[k] = tiers[k].capacity_blocks - stuck
            return budget[k]

        for j in range(1, len(tiers)):
            wanted: dict[bytes, int] = {}
            for h in self.content[j]:
                pin = self.pins.min_tier(h)
                if pin is not None and tiers[j].tier > pin:
                    wanted[h] = max((k for k, tv in enumerate(tiers) if tv.tier <= pin), default=0)
            for h in _parents_first(list(wanted), self.parent):
                target = wanted[h]
                # with its ancestors held slower than the target: a parent left below its
                # child could never leave its tier (not a tail), which would then overflow
                chain = []
                b = h
                while (k := self._level(b)) is not None and k > target:
                    chain.append((b, k))
                    b = self.parent.get(b, ROOT_PARENT_HASH)
                if chain and room(target) >= len(chain):
                    budget[target] -= len(chain)
                    for b, k in reversed(chain):  # parents first
                        self._move_up(b, k, target)

    def _promote_hot(self) -> None:
        """Top up each faster tier below its low watermark with the highest-priority
        blocks of slower tiers that were reused at least `promote_min_reuses` times."""
        tiers = self.tiers
        moved = set(self.origin)
        for i in range(len(tiers) - 1):
            room = _threshold(self.policy.tier(tiers[i].tier).low_watermark, tiers[i].capacity_blocks)
            room -= len(self.content[i])
            if room <= 0:
                continue
            hot = []
            where = {}  # block of a slower tier -> its tier index
            for j in range(i + 1, len(tiers)):
                for h in self.content[j]:
                    where[h] = j
                    if h in moved:
                        continue
                    s = self.stats.get(h)
                    if s is not None and s.num_reuses >= self.policy.promote_min_reuses:
                        hot.append((self.priority(h), j))
            # never a block above its parent: a parent left in a slower tier with a child in
            # a faster one could be neither dropped nor demoted there (its tier overflows)
            for (*_, h), _j in heapq.nlargest(room, hot):
                chain = []
                while h in where:  # it and its ancestors still slower than tier i
                    chain.append(h)
                    h = self.parent.get(h, ROOT_PARENT_HASH)
                if not chain or len(chain) > room:
                    continue
                for b in reversed(chain):  # parents first
                    self._move_up(b, where.pop(b), i)
                    moved.add(b)
                room -= len(chain)
                if room <= 0:
                    break

    def _move_up(self, h: bytes, frm: int, to: int) -> None:
        self.origin.setdefault(h, frm)
        self.content[frm].discard(h)
        self.content[to].add(h)
        self.moved_in.append((h, to))

    def _actions(self) -> list[Action]:
        """Net moves of the pass, in an order an agent can apply one by one: drops first
        (children before parents), then demotions into the slowest tier first (so every
        tier has room when blocks arrive; children before parents, so no block is ever
        slower than a child of it that is moving too), then promotions (parents first)."""
        out: list[Action] = []
        if self.dropped:
            out.append(Evict(self.agent_id, tuple(self.dropped)))
        down: dict[int, list[bytes]] = {}
        up: dict[int, list[bytes]] = {}
        for h, frm in self.origin.items():
            to = self._level(h)
            if to is None or to == frm:
                continue
            (down if to > frm else up).setdefault(to, []).append(h)
        for to in sorted(down, reverse=True):
            hs = _parents_first(down[to], self.parent)[::-1]
            codec = self.policy.tier(self.tiers[to].tier).codec
            run: list[bytes] = []
            for k, h in enumerate(hs):
                run.append(h)
                frm = self.origin[h]
                if k + 1 == len(hs) or self.origin[hs[k + 1]] != frm:
                    out.append(Demote(self.agent_id, tuple(run), self.tiers[frm].tier, self.tiers[to].tier, codec))
                    run = []
        for to in sorted(up):
            out.append(Promote(self.agent_id, tuple(_parents_first(up[to], self.parent)), self.tiers[to].tier))
        return out


def _parents_first(hashes: list[bytes], parent: Mapping[bytes, bytes]) -> list[bytes]:
    """Order `hashes` so that a block comes after its parent when both are listed."""
    chosen = set(hashes)
    out: list[bytes] = []
    done: set[bytes] = set()
    for h in hashes:
        chain = []
        while h in chosen and h not in done:
            chain.append(h)
            done.add(h)
            h = parent.get(h, ROOT_PARENT_HASH)
        out.extend(reversed(chain))
    return out
