"""Engine-path failures a review found, each forced with an in-process pair of data planes
and a fake engine: a batch that failed while a later one timed out (its write may still
land), a peer whose reservation does not add up, and an Abort that came while its Reserve
was still finding pages."""

from __future__ import annotations

import ctypes
import itertools
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from agent.core.block_pool import BlockPool
from agent.core.handoff import RECOMPUTE, Reservations, RetryPolicy
from agent.dataplane import DataPlaneConfig
from agent.handoff_paths import PathError
from agent.store.memory_tier import MemoryTier
from agent.store.transfer_engine import PendingWrite
from protos import errors
from protos.tier import Tier
from tests.handoff.support import SMALL, prompt
from tests.handoff.test_dataplane_pair import Pair, store
from tests.handoff.test_engine_path_fake import engine_pair


class FailThenTimeOut:
    """Batch 0 is written and stays on the wire until batch 1 is submitted; then batch 0
    reports failed (-1) and every later batch timed out (-2) with its bytes not landed
    yet: they are kept, to be written late."""

    name = "fake"
    available = True
    protocol = "tcp"
    endpoint = "127.0.0.1:1"
    timeout_seconds = 5

    def __init__(self):
        self.status = "fake"
        self.status_of: dict[int, int] = {}
        self._ids = itertools.count(1)
        self.batches: list[list[int]] = []
        self.late: list[tuple[int, int, int]] = []

    def register(self, address, length):
        pass

    def unregister(self, address):
        pass

    def submit(self, endpoint, pieces):
        write = PendingWrite(self.status_of.__getitem__, sum(p[2] for p in pieces), endpoint, self.timeout_seconds)
        first = not self.batches
        ids = []
        for src, dst, n in pieces:
            t = next(self._ids)
            ids.append(t)
            if first:
                ctypes.memmove(dst, src, n)
                self.status_of[t] = 0  # on the wire
            else:
                self.late.append((src, dst, n))
                self.status_of[t] = -2  # timed out: it may still land
        write.ids.extend(ids)
        self.batches.append(ids)
        if not first:
            for t in self.batches[0]:
                self.status_of[t] = -1  # the peer refused batch 0
        return write

    def close(self):
        pass


def test_a_batch_that_timed_out_after_another_failed_keeps_the_pages_quarantined():
    """The first error (batch 0 failed) aborted the reservation as quiesced: the receiver
    freed its pages at once, a new block took them, and the timed-out batch landed in it
    (memory-tier reads are not hashed: corrupt KV served)."""
    cfg = DataPlaneConfig(
        chunk_bytes=SMALL.block_bytes, verify_while_sending=False, retry=RetryPolicy(attempts_per_path=1)
    )
    p = Pair(cfg, recv_blocks=4)  # exactly 4 blocks: freed pages are taken by the next store
    engine = FailThenTimeOut()
    for dp in (p.send, p.recv):
        dp.engine = engine
        dp.registered = True
    p.recv.fill_info(p.send._peer_info("dec"))
    try:
        hashes = store(p.send.pool, 4)
        r = p.send.handoff(SMALL.model_id, hashes, "dec", 3.0, paths=("engine",))
        assert r.outcome == RECOMPUTE and "may still land" in r.reason, r
        assert engine.late  # a batch was left on the wire
        assert p.recv.reservations.quarantined_pages() > 0
        _, kv, other = prompt(SMALL, 4, seed=7)
        stored = p.recv.pool.insert_chain(SMALL.model_id, other, lambda i: kv[i])
        for _, dst, n in engine.late:
            ctypes.memset(dst, 0x7F, n)  # the late write lands
        got = p.recv.pool.read_chain(other[: len(stored)]) if stored else None
        for i, t in enumerate(got.blocks if got is not None else []):
            assert torch.equal(t, kv[i]), f"block {i} holds the late write"
    finally:
        p.close()


def test_a_reservation_that_does_not_add_up_leaves_no_writer_behind():
    """The writer thread started before the slots were checked: each mismatch left one
    blocked for ever; 16 took every writer, and later handoffs stalled into recompute."""
    p = engine_pair(DataPlaneConfig(retry=RetryPolicy(attempts_per_path=1)))
    try:
        hashes = store(p.send.pool, 4)
        metas = p.send.pool.acquire_chain(hashes)
        peer = p.send.peer("dec")
        bad = SimpleNamespace(
            num_present_blocks=0,
            transfer_endpoint="x",
            reservation_id="r" * 16,
            slots=SimpleNamespace(addresses=[0], lengths=[1]),
        )
        try:
            for _ in range(20):
                with pytest.raises(PathError, match="reserved 1 B"):
                    p.send._send_engine(None, peer, bad, metas, time.monotonic() + 5, lambda cap=3.0: cap)
        finally:
            p.send.pool.release_chain(metas)
        time.sleep(0.2)
        assert not [t for t in threading.enumerate() if t.name.startswith("te-write")]
        r = p.send.handoff(SMALL.model_id, hashes, "dec", 4.0, paths=("engine",))
        assert r.outcome == "transferred", r
        assert [p.send.pool.blocks[h].ref_count for h in hashes] == [0] * 4
    finally:
        p.close()


def test_an_abort_while_its_reserve_finds_pages_is_not_lost():
    """The Abort popped the Reserve's placeholder and was forgotten: the Reserve then
    opened anyway (its pages held to the TTL), and another got in past max_inbound."""
    block = SMALL.block_bytes
    pool = BlockPool([MemoryTier(Tier.CPU, 16 * block, block)], [SMALL])
    res = Reservations(pool, Tier.CPU, max_inbound=1, clock=lambda: 100.0, quarantine_seconds=7.0)
    _, _, hashes = prompt(SMALL, 4)
    entered, go = threading.Event(), threading.Event()
    real = pool.reserve_chain

    def slow_reserve_chain(*args, **kwargs):  # making room (a demotion to disk) takes a while
        entered.set()
        go.wait(5)
        return real(*args, **kwargs)

    pool.reserve_chain = slow_reserve_chain  # type: ignore[method-assign]
    rid = "a" * 16
    outcome: list[BaseException | None] = []

    def reserve():
        try:
            res.reserve(SMALL.model_id, hashes, [block] * 4, ["none"] * 4, ttl_seconds=300, reservation_id=rid)
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - looked at below
            outcome.append(exc)

    t = threading.Thread(target=reserve)
    t.start()
    assert entered.wait(5)
    assert res.abort(rid, quiesced=True)  # the sender gave up on its Reserve
    _, _, other = prompt(SMALL, 2, seed=3)
    with pytest.raises(errors.ResourceExhausted):  # the slot is still taken
        res.reserve(SMALL.model_id, other, [block] * 2, ["none"] * 2, ttl_seconds=300)
    go.set()
    t.join(5)
    assert isinstance(outcome[0], errors.FailedPrecondition) and "aborted by its sender" in str(outcome[0])
    assert res.open_count() == 0 and pool.store_of[Tier.CPU].used_bytes == 0
    res.reserve(SMALL.model_id, other, [block] * 2, ["none"] * 2, ttl_seconds=300)  # the slot is free again
