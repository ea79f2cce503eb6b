"""A command the control plane queued for an agent whose Sync stream then closed (a
reconnect, a stream reset) went nowhere: the agent never heard of the operation and its
part stayed PENDING until the silence timeout failed it. The control plane now sends such
a command again on the agent's next stream, and the agent answers a Command for an
operation it has already (its final answer again, or where it stands) instead of running
it twice. Real etcd, control plane and agents."""

from __future__ import annotations

import collections
import time

from agent.server import DEMO_MODEL
from cli.client import ControlPlaneClient
from controlplane.api import convert
from controlplane.core.cluster import AgentCommand
from protos.block_hash import hash_prefix, split_hashes
from protos.tier import Tier
from tests.helpers import wait_for
from tests.integration.test_pins_ops import indexed, kv, tokens

M = DEMO_MODEL


def lose_first_command(monkeypatch, agent, kind: str, before_reconnect=lambda op_id: None) -> list[str]:
    """The first `kind` command for `agent` is lost: its stream closes while the command is
    on its way out (it goes into a stream that is gone), and the agent reconnects under the
    same identity. Returns the lost commands' op ids."""
    real = convert.command_to_pb
    lost: list[str] = []

    def command_to_pb(cmd, epoch, now=None):
        msg = real(cmd, epoch, now)
        if cmd.kind == kind and not lost:
            lost.append(cmd.op_id)
            before_reconnect(cmd.op_id)
            connections = agent.link.connections_total
            agent.link.request_reconnect()
            wait_for(lambda: agent.link.connections_total > connections and agent.link.connected.is_set())
        return msg

    monkeypatch.setattr(convert, "command_to_pb", command_to_pb)
    return lost


def finished(c: ControlPlaneClient, op_id: str, timeout_seconds: float = 15):
    # well within the operation timeout (60 s): before, a lost command's part waited for it
    return wait_for(lambda: c.get_operation(op_id).finished and c.get_operation(op_id), timeout_seconds, 0.1, "done")


def test_a_move_lost_with_its_stream_is_sent_again_on_the_next(controlplane, make_agent, tmp_path, monkeypatch):
    a = make_agent("lost1", disk_dir=str(tmp_path / "disk"), disk_capacity_bytes=1 << 24)
    prompt = tokens(4, start=40_000)
    a.engine.store(M.model_id, prompt, kv(4))
    lost = lose_first_command(monkeypatch, a, "move")
    with ControlPlaneClient(controlplane.address) as c:
        wait_for(lambda: indexed(c, "lost1") == 4, what="indexed")
        op = c.move("disk", model_id=M.model_id, token_ids=prompt)
        done = finished(c, op.op_id)
    assert lost == [op.op_id]
    assert done.state == "SUCCEEDED" and done.num_done_blocks == 4, (done.state, done.error)
    assert {a.pool.tier_of(h) for h in split_hashes(hash_prefix(M.model_id, prompt, M.block_size))} == {Tier.DISK}
    assert controlplane.cluster.runs_commands_once("lost1")  # its Hello says so
    resent = controlplane.registry.get_sample_value("kvcp_commands_resent_total", {"cause": "stream_closed"})
    assert resent == 1 and not controlplane.registry.get_sample_value(
        "kvcp_commands_resent_total", {"cause": "leader_changed"}
    )


def test_an_agent_that_does_not_say_it_runs_commands_once_is_sent_nothing_again(
    controlplane, make_agent, tmp_path, monkeypatch
):
    """An agent of an earlier release (its Hello without runs_commands_once) would run a
    repeated command a second time (a drain twice at once): its lost command is left to
    the operation timeout, as before, and never sent again."""
    hello = controlplane.cluster.hello

    def older_hello(*args, **kw):
        kw["runs_commands_once"] = False  # what an older agent's Hello reads as
        return hello(*args, **kw)

    # before the agent starts: its first Hello may come before make_agent returns
    monkeypatch.setattr(controlplane.cluster, "hello", older_hello)
    a = make_agent("lost-old", disk_dir=str(tmp_path / "disk"), disk_capacity_bytes=1 << 24)
    prompt = tokens(4, start=44_000)
    a.engine.store(M.model_id, prompt, kv(4))
    with ControlPlaneClient(controlplane.address) as c:
        wait_for(lambda: indexed(c, "lost-old") == 4, what="indexed")
        assert not controlplane.cluster.runs_commands_once("lost-old")
        lost = lose_first_command(monkeypatch, a, "move")
        op = c.move("disk", model_id=M.model_id, token_ids=prompt)
        wait_for(lambda: lost == [op.op_id], what="the command lost")
        time.sleep(1.5)  # several of the manager's passes (0.2 s apart) on the new stream
        assert a.link._mover.get(op.op_id) is None and a.link.repeated_commands_total == 0
        assert c.get_operation(op.op_id).state == "PENDING"
        assert not [k for k in controlplane.manager._unheard if k[0] == op.op_id]  # given up on: nothing to send again


def test_a_cleanup_lost_with_its_stream_is_sent_again_on_the_next(controlplane, make_agent, monkeypatch):
    a = make_agent("lost2")
    a.engine.store(M.model_id, tokens(3, start=41_000), kv(3), namespace="chat")
    lost = lose_first_command(monkeypatch, a, "cleanup")
    with ControlPlaneClient(controlplane.address) as c:
        wait_for(lambda: indexed(c, "lost2") == 3, what="indexed")
        op = c.cleanup(0, namespace="chat")
        done = finished(c, op.op_id)
        assert lost == [op.op_id]
        assert done.state == "SUCCEEDED" and sum(t.num_blocks for t in done.freed) == 3, (done.state, done.error)
        wait_for(lambda: indexed(c, "lost2") == 0, what="the cleanup reached the index")


def test_a_move_cancelled_while_its_command_was_lost_ends_cancelled(controlplane, make_agent, tmp_path, monkeypatch):
    """The cancel follows the command sent again: the agent, which now has the move queued
    behind another, cancels it and says so, instead of the operation waiting for the
    timeout."""
    a = make_agent("lost3", disk_dir=str(tmp_path / "disk"), disk_capacity_bytes=1 << 24)
    prompt, other = tokens(4, start=42_000), tokens(1, start=43_000)
    a.engine.store(M.model_id, prompt, kv(4))
    a.engine.store(M.model_id, other, kv(1, seed=1))
    mover, move_blocks = a.link._mover, a.pool.move_blocks
    lost = lose_first_command(monkeypatch, a, "move", before_reconnect=controlplane.manager.cancel_op)

    def held_until_cancelled(*args, **kw):
        # the move ahead holds the mover until the lost move's cancel is in
        wait_for(lambda: lost and (m := mover.get(lost[0])) is not None and m.cancel_requested, what="the cancel")
        return move_blocks(*args, **kw)

    monkeypatch.setattr(a.pool, "move_blocks", held_until_cancelled)
    with ControlPlaneClient(controlplane.address) as c:
        wait_for(lambda: indexed(c, "lost3") == 5, what="indexed")
        mover.submit(split_hashes(hash_prefix(M.model_id, other, M.block_size)), Tier.DISK)
        op = c.move("disk", model_id=M.model_id, token_ids=prompt)
        done = finished(c, op.op_id)
    assert lost == [op.op_id]
    assert done.state == "CANCELLED" and done.num_done_blocks == 0, (done.state, done.error)
    assert {a.pool.tier_of(h) for h in split_hashes(hash_prefix(M.model_id, prompt, M.block_size))} == {Tier.CPU}


def test_a_command_sent_twice_runs_once(controlplane, make_agent, tmp_path, monkeypatch):
    """A move, a compression and a cleanup each sent again (as a resend does when the
    agent's answer had not come yet) run once; the repeat is answered, not run."""
    a = make_agent("twice1", disk_dir=str(tmp_path / "disk"), disk_capacity_bytes=1 << 24)
    prompt = tokens(4, start=50_000)
    a.engine.store(M.model_id, prompt, kv(4), namespace="chat")
    runs: collections.Counter[str] = collections.Counter()
    mover, pool = a.link._mover, a.pool
    submit, cleanup, move_blocks = mover.submit, pool.cleanup, pool.move_blocks

    def counted_submit(*args, **kw):
        runs[kw.get("op_id", "")] += 1
        return submit(*args, **kw)

    def counted_cleanup(*args, **kw):
        runs["cleanup"] += 1
        return cleanup(*args, **kw)

    def slow_move_blocks(*args, **kw):
        time.sleep(0.3)  # the first command is still running when its repeat comes
        return move_blocks(*args, **kw)

    monkeypatch.setattr(mover, "submit", counted_submit)
    monkeypatch.setattr(pool, "cleanup", counted_cleanup)
    monkeypatch.setattr(pool, "move_blocks", slow_move_blocks)
    manager = controlplane.manager
    answers: collections.Counter[tuple[str, str]] = collections.Counter()
    on_op_update = manager.on_op_update

    def counted_answer(agent_id, op_id, state, *args, **kw):
        answers[(op_id, state)] += 1
        return on_op_update(agent_id, op_id, state, *args, **kw)

    monkeypatch.setattr(manager, "on_op_update", counted_answer)
    hashes = hash_prefix(M.model_id, prompt, M.block_size)
    send = controlplane.cluster.send
    with ControlPlaneClient(controlplane.address) as c:
        wait_for(lambda: indexed(c, "twice1") == 4, what="indexed")
        op = c.move("disk", model_id=M.model_id, token_ids=prompt)
        again = AgentCommand(op.op_id, "move", block_hashes=hashes, tier=int(Tier.DISK))
        assert send("twice1", again)  # while it runs
        done = c.wait_operation(op.op_id, timeout_seconds=15)
        assert done.state == "SUCCEEDED" and done.num_done_blocks == 4, (done.state, done.error)
        assert send("twice1", again)  # after it ended: its final answer again
        wait_for(lambda: answers[(op.op_id, "SUCCEEDED")] >= 2, what="the final answer said again")
        assert runs[op.op_id] == 1

        comp = c.wait_operation(c.compress("int8", namespace="chat").op_id, timeout_seconds=15)
        assert comp.state == "SUCCEEDED"
        assert send("twice1", AgentCommand(comp.op_id, "compress", namespace="chat", codec="int8"))
        wait_for(lambda: answers[(comp.op_id, "SUCCEEDED")] >= 2, what="the final answer said again")
        assert runs[comp.op_id] == 1

        clean = c.wait_operation(c.cleanup(0, dry_run=True).op_id, timeout_seconds=15)
        assert clean.state == "SUCCEEDED" and runs["cleanup"] == 1
        assert send("twice1", AgentCommand(clean.op_id, "cleanup", dry_run=True))
        wait_for(lambda: answers[(clean.op_id, "SUCCEEDED")] >= 2, what="the final answer said again")
        assert runs["cleanup"] == 1
    assert a.link.repeated_commands_total == 4


def test_a_transfer_sent_twice_is_handed_off_once(controlplane, make_agent, monkeypatch):
    src, dst = make_agent("twice-src"), make_agent("twice-dst")
    prompt = tokens(3, start=51_000)
    src.engine.store(M.model_id, prompt, kv(3))
    runs: list[str] = []
    run_command = src.dataplane.run_command

    def counted(op_id, *args):
        runs.append(op_id)
        return run_command(op_id, *args)

    monkeypatch.setattr(src.dataplane, "run_command", counted)
    with ControlPlaneClient(controlplane.address) as c:
        wait_for(lambda: indexed(c, "twice-src") == 3 and indexed(c, "twice-dst") == 0, what="indexed")
        op = c.transfer(M.model_id, "twice-src", "twice-dst", token_ids=prompt)
        again = AgentCommand(
            op.op_id,
            "transfer",
            block_hashes=hash_prefix(M.model_id, prompt, M.block_size),
            model_id=M.model_id,
            peer_agent_id="twice-dst",
        )
        assert controlplane.cluster.send("twice-src", again)
        done = c.wait_operation(op.op_id, timeout_seconds=15)
        assert done.state == "SUCCEEDED" and done.num_done_blocks == 3, (done.state, done.error)
        assert controlplane.cluster.send("twice-src", again)
        wait_for(lambda: src.link.repeated_commands_total == 2, what="the repeats answered")
    assert runs == [op.op_id]
    assert all(dst.pool.tier_of(h) is not None for h in split_hashes(hash_prefix(M.model_id, prompt, M.block_size)))
