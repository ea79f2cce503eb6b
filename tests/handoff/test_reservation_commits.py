"""Receiving side of a handoff, on a real block pool: a commit never makes visible a
block no checksum was checked for, a verify that finds a mismatch ends the whole
reservation (nothing visible, its pages given back), and checksums are taken only for
the blocks the reservation holds pages for."""

from __future__ import annotations

import pytest
import torch

from agent.core.block_pool import BlockPool
from agent.core.handoff import ReservationError, Reservations, checksum
from agent.store.memory_tier import MemoryTier
from protos import errors
from protos.tier import Tier
from tests.handoff.support import SMALL, prompt

BLOCK = SMALL.block_bytes


def make(capacity_blocks: int = 16):
    pool = BlockPool([MemoryTier(Tier.CPU, capacity_blocks * BLOCK, BLOCK)], [SMALL])
    return pool, Reservations(pool, Tier.CPU, clock=lambda: 100.0)


def fill(res: Reservations, r, kv) -> list[int]:
    """Write the reserved blocks as a sender would; their checksums, from block num_present."""
    sums = []
    for i in range(r.num_present, r.num_blocks):
        raw = kv[i].contiguous().view(-1).view(torch.uint8)
        res.write(r, i, 0, raw.numpy().tobytes())
        sums.append(checksum([raw]))
    return sums


def reserve(res: Reservations, hashes):
    n = len(hashes)
    return res.reserve(SMALL.model_id, hashes, [BLOCK] * n, ["none"] * n, ttl_seconds=5)


def test_a_commit_that_leaves_blocks_unverified_makes_nothing_visible():
    """The last Commit carries checksums for the last blocks only, and no verify checked
    the first ones (a sender that lost a Verify): the first blocks were never checked,
    so nothing is made visible and the pages go back."""
    pool, res = make()
    _, kv, hashes = prompt(SMALL, 4)
    r = reserve(res, hashes)
    sums = fill(res, r, kv)
    with pytest.raises(ReservationError, match="never verified"):
        res.commit(r.reservation_id, 2, sums[2:])
    assert pool.num_leading(hashes) == 0 and pool.blocks == {}
    assert res.open_count() == 0 and res.aborted_total == 1 and res.committed_total == 0


def test_a_mismatch_in_a_verify_ends_the_reservation_and_nothing_becomes_visible():
    pool, res = make()
    _, kv, hashes = prompt(SMALL, 4)
    r = reserve(res, hashes)
    sums = fill(res, r, kv)
    with pytest.raises(ReservationError, match="checksum mismatch on block 1"):
        res.verify(r.reservation_id, 0, [sums[0], sums[1] ^ 1])
    assert res.open_count() == 0 and res.checksum_failures_total == 1
    # the rest arriving afterwards, with right checksums, commits nothing
    with pytest.raises(ReservationError):
        res.commit(r.reservation_id, 0, sums)
    assert pool.num_leading(hashes) == 0 and pool.blocks == {}


def test_checksums_for_blocks_the_receiver_already_held_are_refused():
    """Blocks 0-1 are held here already (num_present 2): a verify naming them is not
    about any page of this reservation."""
    pool, res = make()
    _, kv, hashes = prompt(SMALL, 4)
    first = reserve(res, hashes[:2])
    res.commit(first.reservation_id, 0, fill(res, first, kv))
    r = reserve(res, hashes)
    assert r.num_present == 2
    sums = fill(res, r, kv)
    with pytest.raises(errors.InvalidArgument, match="first_block"):
        res.verify(r.reservation_id, 0, sums)
    with pytest.raises(errors.InvalidArgument, match="first_block"):
        res.commit(r.reservation_id, 1, [0] + sums)
    res.commit(r.reservation_id, 2, sums)  # still open, and right: visible
    assert pool.num_leading(hashes) == 4


def test_a_commit_racing_an_engine_store_of_the_same_prefix_waits_for_it_and_commits(monkeypatch):
    """The decode agent's engine stores the prefix's first block while a handoff of the
    whole prefix commits: the engine's block is placed and being written (invisible) when
    the commit looks. The commit refused ('being written by another caller'), throwing the
    handoff away, its tail the engine never had included; it now waits for that write and
    commits the rest after it."""
    import threading

    pool, res = make()
    _, kv, hashes = prompt(SMALL, 4)
    r = reserve(res, hashes)
    assert r.num_present == 0
    sums = fill(res, r, kv)
    engine_writing, release, commit_looked = threading.Event(), threading.Event(), threading.Event()
    real_write, real_wait = MemoryTier.write, pool._await_other_writer

    def engine_write(self, handle, payload, meta=None):
        if threading.current_thread().name == "engine" and not engine_writing.is_set():
            engine_writing.set()  # block 0 is placed (not ready) and written now
            release.wait(5)
        return real_write(self, handle, payload, meta)

    def commit_waits(block_hash):
        if threading.current_thread().name == "handoff":
            commit_looked.set()  # the commit found block 0 being written, and waits for it
        return real_wait(block_hash)

    monkeypatch.setattr(MemoryTier, "write", engine_write)
    monkeypatch.setattr(pool, "_await_other_writer", commit_waits)
    done: dict = {}
    engine = threading.Thread(
        target=lambda: done.setdefault("engine", pool.insert_chain(SMALL.model_id, hashes[:1], lambda i: kv[i]))
    )
    engine.name = "engine"
    engine.start()
    assert engine_writing.wait(5)

    def commit():
        try:
            done["commit"] = res.commit(r.reservation_id, 0, sums)
        except ReservationError as exc:  # the failure the test reports
            done["commit"] = exc
        commit_looked.set()

    committer = threading.Thread(target=commit, name="handoff")
    committer.start()
    assert commit_looked.wait(5)
    release.set()
    engine.join(10)
    committer.join(10)
    assert tuple(done["engine"]) == (1, 0)
    assert not isinstance(done["commit"], ReservationError), done["commit"]
    assert pool.num_leading(hashes) == 4
    read = pool.read_chain(hashes)
    assert len(read.blocks) == 4 and all(torch.equal(b, kv[i]) for i, b in enumerate(read.blocks))
    store = pool.store_of[Tier.CPU]
    assert store.used_bytes == 4 * store.footprint(BLOCK)  # the reserved page of block 0 given back
    assert res.committed_total == 1 and res.open_count() == 0
