"""Operation state folding (controlplane/core/operations.py), pure: what a cancel means."""

from __future__ import annotations

import contextlib
import json

import pytest

from controlplane.core import operations as ops


def _running(agent_ids):
    op = ops.new_operation("move", {"to": "disk"}, list(agent_ids), now=0.0)
    for a in agent_ids:
        ops.apply_update(op, a, ops.RUNNING, 0, 8, 0, 0, "", now=1.0)
    return op


def test_a_cancel_that_came_after_every_agent_finished_is_no_cancel():
    """The agent checks for a cancel between batches: a move on its last batch ends
    SUCCEEDED, and the operation must say it ran, not CANCELLED."""
    op = _running(["a1"])
    assert ops.cancel(op, now=2.0)
    assert op.state == ops.RUNNING
    ops.apply_update(op, "a1", ops.SUCCEEDED, 8, 8, 0, 65536, "", now=3.0)
    assert op.state == ops.SUCCEEDED and "cancel came after" in op.error


def test_a_cancel_that_stopped_one_agent_is_a_cancel():
    op = _running(["a1", "a2"])
    ops.cancel(op, now=2.0)
    ops.apply_update(op, "a1", ops.SUCCEEDED, 8, 8, 0, 65536, "", now=3.0)
    ops.apply_update(op, "a2", ops.CANCELLED, 3, 8, 0, 24576, "", now=3.0)
    assert op.state == ops.CANCELLED


def test_a_cancel_before_anything_was_sent_cancels():
    op = ops.new_operation("cleanup", {}, ["a1"], now=0.0)
    ops.cancel(op, now=1.0)
    assert op.state == ops.CANCELLED


def test_a_cancelled_operation_shows_how_far_it_got():
    op = _running(["a1"])
    ops.cancel(op, now=2.0)
    ops.apply_update(op, "a1", ops.CANCELLED, 64, 8661, 0, 64 * 8192, "", now=3.0)
    assert op.state == ops.CANCELLED and abs(op.progress - 64 / 8661) < 1e-9
    done = _running(["a1"])
    ops.apply_update(done, "a1", ops.SUCCEEDED, 8, 8, 0, 0, "", now=3.0)
    assert done.progress == 1.0


def _sent(agent_ids):
    op = ops.new_operation("move", {"to": "disk"}, list(agent_ids), now=0.0)
    op.commands_sent = True
    return op


def test_a_cancel_of_a_part_whose_agent_has_the_command_waits_for_the_agents_answer():
    """Sent but not yet reported RUNNING: the agent may be moving already. The cancel
    must not say CANCELLED with 0 done while the agent moves; the agent's answer decides."""
    op = _sent(["a1", "a2"])
    assert ops.cancel(op, now=1.0)
    assert op.state == ops.PENDING and op.cancel_requested
    assert ops.apply_update(op, "a1", ops.CANCELLED, 64, 600, 0, 64 * 8192, "", now=2.0)
    assert op.state == ops.RUNNING  # a2 still to answer
    ops.apply_update(op, "a2", ops.SUCCEEDED, 600, 600, 0, 600 * 8192, "", now=2.0)
    assert op.state == ops.CANCELLED and op.num_done_blocks == 664
    unsent = ops.new_operation("move", {"to": "disk"}, ["a1"], now=0.0)  # cancelled before its fan-out
    ops.cancel(unsent, now=1.0)
    assert unsent.state == ops.CANCELLED


def test_an_agent_given_up_for_silence_that_answers_later_has_the_last_word():
    """The control plane failed the part (no progress for 60 s); the agent, only stalled,
    finished the move. Its final report replaces the failure: the operation says what
    was done. A failure the agent reported itself is final."""
    op = _sent(["a1", "a2"])
    ops.apply_update(op, "a2", ops.SUCCEEDED, 5, 5, 0, 0, "", now=1.0)
    assert ops.expire_silent_parts(op, now=100.0, timeout_seconds=60.0)
    assert op.state == ops.FAILED and "no progress" in op.error
    assert not ops.apply_update(op, "a1", ops.RUNNING, 10, 500, 0, 0, "", now=101.0)  # finished: progress ignored
    assert ops.apply_update(op, "a1", ops.SUCCEEDED, 500, 500, 0, 500 * 8192, "", now=102.0)
    assert op.state == ops.SUCCEEDED and op.num_done_blocks == 505 and op.error == ""
    left = _sent(["a1"])
    ops.fail_part(left, "a1", "agent left", now=5.0, given_up=True)
    ops.apply_update(left, "a1", ops.FAILED, 3, 8, 5, 0, "disk full", now=6.0)
    assert left.state == ops.FAILED and "disk full" in left.error
    own = _sent(["a1"])
    ops.apply_update(own, "a1", ops.FAILED, 0, 8, 8, 0, "disk full", now=1.0)
    assert not ops.apply_update(own, "a1", ops.SUCCEEDED, 8, 8, 0, 0, "", now=2.0)
    assert own.state == ops.FAILED


def test_what_a_cancel_and_a_give_up_need_survives_etcd():
    from controlplane.store.durable import op_from_json, op_to_json

    op = _sent(["a1"])
    ops.expire_silent_parts(op, now=100.0, timeout_seconds=60.0)
    back = op_from_json(op_to_json(op).encode())
    assert back.commands_sent and back.parts["a1"].given_up
    ops.apply_update(back, "a1", ops.SUCCEEDED, 8, 8, 0, 0, "", now=101.0)
    assert back.state == ops.SUCCEEDED


def test_a_succeeded_operation_carries_what_its_agents_noted():
    op = _sent(["a1", "a2"])
    ops.apply_update(op, "a1", ops.SUCCEEDED, 6, 6, 0, 0, "6 block(s) kept in their codec", now=1.0)
    ops.apply_update(op, "a2", ops.SUCCEEDED, 4, 4, 0, 4096, "", now=1.0)
    assert op.state == ops.SUCCEEDED and op.error == "a1: 6 block(s) kept in their codec"


def test_a_record_an_earlier_release_stored_loads_and_is_stored_under_the_new_names():
    """Before 2026-12-06 a part's block counts were stored as done / total / failed /
    skipped_pinned: such a record still loads (an upgrade keeps its operations); what is
    stored now says the unit (num_*_blocks), as the wire does."""
    from controlplane.store.durable import op_from_json, op_to_json

    part = {
        "agent_id": "a1",
        "state": "SUCCEEDED",
        "done": 6,
        "total": 8,
        "failed": 1,
        "skipped_pinned": 1,
        "moved_bytes": 6 << 20,
        "error": "",
        "freed": {"2": [6, 6 << 20]},
        "given_up": False,
        "incarnation": "proc-1",
        "result": "",
    }
    old = {
        "op_id": "cleanup-1",
        "kind": "cleanup",
        "params": {"namespace": "ns"},
        "state": "SUCCEEDED",
        "error": "",
        "dry_run": False,
        "waiting_for_lock": False,
        "commands_sent": True,
        "cancel_requested": False,
        "created_unix_seconds": 1.0,
        "updated_unix_seconds": 2.0,
        "parts": [part],
    }
    op = op_from_json(json.dumps(old).encode())
    p = op.parts["a1"]
    counts = (p.num_done_blocks, p.num_total_blocks, p.num_failed_blocks, p.num_skipped_pinned_blocks)
    assert counts == (6, 8, 1, 1) and (p.moved_bytes, p.freed, p.incarnation) == (6 << 20, {2: (6, 6 << 20)}, "proc-1")
    assert (op.num_done_blocks, op.num_total_blocks, op.num_failed_blocks, op.num_skipped_pinned_blocks) == (6, 8, 1, 1)
    stored = json.loads(op_to_json(op))["parts"][0]
    assert {k: stored[k] for k in ("num_done_blocks", "num_total_blocks", "num_failed_blocks")} == {
        "num_done_blocks": 6,
        "num_total_blocks": 8,
        "num_failed_blocks": 1,
    }
    assert stored["num_skipped_pinned_blocks"] == 1
    # and under the earlier names, for replicas of an earlier release during an upgrade
    assert (stored["done"], stored["total"], stored["failed"], stored["skipped_pinned"]) == (6, 8, 1, 1)
    assert op_from_json(op_to_json(op).encode()) == op
    # a count under neither name: malformed, as a record missing any other field (load_ops skips it)
    del part["done"]
    with pytest.raises(KeyError):
        op_from_json(json.dumps(old).encode())


def test_an_operation_ended_here_and_elsewhere_at_once_is_timed_once():
    """Manager.load signals an operation another leader ended (outside its lock) while a
    progress report may end the same operation here: the check of its event and the set
    were two steps, so both could pass the check and on_finished counted it twice."""
    import threading

    from controlplane.core.cluster import Cluster
    from controlplane.manager import Manager

    manager = Manager(Cluster(), durable=None, election=None)
    op = ops.new_operation("move", {"to": "disk"}, ["a1"], now=0.0)
    ops.apply_update(op, "a1", ops.SUCCEEDED, 8, 8, 0, 0, "", now=1.0)
    both_checked = threading.Barrier(2, timeout=1.0)

    class SlowCheck(threading.Event):
        def is_set(self) -> bool:  # both callers between the check and the set, if they can be
            seen = super().is_set()
            with contextlib.suppress(threading.BrokenBarrierError):  # the fixed code: one caller only
                both_checked.wait()
            return seen

    manager._op_done[op.op_id] = SlowCheck()
    timed = []
    manager.on_finished = lambda kind, state, seconds: timed.append(state)
    threads = [threading.Thread(target=manager._signal_finished, args=(op,)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert timed == [ops.SUCCEEDED]
