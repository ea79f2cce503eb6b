"""The leader's policy (part of controlplane.manager.Manager): the policy key in etcd
(validated, merged by revision, reloaded every resync) and the tier policy pass: lookups
recorded as future-reuse evidence, each agent's view copied out of the index, the pure
`decide` run, and its actions sent as commands."""

from __future__ import annotations

import json
import logging
import math
import time

from controlplane.core import policy as tier_policy
from controlplane.core.cluster import AgentCommand
from controlplane.core.policy import AgentView, Policy  # annotations: in PolicyControl, tier_policy is a method
from controlplane.core.scope import block_bytes
from controlplane.core.tuning import CreditTuner, TunedChoice
from controlplane.manager_state import ManagerState
from controlplane.metrics import PolicyStats
from protos import errors, etcd_keys
from protos.block_hash import BLOCK_HASH_BYTES
from protos.namespaces import check_namespace
from protos.tier import Tier
from protos.units import parse_size

log = logging.getLogger(__name__)

QUOTA_PREFIX = etcd_keys.QUOTA_POLICY_PREFIX  # quota.<namespace>=<size>
CORDON_PREFIX = etcd_keys.CORDON_POLICY_PREFIX  # cordon.<agent_id>=<reason>: no new work for it
ENTRY_REMOVED = etcd_keys.POLICY_ENTRY_REMOVED  # `kvctl policy set quota.<ns>=none` (or empty) lifts either
MAX_CORDON_REASON_CHARS = 200
POLICY_WRITE_TRIES = 5  # SetPolicy merges into a policy written meanwhile, at most this often


def _check_quota_entry(key: str, value: str) -> None:
    """`quota.<namespace>=<size>`: the namespace must be named (`quota.` alone would be
    stored and never read: a pin's namespace is never empty)."""
    namespace = key.removeprefix(QUOTA_PREFIX)
    field = _field(key)
    if not namespace:
        raise errors.InvalidArgument(field, "name the namespace: quota.<namespace>=<size>")
    check_namespace(namespace, field)
    if value in ENTRY_REMOVED:
        return
    try:
        parse_size(value)
    except ValueError as exc:
        raise errors.InvalidArgument(field, str(exc)) from None


def _check_cordon_entry(key: str, value: str) -> None:
    """`cordon.<agent_id>=<reason>` (kvctl cordon): the agent must be named, the reason
    one printable line; none (or empty) uncordons."""
    agent_id = key.removeprefix(CORDON_PREFIX)
    field = _field(key)
    if not agent_id or len(agent_id) > 256 or not agent_id.isprintable():
        raise errors.InvalidArgument(field, "name the agent: cordon.<agent_id>=<reason>")
    if len(value) > MAX_CORDON_REASON_CHARS or not value.isprintable():
        raise errors.InvalidArgument(
            field, f"the reason must be one printable line of at most {MAX_CORDON_REASON_CHARS} characters"
        )


def _check_entry(key: str, value: str) -> None:
    """A quota or cordon entry of the policy (is_entry)."""
    if key.startswith(QUOTA_PREFIX):
        _check_quota_entry(key, value)
    elif key.startswith(CORDON_PREFIX):
        _check_cordon_entry(key, value)


def is_entry(key: str) -> bool:
    """A quota or cordon entry, not a tier-policy setting."""
    return key.startswith((QUOTA_PREFIX, CORDON_PREFIX))


def tier_settings(values: dict[str, str]) -> dict[str, str]:
    """The policy's values that are the tier policy's settings (not quotas, not cordons):
    what controlplane.core.policy.Policy.from_mapping is given."""
    return {k: v for k, v in values.items() if not is_entry(k)}


def _field(key: str) -> str:
    return f"values[{key[:80]}{'...' if len(key) > 80 else ''}]"


def validate_policy(values: dict[str, str]) -> dict[str, str]:
    """Effective policy from stored/changed values: quota.<namespace> sizes and
    cordon.<agent_id> reasons here, the tier policy's keys by its own validator
    (controlplane.core.policy)."""
    settings = tier_settings(values)
    entries = {k: v for k, v in values.items() if is_entry(k)}
    for key, value in entries.items():
        _check_entry(key, value)
    return {**tier_policy.Policy.from_mapping(settings).to_mapping(), **entries}


class PolicyControl(ManagerState):
    """Policy, mixed into Manager (whose state and lock they share: see Manager.__init__)."""

    # ---- policy ---------------------------------------------------------------------
    def get_policy(self) -> tuple[dict[str, str], int]:
        self.ensure_loaded()
        with self._lock:
            return dict(self.policy), self.policy_revision

    def set_policy(self, changes: dict[str, str]) -> dict[str, str]:
        self.ensure_loaded()
        for key, value in changes.items():
            if not is_entry(key):
                continue  # checked with the rest of the tier policy's settings below
            _check_entry(key, value)
            if key.startswith(CORDON_PREFIX) and value not in ENTRY_REMOVED:
                agent_id = key.removeprefix(CORDON_PREFIX)
                if agent_id not in {r.agent_id for r, _ in self.cluster.agents()}:
                    # a typo would cordon nothing (uncordoning one that left is fine)
                    raise errors.NotFound(f"{key}: no agent {agent_id!r} is registered (kvctl agents lists them)")
        with self._lock:
            for _ in range(POLICY_WRITE_TRIES):
                values = {**self.policy, **changes}
                for key, value in changes.items():
                    if is_entry(key) and value in ENTRY_REMOVED:
                        values.pop(key, None)
                merged = self.policy_validator(values)
                if self.durable.replace(etcd_keys.POLICY_KEY, json.dumps(merged, sort_keys=True), self.policy_revision):
                    break
                # written in etcd since this replica read it (by hand, or a restore): merge into
                # that; a key deleted there is written back from memory, as the reload treats it
                stored, revision = self.durable.load_policy()
                if revision:
                    self.policy = self._valid_stored_policy(stored)
                self.policy_revision = revision
            else:
                raise errors.Unavailable("the stored policy kept changing under this write; try again")
            self.policy = merged
            try:
                # what etcd holds now, with its revision: an edit that landed right after this
                # write is taken with it (its revision alone would hide it from the reload)
                stored, revision = self.durable.load_policy()
                if revision:
                    self.policy, self.policy_revision = self._valid_stored_policy(stored), revision
            except errors.KvcpError:
                pass  # the next reload or GetPolicy shows it
            result = dict(self.policy)
        self.cluster.events.publish(
            "policy", "policy set: " + ", ".join(f"{k}={v}" for k, v in sorted(changes.items()))
        )
        return result

    def _reload_policy(self) -> None:
        """Level-triggered like the pins: a policy written in etcd by other means than
        SetPolicy (etcdctl, a restore) applies within a resync. Revisions only grow, so a
        read racing a SetPolicy never puts back the older value; a deleted key (revision 0)
        is left to the restore after an etcd reset."""
        values, revision = self.durable.load_policy()
        with self._lock:
            if revision <= self.policy_revision:
                return
            changed = self._valid_stored_policy(values)
            self.policy, self.policy_revision = changed, revision
        log.info("policy changed in etcd (revision %d): applied", revision)
        self.cluster.events.publish("policy", f"policy changed in etcd (revision {revision}): applied")

    # ---- tier policy ----------------------------------------------------------------
    def note_lookup(self, packed: bytes, now: float) -> None:
        """Cluster.on_lookup: every lookup is evidence of future reuse. Only queued here
        (the lookup path stays O(1)); the reconcile loop folds the queue into the access
        stats and the credit tuner."""
        if len(self._lookups) == self._lookups.maxlen:
            self.lookups_dropped_total += 1
        self._lookups.append((packed, now))

    def _drain_lookups(self) -> None:
        with self._access_lock:
            while self._lookups:
                packed, now = self._lookups.popleft()
                hashes = [packed[i : i + BLOCK_HASH_BYTES] for i in range(0, len(packed), BLOCK_HASH_BYTES)]
                self.access.record_lookup(hashes, now)
                if self.tuner is not None:
                    self.tuner.observe(hashes, now, self.access)

    def _tune(self, policy: Policy, capacity_blocks: int) -> TunedChoice:
        """The reuse credit the shadow caches currently favour (None: tuning off), and
        whether they see loops larger than the cache (recent-first eviction)."""
        if not policy.uses_tuner or capacity_blocks <= 0:
            self.tuner = None
            return TunedChoice(None, False)
        if (
            self.tuner is None
            or abs(self.tuner.capacity_blocks - capacity_blocks) > 0.2 * self.tuner.capacity_blocks
            or self.tuner.max_reuse_credits != policy.max_reuse_credits  # its shadows score by the cap
        ):
            self.tuner = CreditTuner(
                capacity_blocks, default=policy.reuse_credit_turnovers, max_reuse_credits=policy.max_reuse_credits
            )
        self.tuner.default = policy.reuse_credit_turnovers  # set live (it is what a tie or no evidence gives)
        return self.tuner.choose(policy.tune_reuse_credits, policy.scan_resistance)

    def tier_policy(self) -> Policy:
        with self._lock:
            values = tier_settings(self.policy)
        return tier_policy.Policy.from_mapping(values)

    def policy_pass(self, now: float) -> int:
        """Run `decide` for the agents that may need it and send its actions as commands.

        Deciding for an agent copies what it holds out of the index, so the pass first
        picks the agents that can have anything to do, from counts alone: a managed tier
        over its high watermark (the agent's reported usage), a pinned block held slower
        than its pin (the index, for the pinned digests only), or, with `promote_hot`, room
        under a faster tier's low watermark while lookups hit the agent in a slower tier
        since it was last decided for. Of those it takes the longest-waiting first, up to
        `policy_max_blocks_per_pass` blocks copied; the others wait for the next pass (the
        loop is level-triggered: waiting loses nothing). Agents still applying the
        previous pass's commands are left out."""
        started = time.perf_counter()
        try:
            return self._policy_pass(now)
        finally:
            self.policy_passes_total += 1
            self.policy_pass_seconds_last = time.perf_counter() - started
            self.policy_pass_seconds_max = max(self.policy_pass_seconds_max, self.policy_pass_seconds_last)

    def _policy_pass(self, now: float) -> int:
        policy = self.tier_policy()
        with self._lock:
            active = [p for p in self.pins.values() if p.active(now) and p.block_hashes]

        with self._lock:
            refusals = {
                agent_id: {h: tier for h, (tier, until) in held.items() if until > now}
                for agent_id, held in self._pin_refusals.items()
            }
            self._pin_refusals = {a: held for a, held in self._pin_refusals.items() if refusals[a]}

        per_agent: dict[str, dict[bytes, Tier]] = {}

        def pinned_for(agent_id: str) -> dict[bytes, Tier]:
            # the pins this agent honours, and the blocks it said its own pins hold;
            # several on one block: the fastest tier binds (built once per agent and pass)
            if agent_id in per_agent:
                return per_agent[agent_id]
            out = per_agent[agent_id] = dict(refusals.get(agent_id, {}))
            for p in active:
                if p.applies_to(agent_id):
                    for i in range(0, len(p.block_hashes), 16):
                        h = p.block_hashes[i : i + 16]
                        t = out.get(h)
                        if t is None or p.min_tier < t:
                            out[h] = p.min_tier
            return out

        connected = self.cluster.connected_agents()
        # what the passes kept for an agent goes with it (agents that come back under new
        # ids, pods of a rollout, would grow these without end); one back starts afresh
        present = {rec.agent_id for rec in connected}
        for per_agent_state in (self._policy_last, self._policy_report_seen, self._policy_idle, self._policy_inflight):
            for agent_id in [a for a in per_agent_state if a not in present]:
                per_agent_state.pop(agent_id, None)
        due = []
        for rec in connected:
            inflight = self._policy_inflight.get(rec.agent_id, {})
            # agents' answers pop from it on gRPC threads: iterate a copy, pop what is still there
            for op_id, (deadline, session_id) in list(inflight.items()):
                # an agent that never answered, or that opened a new stream since (restarted:
                # the command went with its old process), gets decided for again
                if deadline < now or session_id != rec.session_id:
                    inflight.pop(op_id, None)
            if inflight or not rec.models:
                continue
            if self._policy_due(rec, policy, pinned_for(rec.agent_id)):
                due.append((self._policy_last.get(rec.agent_id, 0.0), rec.agent_id, rec))
        views: list[AgentView] = []
        replicas: dict[bytes, int] = {}  # blocks another agent holds too (cheaper to lose)
        budget = self.policy_max_blocks_per_pass
        for _, agent_id, rec in sorted(due, key=lambda d: d[:2]):
            n = self.cluster.index.num_agent_blocks(agent_id)
            if views and n > budget:
                break
            budget -= n
            self._policy_last[agent_id] = now
            self._policy_report_seen[agent_id] = rec.stats_reports
            self.cluster.forget_slow_hit(agent_id)
            views.append(self._agent_view(rec, replicas))
        self.policy_agents_decided_total += len(views)
        self._drain_lookups()
        if not views:
            return 0
        capacity = sum(self._capacity_blocks(rec) for rec in connected if rec.models)
        credit, recent_first = self._tune(policy, capacity)
        self.policy_credit_turnovers = policy.reuse_credit_turnovers if credit is None else credit
        self.policy_recent_first = recent_first
        actions = []
        with self._access_lock:
            turnover = self.access.turnover_seconds(capacity)
            for agent_view in views:  # one agent at a time: pins may be scoped to an agent
                view = tier_policy.ClusterView(
                    (agent_view,),
                    self.access,
                    tier_policy.Pins(pinned_for(agent_view.agent_id)),
                    replicas=replicas,
                    turnover_seconds=turnover,
                    reuse_credit_turnovers=credit,
                    recent_first=recent_first,
                )
                decided = tier_policy.decide(view, policy, now)
                tier_policy.copies_dropped(replicas, decided)  # the next agent keeps what this one drops
                # a pass that had nothing to do for a tier over its watermark (pins or
                # loads hold it) is not brought forward again by the agent's next report
                self._policy_idle[agent_view.agent_id] = not decided
                actions.extend(decided)
        sessions = {rec.agent_id: rec.session_id for rec in connected}
        for action in actions:
            self._policy_ops += 1
            epoch = getattr(self.election, "epoch", None)
            op_id = f"policy-{epoch or self._policy_op_tag}-{self._policy_ops}"
            packed = b"".join(action.block_hashes)
            if isinstance(action, tier_policy.Evict):
                cmd = AgentCommand(op_id, "evict", block_hashes=packed)
            else:
                codec = getattr(action, "codec", "none")
                cmd = AgentCommand(
                    op_id, "move", block_hashes=packed, tier=int(action.to_tier), codec="" if codec == "none" else codec
                )
            inflight = self._policy_inflight.setdefault(action.agent_id, {})
            # recorded before it goes: an answer that comes back before the record would find
            # nothing to clear, and the record would shut the agent out until its deadline
            inflight[op_id] = (now + self.op_timeout_seconds, sessions.get(action.agent_id, ""))
            if self.cluster.send(action.agent_id, cmd):
                self.policy_actions_total += 1
            else:
                inflight.pop(op_id, None)
        return len(actions)

    @staticmethod
    def _tier_capacity_blocks(rec, t) -> int:
        """A tier's capacity in blocks of the size it holds (models' blocks differ in size:
        the largest model's would make a tier of small blocks look overfull); 0 when it
        cannot be told (no capacity reported, or no block size known): such a tier is left
        to the agent's own safety net."""
        # by what the blocks themselves take: pages reserved for handoffs still arriving (or
        # parked blocks) in used_bytes made a decode agent's blocks look bigger, its tier
        # fuller than it was, and a pass dropped its own blocks while a handoff landed
        held = t.blocks_used_bytes or t.used_bytes
        size = held // t.num_blocks if t.num_blocks and held else 0
        if size <= 0:
            size = max(block_bytes(m) for m in rec.models)
        return t.capacity_bytes // size if size > 0 and t.capacity_bytes > 0 else 0

    def _managed_tiers(self, rec) -> list:
        """The agent's tiers the pass manages: GPU, CPU, DISK with a capacity it can tell."""
        return [t for t in rec.tiers if t.tier in tier_policy.MANAGED_TIERS and self._tier_capacity_blocks(rec, t) > 0]

    def _capacity_blocks(self, rec) -> int:
        return sum(self._tier_capacity_blocks(rec, t) for t in self._managed_tiers(rec))

    def policy_stats(self) -> PolicyStats:
        """For the metrics (kvcp_policy_*)."""
        return PolicyStats(
            self.policy_passes_total,
            self.policy_agents_decided_total,
            self.policy_actions_total,
            self.policy_pass_seconds_last,
            self.policy_credit_turnovers,
            self.policy_recent_first,
            self.lookups_dropped_total,
            len(self.access),
            tuner.num_blocks() if (tuner := self.tuner) is not None else 0,
        )

    def _over_high(self, rec, policy: Policy) -> bool:
        """A managed tier of the agent over its high watermark, by its latest report."""
        for t in self._managed_tiers(rec):
            if t.num_blocks > math.floor(
                policy.tier(t.tier).high_watermark * self._tier_capacity_blocks(rec, t) + 1e-9
            ):
                return True
        return False

    def _urgent(self, policy: Policy) -> bool:
        """Is there an agent a pass should not wait for: over a high watermark in a report
        that came after the last pass decided for it and after it answered that pass's
        commands (an older report may predate what they moved), and not one whose last
        pass found nothing to do (pins hold the tier: the periodic pass is enough)?"""
        for rec in self.cluster.connected_agents():
            if self._policy_inflight.get(rec.agent_id) or not rec.models or self._policy_idle.get(rec.agent_id):
                continue
            if rec.stats_reports > self._policy_report_seen.get(rec.agent_id, 0) and self._over_high(rec, policy):
                return True
        return False

    def _policy_due(self, rec, policy: Policy, pinned: dict[bytes, Tier]) -> bool:
        """Can `decide` have anything to do for this agent? (counts only; see policy_pass)"""
        usage = sorted(self._managed_tiers(rec), key=lambda t: int(t.tier))
        if not usage:
            return False
        if self._over_high(rec, policy):
            return True
        room = False
        for t in usage:
            tp = policy.tier(t.tier)
            capacity = self._tier_capacity_blocks(rec, t)
            room = room or (t is not usage[-1] and t.num_blocks < math.floor(tp.low_watermark * capacity + 1e-9))
        if pinned:
            held = self.cluster.tiers_held(rec.agent_id, b"".join(pinned))
            managed = {int(t.tier) for t in usage}  # a block elsewhere (REMOTE) is not the pass's to move
            # a pin faster than the agent's fastest tier (gpu on a host without one) is met
            # by that tier: `decide` moves nothing for it, so it makes no pass due
            fastest = Tier(usage[0].tier)
            if any(
                t in managed and Tier(t) > max(pin, fastest)
                for t, pin in zip(held.tolist(), pinned.values(), strict=True)
            ):
                return True
        return policy.promote_hot and room and self.cluster.slow_hit(rec.agent_id)

    def _agent_view(self, rec, replicas: dict[bytes, int]) -> AgentView:
        """What the agent holds per managed tier, with parents, copied out of the index;
        its blocks held elsewhere too are added to `replicas`."""
        keys, tiers, parents, replicated, stored = self.cluster.agent_chains(rec.agent_id)
        replicas.update(dict.fromkeys(keys[replicated].tolist(), 2))
        # NaN where the index has no stamp: block_priority takes that as no evidence
        stored_seconds = dict(zip(keys.tolist(), stored.tolist(), strict=True))
        out = []
        for t in self._managed_tiers(rec):
            here = tiers == int(t.tier)
            blocks = dict(zip(keys[here].tolist(), parents[here].tolist(), strict=True))
            out.append(tier_policy.TierView(t.tier, self._tier_capacity_blocks(rec, t), blocks))
        return tier_policy.AgentView(rec.agent_id, tuple(out), stored_seconds=stored_seconds)
