"""The leader's durable actions and its reconcile loop: pins, operations and policy.

Pins, operations and policy live in etcd (controlplane.store.durable) and in memory
here; agents get them as commands over their Sync streams. `run_once(now)` is level
triggered: it expires pins, re-applies every pin to every connected agent that lacks it
(after an agent or control-plane restart), times out silent operations, and reloads
from etcd what other writers changed (a pin released with its owner's lease).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import logging
import math
import threading
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass
from functools import partial

from controlplane.core import operations as ops
from controlplane.core import policy as tier_policy
from controlplane.core.access_stats import AccessStats
from controlplane.core.clock import SteadyWallClock
from controlplane.core.cluster import AgentCommand, Cluster, ModelInfo
from controlplane.core.pins import Pin, check_quota, new_pin, same_request
from controlplane.core.tuning import CreditTuner, TunedChoice
from controlplane.metrics import PolicyStats
from controlplane.store.durable import DurableStore, op_to_json, pin_from_json, pin_key, pin_to_json
from controlplane.store.locks import EtcdLock
from protos import errors, etcd_keys
from protos.block_hash import BLOCK_HASH_BYTES, hash_prefix
from protos.kv_format import CODECS, kv_block_bytes
from protos.namespaces import check_namespace
from protos.tier import Tier
from protos.units import parse_size

log = logging.getLogger(__name__)

MAX_OPS_KEPT = 500
UNPINNED_REMEMBERED_SECONDS = 60.0  # far longer than a reload's read of etcd can take
POLICY_WRITE_TRIES = 5  # SetPolicy merges into a policy written meanwhile, at most this often
PIN_REFUSAL_SECONDS = 60.0  # how long the policy leaves alone a block an agent's pin held
CANCEL_RESEND_SECONDS = 1.0  # a cancel no agent answered yet is sent again this often


def block_bytes(m: ModelInfo) -> int:
    return kv_block_bytes(m.num_layers, m.block_size, m.num_kv_heads, m.head_dim, m.dtype)


# after taking over: how long operations wait (Unavailable) for agents etcd lists to be back
AGENTS_BACK_GRACE_SECONDS = 15.0


@dataclass(frozen=True)
class Scope:
    """What an action is about: a prefix of one model, or a namespace; optionally one agent."""

    model_id: str = ""
    token_ids: tuple[int, ...] = ()
    block_hashes: bytes = b""
    extra_keys: tuple[str, ...] = ()
    namespace: str = ""
    agent_id: str = ""


def _exact(seconds: float) -> str:
    """A number as short as it reads back exactly (shown to users, parsed on resume)."""
    short = f"{seconds:g}"
    return short if float(short) == seconds else repr(seconds)


QUOTA_REMOVED = ("", "none")  # `kvctl policy set quota.<ns>=none` (or empty) lifts a namespace's quota


def _check_quota_entry(key: str, value: str) -> None:
    """`quota.<namespace>=<size>`: the namespace must be named (`quota.` alone would be
    stored and never read: a pin's namespace is never empty)."""
    namespace = key.removeprefix("quota.")
    if not namespace:
        raise errors.InvalidArgument(f"values[{key}]", "name the namespace: quota.<namespace>=<size>")
    check_namespace(namespace, f"values[{key}]")
    if value in QUOTA_REMOVED:
        return
    try:
        parse_size(value)
    except ValueError as exc:
        raise errors.InvalidArgument(f"values[{key}]", str(exc)) from None


def validate_policy(values: dict[str, str]) -> dict[str, str]:
    """Effective policy from stored/changed values: quota.<namespace> sizes here, the
    tier policy's keys by its own validator (controlplane.core.policy)."""
    quotas = {k: v for k, v in values.items() if k.startswith("quota.")}
    for key, value in quotas.items():
        _check_quota_entry(key, value)
    rest = {k: v for k, v in values.items() if not k.startswith("quota.")}
    policy = tier_policy.Policy.from_mapping(rest)
    return {**policy.to_mapping(), **quotas}


class Manager:
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
        self._op_done: dict[str, threading.Event] = {}
        # adopted cleanups taking their scope locks again: queued ones wait for that first
        self._adopted_locks_pending = 0
        self._adopted_locks_settled = threading.Event()
        self._adopted_locks_settled.set()
        self.policy: dict[str, str] = {}
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
        self._lock_threads: set[str] = set()  # cleanups with a thread waiting for or holding their lock
        self._next_reload = 0.0
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
        result it answered must not be undone. The epoch counts as loaded only at the end,
        so a load cut short is done again."""
        epoch = self.election.epoch
        if 0 < epoch < self._state_epoch and not self.durable.exists(etcd_keys.LOADED_KEY):
            self._restore_after_etcd_reset(epoch)
        pins = self.durable.load_pins()
        loaded_ops = self.durable.load_ops()
        values, revision = self.durable.load_policy()
        requeue, adopted = [], []
        with self._lock:
            self.pins = {p.pin_id: p for p in pins}
            merged: dict[str, ops.Operation] = {}
            kept: set[str] = set()  # held here: not adopted as another leader's
            for stored in loaded_ops:
                held = self.ops.get(stored.op_id)
                # stored finished, or started by another leader since: the stored copy is newer
                mine = held is not None and (
                    stored.op_id in self._dirty
                    or not (stored.finished or (held.waiting_for_lock and not stored.waiting_for_lock))
                )
                merged[stored.op_id] = held if mine else stored
                if mine:
                    kept.add(stored.op_id)
            for op_id, held in self.ops.items():
                if op_id not in merged and (not held.finished or op_id in self._dirty):
                    merged[op_id] = held  # registered meanwhile, or not stored yet
                    kept.add(op_id)
            self.ops = OrderedDict(sorted(merged.items(), key=lambda kv: kv[1].created_unix_seconds))
            for gone in [i for i in self._op_said if i not in self.ops]:
                del self._op_said[gone]  # what events said of operations no longer kept
            for gone in [i for i in self._cancel_asked if i not in self.ops]:
                del self._cancel_asked[gone]
            for op_id, op in self.ops.items():
                if op.finished:
                    continue
                if op.kind == "cleanup" and op.waiting_for_lock and not op.cancel_requested:
                    if op_id not in self._lock_threads:
                        self._op_done.setdefault(op_id, threading.Event())
                        requeue.append(op)
                elif op_id not in kept:
                    adopted.append(op)
            self.policy = self._valid_stored_policy(values)
            self.policy_revision = revision
        holders = [op for op in adopted if op.kind == "cleanup" and not op.dry_run and not op.finished]
        if holders:
            with self._lock:
                self._adopted_locks_pending += len(holders)
                self._adopted_locks_settled.clear()
        for op in requeue:
            self._start_locked(op)
        for op in adopted:
            # another leader sent its commands: its agents run them to the end and report
            # on their new streams (progress, or the final answer they send again), so it
            # is followed from here; a part whose agent never reports (it never got the
            # command, or left) fails after the operation timeout like any silent part
            with self._lock:
                now = self.clock()
                for part in op.parts.values():
                    if part.state not in ops.TERMINAL:
                        part.updated_unix_seconds = now
                op.updated_unix_seconds = now
                if op in holders:
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

    def resolve(self, scope: Scope, field: str = "scope") -> tuple[bytes, str]:
        """-> (packed block hashes, namespace); hashes empty means the whole namespace."""
        if scope.token_ids and scope.block_hashes:
            raise errors.InvalidArgument(f"{field}.token_ids", "give token_ids or block_hashes, not both")
        if scope.token_ids or scope.block_hashes:
            if not scope.model_id:
                raise errors.InvalidArgument(f"{field}.model_id", "a prefix needs its model")
            model = self._model(scope.model_id)
            if scope.token_ids:
                try:
                    packed = hash_prefix(scope.model_id, list(scope.token_ids), model.block_size, scope.extra_keys)
                except ValueError as exc:
                    raise errors.InvalidArgument(f"{field}.token_ids", str(exc)) from None
                if not packed:
                    raise errors.InvalidArgument(
                        f"{field}.token_ids", f"fewer tokens than one block ({model.block_size}) of {scope.model_id}"
                    )
            else:
                if len(scope.block_hashes) % BLOCK_HASH_BYTES:
                    raise errors.InvalidArgument(
                        f"{field}.block_hashes",
                        f"length {len(scope.block_hashes)} is not a multiple of {BLOCK_HASH_BYTES}",
                    )
                packed = scope.block_hashes
            return packed, check_namespace(scope.namespace, f"{field}.namespace")
        if not scope.namespace:
            raise errors.InvalidArgument(f"{field}.namespace", "give a prefix (tokens or hashes) or a namespace")
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

    # ---- pins -----------------------------------------------------------------------
    def quota_of(self, namespace: str) -> int | None:
        raw = self.policy.get(f"quota.{namespace}")
        return parse_size(raw) if raw else None

    def pin(
        self,
        scope: Scope,
        min_tier: Tier,
        ttl_seconds: float,
        owner: str = "",
        owner_lease_id: int = 0,
        pin_id: str = "",
    ) -> Pin:
        """A new pin; with a `pin_id` chosen by the caller, a retry of the same request
        returns the pin the first try made (found in memory, or in etcd where the first
        try's answer was lost after etcd took it) and another request under that id is
        ALREADY_EXISTS."""
        self.ensure_loaded()
        packed, namespace = self.resolve(scope)
        if not packed and scope.model_id:  # agents hold a namespace pin over every model's blocks in it
            raise errors.InvalidArgument(
                "scope.model_id", "a namespace pin covers every model's blocks in it; give a prefix to pin one model's"
            )
        if scope.agent_id and scope.agent_id not in {r.agent_id for r, _ in self.cluster.agents()}:
            raise errors.NotFound(f"scope.agent_id: no agent {scope.agent_id!r} is registered")
        if packed:
            pinned_bytes = len(packed) // BLOCK_HASH_BYTES * block_bytes(self._model(scope.model_id))
        else:
            pinned_bytes = self.cluster.namespace_bytes(namespace, scope.agent_id)
        # etcd lease ids are int64: a larger one names no lease (and etcd's client cannot send it)
        if owner_lease_id and (owner_lease_id >= 1 << 63 or not self.durable.lease_alive(owner_lease_id)):
            raise errors.InvalidArgument(
                "owner_lease_id", f"lease {owner_lease_id} (0x{owner_lease_id:x}) does not exist or has expired"
            )
        pin = new_pin(
            namespace,
            scope.model_id,
            packed,
            min_tier,
            ttl_seconds,
            owner,
            owner_lease_id,
            scope.agent_id,
            pinned_bytes,
            self.clock(),
            pin_id,
        )
        with self._lock:
            earlier = self._store_pin(pin, namespace)
        if earlier is not None:  # a retry: the pin exists (sent to its agents again, harmlessly)
            self._apply_pins_now()
            return earlier
        self.cluster.events.publish("pin_created", self._describe(pin), pin_id=pin.pin_id)
        self._apply_pins_now()
        return pin

    def _store_pin(self, pin: Pin, namespace: str) -> Pin | None:
        """Store a new pin (None), or return the live pin its caller-chosen id already
        names for the same request: one this leader holds, or one etcd took although the
        answer to the first try was lost (adopted). Under _lock."""
        now = self.clock()
        earlier = self.pins.get(pin.pin_id)
        if earlier is not None and earlier.active(now):
            return self._same_pin(earlier, pin)
        check_quota(
            list(self.pins.values()), pin, self.quota_of(namespace), partial(self.cluster.namespace_bytes, namespace)
        )
        key, value = pin_key(pin), pin_to_json(pin)
        lease_id = pin.owner_lease_id
        # an expired pin of ours under this id is simply replaced; else create only if free
        held = self.durable.create(key, value, lease_id) if earlier is None else b""
        if held:
            try:
                stored = pin_from_json(held)
            except (ValueError, KeyError):
                stored = None
            if stored is not None and stored.active(now):
                self.pins[stored.pin_id] = stored
                return self._same_pin(stored, pin)
        if held is not None:  # a pin past its TTL under this id, or none that parses: replaced
            self.durable.put(key, value, lease_id)
        self.pins[pin.pin_id] = pin
        self._unpinned.pop(pin.pin_id, None)  # made again under its id: the reload may list it
        return None

    @staticmethod
    def _same_pin(earlier: Pin, pin: Pin) -> Pin:
        if not same_request(earlier, pin):
            raise errors.AlreadyExists(
                f"pin_id: pin {pin.pin_id!r} exists with another scope, tier, TTL or owner "
                "(kvctl pins lists it; choose another id)"
            )
        return earlier

    @staticmethod
    def _describe(pin: Pin) -> str:
        what = f"{pin.num_blocks} blocks of {pin.model_id}" if pin.block_hashes else f"namespace {pin.namespace}"
        ttl = (
            f", expires in {pin.expires_unix_seconds - pin.created_unix_seconds:.0f}s"
            if pin.expires_unix_seconds
            else ""
        )
        return f"pin {pin.pin_id}: {what} at >= {pin.min_tier.label}{ttl}"

    def unpin(self, pin_id: str) -> Pin:
        self.ensure_loaded()
        with self._lock:
            pin = self.pins.get(pin_id)
            if pin is None:
                raise errors.NotFound(f"pin_id: no pin {pin_id!r} (kvctl pins lists them)")
            self.durable.delete(pin_key(pin))
            del self.pins[pin_id]
            self._unpinned[pin_id] = time.monotonic()
            self._pin_refusals.clear()  # a lifted pin may free what an agent refused
        self.cluster.events.publish("pin_removed", f"pin {pin_id} removed", pin_id=pin_id)
        self._apply_pins_now()
        return pin

    def _apply_pins_now(self) -> None:
        """After a pin or unpin is stored: send it to the agents at once. The change is
        made whatever happens here (the caller must hear so, not an error): a failure is
        logged and the reconcile loop's next pass sends it."""
        try:
            self._apply_pins(self.clock())
        except Exception:  # noqa: BLE001 - see above
            log.exception("sending pins to agents failed; the next reconcile pass sends them")

    def list_pins(self, namespace: str = "") -> list[Pin]:
        if namespace:
            check_namespace(namespace, "namespace")  # "a b" names no namespace: say so, not "no pins"
        now = self.clock()
        with self._lock:
            found = sorted(
                (p for p in self.pins.values() if p.active(now) and (not namespace or p.namespace == namespace)),
                key=lambda p: p.created_unix_seconds,
            )
        # a namespace pin covers what its namespace holds now (it grows with it), as its
        # quota check counts it, not what it held when it was made
        return [
            dataclasses.replace(p, pinned_bytes=self.cluster.namespace_bytes(p.namespace, p.agent_id))
            if p.whole_namespace
            else p
            for p in found
        ]

    def _apply_pins(self, now: float) -> None:
        """Send every connected agent the pins it should hold and lacks (or holds in another
        version: a pin made again under its id replaces the agent's copy); unpin the rest."""
        with self._apply_lock:
            self._apply_pins_locked(now)

    def _apply_pins_locked(self, now: float) -> None:
        with self._lock:
            pins = [p for p in self.pins.values() if p.active(now)]
        for rec in self.cluster.connected_agents():
            want = {p.pin_id: p for p in pins if p.applies_to(rec.agent_id)}
            # a copy: a new stream's Hello replaces the record's dict meanwhile
            for pin_id in [i for i in list(rec.applied_pins) if i not in want]:
                if self.cluster.send(rec.agent_id, AgentCommand(f"unpin-{pin_id}", "unpin", pin_id=pin_id)):
                    rec.applied_pins.pop(pin_id, None)
            for pin_id, p in want.items():
                if rec.applied_pins.get(pin_id) == p.version:
                    continue
                cmd = AgentCommand(
                    f"pin-{pin_id}",
                    "pin",
                    block_hashes=p.block_hashes,
                    tier=int(p.min_tier),
                    namespace=p.namespace if p.whole_namespace else "",
                    pin_id=pin_id,
                    pin_version=p.version,
                    expires_unix_seconds=p.expires_unix_seconds,
                )
                if self.cluster.send(rec.agent_id, cmd):
                    rec.applied_pins[pin_id] = p.version

    def _expire_pins(self, now: float) -> None:
        with self._lock:
            expired = [p for p in self.pins.values() if not p.active(now)]
        for p in expired:
            try:
                self.durable.delete(pin_key(p))
            except errors.KvcpError as exc:
                log.warning("could not delete expired pin %s yet: %s", p.pin_id, exc)
                continue  # agents stop honouring it at its expiry anyway; retried next pass
            with self._lock:
                self.pins.pop(p.pin_id, None)
                self._pin_refusals.clear()  # a lifted pin may free what an agent refused
            self.pins_expired_total += 1
            self.cluster.events.publish("pin_expired", f"pin {p.pin_id} expired (TTL)", pin_id=p.pin_id)

    def _watch_pins(self) -> None:
        """A pin key deleted in etcd (its owner's lease ended) brings the reload forward to
        this loop's next turn, instead of the next resync up to `resync_seconds` later:
        the pin is lifted from agents within about a tenth of a second of its lease."""
        with self._lock:
            if self._pins_watch is not None or not hasattr(self.durable, "watch_deletes"):
                return
            self._pins_watch_generation += 1
            generation = self._pins_watch = self._pins_watch_generation  # "opening"

        def reload_now() -> None:
            self._next_reload = 0.0

        def ended() -> None:  # on the watch's thread, maybe before watch_deletes returns
            with self._lock:
                if self._pins_watch == generation:
                    self._pins_watch = self._pins_watch_id = None  # watched again at the next turn

        try:
            watch_id = self.durable.watch_deletes(etcd_keys.PINS_PREFIX, reload_now, ended)
        except errors.Unavailable as exc:
            log.debug("cannot watch pins yet: %s", exc)
            ended()
            return
        with self._lock:
            if self._pins_watch == generation:  # not ended meanwhile
                self._pins_watch_id = watch_id

    def _unwatch_pins(self) -> None:
        """A follower does not reload pins: its watch goes (it is opened again on leading)."""
        with self._lock:
            watch_id, self._pins_watch, self._pins_watch_id = self._pins_watch_id, None, None
        if watch_id is not None and hasattr(self.durable, "cancel_watch"):
            self.durable.cancel_watch(watch_id)

    def _reload_pins(self) -> None:
        """Level-triggered: etcd is the truth (a pin tied to an owner lease vanishes with it)."""
        with self._lock:
            before = dict(self.pins)  # a pin created (or made again) after the read below is not 'gone'
        stored = {p.pin_id: p for p in self.durable.load_pins()}
        with self._lock:
            gone = [pid for pid, p in before.items() if self.pins.get(pid) is p and pid not in stored]
            for pid in gone:
                del self.pins[pid]
                self._pin_refusals.clear()  # a lifted pin may free what an agent refused
            cutoff = time.monotonic() - UNPINNED_REMEMBERED_SECONDS
            self._unpinned = {pid: at for pid, at in self._unpinned.items() if at > cutoff}
            for pid, p in stored.items():
                if pid not in self._unpinned:  # (read before its unpin deleted it)
                    self.pins.setdefault(pid, p)
        for pid in gone:
            self.cluster.events.publish("pin_removed", f"pin {pid} released (owner lease gone)", pin_id=pid)

    # ---- operations -----------------------------------------------------------------
    def _register_op(self, op: ops.Operation) -> None:
        self._persist_op(op)
        with self._lock:
            self.ops[op.op_id] = op
            self._op_done[op.op_id] = threading.Event()
            while len(self.ops) > MAX_OPS_KEPT:
                old_id, old = next(iter(self.ops.items()))
                if not old.finished:
                    break
                self.ops.popitem(last=False)
                self._op_done.pop(old_id, None)
                self._op_said.pop(old_id, None)
                self._cancel_asked.pop(old_id, None)
                try:
                    self.durable.delete(etcd_keys.OPS_PREFIX + old_id)
                except errors.KvcpError:
                    pass

    def _persist_op(self, op: ops.Operation) -> None:
        self.durable.put(etcd_keys.OPS_PREFIX + op.op_id, op_to_json(op))

    def _op_changed(self, op: ops.Operation) -> None:
        try:
            self._persist_op(op)
        except errors.KvcpError as exc:
            # kept to be written by the next passes (_flush_dirty), and never undone by a
            # reload meanwhile: a state this leader answered stays the state
            with self._lock:
                self._dirty.add(op.op_id)
            log.warning("could not persist operation %s yet (retried): %s", op.op_id, exc)
        else:
            with self._lock:
                self._dirty.discard(op.op_id)
        said = (op.state, op.error)
        with self._lock:  # an event when the state (or its error) changes, not at every progress report
            fresh = self._op_said.get(op.op_id) != said
            self._op_said[op.op_id] = said
        if fresh:
            self.cluster.events.publish(
                "op_state",
                f"{op.kind} {op.op_id}: {op.state}" + (f" ({op.error})" if op.error else ""),
                "error" if op.state == ops.FAILED else "info",
                op_id=op.op_id,
            )
        if op.finished:
            ev = self._op_done.get(op.op_id)
            if ev is not None and not ev.is_set():
                ev.set()
                if self.on_finished is not None:
                    self.on_finished(op.kind, op.state, op.updated_unix_seconds - op.created_unix_seconds)

    def _flush_dirty(self) -> None:
        """Write the operations whose latest change etcd did not take (level-triggered)."""
        with self._lock:
            pending = [self.ops[i] for i in self._dirty if i in self.ops]
            self._dirty.intersection_update(self.ops)
        for op in pending:
            try:
                self._persist_op(op)
            except errors.KvcpError:
                return  # etcd still away: the next pass tries again
            with self._lock:
                self._dirty.discard(op.op_id)

    def _fan_out(self, op: ops.Operation, commands: dict[str, AgentCommand]) -> None:
        # under the lock: a cancel that came meanwhile (since the op was registered, or while
        # its start was being recorded) is seen, and none can slip in between check and send
        with self._lock:
            if op.finished or op.cancel_requested:
                return
            now = self.clock()
            for part in op.parts.values():
                part.updated_unix_seconds = now  # silence is counted from when commands go out
            op.commands_sent = True  # from here a cancel waits for the agents' own answers
            for agent_id, cmd in commands.items():
                if not self.cluster.send(agent_id, cmd):
                    ops.fail_part(op, agent_id, "agent has no open stream to the control plane")
                elif agent_id in op.parts:
                    op.parts[agent_id].incarnation = self.cluster.incarnation_of(agent_id)
        self._op_changed(op)

    def move(self, scope: Scope, to_tier: Tier, codec: str = "") -> ops.Operation:
        self.ensure_loaded()
        if to_tier not in (Tier.GPU, Tier.CPU, Tier.DISK):
            raise errors.InvalidArgument("to_tier", "must be gpu, cpu or disk")
        if codec and codec not in CODECS:
            raise errors.InvalidArgument("codec", f"unknown codec {codec!r}; expected one of {'|'.join(CODECS)}")
        self._check_scope_agents_back(scope)  # (before the model: a new leader may not know it yet)
        packed, namespace = self.resolve(scope)
        targets = self._targets(scope, packed)
        params = {"to": to_tier.label, "namespace": namespace if not packed else "", "blocks": str(len(packed) // 16)}
        if codec:
            params["codec"] = codec
        op = ops.new_operation("move", params, list(targets), now=self.clock())
        self._register_op(op)
        self._fan_out(
            op,
            {
                a: AgentCommand(
                    op.op_id,
                    "move",
                    block_hashes=h,
                    tier=int(to_tier),
                    codec=codec,
                    namespace=namespace if not h else "",
                    model_id=scope.model_id if not h else "",
                )
                for a, h in targets.items()
            },
        )
        return op

    def transfer(
        self, scope: Scope, from_agent_id: str, to_agent_id: str, deadline_seconds: float = 0.0
    ) -> ops.Operation:
        """Hand a prefix from one agent to another (prefill -> decode); the source runs it
        (agent.dataplane) and reports the outcome: engine, fallback path, or recompute."""
        self.ensure_loaded()
        # bad input is said as such, whatever the agents' state (not "try again")
        if not math.isfinite(deadline_seconds) or deadline_seconds < 0:
            raise errors.InvalidArgument("deadline_seconds", f"must be a finite number >= 0, got {deadline_seconds}")
        self._check_agents_back(tuple(a for a in (from_agent_id, to_agent_id) if a), indexed=True)
        packed, _ = self.resolve(scope)
        if not packed:
            raise errors.InvalidArgument("scope", "a transfer needs a prefix of a model (token_ids or block_hashes)")
        agents = {r.agent_id: r for r, _ in self.cluster.agents()}
        for field_name, agent_id in (("from_agent_id", from_agent_id), ("to_agent_id", to_agent_id)):
            if not agent_id:
                raise errors.InvalidArgument(field_name, "must not be empty")
            if agent_id not in agents:
                raise errors.NotFound(f"{field_name}: no agent {agent_id!r} is registered (kvctl agents lists them)")
        if from_agent_id == to_agent_id:
            raise errors.InvalidArgument("to_agent_id", "is the source; a transfer goes to another agent")
        hits = {
            m.agent_id: m.num_hit_blocks
            for m in self.cluster.lookup(scope.model_id, block_hashes=packed, record=False).matches
        }
        held = hits.get(from_agent_id, 0)
        if not held:
            raise errors.FailedPrecondition(
                f"from_agent_id: agent {from_agent_id} holds no block of this prefix (kvctl lookup shows who does)"
            )
        need = (held - min(held, hits.get(to_agent_id, 0))) * block_bytes(self._model(scope.model_id))
        capacity = sum(t.capacity_bytes for t in agents[to_agent_id].tiers if t.tier == Tier.CPU)
        if agents[to_agent_id].tiers and need > capacity:
            raise errors.FailedPrecondition(
                f"to_agent_id: agent {to_agent_id} has {capacity} B of cpu tier, the prefix needs {need} B"
            )
        params = {"model": scope.model_id, "from": from_agent_id, "to": to_agent_id, "blocks": str(held)}
        # the whole prefix goes to the source: the index may lag behind what it holds (its
        # latest events in flight), and the source hands off the leading blocks it has
        op = ops.new_operation("transfer", params, [from_agent_id], now=self.clock())
        self._register_op(op)
        command = AgentCommand(
            op.op_id,
            "transfer",
            block_hashes=packed,
            model_id=scope.model_id,
            peer_agent_id=to_agent_id,
            deadline_seconds=deadline_seconds,
        )
        self._fan_out(op, {from_agent_id: command})
        return op

    def compress(self, scope: Scope, codec: str, tier: Tier | None = None) -> ops.Operation:
        self.ensure_loaded()
        if codec not in CODECS:
            raise errors.InvalidArgument("codec", f"unknown codec {codec!r}; expected one of {'|'.join(CODECS)}")
        self._check_scope_agents_back(scope)
        packed, namespace = self.resolve(scope)
        targets = self._targets(scope, packed)
        params = {"codec": codec, "namespace": namespace if not packed else "", "tier": tier.label if tier else ""}
        op = ops.new_operation("compress", params, list(targets), now=self.clock())
        self._register_op(op)
        self._fan_out(
            op,
            {
                a: AgentCommand(
                    op.op_id,
                    "compress",
                    block_hashes=h,
                    codec=codec,
                    namespace=namespace if not h else "",
                    only_tier=int(tier) if tier else 0,
                )
                for a, h in targets.items()
            },
        )
        return op

    def cleanup(
        self,
        older_than_seconds: float,
        namespace: str = "",
        agent_id: str = "",
        model_id: str = "",
        dry_run: bool = False,
    ) -> ops.Operation:
        self.ensure_loaded()
        if not math.isfinite(older_than_seconds) or older_than_seconds < 0:
            raise errors.InvalidArgument(
                "older_than_seconds", f"must be a finite number >= 0, got {older_than_seconds}"
            )
        ns = check_namespace(namespace, "namespace") if namespace else ""
        self._check_agents_back((agent_id,) if agent_id else ())  # (before the model: see move)
        if model_id:
            self._model(model_id)
        agents = [r.agent_id for r, _ in self.cluster.agents()]
        if agent_id:
            if agent_id not in agents:
                raise errors.NotFound(f"agent_id: no agent {agent_id!r} is registered")
            agents = [agent_id]
        params = {
            "older_than_seconds": _exact(older_than_seconds),
            "namespace": ns,
            "agent": agent_id,
            "model": model_id,
        }
        op = ops.new_operation("cleanup", params, agents, dry_run=dry_run, now=self.clock())
        # a real cleanup of a scope takes that scope's lock: two cleanups never race
        op.waiting_for_lock = not (dry_run or op.finished)
        self._register_op(op)
        if op.waiting_for_lock:
            self._start_locked(op)
        else:
            self._fan_out(op, self._cleanup_commands(op))
        return op

    @staticmethod
    def _cleanup_commands(op: ops.Operation) -> dict[str, AgentCommand]:
        p = op.params
        command = AgentCommand(
            op.op_id,
            "cleanup",
            namespace=p["namespace"],
            model_id=p["model"],
            older_than_seconds=float(p["older_than_seconds"]),
            dry_run=op.dry_run,
        )
        return dict.fromkeys(op.parts, command)

    def _owns(self, op: ops.Operation) -> bool:
        """Whether this leader still runs `op`: a lost election, or a reload after one,
        hands it on (to another leader, or to the reloaded copy here). A leader cut off
        from etcd (serving from memory, same epoch) still owns it."""
        leading = self.election.is_leader or getattr(self.election, "serving_from_memory", False)
        return leading and self.ops.get(op.op_id) is op

    def _start_locked(self, op: ops.Operation) -> None:
        with self._lock:
            if op.op_id in self._lock_threads:
                return
            self._lock_threads.add(op.op_id)
        threading.Thread(target=self._run_locked_once, args=(op,), name=f"op {op.op_id}", daemon=True).start()

    def _run_locked_once(self, op: ops.Operation) -> None:
        try:
            self._run_locked(op)
        finally:
            with self._lock:
                self._lock_threads.discard(op.op_id)

    def _cleanup_lock(self, op: ops.Operation) -> tuple[EtcdLock, str]:
        # a namespace cleanup and an all-namespace one exclude each other: the namespace one
        # takes its lock only while the _all lock is free; the _all one, once it holds its
        # lock (so no namespace one starts), waits for those already running
        namespace = op.params["namespace"]
        lock_name = f"cleanup/{namespace or '_all'}"
        all_key = etcd_keys.LOCKS_PREFIX + "cleanup/_all"
        lock = EtcdLock(
            self._etcd,
            lock_name,
            op.op_id,
            also_absent=(all_key,) if namespace else (),
            drain_prefix="" if namespace else etcd_keys.LOCKS_PREFIX + "cleanup/",
        )
        return lock, lock_name

    def _hold_until_done(self, op: ops.Operation) -> None:
        """Wait while `op` runs and this replica leads (bounded by twice the op timeout)."""
        done = self._op_done.get(op.op_id)
        deadline = time.monotonic() + self.op_timeout_seconds * 2
        while done is not None and time.monotonic() < deadline and self._owns(op):
            if done.wait(0.5):
                break

    def _hold_adopted_lock(self, op: ops.Operation) -> None:
        """A cleanup another leader started: take its scope lock again (a cleanup that
        got it in between runs alongside, as it would have anyway) and hold it to the end."""
        lock, _ = self._cleanup_lock(op)
        try:
            got = lock.acquire(self.op_timeout_seconds, cancelled=lambda: op.finished or not self._owns(op))
        except Exception:  # noqa: BLE001 - the operation goes on; its lock is best kept, not required
            log.warning("could not take the scope lock of adopted cleanup %s again", op.op_id, exc_info=True)
            got = False
        with self._lock:
            self._adopted_locks_pending -= 1
            if self._adopted_locks_pending <= 0:
                self._adopted_locks_settled.set()
        if not got:
            return
        try:
            self._hold_until_done(op)
        finally:
            lock.release()

    def _run_locked(self, op: ops.Operation) -> None:
        lock, lock_name = self._cleanup_lock(op)
        self._adopted_locks_settled.wait(self.op_timeout_seconds)  # cleanups already out go first
        try:
            got = lock.acquire(self.op_timeout_seconds, cancelled=lambda: op.cancel_requested or not self._owns(op))
        except Exception as exc:  # noqa: BLE001 - etcd trouble fails the operation, visibly
            got, why = False, f"etcd: {exc}"
        else:
            why = f"lock {lock_name} stayed taken for {self.op_timeout_seconds:.0f}s"
        if not got:
            if not self._owns(op):
                return  # the leader that owns it now queues it again
            with self._lock:
                if not op.finished:
                    for part in op.parts.values():
                        ops.fail_part(op, part.agent_id, "cancelled while waiting" if op.cancel_requested else why)
            self._op_changed(op)
            return
        try:
            with self._lock:
                if op.finished or not self._owns(op):
                    return
                op.waiting_for_lock = False
            try:
                self._persist_op(op)  # a leader that takes over now must not send it again
            except errors.KvcpError as exc:
                # unrecorded, a next leader would queue it again: send nothing
                if self._owns(op):
                    with self._lock:
                        for part in op.parts.values():
                            ops.fail_part(op, part.agent_id, f"could not record its start in etcd: {exc}")
                    self._op_changed(op)
                return
            self._fan_out(op, self._cleanup_commands(op))
            self._hold_until_done(op)  # the scope lock, until it finishes or this replica no longer leads
        finally:
            lock.release()

    def on_op_update(
        self,
        agent_id: str,
        op_id: str,
        state: str,
        done: int,
        total: int,
        failed: int,
        moved_bytes: int,
        error: str,
        skipped_pinned: int = 0,
        freed=None,
        pinned: list[tuple[bytes, int]] | None = None,
        result: str = "",
    ) -> None:
        if op_id.startswith("policy-") and state in ops.TERMINAL:
            self._policy_inflight.get(agent_id, {}).pop(op_id, None)
            self._policy_report_seen[agent_id] = self.cluster.stats_reports(agent_id)
            if pinned:  # the next passes leave these where the agent's pins hold them
                until = self.clock() + PIN_REFUSAL_SECONDS
                with self._lock:
                    held = self._pin_refusals.setdefault(agent_id, {})
                    for h, tier in pinned:
                        held[h] = (Tier(tier), until)
            return
        if state not in ops.STATES:
            log.warning("ignoring an update of %s from %s with unknown state %r", op_id, agent_id, state)
            return
        if freed:
            valid = {int(t) for t in Tier}
            freed = {t: v for t, v in freed.items() if t in valid}  # an unknown tier would break listings
        self.ensure_loaded()  # an update folded into a follower's copy would be lost to load()
        with self._lock:
            op = self.ops.get(op_id)
            if op is None:
                return  # pin/unpin acknowledgements and local operations
            changed = ops.apply_update(
                op,
                agent_id,
                state,
                done,
                total,
                failed,
                moved_bytes,
                error,
                skipped_pinned,
                freed,
                self.clock(),
                result,
            )
        if changed:
            self._op_changed(op)

    def operation_counts(self) -> dict[tuple[str, str], int]:
        """(kind, state lowercase) -> number of operations kept (metrics)."""
        out: dict[tuple[str, str], int] = {}
        with self._lock:
            for op in self.ops.values():
                key = (op.kind, op.state.lower())
                out[key] = out.get(key, 0) + 1
        return out

    def get_op(self, op_id: str) -> ops.Operation:
        self.ensure_loaded()
        with self._lock:
            op = self.ops.get(op_id)
        if op is None:
            raise errors.NotFound(f"op_id: no operation {op_id!r} (kvctl ops lists them)")
        return op

    def list_ops(self, limit: int = 100) -> list[ops.Operation]:
        self.ensure_loaded()
        with self._lock:
            return list(reversed(self.ops.values()))[: limit or 100]

    def cancel_op(self, op_id: str) -> ops.Operation:
        """Cancel an operation: recorded in etcd first, so a cancel answered is one a next
        leader sees (etcd refusing it: Unavailable, nothing changed). Kinds agents run to
        the end once they have them are refused (FailedPrecondition) rather than reported
        cancelled."""
        op = self.get_op(op_id)
        now = self.clock()
        with self._lock:
            self._check_cancellable(op)
            trial = copy.deepcopy(op)
            ops.cancel(trial, now)
        try:
            self._persist_op(trial)
        except errors.OutcomeUnknown:
            # it may be stored: memory follows, and the next passes write memory's state
            with self._lock:
                self._dirty.add(op.op_id)
            with contextlib.suppress(errors.FailedPrecondition):
                self._cancel_now(op, now, persist=False)
            raise
        return self._cancel_now(op, now, persist=True)

    def _check_cancellable(self, op: ops.Operation) -> None:
        if op.finished:
            raise errors.FailedPrecondition(f"operation {op.op_id} already {op.state.lower()}")
        why = ops.not_cancellable(op)
        if why:
            raise errors.FailedPrecondition(f"operation {op.op_id} cannot be cancelled: {why}")

    def _cancel_now(self, op: ops.Operation, now: float, persist: bool) -> ops.Operation:
        with self._lock:
            # it may have finished or started meanwhile: then etcd gets its real state back
            refused = op.finished or bool(ops.not_cancellable(op))
            running = [] if refused else [p.agent_id for p in op.parts.values() if p.state not in ops.TERMINAL]
            if not refused:
                ops.cancel(op, now)
        self._send_cancel(op, running, now)
        if persist or not refused:
            self._op_changed(op)
        if refused:
            self._check_cancellable(op)
        return op

    def _send_cancel(self, op: ops.Operation, agent_ids: list[str], now: float) -> None:
        with self._lock:
            self._cancel_asked[op.op_id] = now
        for agent_id in agent_ids:
            self.cluster.send(agent_id, AgentCommand(op.op_id, "cancel"))

    def _expire_ops(self, now: float) -> None:
        # an agent with a key in etcd is alive though not yet back on this leader's stream;
        # before the first membership listing nobody is known to have left
        in_etcd = self.cluster.agents_in_etcd()
        live = {r.agent_id for r, _ in self.cluster.agents()} | (in_etcd or frozenset())
        with self._lock:
            # a cleanup still waiting for its lock has its own timeout (_run_locked)
            running = [o for o in self.ops.values() if not o.finished and not o.waiting_for_lock]
            # ... while its thread lives: one left without (a load cut short, a thread that
            # gave up as leadership flickered) is queued again, or failed once past its time
            orphans = [
                o
                for o in self.ops.values()
                if not o.finished and o.waiting_for_lock and o.op_id not in self._lock_threads
            ]
        for op in orphans:
            if not self._owns(op):
                continue
            if now - op.created_unix_seconds > 2 * self.op_timeout_seconds:
                with self._lock:
                    for part in op.parts.values():
                        ops.fail_part(op, part.agent_id, "its scope lock was never taken", now)
                self._op_changed(op)
            else:
                with self._lock:
                    self._op_done.setdefault(op.op_id, threading.Event())
                self._start_locked(op)
        for op in running:
            asked = self._cancel_asked.get(op.op_id, 0.0)
            if op.cancel_requested and op.commands_sent and self._owns(op) and now - asked >= CANCEL_RESEND_SECONDS:
                # a cancel's command may not have reached an agent (its stream was down, or
                # the leader that stored the cancel died): asked again, once a second, until
                # it answers
                waiting = [p.agent_id for p in list(op.parts.values()) if p.state not in ops.TERMINAL]
                self._send_cancel(op, waiting, now)
            changed = False
            with self._lock:
                for part in list(op.parts.values()):
                    if in_etcd is not None and part.agent_id not in live:
                        changed |= ops.fail_part(op, part.agent_id, "agent left", now, given_up=True)
                    elif part.incarnation and self.cluster.incarnation_of(part.agent_id) not in ("", part.incarnation):
                        # a process that was not the one given the command: that one is gone
                        changed |= ops.fail_part(op, part.agent_id, "agent restarted; its command was lost", now)
                changed |= ops.expire_silent_parts(op, now, self.op_timeout_seconds)
            if changed:
                self._op_changed(op)

    # ---- policy ---------------------------------------------------------------------
    def get_policy(self) -> tuple[dict[str, str], int]:
        self.ensure_loaded()
        with self._lock:
            return dict(self.policy), self.policy_revision

    def set_policy(self, changes: dict[str, str]) -> dict[str, str]:
        self.ensure_loaded()
        for key, value in changes.items():
            if key.startswith("quota."):
                _check_quota_entry(key, value)
        with self._lock:
            for _ in range(POLICY_WRITE_TRIES):
                values = {**self.policy, **changes}
                for key, value in changes.items():
                    if key.startswith("quota.") and value in QUOTA_REMOVED:
                        del values[key]
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

    def _tune(self, policy: tier_policy.Policy, capacity_blocks: int) -> TunedChoice:
        """The reuse credit the shadow caches currently favour (None: tuning off), and
        whether they see loops larger than the cache (recent-first eviction)."""
        if not policy.uses_tuner or capacity_blocks <= 0:
            self.tuner = None
            return TunedChoice(None, False)
        if self.tuner is None or abs(self.tuner.capacity_blocks - capacity_blocks) > 0.2 * self.tuner.capacity_blocks:
            self.tuner = CreditTuner(
                capacity_blocks, default=policy.reuse_credit_turnovers, max_reuse_credits=policy.max_reuse_credits
            )
        return self.tuner.choose(policy.tune_reuse_credits, policy.scan_resistance)

    def tier_policy(self) -> tier_policy.Policy:
        with self._lock:
            values = {k: v for k, v in self.policy.items() if not k.startswith("quota.")}
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
        views = []
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
            session_id = sessions.get(action.agent_id, "")
            if self.cluster.send(action.agent_id, cmd):
                self._policy_inflight.setdefault(action.agent_id, {})[op_id] = (
                    now + self.op_timeout_seconds,
                    session_id,
                )
                self.policy_actions_total += 1
        return len(actions)

    @staticmethod
    def _tier_capacity_blocks(rec, t) -> int:
        """A tier's capacity in blocks of the size it holds (models' blocks differ in size:
        the largest model's would make a tier of small blocks look overfull); 0 when it
        cannot be told (no capacity reported, or no block size known): such a tier is left
        to the agent's own safety net."""
        size = t.used_bytes // t.num_blocks if t.num_blocks and t.used_bytes else 0
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
        )

    def _over_high(self, rec, policy: tier_policy.Policy) -> bool:
        """A managed tier of the agent over its high watermark, by its latest report."""
        for t in self._managed_tiers(rec):
            if t.num_blocks > math.floor(
                policy.tier(t.tier).high_watermark * self._tier_capacity_blocks(rec, t) + 1e-9
            ):
                return True
        return False

    def _urgent(self, policy: tier_policy.Policy) -> bool:
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

    def _policy_due(self, rec, policy: tier_policy.Policy, pinned: dict[bytes, Tier]) -> bool:
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

    def _agent_view(self, rec, replicas: dict[bytes, int]) -> tier_policy.AgentView:
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

    def run_forever(self, stop: threading.Event, interval_seconds: float = 0.2) -> None:
        while not stop.is_set():
            try:
                self.run_once()
            except errors.KvcpError as exc:
                log.warning("reconcile pass failed: %s", exc)
            except Exception:  # noqa: BLE001 - keep reconciling; the next pass repairs
                log.exception("reconcile pass failed")
            stop.wait(interval_seconds)
