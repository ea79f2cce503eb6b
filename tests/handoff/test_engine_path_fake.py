"""The engine path between two data planes of this process, through an engine that copies
in process (both slabs are this process's memory): what the sender tells the receiver
when a write never ends, and the time the last Commit is given."""

from __future__ import annotations

import ctypes
import itertools
import threading
import time

import pytest

from agent.core.handoff import RECOMPUTE, TRANSFERRED
from agent.dataplane import DataPlaneConfig
from agent.store.transfer_engine import PendingWrite
from tests.handoff.test_dataplane_pair import Pair, store


class CopyEngine:
    """A transfer engine that copies at once in this process; `status` is what each
    submitted transfer reports (`reports`: 1 landed; 0 on the wire; -2 the engine timed it out)."""

    name = "fake"
    available = True
    protocol = "tcp"
    endpoint = "127.0.0.1:1"
    timeout_seconds = 5

    def __init__(self, status: int = 1):
        self.reports = status
        self.status = "fake engine in process"
        self.status_of: dict[int, int] = {}
        self._ids = itertools.count(1)

    def register(self, address: int, num_bytes: int) -> None:
        pass

    def unregister(self, address: int) -> None:
        pass

    def write(self, endpoint: str, pieces) -> None:
        for src, dst, n in pieces:
            ctypes.memmove(dst, src, n)

    def submit(self, endpoint: str, pieces) -> PendingWrite:
        w = PendingWrite(self.status_of.__getitem__, sum(p[2] for p in pieces), endpoint, self.timeout_seconds)
        for src, dst, n in pieces:
            if self.reports == 1:
                ctypes.memmove(dst, src, n)
            t = next(self._ids)
            self.status_of[t] = self.reports
            w.ids.append(t)
        return w

    def close(self) -> None:
        pass


def engine_pair(config: DataPlaneConfig, status: int = 1) -> Pair:
    p = Pair(config)
    for dp in (p.send, p.recv):
        dp.engine = CopyEngine(status)
        dp.registered = True
    info = p.send._peer_info("dec")
    p.recv.fill_info(info)
    return p


def test_a_write_the_engine_timed_out_quarantines_the_receivers_pages():
    """A transfer the engine reports timed out (or one given up) may still land: the
    receiver must not free the reservation's pages for another block to take."""
    p = engine_pair(DataPlaneConfig(retry=DataPlaneConfig().retry), status=-2)
    try:
        hashes = store(p.send.pool, 4)
        r = p.send.handoff("small", hashes, "dec", 3.0, paths=("engine",))
        assert r.outcome == RECOMPUTE and "timed out" in r.reason, r
        assert p.recv.reservations.open_count() == 0
        assert p.recv.reservations._quarantine, "pages a late write may reach were freed at once"
    finally:
        p.close()


@pytest.mark.parametrize("verify_while_sending", [True, False])
def test_the_last_commit_has_time_for_every_block_it_verifies(verify_while_sending):
    """The Commit that verifies blocks is given 0.1 s plus a second per GB of them: with
    verify_while_sending off the last one verifies every block sent, not just its batch."""
    cfg = DataPlaneConfig(chunk_bytes=1 << 10, verify_while_sending=verify_while_sending)
    p = engine_pair(cfg)
    try:
        hashes = store(p.send.pool, 48)
        stored = [p.send.pool.blocks[h].stored_bytes for h in hashes]
        commits = []
        real_stub = p.send._stub

        def spying_stub(address):
            stub, channel = real_stub(address)
            real_commit, real_reserve = stub.Commit, stub.Reserve

            def reserve(request, timeout=None):
                try:
                    return real_reserve(request, timeout=timeout)
                finally:  # from here on the per-byte budget alone sizes each Commit's time
                    p.send.config.rpc_timeout_seconds = 0.0

            stub.Reserve = reserve

            def commit(request, timeout=None):
                commits.append((request.first_block, len(request.checksums), timeout))
                return real_commit(request, timeout=timeout)

            commit.future = real_commit.future  # the batches' Commits while later ones travel
            stub.Commit = commit
            return stub, channel

        p.send._stub = spying_stub
        r = p.send.handoff("small", hashes, "dec", 5.0, paths=("engine",))
        assert (r.outcome, r.num_sent_blocks) == (TRANSFERRED, 48), r
        first, n, timeout = commits[-1]
        assert timeout >= 0.1 + sum(stored[first : first + n]) / 1e9 - 1e-9, (commits[-1], sum(stored))
    finally:
        p.close()


class BatchIds:
    """The Mooncake binding's batch-id rules, as transfer_engine_py.cpp has them: a
    submitted write holds a batch id until `transfer_check_status` sees it completed (1)
    or failed (-1), which frees it; timed out (-2) or on the wire (0) keeps it. Checking a
    freed id is a use after free: refused here."""

    def __init__(self):
        self.state: dict[int, int] = {}  # held ids -> what a check reports
        self._ids = itertools.count(1)

    def transfer_submit_write(self, endpoint, src, dst, n) -> int:
        t = next(self._ids)
        self.state[t] = 0
        return t

    def transfer_check_status(self, t: int) -> int:
        assert t in self.state, f"batch id {t} checked after it was freed"
        rc = self.state[t]
        if rc in (1, -1):
            del self.state[t]
        return rc


def test_batch_ids_of_writes_given_up_are_freed_once_the_engine_ends_them():
    from agent.store.transfer_engine import MooncakeEngine, TransferTimedOut

    engine = MooncakeEngine.__new__(MooncakeEngine)  # its bookkeeping, without a live engine
    engine._engine, engine._lock, engine._abandoned, engine.timeout_seconds = BatchIds(), threading.Lock(), [], 0
    ids = engine._engine
    stuck = engine.submit("peer:1", [(0, 0, 4096), (4096, 4096, 4096)])
    time.sleep(0.01)
    with pytest.raises(TransferTimedOut):
        while not stuck.poll():  # given up at once (timeout 0): both still the engine's
            pass
    assert engine.reap() == 2 and len(ids.state) == 2
    ids.state[1], ids.state[2] = -2, 1  # one the engine timed out, one that landed late
    assert engine.reap() == 1 and list(ids.state) == [1]
    ids.state[1] = -1  # the timed-out one ends (failed): the next submit's check frees it
    engine.timeout_seconds = 60
    ok = engine.submit("peer:1", [(0, 0, 4096)])
    assert ids.state == {3: 0} and engine.reap() == 0
    ids.state[3] = 1
    assert ok.poll() and ids.state == {}
    timed_out = engine.submit("peer:1", [(0, 0, 4096)])  # timed out by the engine: kept until it ends
    ids.state[4] = -2
    with pytest.raises(TransferTimedOut):
        timed_out.poll()
    assert engine.reap() == 1
    ids.state[4] = 1
    assert engine.reap() == 0 and ids.state == {}
