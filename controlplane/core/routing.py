"""Routing for disaggregated serving: which agent prefills a request, which decodes it,
and whether to split them at all. Pure functions over what agents report
(AgentStats.dataplane: free capacity, handoffs in flight and queued, each link's fitted
latency and capacity) and what the index knows (cached prefix per agent).

The rule (README, "Prefill->decode handoff"; in full in docs/handoff.md):

- prefill agent: least estimated time to first byte of KV, i.e. the tokens it must
  still compute (prompt minus its cached prefix) at `prefill_tokens_per_second`, plus
  `queue_penalty_seconds` per handoff it has waiting or on the wire. Agents whose
  handoffs are queued behind slow decode agents are steered away from this way.
- decode agent (given the prefill agent P): least estimated handoff time, i.e. the
  link's latency plus the bytes it lacks (prompt blocks minus its cached prefix) over
  the capacity P fitted for the link to it (or `default_link_bytes_per_second` before
  any transfer measured it), scaled by 1 + the transfers already on that link, plus
  `queue_penalty_seconds` per handoff arriving there. A decode agent is *behind* when its free capacity for handoffs is
  under `free_watermark` of its capacity (or under what this request needs), or it
  has `max_inbound` handoffs arriving; behind agents are only chosen when all are, and
  then the answer says `backpressure` (a router queues the request).
- split or not: when P can also decode (role both), the request stays on P when the
  handoff would cost more than it saves: cost = the decode agent's handoff time,
  saving = `interference_factor` x P's prefill time (the decode slowdown a prefill
  causes on an agent doing both). It also stays when no decode agent is usable.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

from protos import errors
from protos.block_hash import BLOCK_HASH_BYTES
from protos.kv_format import kv_block_bytes

PREFILL, DECODE, BOTH = "prefill", "decode", "both"
ROUTED_HOLD_SECONDS = 2.0  # a Route's bytes count against its decode agent this long (about two reports)
ROLES = ("prefill", "decode", "pair")


@dataclass(frozen=True)
class LinkView:
    peer_agent_id: str
    throughput_bytes_per_second: float = 0.0  # the link's capacity for bytes (0: not measured)
    inflight: int = 0
    queued: int = 0
    latency_seconds: float = 0.0  # the fixed cost of one transfer on it


@dataclass(frozen=True)
class DataPlaneView:
    """What one agent last reported about its data plane."""

    handoff_free_bytes: int = 0
    handoff_capacity_bytes: int = 0
    inbound_reservations: int = 0
    max_inbound: int = 8
    outbound_inflight: int = 0
    outbound_queued: int = 0
    links: Mapping[str, LinkView] = field(default_factory=dict)
    handoff_tier: int = 0  # the tier handoffs land in (0: not told)


@dataclass(frozen=True)
class Candidate:
    agent_id: str
    address: str
    role: str = BOTH
    num_cached_blocks: int = 0
    dataplane: DataPlaneView | None = None
    lookup_rank: int = 0  # its place in the lookup's answer (longest, then fastest tiers first)
    # of its cached prefix blocks, those its handoff_free_bytes counts (held in the handoff
    # tier, not pinned): a handoff keeps them, so they are no room for it (None: not known,
    # every cached block is taken to count)
    num_counted_cached_blocks: int | None = None


@dataclass(frozen=True)
class RouteParams:
    prefill_tokens_per_second: float = 20_000.0
    default_link_bytes_per_second: float = 1e9
    interference_factor: float = 0.5
    free_watermark: float = 0.1
    queue_penalty_seconds: float = 0.05
    # decode agents whose scores are within this fraction of the best (plus 1 ms) are as
    # good a choice: the roomiest of them is taken (a link measured a little faster took
    # every handoff while another agent had room, and its blocks were pushed out)
    near_score_fraction: float = 0.25
    # an agent silent this long is not routed to (it reports every second when well)
    max_silence_seconds: float = 5.0


@dataclass(frozen=True)
class Score:
    agent_id: str
    score: float
    num_cached_blocks: int
    load: float
    free_bytes: int
    link_bytes_per_second: float = 0.0
    transfer_seconds: float = 0.0
    behind: bool = False
    note: str = ""


@dataclass(frozen=True)
class RouteDecision:
    role: str
    agent_id: str = ""
    prefill_agent_id: str = ""
    decode_agent_id: str = ""
    disaggregate: bool = False
    num_cached_tokens: int = 0
    transfer_seconds: float = 0.0
    saved_seconds: float = 0.0
    reason: str = ""
    candidates: tuple[Score, ...] = ()
    backpressure: bool = False
    address: str = ""  # of `agent_id`


def _load(dp: DataPlaneView | None) -> float:
    if dp is None:
        return 0.0
    return float(dp.inbound_reservations + dp.outbound_inflight + dp.outbound_queued)


def prefill_scores(agents: Sequence[Candidate], num_blocks: int, block_size: int, params: RouteParams) -> list[Score]:
    out = []
    for a in agents:
        if a.role not in (PREFILL, BOTH):
            continue
        tokens = (num_blocks - a.num_cached_blocks) * block_size
        compute = max(0, tokens) / params.prefill_tokens_per_second
        queued = (a.dataplane.outbound_queued + a.dataplane.outbound_inflight) if a.dataplane else 0
        out.append(
            Score(
                a.agent_id,
                compute + params.queue_penalty_seconds * queued,
                a.num_cached_blocks,
                _load(a.dataplane),
                a.dataplane.handoff_free_bytes if a.dataplane else 0,
                note=f"prefill: {max(0, tokens)} tokens to compute, {queued} handoffs waiting",
            )
        )
    rank = {a.agent_id: a.lookup_rank for a in agents}
    return sorted(out, key=lambda s: (s.score, -s.num_cached_blocks, rank[s.agent_id], s.agent_id))


def decode_scores(
    agents: Sequence[Candidate],
    num_blocks: int,
    block_bytes: int,
    params: RouteParams,
    prefill_agent_id: str = "",
    prefill_view: DataPlaneView | None = None,
) -> list[Score]:
    out = []
    for a in agents:
        if a.role not in (DECODE, BOTH) or a.agent_id == prefill_agent_id:
            continue
        dp = a.dataplane or DataPlaneView()
        need = max(0, num_blocks - a.num_cached_blocks) * block_bytes
        # the blocks of the prefix it holds in the handoff tier, unpinned, count in its free
        # bytes (they could be evicted), but a handoff keeps them: what it can take is what
        # is free besides them
        counted = a.num_cached_blocks if a.num_counted_cached_blocks is None else a.num_counted_cached_blocks
        usable = max(0, dp.handoff_free_bytes - min(num_blocks, a.num_cached_blocks, counted) * block_bytes)
        link = (prefill_view.links.get(a.agent_id) if prefill_view is not None else None) or LinkView(a.agent_id)
        rate = link.throughput_bytes_per_second or params.default_link_bytes_per_second
        busy = link.inflight + link.queued
        # its share of the link, after those on it or waiting; plus one transfer's fixed cost
        transfer = (link.latency_seconds if need else 0.0) + need / rate * (1 + busy)
        behind_why = ""
        if dp.handoff_capacity_bytes and dp.handoff_free_bytes < params.free_watermark * dp.handoff_capacity_bytes:
            behind_why = f"free {dp.handoff_free_bytes} B under the {params.free_watermark:.0%} watermark"
        elif dp.handoff_capacity_bytes and usable < need:
            behind_why = f"free {usable} B besides the prefix's own blocks < {need} B needed"
        elif dp.inbound_reservations >= dp.max_inbound:
            behind_why = f"{dp.inbound_reservations} handoffs arriving (limit {dp.max_inbound})"
        score = transfer + params.queue_penalty_seconds * dp.inbound_reservations
        measured = "measured" if link.throughput_bytes_per_second else "assumed"
        fixed = f" + {link.latency_seconds * 1e3:.1f} ms a transfer" if need and link.latency_seconds else ""
        out.append(
            Score(
                a.agent_id,
                score,
                a.num_cached_blocks,
                _load(dp),
                dp.handoff_free_bytes,
                rate,
                transfer,
                bool(behind_why),
                "decode: "
                + (behind_why or f"{need} B over a {rate / 1e9:.2f} GB/s link ({measured}){fixed}, {busy} on it"),
            )
        )
    return _roomiest_of_the_best(sorted(out, key=lambda s: (s.behind, s.score, -s.free_bytes, s.agent_id)), params)


def _roomiest_of_the_best(scores: list[Score], params: RouteParams) -> list[Score]:
    """`scores` (best first) with those as good as the best, in the same class (behind or
    not) and within `near_score_fraction` of its score plus 1 ms, put first, the roomiest
    first: transfers that cost about the same land where they push out the fewest
    blocks, and Route's own notes spread a burst across them."""
    if len(scores) < 2:
        return scores
    best = scores[0]
    bound = best.score * (1 + params.near_score_fraction) + 1e-3
    near = [s for s in scores if s.behind == best.behind and s.score <= bound]
    if len(near) < 2:
        return scores
    near.sort(key=lambda s: (-s.free_bytes, s.score, s.agent_id))
    taken = {s.agent_id for s in near}
    return near + [s for s in scores if s.agent_id not in taken]


def _decode_stays(role: str, p: Candidate, why: str, behind: tuple[Score, ...] = ()) -> RouteDecision:
    """Decode on the prefill agent `p` itself (role both): no handoff. `behind`: the decode
    agents there were, all behind (backpressure)."""
    return RouteDecision(
        role,
        p.agent_id,
        prefill_agent_id=p.agent_id,
        decode_agent_id=p.agent_id,
        reason=f"{why}: decode stays on {p.agent_id} (role both), no handoff",
        candidates=behind,
        backpressure=bool(behind),
    )


def route(
    role: str,
    agents: Sequence[Candidate],
    num_blocks: int,
    block_size: int,
    block_bytes: int,
    params: RouteParams | None = None,
    prefill_agent_id: str = "",
) -> RouteDecision:
    """role: prefill | decode | pair ('' = pair)."""
    params = params or RouteParams()
    role = role or "pair"
    by_id = {a.agent_id: a for a in agents}
    if role == PREFILL:
        scores = prefill_scores(agents, num_blocks, block_size, params)
        if not scores:
            return RouteDecision(role, reason="no agent takes prefill (roles prefill or both)")
        best = scores[0]
        return RouteDecision(
            role,
            best.agent_id,
            prefill_agent_id=best.agent_id,
            num_cached_tokens=best.num_cached_blocks * block_size,
            reason=best.note,
            candidates=tuple(scores),
        )
    if role == DECODE:
        p = by_id.get(prefill_agent_id)
        scores = decode_scores(
            agents, num_blocks, block_bytes, params, prefill_agent_id, p.dataplane if p is not None else None
        )
        if not scores:
            if p is not None and p.role == BOTH:  # the prefill agent decodes too: no handoff
                return _decode_stays(role, p, "no other decode agent")
            if p is not None and p.role == DECODE:
                return RouteDecision(role, reason=f"no decode agent besides the prefill agent {p.agent_id}")
            return RouteDecision(role, reason="no agent takes decode (roles decode or both)")
        best = scores[0]
        if best.behind and p is not None and p.role == BOTH:  # as a pair Route decides: no handoff
            return _decode_stays(role, p, "every decode agent is behind", tuple(scores))
        return RouteDecision(
            role,
            best.agent_id,
            prefill_agent_id=prefill_agent_id,
            decode_agent_id=best.agent_id,
            disaggregate=True,
            transfer_seconds=best.transfer_seconds,
            reason=best.note,
            candidates=tuple(scores),
            backpressure=best.behind,
        )
    # pair: a prefill agent, then a decode agent for it, then whether to split
    pre = prefill_scores(agents, num_blocks, block_size, params)
    if not pre:
        return RouteDecision(role, reason="no agent takes prefill (roles prefill or both)")
    p = by_id[pre[0].agent_id]
    prefill_seconds = max(0, num_blocks - p.num_cached_blocks) * block_size / params.prefill_tokens_per_second
    saved = params.interference_factor * prefill_seconds
    dec = decode_scores(agents, num_blocks, block_bytes, params, p.agent_id, p.dataplane)
    cached = p.num_cached_blocks * block_size
    can_colocate = p.role == BOTH
    usable = [d for d in dec if not d.behind]
    if not usable:
        if can_colocate:
            why = "every decode agent is behind" if dec else "no other decode agent"
            return RouteDecision(
                role,
                p.agent_id,
                prefill_agent_id=p.agent_id,
                decode_agent_id=p.agent_id,
                num_cached_tokens=cached,
                saved_seconds=saved,
                reason=f"{why}: prefill and decode on {p.agent_id}",
                candidates=tuple(pre) + tuple(dec),
                backpressure=bool(dec),
            )
        least_behind = dec[0] if dec else None
        return RouteDecision(
            role,
            p.agent_id,
            prefill_agent_id=p.agent_id,
            decode_agent_id=least_behind.agent_id if least_behind else "",
            disaggregate=least_behind is not None,
            num_cached_tokens=cached,
            transfer_seconds=least_behind.transfer_seconds if least_behind else 0.0,
            saved_seconds=saved,
            reason=f"every decode agent is behind ({least_behind.note}); queue the handoff"
            if least_behind
            else "no agent takes decode",
            candidates=tuple(pre) + tuple(dec),
            backpressure=True,
        )
    d = usable[0]
    if can_colocate and d.transfer_seconds >= saved:  # (nothing to save, as a prompt of no full block: stay)
        return RouteDecision(
            role,
            p.agent_id,
            prefill_agent_id=p.agent_id,
            decode_agent_id=p.agent_id,
            num_cached_tokens=cached,
            transfer_seconds=d.transfer_seconds,
            saved_seconds=saved,
            reason=f"not split: the handoff to {d.agent_id} ({d.transfer_seconds * 1e3:.2f} ms) costs more than "
            f"the {saved * 1e3:.2f} ms of interference it saves",
            candidates=tuple(pre) + tuple(dec),
        )
    return RouteDecision(
        role,
        p.agent_id,
        prefill_agent_id=p.agent_id,
        decode_agent_id=d.agent_id,
        disaggregate=True,
        num_cached_tokens=cached,
        transfer_seconds=d.transfer_seconds,
        saved_seconds=saved,
        reason=f"split: prefill on {p.agent_id}, decode on {d.agent_id} ({d.note})",
        candidates=tuple(pre) + tuple(dec),
    )


def route_request(
    cluster,
    model_id: str,
    token_ids=None,
    block_hashes: bytes = b"",
    extra_keys: tuple[str, ...] = (),
    role: str = "",
    prefill_agent_id: str = "",
    params: RouteParams | None = None,
    pinned: Callable[[str, Sequence[bytes]], Collection[bytes]] | None = None,
) -> RouteDecision:
    """Route one request against the cluster's state (controlplane.core.cluster.Cluster):
    its index lookup gives each agent's cached prefix; its data-plane states the rest.
    `pinned(agent_id, hashes)`: which of these blocks the control plane's pins hold on
    that agent (None: no pins known)."""
    if role and role not in ROLES:
        raise errors.InvalidArgument("role", f"unknown role {role!r}; expected prefill, decode or pair")
    # a request's decode Route follows its prefill Route: one request, one lookup counted
    result = cluster.lookup(
        model_id, token_ids=token_ids, block_hashes=block_hashes, extra_keys=extra_keys, record=role != "decode"
    )
    model = cluster.model(model_id)
    block_bytes = kv_block_bytes(model.num_layers, model.block_size, model.num_kv_heads, model.head_dim, model.dtype)
    hits = {m.agent_id: m.num_hit_blocks for m in result.matches}
    ranks = {m.agent_id: k for k, m in enumerate(result.matches)}
    held_tiers = {m.agent_id: m.tiers for m in result.matches}
    states = cluster.dataplane
    params = params or RouteParams()
    step = BLOCK_HASH_BYTES
    hashes = [result.block_hashes[i : i + step] for i in range(0, len(result.block_hashes), step)]

    def counted(agent_id: str, view: DataPlaneView | None) -> int | None:
        tiers = held_tiers.get(agent_id, b"")
        if view is None or not view.handoff_tier or not tiers:
            return None if tiers else 0
        held = [i for i, t in enumerate(tiers) if t == view.handoff_tier]
        locked = set(pinned(agent_id, [hashes[i] for i in held])) if pinned is not None and held else set()
        return sum(1 for i in held if hashes[i] not in locked)

    # read free bytes, decide and note what was sent as one step: two Routes at once both saw
    # the same room and each took it (promised past the agent's free bytes; a review)
    with states.deciding:
        # only agents with an open stream that were heard from lately: one that died or hangs
        # keeps its registration (and its blocks indexed) until its lease goes
        candidates = [
            Candidate(
                rec.agent_id,
                rec.address,
                states.role(rec.agent_id),
                hits.get(rec.agent_id, 0),
                view,
                ranks.get(rec.agent_id, len(ranks)),
                counted(rec.agent_id, view),
            )
            for rec in cluster.connected_agents(params.max_silence_seconds)
            if any(m.model_id == model_id for m in rec.models)
            # the decode of a request prefilled on an agent cordoned since is no new work for it:
            # it stays the handoff's source (decode_scores never picks the prefill agent)
            and (not cluster.cordon_reason(rec.agent_id) or (role == "decode" and rec.agent_id == prefill_agent_id))
            for view in (states.view(rec.agent_id),)
        ]
        if prefill_agent_id and role != "decode" and cluster.cordon_reason(prefill_agent_id):
            raise errors.FailedPrecondition(
                f"prefill_agent_id: agent {prefill_agent_id!r} is cordoned ({cluster.cordon_reason(prefill_agent_id)})"
            )
        if prefill_agent_id and prefill_agent_id not in {c.agent_id for c in candidates}:
            raise errors.NotFound(
                f"prefill_agent_id: no connected agent {prefill_agent_id!r} serves {model_id!r} "
                f"(not connected, or silent for over {params.max_silence_seconds:g}s)"
            )
        decision = route(role, candidates, result.num_blocks, result.block_size, block_bytes, params, prefill_agent_id)
        if not decision.agent_id and decision.reason.startswith("no agent takes"):
            left_out = [
                rec.agent_id
                for rec in cluster.connected_agents()
                if any(m.model_id == model_id for m in rec.models)
                and rec.agent_id not in {c.agent_id for c in candidates}
            ]
            cordoned = [a for a in left_out if cluster.cordon_reason(a)]
            silent = [a for a in left_out if a not in cordoned]
            if silent:  # they take the role, but have not reported lately (hung, or a stalled machine)
                decision = dataclasses.replace(
                    decision,
                    reason=f"{decision.reason}: {', '.join(silent)} silent for over "
                    f"{params.max_silence_seconds:g}s (hung or stalled?)",
                )
            if cordoned:
                decision = dataclasses.replace(decision, reason=f"{decision.reason}; cordoned: {', '.join(cordoned)}")
        if decision.disaggregate and decision.decode_agent_id:  # its bytes count against it until reported
            d = next((c for c in candidates if c.agent_id == decision.decode_agent_id), None)
            if d is not None:
                states.note_routed(d.agent_id, max(0, result.num_blocks - d.num_cached_blocks) * block_bytes)
    address = next((c.address for c in candidates if c.agent_id == decision.agent_id), "")
    return dataclasses.replace(decision, address=address)


class DataPlaneStates:
    """Roles and the last data-plane report of each agent (thread-safe; the leader's memory)."""

    def __init__(self, clock=time.monotonic) -> None:
        self._lock = threading.Lock()
        self._roles: dict[str, tuple[str, str]] = {}  # agent_id -> (role, transfer_engine)
        self._views: dict[str, DataPlaneView] = {}
        # bytes Route sent to each decode agent lately, (monotonic time, bytes): a burst of
        # Routes within one report all saw the same free bytes and picked one agent past
        # its room (its Reserve then refused the rest: recompute)
        self._routed: dict[str, list[tuple[float, int]]] = {}
        self._clock = clock
        # held by a Route from reading the views to note_routed (routing.route_request)
        self.deciding = threading.Lock()

    def register(self, agent_id: str, role: str, transfer_engine: str = "") -> None:
        with self._lock:
            self._roles[agent_id] = (role or BOTH, transfer_engine)

    def update(self, agent_id: str, view: DataPlaneView) -> None:
        with self._lock:
            self._views[agent_id] = view

    def role(self, agent_id: str) -> str:
        with self._lock:
            return self._roles.get(agent_id, (BOTH, ""))[0]

    def transfer_engine(self, agent_id: str) -> str:
        with self._lock:
            return self._roles.get(agent_id, (BOTH, ""))[1]

    def view(self, agent_id: str) -> DataPlaneView | None:
        """Its last report, less what Route sent it in the last ROUTED_HOLD_SECONDS."""
        with self._lock:
            view = self._views.get(agent_id)
            pending = self._routed_lately(agent_id)
        if view is None or not pending:
            return view
        return dataclasses.replace(view, handoff_free_bytes=max(0, view.handoff_free_bytes - pending))

    def _routed_lately(self, agent_id: str) -> int:
        """Bytes Route sent `agent_id` in the last ROUTED_HOLD_SECONDS; older notes are
        forgotten (lock held)."""
        routed = self._routed.get(agent_id)
        if not routed:
            return 0
        since = self._clock() - ROUTED_HOLD_SECONDS
        routed[:] = [(t, n) for t, n in routed if t > since]
        return sum(n for _, n in routed)

    def routed_bytes(self, agent_id: str) -> int:
        """Bytes Route sent to `agent_id` in the last ROUTED_HOLD_SECONDS: handoffs that
        its reports may not show yet (a drain counts them as taken)."""
        with self._lock:
            return self._routed_lately(agent_id)

    def note_routed(self, agent_id: str, num_bytes: int) -> None:
        """Route sent a handoff of `num_bytes` to the decode agent `agent_id`."""
        if num_bytes > 0:
            with self._lock:
                self._routed.setdefault(agent_id, []).append((self._clock(), num_bytes))

    def forget(self, agent_id: str) -> None:
        with self._lock:
            self._roles.pop(agent_id, None)
            self._views.pop(agent_id, None)
            self._routed.pop(agent_id, None)
