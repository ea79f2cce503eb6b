"""A command on its way when its leader died was lost with that leader's stream: the next
leader adopted the operation but not its commands, so the agent never heard of it and its
part failed at the operation timeout. Each operation's commands are now kept in etcd until
it ends, and the next leader sends a part still unanswered again once its agent is on a
stream there (agents run a command once: a repeat is answered with where it stands).
Real etcd, two control-plane replicas in process, stand-in and real agents."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

from agent.server import DEMO_MODEL
from controlplane import manager_ops
from controlplane.api import convert
from controlplane.core.cluster import AgentCommand, BlockGroup
from controlplane.core.scope import Scope
from controlplane.server import ControlPlane, ControlPlaneConfig
from controlplane.store.durable import MAX_OP_COMMAND_BYTES, op_commands_from_json, op_commands_to_json
from protos import errors, etcd_keys
from protos.block_hash import MAX_PROMPT_BLOCKS, hash_prefix, split_hashes
from protos.tier import Tier
from tests.helpers import wait_for
from tests.integration.test_pins_ops import kv, tokens
from tests.reliability.test_ops_durability import StandInAgent, start_cp, stored_op

M = DEMO_MODEL
CAUSES = ("leader_changed", "leader_won_again", "stream_closed")


def stored_commands(etcd: str, op_id: str):
    """agent id -> its stored command of the operation (None: none stored)."""
    client = etcd_keys.connect(etcd)
    try:
        out = {}
        for raw, _ in client.get_prefix(etcd_keys.OP_COMMANDS_PREFIX + op_id + "/"):
            out.update(op_commands_from_json(raw))
        return out or None
    finally:
        client.close()


def follower(etcd: str) -> ControlPlane:
    config = ControlPlaneConfig(
        listen="127.0.0.1:0",
        etcd=etcd,
        election_ttl_seconds=3,
        metrics_listen="",
        policy_enabled=False,
        op_timeout_seconds=60,
    )
    return ControlPlane(config).start()


def on_stream(cp: ControlPlane, agent_id: str, session: str, runs_commands_once: bool = True) -> StandInAgent:
    """The stand-in agent `agent_id` on a stream of `cp` (its Hello as this release's)."""
    agent = StandInAgent(cp, agent_id)
    cp.cluster.hello(agent_id, session, runs_commands_once=runs_commands_once)
    cp.cluster.attach_outbox(agent_id, session, agent.outbox)
    return agent


def hold_first_command(monkeypatch, kind: str) -> tuple[threading.Event, list[str]]:
    """Hold the first command of `kind` on its way to the agent's stream until the event
    is set (the leader dies meanwhile: it goes into a dead stream); its op id is listed."""
    released, lost = threading.Event(), []
    real = convert.command_to_pb

    def command_to_pb(cmd, epoch, now=None):
        if cmd.kind == kind and not lost:
            lost.append(cmd.op_id)
            released.wait(15)
        return real(cmd, epoch, now)

    monkeypatch.setattr(convert, "command_to_pb", command_to_pb)
    return released, lost


class LeaderDied(BaseException):
    """The leader process ending at a step of its own: nothing after that step runs."""


def die_after_recording(monkeypatch, cp: ControlPlane, kind: str) -> list[str]:
    """`cp` dies right after etcd recorded the first new operation of `kind` (its id is
    listed); from then on it writes nothing more."""
    real, recorded = cp.manager._persist_op, []

    def persist(op):
        if recorded:
            raise errors.Unavailable("etcd is unreachable (test: the leader died)")
        real(op)
        if op.kind == kind:
            recorded.append(op.op_id)
            raise LeaderDied()

    monkeypatch.setattr(cp.manager, "_persist_op", persist)
    return recorded


def take_over(old: ControlPlane, new: ControlPlane) -> None:
    old.stop()  # resigns: the follower wins at once
    wait_for(lambda: new.election.is_leader, 15, 0.02, "the follower leads")
    wait_for(lambda: new.manager._loaded_epoch == new.election.epoch, 10, 0.02, "its state loaded")


def test_a_command_lost_with_a_dead_leader_is_sent_again_by_the_next(etcd):
    a = start_cp(etcd, op_timeout_seconds=60)
    b = None
    try:
        first1, first2 = on_stream(a, "a1", "s1"), on_stream(a, "a2", "s1")
        op = a.manager.move(Scope(namespace="ns1"), Tier.DISK, codec="int8")
        # a1's went down a's stream and was lost with it; a2 had its own and is running it
        [sent] = first1.commands("move", op.op_id)
        assert sent.codec == "int8" and sent.namespace == "ns1"
        assert stored_commands(etcd, op.op_id) == {"a1": sent, "a2": first2.commands("move", op.op_id)[0]}
        b = follower(etcd)
        take_over(a, b)
        a1, a2 = on_stream(b, "a1", "t1"), on_stream(b, "a2", "t1")
        b.manager.run_once()
        assert a1.commands("move", op.op_id) == [sent]  # the same command: codec and all
        resent = {c: b.registry.get_sample_value("kvcp_commands_resent_total", {"cause": c}) for c in CAUSES}
        assert resent == {"leader_changed": 2, "leader_won_again": 0, "stream_closed": 0}  # a1's and a2's
        assert len(a2.commands("move", op.op_id)) == 1  # it had it: it answers the repeat
        a1.report(op.op_id, "SUCCEEDED", 3, 3)
        a2.report(op.op_id, "SUCCEEDED", 2, 2)
        done = b.manager.get_op(op.op_id)
        assert done.state == "SUCCEEDED" and done.num_done_blocks == 5, (done.state, done.error)
        assert stored_commands(etcd, op.op_id) is None  # gone with the operation's end
        b.manager.run_once()
        assert a1.commands("move", op.op_id) == [sent]  # answered: not sent again
    finally:
        a.stop()
        if b is not None:
            b.stop()


def test_a_next_leader_sends_nothing_to_an_agent_that_answered_or_restarted_or_is_older(etcd):
    a = start_cp(etcd, op_timeout_seconds=60)
    b = None
    try:
        for agent_id in ("done", "restarted", "older"):
            on_stream(a, agent_id, "s1")
            a.cluster.hello(agent_id, "s1", incarnation="proc-1", runs_commands_once=True)
        op = a.manager.move(Scope(namespace="ns1"), Tier.DISK)
        StandInAgent.report(on_stream(a, "done", "s2"), op.op_id, "SUCCEEDED", 1, 1)
        b = follower(etcd)
        take_over(a, b)
        done = on_stream(b, "done", "t1")
        restarted = StandInAgent(b, "restarted")
        b.cluster.hello("restarted", "t1", incarnation="proc-2", runs_commands_once=True)
        b.cluster.attach_outbox("restarted", "t1", restarted.outbox)
        older = on_stream(b, "older", "t1", runs_commands_once=False)  # it would run a repeat again
        b.manager.run_once()
        assert not done.commands("move") and not restarted.commands("move") and not older.commands("move")
        got = b.manager.get_op(op.op_id)
        assert got.parts["restarted"].state == "FAILED" and "restarted" in got.parts["restarted"].error
        assert got.parts["older"].state not in ("SUCCEEDED", "FAILED")  # left to the operation timeout
    finally:
        a.stop()
        if b is not None:
            b.stop()


def test_a_command_sent_again_is_tied_to_the_process_it_went_to(etcd):
    """A leader that died before it kept which agent process it sent a command to left the
    part with none: the next leader sent it again without noting one, so a restart of that
    process was not seen (the part waited for the operation timeout) and the new process
    could be sent the command again and run it a second time (a stress review's reading)."""
    a = start_cp(etcd, op_timeout_seconds=60)
    b = None
    try:
        on_stream(a, "x", "s1")  # its Hello named no process: none kept with the part
        op = a.manager.move(Scope(namespace="ns1"), Tier.DISK)
        assert a.manager.get_op(op.op_id).parts["x"].incarnation == ""
        b = follower(etcd)
        take_over(a, b)
        first = StandInAgent(b, "x")
        b.cluster.hello("x", "t1", incarnation="proc-1", runs_commands_once=True)
        b.cluster.attach_outbox("x", "t1", first.outbox)
        b.manager.run_once()
        assert len(first.commands("move", op.op_id)) == 1  # sent again, to proc-1
        b.manager.run_once()  # ... and which process had it stored, for a leader after b
        assert [p["incarnation"] for p in stored_op(etcd, op.op_id)["parts"]] == ["proc-1"]
        restarted = StandInAgent(b, "x")
        b.cluster.hello("x", "t2", incarnation="proc-2", runs_commands_once=True)
        b.cluster.attach_outbox("x", "t2", restarted.outbox)
        b.manager.run_once()
        assert not restarted.commands("move")  # a new process: not given it to run again
        got = b.manager.get_op(op.op_id)
        assert got.parts["x"].state == "FAILED" and "restarted" in got.parts["x"].error, got.parts["x"]
    finally:
        a.stop()
        if b is not None:
            b.stop()


def test_a_leader_that_wins_again_asks_its_agents_where_its_operations_stand(etcd):
    """A replica that led, lost and won again keeps its own copy of an unfinished
    operation. An agent had answered it (its command heard), then finished the part while
    another leader led that could not store the end (etcd paused): that answer was lost,
    and this replica, which had nothing unheard, never asked again (the part failed "no
    progress" at the operation timeout: a chaos run). Winning again, it sends the
    unfinished parts' commands once more; an agent answers a repeat with where it stands.
    Those are counted as sent again on winning again (leader_won_again), not as lost with
    another leader (leader_changed), which they were counted as: no other leader sent them."""
    a = start_cp(etcd, op_timeout_seconds=60)
    try:
        first = on_stream(a, "a1", "s1")
        op = a.manager.move(Scope(namespace="ns1"), Tier.DISK)
        first.report(op.op_id, "RUNNING", 1, 3)  # heard: nothing to send again
        a.manager.run_once()
        assert len(first.commands("move", op.op_id)) == 1
        a.manager.load()  # as on winning an election again; the agent is back on a new stream
        again = on_stream(a, "a1", "s2")
        a.manager.run_once()
        assert len(again.commands("move", op.op_id)) == 1
        resent = {c: a.registry.get_sample_value("kvcp_commands_resent_total", {"cause": c}) for c in CAUSES}
        assert resent == {"leader_changed": 0, "leader_won_again": 1, "stream_closed": 0}
        again.report(op.op_id, "SUCCEEDED", 3, 3)  # what it answers: it had finished
        assert a.manager.get_op(op.op_id).state == "SUCCEEDED"
    finally:
        a.stop()


def test_commands_of_an_operation_that_ended_are_deleted_by_the_next_leader(etcd):
    """A leader that could not delete an ended operation's commands (etcd away at its end,
    or it died just then) leaves them; the next leader deletes them and sends none."""
    a = start_cp(etcd, op_timeout_seconds=60)
    b = None
    try:
        agent = on_stream(a, "a1", "s1")
        op = a.manager.move(Scope(namespace="ns1"), Tier.DISK)
        raw = etcd_keys.connect(etcd)
        key = etcd_keys.op_command_key(op.op_id, "a1")
        value, _ = raw.get(key)
        agent.report(op.op_id, "SUCCEEDED", 1, 1)
        raw.put(key, value)  # as if its delete never happened
        raw.close()
        b = follower(etcd)
        take_over(a, b)
        again = on_stream(b, "a1", "t1")
        b.manager.run_once()
        assert stored_commands(etcd, op.op_id) is None
        assert not again.commands("move")
    finally:
        a.stop()
        if b is not None:
            b.stop()


def test_a_real_agent_runs_a_move_its_dead_leader_never_delivered(etcd, make_agent, tmp_path, monkeypatch):
    """End to end: the leader dies with the move's command still on its way to a real
    agent; the agent follows the next leader, which sends it again, and the move is done
    well within the operation timeout (60 s)."""
    a = start_cp(etcd, op_timeout_seconds=60)
    b = None
    try:
        agent = make_agent("follower-agent", disk_dir=str(tmp_path / "disk"), disk_capacity_bytes=1 << 24)
        prompt = tokens(4, start=52_000)
        agent.engine.store(M.model_id, prompt, kv(4))
        wait_for(lambda: a.cluster.stream_of("follower-agent"), 20, 0.05, "agent on a's stream")
        hashes = split_hashes(hash_prefix(M.model_id, prompt, M.block_size))
        held = lambda: [m.num_hit_blocks for m in a.cluster.lookup(M.model_id, prompt, record=False).matches]  # noqa: E731
        wait_for(lambda: held() == [4], 20, 0.05, "indexed")
        released, lost = hold_first_command(monkeypatch, "move")
        b = follower(etcd)
        op = a.manager.move(Scope(model_id=M.model_id, token_ids=tuple(prompt)), Tier.DISK)
        wait_for(lambda: lost, 10, 0.02, "the command on its way")
        take_over(a, b)
        released.set()
        wait_for(lambda: b.manager.get_op(op.op_id).finished, 20, 0.1, "the move done by the next leader")
        done = b.manager.get_op(op.op_id)
        assert lost == [op.op_id]
        assert done.state == "SUCCEEDED" and done.num_done_blocks == 4, (done.state, done.error)
        assert {agent.pool.tier_of(h) for h in hashes} == {Tier.DISK}
    finally:
        a.stop()
        if b is not None:
            b.stop()


def test_an_operation_whose_commands_etcd_refuses_still_runs(etcd, monkeypatch):
    """Keeping the commands is for a next leader only: etcd refusing that write (over its
    request size, away a moment) neither stops the operation nor leaves anything stored."""
    a = start_cp(etcd, op_timeout_seconds=60)
    try:
        agent = on_stream(a, "a1", "s1")

        def refused(items):
            raise errors.InvalidArgument("request", "etcd refused to store it: request is too large (test)")

        monkeypatch.setattr(a.manager.durable, "put_all", refused)
        op = a.manager.move(Scope(namespace="ns1"), Tier.DISK)
        assert len(agent.commands("move", op.op_id)) == 1
        assert stored_commands(etcd, op.op_id) is None
        agent.report(op.op_id, "SUCCEEDED", 1, 1)
        assert a.manager.get_op(op.op_id).state == "SUCCEEDED"
        assert op.op_id not in a.manager._stored_commands  # (its delete at the end found nothing)
    finally:
        a.stop()


def test_a_next_leader_loads_the_commands_of_operations_past_one_etcd_answer(etcd):
    """Each agent's command keeps up to 1.4 MiB: a few large ones under way pass what one
    etcd answer carries (gRPC's 4 MiB), and a next leader that read them all at once could
    never load its state (every call UNAVAILABLE, for good)."""
    raw = etcd_keys.connect(etcd)
    try:
        for i in range(5):
            big = AgentCommand(f"op-big-{i}", "move", block_hashes=bytes(16 * MAX_PROMPT_BLOCKS), tier=int(Tier.DISK))
            value = op_commands_to_json({"a1": big})
            assert len(value) <= MAX_OP_COMMAND_BYTES  # each one kept
            raw.put(etcd_keys.op_command_key(big.op_id, "a1"), value)
    finally:
        raw.close()
    a = start_cp(etcd)
    try:
        a.manager.ensure_loaded()
        assert a.manager.ready
        assert {f"op-big-{i}" for i in range(5)} <= a.manager._stored_commands
        a.manager.run_once()  # no such operations: deleted
        assert all(stored_commands(etcd, f"op-big-{i}") is None for i in range(5))
    finally:
        a.stop()


def test_a_pass_with_etcd_away_tries_one_delete_of_ended_commands_not_one_each(etcd, monkeypatch):
    """Deletes of ended operations' commands that etcd did not take are tried again by the
    next passes; with etcd still away a pass stops at the first (each may wait the etcd
    timeout: one per operation would hold up the pass, its expiries and resends)."""
    a = start_cp(etcd, op_timeout_seconds=60)
    try:
        a.manager.ensure_loaded()
        tried = []

        def away(key, *args, **kwargs):
            tried.append(key)
            raise errors.Unavailable("etcd is unreachable (test)")

        with a.manager._lock:
            a.manager._stored_commands.update({"ended-1", "ended-2", "ended-3"})
        monkeypatch.setattr(a.manager.durable, "delete_tree", away)
        a.manager._expire_ops(a.manager.clock())
        assert len(tried) == 1
        assert a.manager._stored_commands >= {"ended-1", "ended-2", "ended-3"}  # left for the next passes
        monkeypatch.undo()
        a.manager._expire_ops(a.manager.clock())
        assert not a.manager._stored_commands & {"ended-1", "ended-2", "ended-3"}
    finally:
        a.stop()


def test_a_command_sent_just_before_its_leader_died_unrecorded_is_sent_again(etcd, monkeypatch):
    """The leader sent the command, then died before etcd recorded that it had (the write
    after the send): the next leader adopts the operation as unsent, yet its commands are
    stored, so one may be on its way. It is sent again (and the operation counts as sent:
    a cancel then waits for the agent) instead of the part failing at the timeout."""
    a = start_cp(etcd, op_timeout_seconds=60)
    b = None
    try:
        first = on_stream(a, "a1", "s1")
        real_persist = a.manager._persist_op

        def dies_before_recording(op):
            if op.commands_sent:
                raise errors.Unavailable("etcd is unreachable (test: the leader died)")
            real_persist(op)

        monkeypatch.setattr(a.manager, "_persist_op", dies_before_recording)
        op = a.manager.move(Scope(namespace="ns1"), Tier.DISK)
        [sent] = first.commands("move", op.op_id)
        b = follower(etcd)
        take_over(a, b)
        adopted = b.manager.get_op(op.op_id)
        assert not adopted.finished
        again = on_stream(b, "a1", "t1")
        b.manager.run_once()
        assert again.commands("move", op.op_id) == [sent]
        assert b.manager.get_op(op.op_id).commands_sent
        again.report(op.op_id, "SUCCEEDED", 1, 1)
        assert b.manager.get_op(op.op_id).state == "SUCCEEDED"
        assert stored_commands(etcd, op.op_id) is None
    finally:
        a.stop()
        if b is not None:
            b.stop()


def test_the_largest_operation_is_kept_for_a_next_leader(etcd):
    """A move of a prompt at the size cap (MAX_PROMPT_BLOCKS blocks) held by two agents: its
    commands (1.4 MB each) were over the 1 MiB an operation could keep, so a command lost
    with its leader failed at the timeout. Each agent's is kept under its own key now, and
    the next leader sends it again whole."""
    a = start_cp(etcd, op_timeout_seconds=60)
    b = None
    try:
        first1, first2 = on_stream(a, "a1", "s1"), on_stream(a, "a2", "s1")
        prompt = list(range(MAX_PROMPT_BLOCKS * 16))
        packed = hash_prefix("m", prompt, 16)
        for agent_id in ("a1", "a2"):
            assert a.cluster.apply_inventory_chunk(agent_id, 0, 0, True, [BlockGroup("m", Tier.CPU, packed)]) is None
        op = a.manager.move(Scope(model_id="m", token_ids=tuple(prompt)), Tier.DISK)
        [sent] = first1.commands("move", op.op_id)
        assert sent.block_hashes == packed and len(first2.commands("move", op.op_id)) == 1
        assert len(op_commands_to_json({"a1": sent})) > 1 << 20  # past the old bound on a whole operation
        assert stored_commands(etcd, op.op_id) == {"a1": sent, "a2": first2.commands("move", op.op_id)[0]}
        b = follower(etcd)
        take_over(a, b)
        a1 = on_stream(b, "a1", "t1")
        b.manager.run_once()
        assert a1.commands("move", op.op_id) == [sent]
        a1.report(op.op_id, "SUCCEEDED", MAX_PROMPT_BLOCKS, MAX_PROMPT_BLOCKS)
        StandInAgent.report(on_stream(b, "a2", "t1"), op.op_id, "SUCCEEDED", MAX_PROMPT_BLOCKS, MAX_PROMPT_BLOCKS)
        assert b.manager.get_op(op.op_id).state == "SUCCEEDED"
        assert stored_commands(etcd, op.op_id) is None
    finally:
        a.stop()
        if b is not None:
            b.stop()


def test_commands_an_earlier_release_kept_in_one_key_are_loaded_and_deleted(etcd):
    """An earlier release kept an operation's commands in one key (`opcommands/<op_id>`):
    a leader of this release taking over mid-upgrade sends them again and deletes that key
    at the operation's end."""
    a = start_cp(etcd, op_timeout_seconds=60)
    b = None
    try:
        first = on_stream(a, "a1", "s1")
        op = a.manager.move(Scope(namespace="ns1"), Tier.DISK)
        [sent] = first.commands("move", op.op_id)
        raw = etcd_keys.connect(etcd)
        raw.delete(etcd_keys.op_command_key(op.op_id, "a1"))
        raw.put(etcd_keys.OP_COMMANDS_PREFIX + op.op_id, op_commands_to_json({"a1": sent}))  # as that release did
        b = follower(etcd)
        take_over(a, b)
        again = on_stream(b, "a1", "t1")
        b.manager.run_once()
        assert again.commands("move", op.op_id) == [sent]
        again.report(op.op_id, "SUCCEEDED", 1, 1)
        assert b.manager.get_op(op.op_id).state == "SUCCEEDED"
        assert raw.get(etcd_keys.OP_COMMANDS_PREFIX + op.op_id)[0] is None
        raw.close()
    finally:
        a.stop()
        if b is not None:
            b.stop()


def test_a_cleanup_sent_again_by_the_next_leader_keeps_blocks_used_since_it_was_asked(
    etcd, make_agent, tmp_path, monkeypatch
):
    """A cleanup's command lost with its dead leader reaches the agent seconds later, from
    the next leader. The agent counted its `older_than_seconds` back from when it ran it,
    so blocks stored after the cleanup was asked for (and idle for longer than that by the
    time the command came again) were dropped; the command now counts back from when it
    was asked for, whenever it arrives."""
    a = start_cp(etcd, op_timeout_seconds=60)
    b = None
    try:
        agent = make_agent("cleanup-agent", disk_dir=str(tmp_path / "disk"), disk_capacity_bytes=1 << 24)
        old, fresh = tokens(3, start=61_000), tokens(3, start=62_000)
        agent.engine.store(M.model_id, old, kv(3), namespace="stale")
        wait_for(lambda: a.cluster.stream_of("cleanup-agent"), 20, 0.05, "agent on a's stream")
        time.sleep(1.5)  # the old blocks are idle for longer than the cleanup's 1 s
        released, lost = hold_first_command(monkeypatch, "cleanup")
        b = follower(etcd)
        op = a.manager.cleanup(1.0, namespace="stale")
        wait_for(lambda: lost, 10, 0.02, "the command on its way")
        agent.engine.store(M.model_id, fresh, kv(3, seed=1), namespace="stale")  # used after it was asked
        time.sleep(1.5)  # ... and idle for longer than 1 s when the next leader sends it again
        take_over(a, b)
        released.set()
        wait_for(lambda: b.manager.get_op(op.op_id).finished, 20, 0.1, "the cleanup done by the next leader")
        done = b.manager.get_op(op.op_id)
        assert lost == [op.op_id]
        assert done.state == "SUCCEEDED" and done.num_done_blocks == 3, (done.state, done.num_done_blocks, done.error)
        assert agent.engine.lookup(M.model_id, old) == 0
        assert agent.engine.lookup(M.model_id, fresh) == len(fresh)
    finally:
        a.stop()
        if b is not None:
            b.stop()


def lose_and_win_again(cp: ControlPlane, client, lock_key: str) -> None:
    """Another replica leads for a while (the leader key under a lease of the test's, which
    the replica's next step sees), long enough for `cp` to let go of the scope lock
    `lock_key`; then it goes, and `cp` wins again and loads."""
    other = client.lease(30)
    client.put(etcd_keys.LEADER_KEY, "127.0.0.1:9", other)
    wait_for(lambda: not cp.election.is_leader, 10, 0.02, "the leadership lost")
    wait_for(lambda: client.get(lock_key)[0] is None, 5, 0.02, "the scope lock let go of")
    epoch = cp.election.epoch
    other.revoke()
    wait_for(lambda: cp.election.is_leader and cp.manager._loaded_epoch > epoch, 15, 0.02, "won and loaded again")


@contextlib.contextmanager
def a_running_cleanup(etcd: str):
    """A leader running a cleanup of namespace kb on a stand-in agent that does not answer:
    (the replica, an etcd client, the scope lock's key, the agent, the operation)."""
    a = start_cp(etcd, op_timeout_seconds=60)
    client = etcd_keys.connect(etcd)
    try:
        agent = on_stream(a, "a1", "s1")
        op = a.manager.cleanup(0.0, namespace="kb")
        wait_for(lambda: agent.commands("cleanup", op.op_id), 10, 0.02, "the cleanup's command")
        yield a, client, etcd_keys.LOCKS_PREFIX + "cleanup/kb", agent, op
    finally:
        a.stop()
        client.close()


def test_a_cleanup_kept_over_a_lost_and_won_again_leadership_holds_its_scope_lock_again(etcd):
    """A replica running a cleanup loses the leadership (another replica's key), so it
    lets go of the cleanup's scope lock; winning again before anyone adopted it, it keeps
    its own copy of the operation. It takes the lock again (it held none from then on, so
    a cleanup of the same namespace started next ran beside it), and a cleanup queued now
    waits behind it."""
    with a_running_cleanup(etcd) as (a, client, lock_key, agent, op):
        assert client.get(lock_key)[0] == op.op_id.encode()
        lose_and_win_again(a, client, lock_key)  # no other replica adopted it meanwhile: it keeps its copy
        assert a.manager.get_op(op.op_id) is op and not op.finished
        wait_for(lambda: client.get(lock_key)[0] == op.op_id.encode(), 5, 0.02, "the scope lock taken again")
        queued = a.manager.cleanup(0.0, namespace="kb")
        time.sleep(1.0)
        assert a.manager.get_op(queued.op_id).state == "PENDING"  # behind the kept one
        assert not agent.commands("cleanup", queued.op_id)
        a.manager.on_op_update("a1", op.op_id, "SUCCEEDED", 0, 0, 0, 0, "")
        wait_for(
            lambda: agent.commands("cleanup", queued.op_id), 15, 0.05, "the queued cleanup sent once the lock is free"
        )


def test_a_cleanup_queued_behind_a_kept_one_waits_for_it_to_take_its_lock_again(etcd, monkeypatch):
    """A cleanup queued behind a running one of the same namespace when the replica loses
    the leadership is queued again when it wins again (load), while the running one, kept,
    takes its scope lock again only at its next check: the queued one must not take the
    lock in between and run beside it (its checks are spaced out here to show the window
    every time)."""
    monkeypatch.setattr(manager_ops, "SCOPE_LOCK_CHECK_SECONDS", 2.0)
    with a_running_cleanup(etcd) as (a, client, lock_key, agent, op):
        queued = a.manager.cleanup(0.0, namespace="kb")
        lose_and_win_again(a, client, lock_key)
        wait_for(lambda: client.get(lock_key)[0] is not None, 5, 0.02, "the scope lock taken again")
        time.sleep(0.5)
        assert client.get(lock_key)[0] == op.op_id.encode()  # the running one's, not the queued one's
        assert a.manager.get_op(queued.op_id).state == "PENDING"
        assert not agent.commands("cleanup", queued.op_id)
        a.manager.on_op_update("a1", op.op_id, "SUCCEEDED", 0, 0, 0, 0, "")
        wait_for(lambda: agent.commands("cleanup", queued.op_id), 15, 0.05, "the queued one sent once it is free")


@pytest.mark.parametrize("kind", ["move", "drain"])
def test_an_operation_whose_leader_died_right_after_recording_it_is_sent_by_the_next(etcd, monkeypatch, kind):
    """The leader recorded the operation in etcd and died before it stored its commands
    (the write after the record) or sent them: the next leader adopted it with nothing to
    send, and its part failed "no progress for 60s" at the operation timeout (chaos runs:
    a move whose start was answered with an error around a failover, found in the list,
    never sent again). Its commands are stored before its record now: the next leader
    sends them at once, and the agent, which never had them, runs them."""
    a = start_cp(etcd, op_timeout_seconds=60)
    b = None
    try:
        first = on_stream(a, "a1", "s1")
        if kind == "drain":  # its destination; both ready (their empty inventories synced)
            on_stream(a, "a2", "s1")
            for agent_id in ("a1", "a2"):
                assert a.cluster.apply_inventory_chunk(agent_id, 0, 0, True, []) is None
        recorded = die_after_recording(monkeypatch, a, kind)
        with pytest.raises(LeaderDied):
            if kind == "move":
                a.manager.move(Scope(namespace="ns1"), Tier.DISK)
            else:
                a.manager.drain("a1")
        [op_id] = recorded
        assert not first.commands(kind)  # nothing went out
        assert stored_op(etcd, op_id)["state"] == "PENDING"  # recorded, not finished
        b = follower(etcd)
        take_over(a, b)
        again = on_stream(b, "a1", "t1")
        if kind == "drain":
            on_stream(b, "a2", "t1")
        b.manager.run_once()
        [sent] = again.commands(kind, op_id)  # within a pass, not at the operation timeout
        assert sent.op_id == op_id and (sent.tier == int(Tier.DISK) if kind == "move" else sent.peer_agent_ids)
        assert b.registry.get_sample_value("kvcp_commands_resent_total", {"cause": "leader_changed"}) == 1
        again.report(op_id, "SUCCEEDED", 1, 1)
        assert b.manager.get_op(op_id).state == "SUCCEEDED"
        assert stored_commands(etcd, op_id) is None
    finally:
        a.stop()
        if b is not None:
            b.stop()


def test_an_operation_etcd_recorded_without_answering_is_carried_out(etcd, monkeypatch):
    """etcd took a move's record but did not answer in time (paused): the start was
    answered UNKNOWN ("may or may not have been applied: list before trying again"), and
    the leader forgot a move that etcd then held; the caller's list found it, and the
    leader that loaded it after the pause (a new epoch) had no command to send: FAILED "no
    progress for 60s" (chaos runs). The leader now keeps it (written again by its next
    pass) and sends its commands before it answers UNKNOWN; a next leader that adopts it
    sends them again, and the agent answers the repeat with where it stands."""
    a = start_cp(etcd, op_timeout_seconds=60)
    b = None
    try:
        first = on_stream(a, "a1", "s1")
        real, unanswered = a.manager._persist_op, []

        def taken_unanswered(op):
            real(op)
            if not unanswered:
                unanswered.append(op.op_id)
                raise errors.OutcomeUnknown(
                    "etcd did not answer in time (test); the change may or may not have been applied"
                )

        monkeypatch.setattr(a.manager, "_persist_op", taken_unanswered)
        with pytest.raises(errors.OutcomeUnknown):
            a.manager.move(Scope(namespace="ns1"), Tier.DISK)
        [op_id] = unanswered
        assert [o.op_id for o in a.manager.list_ops()] == [op_id]  # a caller that lists finds it
        [sent] = first.commands("move", op_id)  # carried out
        a.manager.run_once()
        assert op_id not in a.manager._dirty and stored_op(etcd, op_id)["commands_sent"]
        b = follower(etcd)
        take_over(a, b)
        again = on_stream(b, "a1", "t1")
        b.manager.run_once()
        assert again.commands("move", op_id) == [sent]
        again.report(op_id, "SUCCEEDED", 1, 1)
        assert b.manager.get_op(op_id).state == "SUCCEEDED"
    finally:
        a.stop()
        if b is not None:
            b.stop()


def test_commands_stored_for_an_operation_etcd_refused_to_record_are_deleted(etcd, monkeypatch):
    """Commands are stored before their operation's record: a record etcd refuses (away)
    leaves no operation, sends nothing, and the next pass deletes what was stored."""
    a = start_cp(etcd, op_timeout_seconds=60)
    try:
        agent = on_stream(a, "a1", "s1")
        real, refused = a.manager._persist_op, []

        def refuse_first(op):
            if not refused:
                refused.append(op.op_id)
                raise errors.Unavailable("etcd is unreachable (test)")
            real(op)

        monkeypatch.setattr(a.manager, "_persist_op", refuse_first)
        with pytest.raises(errors.Unavailable):
            a.manager.move(Scope(namespace="ns1"), Tier.DISK)
        [op_id] = refused
        assert not a.manager.list_ops() and not agent.commands("move")
        a.manager.run_once()
        assert stored_commands(etcd, op_id) is None
    finally:
        a.stop()
