"""Operation state folding (controlplane/core/operations.py), pure: what a cancel means."""

from __future__ import annotations

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
