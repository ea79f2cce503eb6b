"""The leader's operations (part of controlplane.manager.Manager): move, transfer, compress
and cleanup fanned out to agents as commands, their progress merged from the agents'
updates and kept in etcd, cancelled, timed out when agents fall silent; a cleanup's scope
lock taken in etcd so two cannot race."""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import threading
import time
import zlib

from controlplane.core import operations as ops
from controlplane.core.cluster import AgentCommand, AgentState
from controlplane.core.policy import drop_line_bytes, room_without_drops_bytes
from controlplane.core.scope import Scope, block_bytes
from controlplane.manager_policy import MAX_CORDON_REASON_CHARS
from controlplane.manager_state import ManagerState
from controlplane.metrics import COMMAND_ASKED_ON_WINNING_AGAIN, COMMAND_LOST_WITH_LEADER, COMMAND_LOST_WITH_STREAM
from controlplane.store.durable import MAX_OP_COMMAND_BYTES, op_commands_to_json, op_to_json
from controlplane.store.locks import EtcdLock
from protos import errors, etcd_keys
from protos.kv_format import CODECS, MAX_HANDOFF_DEADLINE_SECONDS
from protos.namespaces import check_namespace
from protos.tier import Tier

log = logging.getLogger(__name__)

MAX_OPS_KEPT = 500
PIN_REFUSAL_SECONDS = 60.0  # how long the policy leaves alone a block an agent's pin held
CANCEL_RESEND_SECONDS = 1.0  # a cancel no agent answered yet is sent again this often
SCOPE_LOCK_CHECK_SECONDS = 0.5  # how often a running cleanup checks its scope lock against the leadership
# a drain that ended keeps the room it was given at most this long, until its destinations
# have reported their usage since (their reports come every second by default)
DRAIN_REPORT_WAIT_SECONDS = 10.0
# the session an adopted operation's commands went down: another leader's stream, never
# one of this leader's (they are sent again once their agent has a stream here)
ANOTHER_LEADERS_STREAM = ""
# the session of a command this replica sent before it lost the leadership and won it
# again: a stream of its earlier term, never one of this term's (sent again the same way)
AN_EARLIER_TERMS_STREAM = "(an earlier term)"
# why a command whose last session was one of those is sent again; else its stream closed
RESEND_CAUSE_OF_SESSION = {
    ANOTHER_LEADERS_STREAM: COMMAND_LOST_WITH_LEADER,
    AN_EARLIER_TERMS_STREAM: COMMAND_ASKED_ON_WINNING_AGAIN,
}
RESEND_WHY = {
    COMMAND_LOST_WITH_STREAM: "the stream it went down closed",
    COMMAND_LOST_WITH_LEADER: "the leadership changed since it went out (the command, or its answer, may be lost)",
    COMMAND_ASKED_ON_WINNING_AGAIN: (
        "this replica lost the leadership since it sent it and won it again (an answer given meanwhile may be lost)"
    ),
}


def _exact(seconds: float) -> str:
    """A number as short as it reads back exactly (shown to users, parsed on resume)."""
    short = f"{seconds:g}"
    return short if float(short) == seconds else repr(seconds)


class OperationControl(ManagerState):
    """Operations, mixed into Manager (whose state and lock they share: see Manager.__init__)."""

    # ---- operations -----------------------------------------------------------------
    def _register_op(
        self, op: ops.Operation, commands: dict[str, AgentCommand] | None = None
    ) -> errors.OutcomeUnknown | None:
        """Record a new operation in etcd and keep it here. Its `commands` are stored
        first: a leader that finds the record finds them too, and sends them (load(); an
        agent that had one answers the repeat with where it stands). Stored after the
        record, a leader that died between the two writes left an accepted operation no
        next leader could send, which failed at the operation timeout (chaos runs).

        etcd not answering the record's write (OutcomeUnknown: it may land later, and a
        next leader then follows it) is returned, not raised: memory follows it as
        applied, the next passes write it (_dirty), and the caller sends its commands and
        then raises it, so a caller that lists before trying again (as the error says)
        finds it carried out. Any other failure: nothing is kept (stored commands go with
        the next pass), and it is raised."""
        items = self._command_items(op, commands or {})
        if items:
            self._write_commands(op, items)
        unknown = None
        try:
            self._persist_op(op)
        except errors.OutcomeUnknown as exc:
            unknown = exc
            log.warning("operation %s may not be recorded yet (kept, written again): %s", op.op_id, exc)
        except errors.KvcpError:
            if items:  # not recorded: commands written before it are deleted by the next pass
                with self._lock:
                    self._stored_commands.add(op.op_id)
            raise
        trimmed = []
        with self._lock:
            self.ops[op.op_id] = op
            if items:  # (only now: a pass before it was kept here would delete them as ended)
                self._stored_commands.add(op.op_id)
            if unknown is not None:
                self._dirty.add(op.op_id)
            self._op_done[op.op_id] = threading.Event()
            while len(self.ops) > MAX_OPS_KEPT:
                old_id, old = next(iter(self.ops.items()))
                if not old.finished:
                    break
                self.ops.popitem(last=False)
                self._op_done.pop(old_id, None)
                self._op_said.pop(old_id, None)
                self._cancel_asked.pop(old_id, None)
                self._drain_landings.pop(old_id, None)
                trimmed.append(old_id)
        for old_id in trimmed:  # outside the lock: a slow etcd holds up no agent's progress report
            try:
                self.durable.delete(etcd_keys.OPS_PREFIX + old_id)
            except errors.KvcpError:  # etcd away: the record stays; a leader that loads it trims it again
                break
        return unknown

    def _persist_op(self, op: ops.Operation) -> None:
        """Write the operation as it is when this write's turn comes: one write of an
        operation at a time, so a slower write of an older state never lands after a
        newer one (etcd would keep RUNNING after SUCCEEDED was answered)."""
        with self._op_write_locks[zlib.crc32(op.op_id.encode()) % len(self._op_write_locks)]:
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
            self._signal_finished(op)
            self._drop_stored_commands(op.op_id)

    def _signal_finished(self, op: ops.Operation) -> None:
        """Wake whoever waits for the finished operation (its thread, a scope lock held
        until it ends) and time it, once."""
        with self._lock:  # the check and the set as one: load() and a progress report may both end it
            ev = self._op_done.get(op.op_id)
            if ev is None or ev.is_set():
                return
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

    def _fan_out(
        self, op: ops.Operation, commands: dict[str, AgentCommand], unknown: errors.OutcomeUnknown | None = None
    ) -> None:
        """Send a registered operation's commands, stored in etcd before the write that
        records them as going out (_register_op, _run_locked). `unknown`: that write went
        unanswered (_register_op's answer), raised once they are out."""
        # under the lock: a cancel that came meanwhile (since the op was registered, or while
        # its start was being recorded) is seen, and none can slip in between check and send
        with self._lock:
            unsent = op.finished or op.cancel_requested
            if not unsent:
                self._send_commands(op, commands)
        if unsent:
            self._drop_stored_commands(op.op_id)
        else:
            self._op_changed(op)
        if unknown is not None:
            raise unknown

    def _send_commands(self, op: ops.Operation, commands: dict[str, AgentCommand]) -> None:
        """(Under the lock.)"""
        now = self.clock()
        for part in op.parts.values():
            part.updated_unix_seconds = now  # silence is counted from when commands go out
        op.commands_sent = True  # from here a cancel waits for the agents' own answers
        for agent_id, cmd in commands.items():
            session = self.cluster.send_on_stream(agent_id, cmd)
            if not session:
                ops.fail_part(op, agent_id, "agent has no open stream to the control plane")
            elif agent_id in op.parts:
                op.parts[agent_id].incarnation = self.cluster.incarnation_of(agent_id)
                self._unheard[(op.op_id, agent_id)] = (cmd, session)

    def _store_commands(self, op: ops.Operation, commands: dict[str, AgentCommand]) -> None:
        """Keep the commands of an operation already registered here in etcd (see
        _command_items), before the write that records them as about to go out."""
        items = self._command_items(op, commands)
        if not items:
            return
        with self._lock:  # before the writes: one that fails may leave others (or itself) written
            self._stored_commands.add(op.op_id)
        self._write_commands(op, items)

    def _command_items(self, op: ops.Operation, commands: dict[str, AgentCommand]) -> list[tuple[str, str]]:
        """The etcd keys and values that keep the operation's commands until it ends: a
        command still on its way when this leader dies is lost with its stream, and the
        next leader, which adopts the operation, sends it again (agents run each once).
        One key an agent, so an operation's size is not bounded by one request's; a
        command larger than an etcd request holds is not kept (its part is left to the
        operation timeout, as before)."""
        if op.finished or op.cancel_requested or not commands:
            return []
        items = []
        for agent_id, cmd in commands.items():
            if agent_id not in op.parts:
                continue
            value = op_commands_to_json({agent_id: cmd})
            if len(value) > MAX_OP_COMMAND_BYTES:
                log.info(
                    "operation %s's command to %s (%d bytes) is not kept for a next leader",
                    op.op_id,
                    agent_id,
                    len(value),
                )
                continue
            items.append((etcd_keys.op_command_key(op.op_id, agent_id), value))
        return items

    def _write_commands(self, op: ops.Operation, items: list[tuple[str, str]]) -> None:
        """Best effort: etcd refusing it leaves such a part to the operation timeout, as
        before (and the write of the record after it most likely fails too)."""
        try:
            self.durable.put_all(items)
        except errors.KvcpError as exc:
            log.warning("could not keep operation %s's commands for a next leader: %s", op.op_id, exc)

    def _drop_stored_commands(self, op_id: str) -> bool:
        """Delete a finished operation's stored commands (etcd away: the next pass tries
        again, and a next leader's load deletes those of ended operations). False when
        etcd did not take the delete."""
        with self._lock:
            if op_id not in self._stored_commands:
                return True
        try:
            self.durable.delete_tree(etcd_keys.OP_COMMANDS_PREFIX + op_id)  # (and the one key of an earlier release)
        except errors.KvcpError:
            return False
        with self._lock:
            self._stored_commands.discard(op_id)
        return True

    def move(self, scope: Scope, to_tier: Tier, codec: str = "") -> ops.Operation:
        self.ensure_loaded()
        if to_tier not in (Tier.GPU, Tier.CPU, Tier.DISK):
            raise errors.InvalidArgument("to_tier", "must be gpu, cpu or disk")
        if codec and codec not in CODECS:
            raise errors.InvalidArgument("codec", f"unknown codec {codec!r}; expected one of {'|'.join(CODECS)}")
        self._check_scope_agents_back(scope)  # (before the model: a new leader may not know it yet)
        packed, namespace = self.resolve(scope, per="move")
        if scope.model_id and not packed:
            self._model(scope.model_id)  # a namespace's blocks of one model: a model it knows
        targets = self._targets(scope, packed)
        params = {"to": to_tier.label, "namespace": namespace if not packed else "", "blocks": str(len(packed) // 16)}
        if codec:
            params["codec"] = codec
        op = ops.new_operation("move", params, list(targets), now=self.clock())
        commands = {
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
        }
        self._fan_out(op, commands, self._register_op(op, commands))
        return op

    def transfer(
        self, scope: Scope, from_agent_id: str, to_agent_id: str, deadline_seconds: float = 0.0
    ) -> ops.Operation:
        """Hand a prefix from one agent to another (prefill -> decode); the source runs it
        (agent.dataplane) and reports the outcome: engine, fallback path, or recompute."""
        self.ensure_loaded()
        # bad input is said as such, whatever the agents' state (not "try again")
        if not 0 <= deadline_seconds <= MAX_HANDOFF_DEADLINE_SECONDS:  # also NaN; the agents refuse more
            raise errors.InvalidArgument(
                "deadline_seconds", f"must be in [0, {MAX_HANDOFF_DEADLINE_SECONDS:g}] seconds, got {deadline_seconds}"
            )
        self.check_scope_form(scope)
        if scope.agent_id:  # (ignored before: a transfer names its agents itself)
            raise errors.InvalidArgument(
                "scope.agent_id", "a transfer names its agents in from_agent_id and to_agent_id"
            )
        self._check_agents_back(tuple(a for a in (from_agent_id, to_agent_id) if a), indexed=True)
        packed, _ = self.resolve(scope, per="transfer")
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
        cordoned = self.cluster.cordon_reason(to_agent_id)
        if cordoned:  # out of rotation: KV sent there would serve nobody (the source may be one)
            raise errors.FailedPrecondition(
                f"to_agent_id: agent {to_agent_id} is cordoned ({cordoned}); kvctl uncordon {to_agent_id} first"
            )
        hits = {
            m.agent_id: m.num_hit_blocks
            for m in self.cluster.lookup(
                scope.model_id, block_hashes=packed, record=False, include_cordoned=True
            ).matches
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
        command = AgentCommand(
            op.op_id,
            "transfer",
            block_hashes=packed,
            model_id=scope.model_id,
            peer_agent_id=to_agent_id,
            deadline_seconds=deadline_seconds,
        )
        commands = {from_agent_id: command}
        self._fan_out(op, commands, self._register_op(op, commands))
        return op

    def drain(
        self,
        agent_id: str,
        to_agent_ids: tuple[str, ...] = (),
        model_id: str = "",
        deadline_seconds: float = 0.0,
        reason: str = "",
    ) -> ops.Operation:
        """Maintenance (a rolling upgrade): cordon the agent (unless it is) and have it hand
        every prefix it holds to agents in rotation, most recently used first, so that its
        restart costs the cluster no hits (operation kind "drain"; the agent runs it,
        agent.dataplane.run_drain). Destinations: those named, or every ready agent in
        rotation serving the model, the roomiest first: the room of their CPU and disk tiers
        up to where the tier policy would drop blocks (policy.room_without_drops_bytes),
        less the room the drains under way or just ended hold there (_room_held: what they
        were given, less what landed that the destination's reports show) and what Route
        sent there in the last ROUTED_HOLD_SECONDS (handoffs its last report may not show
        yet). Each is told its drop line too (policy.drop_line_bytes): Route goes on sending
        handoffs there while the drain runs, and the destination refuses the drain's blocks
        past that line as its tiers stand at each one, so they take the room the handoffs
        left (the agent tries a destination that refused again as room frees there, for a
        bounded time, within the room it was given: that stays the drain's while it runs)."""
        self.ensure_loaded()
        if not 0 <= deadline_seconds <= MAX_HANDOFF_DEADLINE_SECONDS:  # also NaN; the agents refuse more
            raise errors.InvalidArgument(
                "deadline_seconds", f"must be in [0, {MAX_HANDOFF_DEADLINE_SECONDS:g}] seconds, got {deadline_seconds}"
            )
        if not agent_id:
            raise errors.InvalidArgument("agent_id", "must not be empty")
        if reason.strip().lower() in etcd_keys.POLICY_ENTRY_REMOVED[1:] or (
            reason and (len(reason) > MAX_CORDON_REASON_CHARS or not reason.isprintable())
        ):
            raise errors.InvalidArgument(
                "reason", f"must be one printable line of at most {MAX_CORDON_REASON_CHARS} characters, not 'none'"
            )
        if len(set(to_agent_ids)) != len(to_agent_ids) or "" in to_agent_ids:
            raise errors.InvalidArgument("to_agent_ids", "names an agent twice, or an empty one")
        # one drain starts at a time: each sees the ones before it (the room they were given,
        # the agent being drained already)
        with self._drain_start:
            self._check_agents_back((agent_id, *to_agent_ids))
            agents = {r.agent_id: r for r, _ in self.cluster.agents()}
            if agent_id not in agents:
                raise errors.NotFound(f"agent_id: no agent {agent_id!r} is registered (kvctl agents lists them)")
            with self._lock:
                drains = [o for o in self.ops.values() if o.kind == "drain"]
            running = [o for o in drains if not o.finished]
            for o in running:
                if o.params.get("agent") == agent_id:  # two would run side by side, each with all the room
                    raise errors.FailedPrecondition(
                        f"agent_id: agent {agent_id} is being drained already ({o.op_id}); "
                        f"kvctl op {o.op_id} --wait waits for it, kvctl cancel {o.op_id} stops it"
                    )
            if agents[agent_id].state != AgentState.READY:  # (before cordoning it: nothing changes)
                raise errors.FailedPrecondition(
                    f"agent_id: agent {agent_id} is {agents[agent_id].state.name.lower()}, not ready: it cannot hand "
                    "its prefixes off now (kvctl cordon takes it out of rotation meanwhile)"
                )
            if model_id and model_id not in {m.model_id for m in agents[agent_id].models}:
                raise errors.InvalidArgument("model_id", f"agent {agent_id} serves no model {model_id!r}")
            models = {model_id} if model_id else {m.model_id for m in agents[agent_id].models}
            for to in to_agent_ids:
                if to == agent_id:
                    raise errors.InvalidArgument("to_agent_ids", f"names {to}, the agent drained")
                if to not in agents:
                    raise errors.NotFound(f"to_agent_ids: no agent {to!r} is registered (kvctl agents lists them)")
                if self.cluster.cordon_reason(to):
                    raise errors.FailedPrecondition(
                        f"to_agent_ids: agent {to} is cordoned ({self.cluster.cordon_reason(to)}); "
                        f"kvctl uncordon {to} first, or drain to another agent"
                    )
            candidates = [
                r
                for a, r in agents.items()
                if a != agent_id
                and (a in to_agent_ids if to_agent_ids else not self.cluster.cordon_reason(a))
                and r.state == AgentState.READY
                and models & {m.model_id for m in r.models}
            ]
            if not candidates:
                named = f" among {', '.join(to_agent_ids)}" if to_agent_ids else ""
                raise errors.FailedPrecondition(
                    f"no ready agent in rotation{named} serves {' or '.join(sorted(models)) or 'its models'}: "
                    f"nothing to drain {agent_id} to"
                )

            # the room the drains under way or just ended hold (_room_held): counted as
            # taken, never twice
            promised: dict[str, int] = {}
            promised_by: dict[str, set[str]] = {}  # destination -> the drains holding room there
            now = self.clock()
            for o in drains:
                for to, held in self._room_held(o, now).items():
                    promised[to] = promised.get(to, 0) + held
                    promised_by.setdefault(to, set()).add(o.op_id)

            policy = self.tier_policy()

            # the handoffs Route sent a destination lately land in the same room, and its
            # last report may not show them yet
            routed = {r.agent_id: self.cluster.dataplane.routed_bytes(r.agent_id) for r in candidates}

            def free_bytes(r) -> int:  # CPU and below, to where a pass would start dropping
                taken = promised.get(r.agent_id, 0) + routed[r.agent_id]
                return max(0, room_without_drops_bytes(r.tiers, policy) - taken)

            ranked = sorted(candidates, key=lambda r: (-free_bytes(r), r.agent_id))
            destinations = tuple(r.agent_id for r in ranked)
            if not any(free_bytes(r) for r in ranked):
                under_way = sorted({op_id for d in destinations for op_id in promised_by.get(d, ())})
                raise errors.FailedPrecondition(
                    f"no room: {', '.join(destinations)} have no room below the policy's watermarks "
                    "in their cpu or disk tiers (kvctl agents)"
                    + (
                        f" that drains under way or just ended ({', '.join(under_way)}) were not given "
                        "(theirs until the destinations report what landed: try again in a few seconds)"
                        if under_way
                        else ""
                    )
                    + ", and a drain pushes out none of their own blocks"
                )
            if not self.cluster.cordon_reason(agent_id):
                why = reason or "drained with kvctl"
                self.set_policy({etcd_keys.CORDON_POLICY_PREFIX + agent_id: why})
            room = tuple(free_bytes(r) for r in ranked)
            lines = tuple(drop_line_bytes(r.tiers, policy) for r in ranked)
            params = {
                "agent": agent_id,
                "to": ",".join(destinations),
                "room": ",".join(str(n) for n in room),
                "model": model_id,
            }
            op = ops.new_operation("drain", params, [agent_id], now=self.clock())
            commands = {
                agent_id: AgentCommand(
                    op.op_id,
                    "drain",
                    model_id=model_id,
                    peer_agent_ids=destinations,
                    peer_free_bytes=room,
                    peer_fill_limit_bytes=lines,
                    deadline_seconds=deadline_seconds,
                )
            }
            unknown = self._register_op(op, commands)
        self._fan_out(op, commands, unknown)
        return op

    def _room_held(self, o: ops.Operation, now: float) -> dict[str, int]:
        """Destination -> the room drain `o` holds there, which another drain is not given.
        Under way: the room it was given (all of which it may fill) less what it landed
        there that the destination's reports already show (_reported_landed_bytes: those
        count in its usage). Ended: what its blocks take there, as its agent said (the
        pages: a block's payload may end inside its last one; from an agent that did not
        say, its payload, all of which may have gone to any one destination), less the
        same, until the destination reported twice after the end (_landing_unreported).
        Where in doubt it holds more, never less: room is never given twice."""
        to_ids = o.params.get("to", "").split(",")
        seen = dict(zip(to_ids, o.params.get("reports_at_end", "").split(","), strict=False))
        taken = dict(zip(to_ids, o.params.get("taken", "").split(","), strict=False))
        held: dict[str, int] = {}
        for to, given in zip(to_ids, o.params.get("room", "").split(","), strict=False):
            if not to or not given.isdigit():
                continue
            if o.finished and not self._landing_unreported(to, seen.get(to, ""), now - o.updated_unix_seconds):
                continue
            there = taken.get(to, "")
            filled = min(int(given), int(there) if there.isdigit() else o.moved_bytes) if o.finished else int(given)
            n = filled - self._reported_landed_bytes(o.op_id, to)
            if n > 0:
                held[to] = n
        return held

    def _reported_twice_since(self, destination: str, reports_at: int) -> bool:
        """Has `destination` made two usage reports since its count stood at `reports_at`?
        Those show what had landed there by then (the first may have been on its way)."""
        return self.cluster.stats_reports(destination) >= reports_at + 2

    def _landing_unreported(self, destination: str, reports_at_end: str, seconds_since_end: float) -> bool:
        """Has `destination` not reported its usage since a drain into it ended? Its last
        report may predate the blocks that landed: the next drain must not count that room
        again. Two reports after the end (one may have been on its way), and at most
        DRAIN_REPORT_WAIT_SECONDS (the counts are this replica's: a new leader's start at 0)."""
        if seconds_since_end > DRAIN_REPORT_WAIT_SECONDS or not reports_at_end.isdigit():
            return False
        return not self._reported_twice_since(destination, int(reports_at_end))

    def _reported_landed_bytes(self, op_id: str, destination: str) -> int:
        """What drain `op_id` landed at `destination` that the destination's usage reports
        to this replica show (0: none known here, as on a new leader before its own reports)."""
        landing = self._drain_landings.get(op_id, {}).get(destination)
        if landing is None:
            return 0
        if self._reported_twice_since(destination, landing.reports_at):
            return landing.landed_bytes
        return landing.reported_bytes

    def _note_landing(self, op_id: str, destinations: list[str], taken: list[int]) -> None:
        """A drain's agent said what its blocks take at each destination so far (`taken`),
        landed there. Where the destination has reported twice since the last such note
        kept (or none is kept), that note's bytes show in its reports, and this one is
        kept with the destination's report count now, to wait for its next two. (Under
        self._lock; a note is replaced whole, so a drain starting reads one or the other.)"""
        landings = self._drain_landings.setdefault(op_id, {})
        for to, landed in zip(destinations, taken, strict=False):
            kept = landings.get(to)
            if kept is None or self._reported_twice_since(to, kept.reports_at):
                reported = self._reported_landed_bytes(op_id, to)
                landings[to] = ops.DrainLanding(reported, max(landed, reported), self.cluster.stats_reports(to))

    def compress(self, scope: Scope, codec: str, tier: Tier | None = None) -> ops.Operation:
        self.ensure_loaded()
        if codec not in CODECS:
            raise errors.InvalidArgument("codec", f"unknown codec {codec!r}; expected one of {'|'.join(CODECS)}")
        self._check_scope_agents_back(scope)
        packed, namespace = self.resolve(scope, per="compress")
        if scope.model_id and not packed:
            self._model(scope.model_id)  # a namespace's blocks of one model: a model it knows
        targets = self._targets(scope, packed)
        params = {"codec": codec, "namespace": namespace if not packed else "", "tier": tier.label if tier else ""}
        op = ops.new_operation("compress", params, list(targets), now=self.clock())
        commands = {
            a: AgentCommand(
                op.op_id,
                "compress",
                block_hashes=h,
                codec=codec,
                namespace=namespace if not h else "",
                model_id=scope.model_id if not h else "",  # a namespace's blocks of this model only
                only_tier=int(tier) if tier else 0,
            )
            for a, h in targets.items()
        }
        self._fan_out(op, commands, self._register_op(op, commands))
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
        if op.waiting_for_lock:  # its commands are made, and stored, when it takes its lock
            unknown = self._register_op(op)
            self._start_locked(op)
            if unknown is not None:
                raise unknown
        else:
            commands = self._cleanup_commands(op)
            self._fan_out(op, commands, self._register_op(op, commands))
        return op

    def _cleanup_commands(self, op: ops.Operation) -> dict[str, AgentCommand]:
        p = op.params
        command = AgentCommand(
            op.op_id,
            "cleanup",
            namespace=p["namespace"],
            model_id=p["model"],
            older_than_seconds=float(p["older_than_seconds"]),
            dry_run=op.dry_run,
            older_than_from_unix_seconds=self.clock(),  # (kept with the command for a next leader)
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

    def _keep_scope_lock(self, op: ops.Operation, lock: EtcdLock) -> None:
        """Hold `op`'s scope lock while it runs (bounded by twice the op timeout), level-
        triggered: let go while this replica does not lead (the leader that adopts the
        operation takes it), taken again while it leads again with its own copy (a
        re-won election keeps a running cleanup: it held no lock after the loss; the
        cleanups load() queues again wait for that try). Ends, releasing what it holds,
        once the operation finishes or another copy replaces it."""
        done = self._op_done.get(op.op_id)
        deadline = time.monotonic() + self.op_timeout_seconds * 2
        held = lock
        with self._lock:
            self._lock_keepers.add(op.op_id)
        try:
            while done is not None and time.monotonic() < deadline and self.ops.get(op.op_id) is op:
                if self._owns(op):
                    if not held.held:
                        held = self._retake_scope_lock(op) or held
                    self._lock_settled(op.op_id)
                else:
                    held.release()  # (idempotent: no etcd call once let go)
                if done.wait(SCOPE_LOCK_CHECK_SECONDS):
                    break
        finally:
            held.release()
            with self._lock:
                self._lock_keepers.discard(op.op_id)
            self._lock_settled(op.op_id)

    def _lock_settled(self, op_id: str = "") -> None:
        """A cleanup load() counted in `_adopted_locks_pending` tried its scope lock (""
        an adopted one; otherwise a kept one, counted once while in `_locks_to_retake`)."""
        with self._lock:
            if op_id:
                if op_id not in self._locks_to_retake:
                    return
                self._locks_to_retake.discard(op_id)
            self._adopted_locks_pending -= 1
            if self._adopted_locks_pending <= 0:
                self._adopted_locks_settled.set()

    def _retake_scope_lock(self, op: ops.Operation) -> EtcdLock | None:
        """`op`'s scope lock taken again where it is free (a fresh lock: its lease is new),
        else None (the next check tries again)."""
        lock, lock_name = self._cleanup_lock(op)
        try:
            if lock.try_acquire():
                log.warning("cleanup %s holds its scope lock %s again", op.op_id, lock_name)
                return lock
        except Exception as exc:  # noqa: BLE001 - etcd away: the next check tries again
            log.debug("cleanup %s: scope lock %s not taken again yet: %s", op.op_id, lock_name, exc)
        return None

    def _hold_adopted_lock(self, op: ops.Operation) -> None:
        """A cleanup another leader started: take its scope lock again (a cleanup that
        got it in between runs alongside, as it would have anyway) and hold it to the end."""
        lock, _ = self._cleanup_lock(op)
        try:
            got = lock.acquire(self.op_timeout_seconds, cancelled=lambda: op.finished or not self._owns(op))
        except Exception:  # noqa: BLE001 - the operation goes on; its lock is best kept, not required
            log.warning("could not take the scope lock of adopted cleanup %s again", op.op_id, exc_info=True)
            got = False
        self._lock_settled()
        if got:
            self._keep_scope_lock(op, lock)

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
            while True:
                with self._lock:
                    if op.finished or not self._owns(op):
                        return
                    # a cancel being stored now (CANCELLED in etcd) must not find it started
                    if op.op_id not in self._cancelling:
                        op.waiting_for_lock = False
                        break
                time.sleep(0.02)
            commands = self._cleanup_commands(op)
            # stored before its start is recorded: a leader that finds it started sends them
            self._store_commands(op, commands)
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
            self._fan_out(op, commands)
            self._keep_scope_lock(op, lock)  # until it finishes (let go while another replica leads)
        finally:
            lock.release()

    def on_op_update(
        self,
        agent_id: str,
        op_id: str,
        state: str,
        num_done_blocks: int,
        num_total_blocks: int,
        num_failed_blocks: int,
        moved_bytes: int,
        error: str,
        num_skipped_pinned_blocks: int = 0,
        freed=None,
        pinned: list[tuple[bytes, int]] | None = None,
        result: str = "",
        peer_taken_bytes: list[int] | None = None,
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
            self._unheard.pop((op_id, agent_id), None)  # it has the command: none is sent again
            op = self.ops.get(op_id)
            if op is None:
                return  # pin/unpin acknowledgements and local operations
            changed = ops.apply_update(
                op,
                agent_id,
                state,
                num_done_blocks,
                num_total_blocks,
                num_failed_blocks,
                moved_bytes,
                error,
                num_skipped_pinned_blocks,
                freed,
                self.clock(),
                result,
            )
            if op.kind == "drain" and peer_taken_bytes and agent_id == op.params.get("agent"):
                # what each destination's blocks take there (pages), which an ended drain keeps
                taken = ",".join(str(n) for n in peer_taken_bytes)
                changed = changed or op.params.get("taken") != taken
                op.params["taken"] = taken
                self._note_landing(op_id, op.params.get("to", "").split(","), peer_taken_bytes)
            if changed and op.kind == "drain" and op.finished and "reports_at_end" not in op.params:
                # where each destination's usage reports stood: the next drain waits for newer ones
                op.params["reports_at_end"] = ",".join(
                    str(self.cluster.stats_reports(to)) for to in op.params.get("to", "").split(",")
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
        """The newest `limit` operations, newest first; one still unfinished is never
        left out for newer ones that ended (a long move behind a stream of finished
        operations dropped off `kvctl ops` and the dashboard while it ran)."""
        self.ensure_loaded()
        limit = limit or 100
        with self._lock:
            newest_first = list(reversed(self.ops.values()))
        unfinished = sum(1 for o in newest_first if not o.finished)
        finished_left = max(0, limit - unfinished)
        out: list[ops.Operation] = []
        for o in newest_first:
            if len(out) == limit:
                break
            if not o.finished:
                out.append(o)
            elif finished_left:
                out.append(o)
                finished_left -= 1
        return out

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
            # a queued cleanup whose lock comes free meanwhile waits for this cancel to end
            self._cancelling[op.op_id] = self._cancelling.get(op.op_id, 0) + 1
        try:
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
        finally:
            with self._lock:
                left = self._cancelling.pop(op.op_id) - 1
                if left:
                    self._cancelling[op.op_id] = left

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

    def _resend_lost_commands(self, now: float) -> None:
        """Send again each command whose agent has not answered it and has a stream other
        than the one it went down: a command still queued when that stream closed (a
        reset, a reconnect) is lost with it, and the agent, unaware of the operation, would
        leave its part silent until the operation timeout. An agent that had the command
        after all answers the repeat with what it knows and does not run it twice
        (agent.api.sync_client; it says so in its Hello, and an agent that does not is sent
        nothing again); a cancel asked meanwhile follows it. The commands of an operation
        adopted from another leader (load() takes them from etcd) are sent again the same
        way, once their agent has a stream here, and so are those of its own unfinished
        operations when this replica wins the leadership again. Commands of another agent
        process are not sent: the restart check fails those parts."""
        with self._lock:
            for key, (command, session) in list(self._unheard.items()):
                op_id, agent_id = key
                op = self.ops.get(op_id)
                part = op.parts.get(agent_id) if op is not None else None
                if op is None or part is None or op.finished or part.state in ops.TERMINAL:
                    del self._unheard[key]
                    continue
                stream = self.cluster.stream_of(agent_id)
                if stream in ("", session) or not self._owns(op):
                    continue
                if part.incarnation and self.cluster.incarnation_of(agent_id) not in ("", part.incarnation):
                    del self._unheard[key]
                    continue
                if not self.cluster.runs_commands_once(agent_id):
                    # an older agent would run it twice (a drain twice at once): its part
                    # waits for the operation timeout, as before
                    del self._unheard[key]
                    continue
                sent = self.cluster.send_on_stream(agent_id, command)
                if not sent:
                    continue
                self._unheard[key] = (command, sent)
                if not part.incarnation:  # (a leader that died before it kept whom it sent it to)
                    # the process sent it now: a restart of that one fails the part at once
                    # (the restart check), and a new process is not sent it again to run twice
                    part.incarnation = self.cluster.incarnation_of(agent_id)
                    self._dirty.add(op_id)  # stored by the next pass, for a leader after this one
                cause = RESEND_CAUSE_OF_SESSION.get(session, COMMAND_LOST_WITH_STREAM)
                self.commands_resent_total[cause] += 1
                log.info("sending %s's command to %s again: %s", op_id, agent_id, RESEND_WHY[cause])
                part.updated_unix_seconds = now  # silence is counted from when the command goes out
                if op.cancel_requested:
                    self.cluster.send(agent_id, AgentCommand(op_id, "cancel"))
                    self._cancel_asked[op_id] = now

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
        with self._lock:
            ended = [i for i in self._stored_commands if i not in self.ops or self.ops[i].finished]
        for op_id in ended:  # (their deletes at the end found etcd away)
            if not self._drop_stored_commands(op_id):
                break  # etcd still away: the next pass tries again (one wait a pass, not one an operation)
        self._resend_lost_commands(now)
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
