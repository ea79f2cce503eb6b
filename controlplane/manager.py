"""The leader's durable actions and its reconcile loop: pins (manager_pins.py), operations
(manager_ops.py) and policy (manager_policy.py), mixed into one Manager that shares their
state and lock.

Pins, operations and policy live in etcd (controlplane.store.durable) and in memory
here; agents get them as commands over their Sync streams. `run_once(now)` is level
triggered: it expires pins, re-applies every pin to every connected agent that lacks it
(after an agent or control-plane restart), times out silent operations, and reloads
from etcd what other writers changed (a pin released with its owner's lease).
"""

from __future__ import annotations

import json
import logging
import math
import re
import threading
import time
import uuid
from collections import OrderedDict, deque

from controlplane.core import operations as ops
from controlplane.core.access_stats import AccessStats
from controlplane.core.clock import SteadyWallClock
from controlplane.core.cluster import AgentCommand, Cluster, ModelInfo
from controlplane.core.pins import Pin, one_per_id
from controlplane.core.scope import Scope
from controlplane.core.tuning import CreditTuner
from controlplane.manager_ops import AN_EARLIER_TERMS_STREAM, ANOTHER_LEADERS_STREAM, OperationControl
from controlplane.manager_pins import PinControl
from controlplane.manager_policy import PolicyControl
from controlplane.metrics import RESEND_CAUSES
from controlplane.store.durable import DurableStore, pin_key, pin_to_json
from protos import errors, etcd_keys
from protos.block_hash import BLOCK_HASH_BYTES, MAX_PROMPT_BLOCKS, check_extra_keys, check_prompt_size, hash_prefix
from protos.namespaces import check_namespace
from protos.tier import Tier

log = logging.getLogger(__name__)

# after taking over: how long operations wait (Unavailable) for agents etcd lists to be back
AGENTS_BACK_GRACE_SECONDS = 15.0
OP_WRITE_LOCKS = 64  # operations written to etcd one write at a time per stripe (see _persist_op)


class Manager(PinControl, OperationControl, PolicyControl):
    def __init__(
        self,
        cluster: Cluster,
        durable: DurableStore,
        election,
        etcd_client=None,
        clock=None,
        op_timeout_seconds: float = 60.0,
        resync_seconds: float = 2.0,
        policy_validator=None,
    ):
        self.cluster = cluster
        self.durable = durable
        self.election = election
        self._etcd = etcd_client
        self.clock = clock or SteadyWallClock()  # Unix seconds a step of the host's clock does not move
        self.op_timeout_seconds = op_timeout_seconds
        self.resync_seconds = resync_seconds
        # callable(values: dict[str, str]) -> dict[str, str] of effective values; raises InvalidArgument
        self.policy_validator = policy_validator or (lambda values: dict(values))
        self._lock = threading.RLock()
        self.pins: dict[str, Pin] = {}
        self.ops: OrderedDict[str, ops.Operation] = OrderedDict()
        self._op_said: dict[str, tuple[str, str]] = {}  # op id -> the (state, error) its last event said
        self._cancel_asked: dict[str, float] = {}  # op id -> when its cancel was last sent to agents
        # (op id, agent id) -> its command and the session of the stream it went down, until
        # the agent first answers: one lost with its stream is sent again on the next
        self._unheard: dict[tuple[str, str], tuple[AgentCommand, str]] = {}
        # op ids whose commands are stored in etcd (for a next leader): deleted at their end
        self._stored_commands: set[str] = set()
        # commands sent again, by why they were lost: with the agent's stream that closed
        # under this leader, or with another leader's (kvcp_commands_resent_total)
        self.commands_resent_total = dict.fromkeys(RESEND_CAUSES, 0)
        self._op_done: dict[str, threading.Event] = {}
        # adopted cleanups taking their scope locks again, and kept running ones (a lost
        # leadership won again) trying theirs (_locks_to_retake): queued ones wait for that first
        self._adopted_locks_pending = 0
        self._locks_to_retake: set[str] = set()
        self._lock_keepers: set[str] = set()  # running cleanups whose scope lock a thread keeps
        self._adopted_locks_settled = threading.Event()
        self._adopted_locks_settled.set()
        self.policy = {}
        self.policy_revision = 0
        self._loaded_epoch = 0  # the epoch whose state load() read from etcd; 0: none yet
        # the epoch whose state memory holds as its leader's: kept while no other replica
        # is seen leading (an outage, a lapsed lease won again), so an etcd that comes
        # back with its revisions gone back can be told and given that state again
        self._state_epoch = 0
        self._loaded_monotonic = -math.inf  # when load() last ended: agents come back after it
        self._load_lock = threading.Lock()
        # pins go to agents from the reconcile loop and from Pin/Unpin calls: one at a time
        # (each compares and updates the records' applied_pins)
        self._apply_lock = threading.Lock()
        # pins this replica unpinned lately: a reload whose read of etcd came before the
        # delete must not bring them back (pin id -> monotonic time of the unpin)
        self._unpinned: dict[str, float] = {}
        # op ids whose latest change etcd has not taken (an outage): retried every pass, and
        # load() keeps the in-memory op over the older stored one
        self._dirty: set[str] = set()
        # one write of an operation at a time (striped by op id): two agents' reports of one
        # operation, written from their stream threads, reach etcd in the order they were taken
        self._op_write_locks = [threading.Lock() for _ in range(OP_WRITE_LOCKS)]
        self._drain_start = threading.Lock()  # drain(): one starts at a time
        # drain op id -> destination -> what it landed there that the destination's reports to
        # this replica show (manager_ops: _note_landing), kept in memory: those report counts
        # are this replica's, and another leader's say nothing of the figures it holds
        self._drain_landings: dict[str, dict[str, ops.DrainLanding]] = {}
        self._lock_threads: set[str] = set()  # cleanups with a thread waiting for or holding their lock
        # operations whose cancel is being written to etcd -> how many cancels write it (a
        # cancel asked again while one is written: the first to end must not end the wait)
        self._cancelling: dict[str, int] = {}
        self._next_reload = 0.0
        self._next_follow = 0.0  # when a follower next reads the stored policy
        # the watch on the pin keys (durable.watch_deletes): the generation of the one open
        # or opening (None: none; an old one's end does not end a newer one), and its id
        self._pins_watch: int | None = None
        self._pins_watch_id: object = None
        self._pins_watch_generation = 0
        self.pins_expired_total = 0
        self.etcd_resets_total = 0  # etcd found to have lost its data on winning an election
        # the tier policy: future-reuse evidence from lookups
        self.access = AccessStats()
        self._access_lock = threading.Lock()
        self.policy_interval_seconds = 2.0
        # a pass sooner, for an agent whose report after its last commands shows a tier
        # over its high watermark: the workload fills the band between the watermarks in
        # about a second, faster than the periodic pass reacts
        self.policy_urgent_min_seconds = 0.25
        self._next_urgent = 0.0
        # agent -> its stats_reports when a pass last decided for it / when it answered a
        # policy command: a report newer than both shows what the commands did
        self._policy_report_seen: dict[str, int] = {}
        self._policy_idle: dict[str, bool] = {}  # agent -> its last decide had nothing to do
        # blocks copied out of the index for `decide` in one pass (agents beyond wait)
        self.policy_max_blocks_per_pass = 1_000_000
        self._next_policy = 0.0
        self._policy_last: dict[str, float] = {}  # agent -> when a pass last decided for it
        self.policy_passes_total = 0
        self.policy_agents_decided_total = 0
        self.policy_pass_seconds_max = 0.0  # the longest pass (copying out, decide, sending)
        self.policy_pass_seconds_last = 0.0
        self.policy_credit_turnovers = 0.0  # the reuse credit of the latest pass that decided (tuned or set)
        self.policy_recent_first = False  # the latest pass evicted most recently used first (loops)
        # agent -> {op_id: (deadline, the agent's stream session it went down)}
        self._policy_inflight: dict[str, dict[str, tuple[float, str]]] = {}
        # blocks an agent left alone because its pins hold them (namespace pins: the index
        # does not know a block's namespace): agent -> {block: (pin tier, until)}; forgotten
        # when any pin goes, or after PIN_REFUSAL_SECONDS
        self._pin_refusals: dict[str, dict[bytes, tuple[Tier, float]]] = {}
        # prefix pins by block, for Route (built again when the pins change): (ids of
        # the pins it was built from, those pins, block -> pins naming it)
        self._pinned_by_block: tuple[list[int], list[Pin], dict[bytes, list[Pin]]] | None = None
        self._pinned_index_lock = threading.Lock()  # that index's own: no etcd call is made under it
        self._policy_ops = 0
        # policy commands carry "policy-<leader epoch>-<n>" (a random tag without an
        # election): a new leader's ids never repeat a deposed one's that an agent may
        # still be running, nor do its updates close another leader's commands
        self._policy_op_tag = uuid.uuid4().hex[:8]
        self.policy_actions_total = 0
        self.policy_enabled = True
        self.tuner: CreditTuner | None = None
        self._lookups: deque[tuple[bytes, float]] = deque(maxlen=100_000)
        self.lookups_dropped_total = 0
        self.on_finished = None  # callable(kind, state, seconds) when an operation finishes (metrics)

    # ---- the policy's values ---------------------------------------------------------
    @property
    def policy(self) -> dict[str, str]:
        return self._policy_values

    @policy.setter
    def policy(self, values: dict[str, str]) -> None:
        """Every policy that takes effect (set, reloaded, loaded on winning) tells the
        cluster its cordoned agents, which lookups and Route then leave out."""
        self._policy_values = values
        self.cluster.set_cordoned(etcd_keys.cordoned_agents(values))

    # ---- leadership -----------------------------------------------------------------
    @property
    def ready(self) -> bool:
        """Whether this leader has loaded its state from etcd for its current epoch."""
        e = self.election
        return e is not None and self._loaded_epoch != 0 and self._loaded_epoch == e.epoch

    def ensure_loaded(self) -> None:
        """Load the state of a newly won epoch before anything is answered or changed from
        memory: an operation created before load() would be failed by it, and a policy
        change would overwrite the stored policy with a follower's empty one. The first
        caller after winning loads (the reconcile loop, or a request that comes sooner);
        etcd unreachable meanwhile: Unavailable. A follower's callers are left to the
        leadership checks (its durable writes refuse: NotLeader)."""
        e = self.election
        if e is None or self.ready:
            return
        if not e.is_leader:
            if getattr(e, "serving_from_memory", False):
                raise errors.Unavailable(
                    "the leader is loading its state from etcd, which is unreachable; try again when it returns"
                )
            return
        with self._load_lock:
            if not self.ready and e.is_leader:
                self.load()

    def load(self) -> None:
        """On winning an election: read pins, operations and policy from etcd. A cleanup
        still queued behind its scope lock (no command sent) is queued again; other
        operations a previous leader left unfinished are marked failed (their agents'
        commands may or may not have run; a new operation can be started).

        Operations this replica already holds (it led before, e.g. its lease lapsed and it
        won again) are kept over the stored copy while that is unfinished, and always when
        their latest change is not stored yet: its own commands may be out, and a cancel or
        result it answered must not be undone (but an unstored change short of an end gives
        way to a stored end: another leader got the result meanwhile). The epoch counts as loaded only at the end,
        so a load cut short is done again."""
        epoch = self.election.epoch
        if 0 < epoch < self._state_epoch and not self.durable.exists(etcd_keys.LOADED_KEY):
            self._restore_after_etcd_reset(epoch)
        pins = self.durable.load_pins()
        loaded_ops = self.durable.load_ops()
        stored_commands = self.durable.load_op_commands()
        values, revision = self.durable.load_policy()
        requeue, adopted = [], []
        ended_elsewhere: list[ops.Operation] = []  # held here unfinished, stored finished by another leader
        with self._lock:
            self.pins, stale_pins = one_per_id(pins)
            merged: dict[str, ops.Operation] = {}
            kept: set[str] = set()  # held here: not adopted as another leader's
            for stored in loaded_ops:
                held = self.ops.get(stored.op_id)
                # stored finished, or started by another leader since: the stored copy is newer
                # (an unstored change here is kept over a stored end only when it is an end
                # too: progress this replica could not store is older than another leader's
                # record of the result, which its agent's final answer gave it)
                mine = held is not None and (
                    (stored.op_id in self._dirty and (held.finished or not stored.finished))
                    or not (stored.finished or (held.waiting_for_lock and not stored.waiting_for_lock))
                )
                if held is not None and not mine:
                    self._dirty.discard(stored.op_id)
                    if stored.finished and not held.finished:
                        ended_elsewhere.append(stored)
                merged[stored.op_id] = held if mine and held is not None else stored  # (mine: it is held)
                if mine:
                    kept.add(stored.op_id)
            for op_id, held in self.ops.items():
                if op_id not in merged and (not held.finished or op_id in self._dirty):
                    merged[op_id] = held  # registered meanwhile, or not stored yet
                    kept.add(op_id)
            self.ops = OrderedDict(sorted(merged.items(), key=lambda kv: kv[1].created_unix_seconds))
            for gone in [i for i in self._op_said if i not in self.ops]:
                del self._op_said[gone]  # what events said of operations no longer kept
            for gone in [i for i in self._drain_landings if i not in self.ops]:
                del self._drain_landings[gone]
            for gone in [i for i in self._cancel_asked if i not in self.ops]:
                del self._cancel_asked[gone]
            for op_id, op in self.ops.items():
                if op.finished:
                    continue
                if op.kind == "cleanup" and op.waiting_for_lock and not op.cancel_requested:
                    if op_id not in self._lock_threads:
                        self._op_done.setdefault(op_id, threading.Event())
                        requeue.append(op)
                else:
                    if op_id not in kept:
                        adopted.append(op)
                        if stored_commands.get(op_id) and not op.cancel_requested:
                            # stored before the operation was recorded (_register_op): its
                            # leader may have died before it sent them, or before it recorded
                            # that it had (one may be on its way); sent from here either way
                            op.commands_sent = True
                    # sent again once the agent has a stream here (_resend_lost_commands), and
                    # to one this replica holds too: an agent may have given its answer (an
                    # end) to a leader between that could not store it; a repeat is answered
                    # with where the agent stands, never run twice. Counted by who sent it
                    # (kvcp_commands_resent_total): another leader (an adopted operation), or
                    # this replica before it lost the leadership (one it kept: it won again)
                    went_down = AN_EARLIER_TERMS_STREAM if op_id in kept else ANOTHER_LEADERS_STREAM
                    for agent_id, command in stored_commands.get(op_id, {}).items() if op.commands_sent else ():
                        part = op.parts.get(agent_id)
                        if part is not None and part.state not in ops.TERMINAL:
                            self._unheard[(op_id, agent_id)] = (command, went_down)
            # deleted when their operations end; those of ended ones by the next pass
            self._stored_commands.update(stored_commands)
            self.policy = self._valid_stored_policy(values)
            self.policy_revision = revision
        for op in ended_elsewhere:  # its waiters (a scope lock held until it ends) and its timing
            self._signal_finished(op)
        self._delete_stale_pins(stale_pins)
        holders = [op for op in adopted if op.kind == "cleanup" and not op.dry_run and not op.finished]
        with self._lock:
            # kept running cleanups take their locks again at their keeper's next check: the
            # cleanups queued again below must not take one first and run beside them
            retaking = [i for i in kept if i in self._lock_keepers and i not in self._locks_to_retake]
            self._locks_to_retake.update(retaking)
            if holders or retaking:
                self._adopted_locks_pending += len(holders) + len(retaking)
                self._adopted_locks_settled.clear()
        for op in requeue:
            self._start_locked(op)
        for op in adopted:
            # another leader sent its commands: its agents run them to the end and report
            # on their new streams (progress, or the final answer they send again), so it
            # is followed from here. A command lost with that leader's stream is sent again
            # from its copy in etcd (an agent that had it answers the repeat with where it
            # stands); a part whose agent never reports (its command was not kept, or it
            # left) fails after the operation timeout like any silent part
            with self._lock:
                now = self.clock()
                for part in op.parts.values():
                    if part.state not in ops.TERMINAL:
                        part.updated_unix_seconds = now
                op.updated_unix_seconds = now
                # followed here to its end: set when it finishes, and timed then
                # (kvcp_operation_duration_seconds missed every operation a failover adopted)
                self._op_done.setdefault(op.op_id, threading.Event())
            self._op_changed(op)
            if op in holders:
                # its scope lock lapsed with the old leader's lease: held again here until
                # it ends, so a cleanup queued behind it still waits
                threading.Thread(target=self._hold_adopted_lock, args=(op,), name=f"op {op.op_id}", daemon=True).start()
        # said in etcd: a later leader of this etcd's history has state to load, and must
        # not restore its own over it (etcd emptied after this, a paused replica wins...)
        self.durable.put(
            etcd_keys.LOADED_KEY, json.dumps({"address": getattr(self.election, "address", ""), "epoch": epoch})
        )
        self._loaded_epoch = self._state_epoch = epoch
        self._loaded_monotonic = time.monotonic()
        self.cluster.events.publish(
            "leader",
            f"{getattr(self.election, 'address', '') or 'this replica'} leads (epoch {epoch}): loaded "
            f"{len(pins)} pin(s), {len(loaded_ops)} operation(s) ({len(adopted)} adopted, {len(requeue)} queued again)",
        )

    def _restore_after_etcd_reset(self, epoch: int) -> None:
        """This replica led at a later epoch than the one it just won, saw no other replica
        lead since, and etcd holds no leader's loaded state (LOADED_KEY): etcd lost its
        data (a new empty member) and no leader has loaded since. What this replica holds
        in memory is the newest state there is: its live pins and its policy are written
        back before loading, instead of the pins being lifted from every agent as gone. A
        pin tied to an owner's lease cannot be (the lease went with etcd's data): said,
        and left to its owner to make again. An etcd restored from a snapshot holds an
        older leader's mark: its state is loaded as it is."""
        now = self.clock()
        with self._lock:
            mine = {p.pin_id: p for p in self.pins.values() if p.active(now)}
            policy = dict(self.policy)
        stored = {p.pin_id for p in self.durable.load_pins()}
        restored, lost = 0, []
        for p in mine.values():
            if p.owner_lease_id:
                lost.append(p.pin_id)
            elif p.pin_id not in stored:
                self.durable.create(pin_key(p), pin_to_json(p))
                restored += 1
        if policy:  # only where etcd holds none: a policy written since the reset stays
            self.durable.create(etcd_keys.POLICY_KEY, json.dumps(policy, sort_keys=True))
        message = (
            f"etcd lost its data (epoch {epoch} after {self._state_epoch}): restored {restored} pin(s) and the "
            f"policy from this leader's memory"
            + (
                f"; {len(lost)} pin(s) tied to owner leases etcd no longer has were not: {', '.join(lost)}"
                if lost
                else ""
            )
        )
        self.etcd_resets_total += 1  # (a restore cut short by etcd is done again, and counted once)
        log.error("%s", message)
        self.cluster.events.publish("etcd_reset", message, "error")

    def _valid_stored_policy(self, values: dict[str, str]) -> dict[str, str]:
        """The stored policy, less any key a newer rule no longer takes (said in the log):
        one such key must not keep a new leader from loading at all."""
        try:
            return self.policy_validator(values)
        except errors.InvalidArgument as exc:
            log.warning("the stored policy does not validate (%s); loading the keys that do", exc)
        # the key each refusal names goes, the others stay together (checked one by one
        # against the defaults, a lowered high watermark failed beside its own low one)
        kept = dict(values)
        while True:
            try:
                return self.policy_validator(kept)
            except errors.InvalidArgument as exc:
                named = re.search(r"\[(.+)\]$", exc.field)
                if named is None or named.group(1) not in kept:
                    break
                log.warning("ignoring the stored policy key %s=%s: %s", named.group(1), kept.pop(named.group(1)), exc)
        good: dict[str, str] = {}
        for key, value in values.items():
            try:
                self.policy_validator({**good, key: value})
                good[key] = value
            except errors.InvalidArgument as exc:
                log.warning("ignoring the stored policy key %s=%s: %s", key, value, exc)
        return self.policy_validator(good)

    # ---- scope ----------------------------------------------------------------------
    def _model(self, model_id: str) -> ModelInfo:
        return self.cluster.model(model_id)

    @staticmethod
    def check_scope_form(scope: Scope, field: str = "scope") -> None:
        """What `resolve` refuses without knowing the cluster (the model aside): checked
        first, so bad input is said as such whatever the agents' state."""
        if scope.token_ids and scope.block_hashes:
            raise errors.InvalidArgument(f"{field}.token_ids", "give token_ids or block_hashes, not both")
        if scope.token_ids or scope.block_hashes:
            if not scope.model_id:
                raise errors.InvalidArgument(f"{field}.model_id", "a prefix needs its model")
            if len(scope.block_hashes) % BLOCK_HASH_BYTES:
                raise errors.InvalidArgument(
                    f"{field}.block_hashes",
                    f"length {len(scope.block_hashes)} is not a multiple of {BLOCK_HASH_BYTES}",
                )
        elif not scope.namespace:
            raise errors.InvalidArgument(f"{field}.namespace", "give a prefix (tokens or hashes) or a namespace")
        if scope.extra_keys and not scope.token_ids:
            # they go into the hashes of tokens: beside hashes or a namespace they were ignored,
            # and a LoRA's prefix meant became the whole namespace
            raise errors.InvalidArgument(
                f"{field}.extra_keys", "extra keys go with token_ids (they are hashed with them)"
            )
        try:  # their size too: each block hashes them again (a big one held a pin or move for minutes)
            check_extra_keys(scope.extra_keys)
        except ValueError as exc:
            raise errors.InvalidArgument(f"{field}.extra_keys", str(exc)) from None
        check_namespace(scope.namespace, f"{field}.namespace")

    def resolve(self, scope: Scope, field: str = "scope", per: str = "request") -> tuple[bytes, str]:
        """-> (packed block hashes, namespace); hashes empty means the whole namespace.
        `per`: what the size limit is said of (pin, transfer...)."""
        self.check_scope_form(scope, field)
        if scope.token_ids or scope.block_hashes:
            model = self._model(scope.model_id)
            if scope.token_ids:
                check_prompt_size(len(scope.token_ids), model.block_size, per, f"{field}.token_ids")
                try:
                    packed = hash_prefix(scope.model_id, list(scope.token_ids), model.block_size, scope.extra_keys)
                except ValueError as exc:
                    raise errors.InvalidArgument(f"{field}.token_ids", str(exc)) from None
                if not packed:
                    raise errors.InvalidArgument(
                        f"{field}.token_ids", f"fewer tokens than one block ({model.block_size}) of {scope.model_id}"
                    )
            else:
                packed = scope.block_hashes
                if len(packed) // BLOCK_HASH_BYTES > MAX_PROMPT_BLOCKS:
                    raise errors.InvalidArgument(
                        f"{field}.block_hashes",
                        f"at most {MAX_PROMPT_BLOCKS} blocks per {per}; got {len(packed) // BLOCK_HASH_BYTES}",
                    )
            return packed, check_namespace(scope.namespace, f"{field}.namespace")
        return b"", check_namespace(scope.namespace, f"{field}.namespace")

    def _check_agents_back(self, agent_ids: tuple[str, ...] = (), indexed: bool = False) -> None:
        """Right after this control plane began to lead, an agent that etcd lists may not
        be back on its stream yet, and an operation sent to the agents it has would
        succeed having done nothing where that agent holds the blocks: Unavailable (retry
        shortly) for the first AGENTS_BACK_GRACE_SECONDS. `agent_ids`: only these matter;
        `indexed`: the operation finds its agents in the index (a prefix), so their
        inventories must be in too."""
        if time.monotonic() - self._loaded_monotonic >= AGENTS_BACK_GRACE_SECONDS:
            return  # one still away now is away: the operation goes to the agents here
        away = self.cluster.agents_not_back(indexed)
        if agent_ids:
            away = away & frozenset(agent_ids)
        if away:
            raise errors.Unavailable(
                f"agent(s) {', '.join(sorted(away))} registered in etcd are not back on this control plane yet "
                "(it took over moments ago); try again in a few seconds"
            )

    def _check_scope_agents_back(self, scope: Scope) -> None:
        self.check_scope_form(scope)  # bad input is said as such, not "try again"
        self._check_agents_back(
            (scope.agent_id,) if scope.agent_id else (), indexed=bool(scope.token_ids or scope.block_hashes)
        )

    def _targets(self, scope: Scope, packed: bytes) -> dict[str, bytes]:
        """agent_id -> packed hashes to send (b"" for a namespace scope)."""
        agents = [r.agent_id for r, _ in self.cluster.agents()]
        if scope.agent_id:
            if scope.agent_id not in agents:
                raise errors.NotFound(f"scope.agent_id: no agent {scope.agent_id!r} is registered")
            agents = [scope.agent_id]
        if not packed:
            return {a: b"" for a in agents}
        hashes = [packed[i : i + 16] for i in range(0, len(packed), 16)]
        held = self.cluster.holders_of(hashes)
        return {a: b"".join(held[a]) for a in agents if a in held}

    # ---- loop -----------------------------------------------------------------------
    def run_once(self, now: float | None = None) -> None:
        if not self.election.is_leader:
            if not getattr(self.election, "serving_from_memory", False):
                self._loaded_epoch = 0  # reload when we lead again (another epoch)
            leader = getattr(self.election, "leader_address", "")
            if leader and leader != getattr(self.election, "address", leader):
                self._state_epoch = 0  # another replica leads: what memory holds is not the newest
            if self._pins_watch is not None:
                self._unwatch_pins()
            self._follow_policy(self.clock() if now is None else now)
            return
        now = self.clock() if now is None else now
        self.ensure_loaded()
        self._flush_dirty()
        self._watch_pins()
        if now >= self._next_reload:
            self._next_reload = now + self.resync_seconds
            self._reload_pins()
            self._reload_policy()
        self._expire_pins(now)
        self._apply_pins(now)
        self._expire_ops(now)
        if self.policy_enabled and (
            now >= self._next_policy or (now >= self._next_urgent and self._urgent(self.tier_policy()))
        ):
            started = time.perf_counter()
            self.policy_pass(now)
            # a long pass (large agents to decide for) spaces the next one out, so the pass
            # takes at most a third of a core from ingest and lookups
            spacing = 2 * (time.perf_counter() - started)
            self._next_policy = now + max(self.policy_interval_seconds, spacing)
            self._next_urgent = now + max(self.policy_urgent_min_seconds, spacing)

    def _follow_policy(self, now: float) -> None:
        """A follower reads the stored policy every resync, so that when it takes over its
        cordons already keep lookups and Route away from those agents (load() reads it
        again; until then a new leader answers from memory)."""
        if now < self._next_follow:
            return
        self._next_follow = now + self.resync_seconds
        try:
            self._reload_policy()
        except errors.KvcpError as exc:  # etcd away: the leader's load reads it when it is back
            log.debug("cannot read the policy while following: %s", exc)

    def run_forever(self, stop: threading.Event, interval_seconds: float = 0.2) -> None:
        while not stop.is_set():
            try:
                self.run_once()
            except errors.KvcpError as exc:
                log.warning("reconcile pass failed: %s", exc)
            except Exception:  # noqa: BLE001 - keep reconciling; the next pass repairs
                log.exception("reconcile pass failed")
            stop.wait(interval_seconds)
