"""`PendingWrite`, the engine's submitted writes: a failure is said only once every write
it took has ended (until then the engine may still read the source pages), and a write
the engine never finishes is given up after the engine's own timeout, as its blocking
write would."""

from __future__ import annotations

import time

import pytest

from agent.store.transfer_engine import PendingWrite, TransferFailed


class Wire:
    """Transfer ids with the status the engine would give them (1 landed, 0 on the wire, < 0 failed)."""

    def __init__(self):
        self.status: dict[int, int] = {}
        self.asked: list[int] = []

    def check(self, t: int) -> int:
        self.asked.append(t)
        return self.status[t]


def test_landed_only_when_every_piece_landed():
    wire = Wire()
    w = PendingWrite(wire.check, 3 << 20, "peer:1", timeout_seconds=5)
    w.ids = [1, 2, 3]
    wire.status = {1: 1, 2: 0, 3: 1}
    assert w.poll() is False and w.ids == [2]
    wire.status[2] = 1
    assert w.poll() is True and w.ids == []


def test_a_failed_piece_is_said_after_the_others_ended():
    wire = Wire()
    w = PendingWrite(wire.check, 2 << 20, "peer:1", timeout_seconds=5)
    w.ids = [1, 2]
    wire.status = {1: -1, 2: 0}
    assert w.poll() is False  # piece 2 may still read the source pages
    wire.status[2] = 1
    with pytest.raises(TransferFailed, match=r"2097152 B to peer:1 failed \(rc -1\)"):
        w.poll()


def test_a_timed_out_piece_fails_the_write():
    wire = Wire()
    w = PendingWrite(wire.check, 1 << 20, "peer:1", timeout_seconds=5)
    w.ids = [7]
    wire.status = {7: -2}
    with pytest.raises(TransferFailed, match="timed out"):
        w.poll()


def test_a_write_that_never_completes_is_given_up_after_the_engine_timeout():
    wire = Wire()
    w = PendingWrite(wire.check, 1 << 20, "peer:1", timeout_seconds=0.05)
    w.ids = [9]
    wire.status = {9: 0}
    assert w.poll() is False
    time.sleep(0.1)
    with pytest.raises(TransferFailed, match="never completed"):
        w.poll()
    assert w.ids == []


def test_a_refused_piece_fails_the_write_once_the_taken_ones_end():
    wire = Wire()
    w = PendingWrite(wire.check, 2 << 20, "peer:1", timeout_seconds=5)
    w.ids, w.error = [4], "engine refused a write of 1048576 B to peer:1 (rc -1)"
    wire.status = {4: 0}
    assert w.poll() is False
    wire.status[4] = 1
    with pytest.raises(TransferFailed, match="refused"):
        w.poll()


def test_only_a_write_that_may_still_land_is_said_timed_out():
    from agent.store.transfer_engine import TransferTimedOut

    for rc, timed_out in ((-1, False), (-2, True)):
        wire = Wire()
        w = PendingWrite(wire.check, 1 << 20, "peer:1", timeout_seconds=5)
        w.ids = [1]
        wire.status = {1: rc}
        with pytest.raises(TransferFailed) as caught:
            w.poll()
        assert isinstance(caught.value, TransferTimedOut) is timed_out
