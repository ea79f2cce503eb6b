"""Receiving side of a handoff, on a real block pool (no servers): reserved blocks stay
invisible until the whole prefix verified, a failed or expired reservation leaves
nothing behind, and the pages of one that may still be written are quarantined."""

from __future__ import annotations

import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.core.block_moves import pair_runs
from agent.core.block_pool import BlockPool
from agent.core.blocks import PoolFull
from agent.core.handoff import (
    LandedGroups,
    Link,
    ReservationError,
    Reservations,
    RunCursor,
    batches_of,
    checksum,
)
from agent.store.memory_tier import MemoryTier
from protos import errors
from protos.tier import Tier
from tests.handoff.support import SMALL, prompt

BLOCK = SMALL.block_bytes  # 64 B


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def make(capacity_blocks: int = 16, **kw):
    pool = BlockPool([MemoryTier(Tier.CPU, capacity_blocks * BLOCK, BLOCK)], [SMALL])
    clock = Clock()
    return pool, Reservations(pool, Tier.CPU, clock=clock, **kw), clock


def fill(res: Reservations, r, kv) -> list[int]:
    """Write the KV of the reserved blocks as a sender would, return their checksums."""
    sums = []
    for i in range(r.num_present, r.num_blocks):
        raw = kv[i].contiguous().view(-1).view(__import__("torch").uint8)
        res.write(r, i, 0, raw.numpy().tobytes())
        sums.append(checksum([raw]))
    return sums


def reserve(res, hashes, n=None):
    n = len(hashes) if n is None else n
    return res.reserve(SMALL.model_id, hashes[:n], [BLOCK] * n, ["none"] * n, ttl_seconds=5)


def test_reserved_blocks_are_invisible_until_the_last_commit():
    pool, res, _ = make()
    _, kv, hashes = prompt(SMALL, 6)
    r = reserve(res, hashes)
    assert r.num_present == 0 and len(r.handles) == 6
    sums = fill(res, r, kv)
    res.verify(r.reservation_id, 0, sums[:3])  # a staged chunk
    assert pool.num_leading(hashes) == 0 and pool.inventory()[1] == []
    res.commit(r.reservation_id, 3, sums[3:])
    assert pool.num_leading(hashes) == 6
    blocks, _ = pool.read_chain(hashes)
    assert all(bool((b == kv[i]).all()) for i, b in enumerate(blocks))
    assert res.open_count() == 0


def watch_hashing(monkeypatch) -> list[tuple[int, bool]]:
    """Each batch the receiver hashes from now on: (number of blocks, in the background)."""
    import agent.core.handoff as handoff

    calls: list[tuple[int, bool]] = []
    real = handoff.checksums_of

    def checksums_of(blocks, background=False):
        calls.append((len(blocks), background))
        return real(blocks, background)

    monkeypatch.setattr(handoff, "checksums_of", checksums_of)
    return calls


def test_a_commit_with_every_checksum_hashes_only_what_no_verify_matched(monkeypatch):
    """The shm sender's last Commit carries all checksums while earlier verifies may still
    run: blocks they matched are not hashed again, the rest are, and a mismatch anywhere
    still makes nothing visible."""
    calls = watch_hashing(monkeypatch)
    pool, res, _ = make()
    _, kv, hashes = prompt(SMALL, 6)
    r = reserve(res, hashes)
    sums = fill(res, r, kv)
    res.verify(r.reservation_id, 0, sums[:4])
    res.commit(r.reservation_id, 0, sums)
    # the verify hashed in the background (engine writes may still travel), the Commit at once
    assert calls == [(4, True), (2, False)] and pool.num_leading(hashes) == 6
    # a verified block sent with another checksum in the Commit is hashed again: a mismatch
    _, kv2, hashes2 = prompt(SMALL, 3, seed=5)
    r2 = reserve(res, hashes2)
    sums2 = fill(res, r2, kv2)
    res.verify(r2.reservation_id, 0, sums2[:2])
    with pytest.raises(ReservationError, match="checksum mismatch on block 1"):
        res.commit(r2.reservation_id, 0, [sums2[0], sums2[1] ^ 1, sums2[2]])
    assert pool.num_leading(hashes2) == 0


def test_a_verify_that_lost_the_race_to_an_abort_hashes_nothing():
    """A verify took the reservation just before an abort freed its pages: it must not hash
    pages that are no longer its (nor count a false checksum failure)."""
    pool, res, _ = make()
    _, kv, hashes = prompt(SMALL, 3)
    r = reserve(res, hashes)
    sums = fill(res, r, kv)
    res.get = lambda _rid: r  # the verify's lookup ran before the abort
    res.abort(r.reservation_id, quiesced=True)
    with pytest.raises(ReservationError, match="no longer open"):
        res.verify(r.reservation_id, 0, sums)
    assert res.checksum_failures_total == 0 and r.verified == {}


def test_slots_cover_the_reserved_pages_in_order_merged_where_they_touch():
    pool, res, _ = make()
    _, _, hashes = prompt(SMALL, 6)
    held = pool.top.allocate(BLOCK)  # a page taken in between: the reservation has two runs
    res.reserve(SMALL.model_id, hashes[:1], [BLOCK], ["none"], ttl_seconds=5)
    pool.top.free(held)
    r = reserve(res, hashes)
    slots = res.slots(r)
    flat = [a + k for a, n in slots for k in range(n)]
    views = [v for i in range(r.num_present, r.num_blocks) for v in res.views(r, i)]
    assert flat == [v.data_ptr() + k for v in views for k in range(v.numel())]
    assert len(slots) == 2  # one run per stretch of touching pages, not one per block
    cursor = RunCursor(slots)
    taken = cursor.take(BLOCK // 2) + cursor.take(5 * BLOCK + BLOCK // 2)
    assert [a + k for a, n in taken for k in range(n)] == flat
    with pytest.raises(ValueError):
        cursor.take(1)


def test_checksum_mismatch_makes_nothing_visible_and_quarantines_the_pages():
    pool, res, clock = make(quarantine_seconds=3)
    _, kv, hashes = prompt(SMALL, 4)
    r = reserve(res, hashes)
    sums = fill(res, r, kv)
    sums[2] ^= 1
    with pytest.raises(ReservationError, match="checksum mismatch on block 2"):
        res.commit(r.reservation_id, 0, sums)
    assert pool.num_leading(hashes) == 0
    assert res.quarantined_pages() == 4 and pool.top.used_bytes == 4 * BLOCK
    clock.now += 3
    res.run_once()
    assert res.quarantined_pages() == 0 and pool.top.used_bytes == 0
    with pytest.raises(ReservationError, match="not open"):
        res.commit(r.reservation_id, 0, [])


def test_a_partial_transfer_expires_without_a_trace():
    pool, res, clock = make(quarantine_seconds=2)
    _, kv, hashes = prompt(SMALL, 5)
    r = reserve(res, hashes)
    fill(res, r, kv)  # all bytes arrived but the sender never committed (it died)
    clock.now += 4
    assert res.run_once() == 0
    clock.now += 1.5
    assert res.run_once() == 1 and res.expired_total == 1
    assert pool.num_leading(hashes) == 0 and pool.top.used_bytes == 5 * BLOCK  # quarantined
    clock.now += 2
    res.run_once()
    assert pool.top.used_bytes == 0


def test_present_leading_blocks_are_not_sent_and_stay_referenced():
    pool, res, _ = make(capacity_blocks=8)
    tokens, kv, hashes = prompt(SMALL, 6)
    pool.insert_chain(SMALL.model_id, hashes[:2], lambda i: kv[i])
    r = reserve(res, hashes)
    assert r.num_present == 2 and len(r.handles) == 4
    assert all(m.ref_count == 1 for m in r.present)
    # filling the rest of the tier cannot evict the leading blocks the reservation relies on
    _, other, other_hashes = prompt(SMALL, 2, seed=7)
    pool.insert_chain(SMALL.model_id, other_hashes, lambda i: other[i])
    assert pool.num_leading(hashes[:2]) == 2
    res.commit(r.reservation_id, 2, fill(res, r, kv))
    assert pool.num_leading(hashes) == 6 and all(m.ref_count == 0 for m in r.present)


def test_too_many_arriving_is_busy_and_no_room_is_a_clear_error():
    pool, res, _ = make(capacity_blocks=4, max_inbound=1)
    _, _, hashes = prompt(SMALL, 3)
    reserve(res, hashes, 1)
    with pytest.raises(errors.ResourceExhausted, match="retry"):
        reserve(res, hashes, 1)
    res.max_inbound = 8
    pool.set_pin([], None)
    _, kv, big = prompt(SMALL, 4, seed=3)
    pool.insert_chain(SMALL.model_id, big[:3], lambda i: kv[i])
    pool.set_pin(big[:3], Tier.CPU)  # pinned: cannot make room
    with pytest.raises(errors.FailedPrecondition, match="no room"):
        reserve(res, hashes)
    assert pool.top.used_bytes == 4 * BLOCK  # nothing held by the failed reservation


def test_a_prefix_held_whole_opens_no_reservation():
    pool, res, _ = make()
    _, kv, hashes = prompt(SMALL, 4)
    pool.insert_chain(SMALL.model_id, hashes, lambda i: kv[i])
    r = reserve(res, hashes)
    assert r.num_present == 4 and not r.handles
    assert res.open_count() == 0 and all(pool.blocks[h].ref_count == 0 for h in hashes)


def test_a_prefix_that_can_never_fit_evicts_nothing():
    pool, res, _ = make(capacity_blocks=8)
    _, kv, cached = prompt(SMALL, 6, seed=1)
    pool.insert_chain(SMALL.model_id, cached, lambda i: kv[i])
    _, _, hashes = prompt(SMALL, 12, seed=2)
    with pytest.raises(errors.FailedPrecondition):
        reserve(res, hashes)
    assert pool.num_leading(cached) == 6  # refused before making room, not after


def test_a_drains_reserve_is_refused_past_its_fill_limit_as_the_tiers_stand_and_pushes_out_nothing():
    """A drain's Reserve (fill_limit_bytes) takes blocks only while the handoff tier and the
    tiers below it stay within the limit, counted as they stand at that Reserve: a handoff
    of the engines' own that came meanwhile (no limit) took room, and the drain's blocks
    that would go past the line are refused, nothing of the agent's own pushed out for them."""
    pool = BlockPool([MemoryTier(Tier.CPU, 6 * BLOCK, BLOCK), MemoryTier(Tier.DISK, 8 * BLOCK, BLOCK)], [SMALL])
    res = Reservations(pool, Tier.CPU, clock=Clock())

    def used() -> int:
        return sum(u.used_bytes for u in pool.usage())

    _, kv, own = prompt(SMALL, 4, seed=1)
    pool.insert_chain(SMALL.model_id, own, lambda i: kv[i])
    limited = {"fill_limit_bytes": 10 * BLOCK, "ttl_seconds": 5}  # of the 14 the two tiers hold
    _, _, drained = prompt(SMALL, 3, seed=2)
    first = res.reserve(SMALL.model_id, drained, [BLOCK] * 3, ["none"] * 3, **limited)  # 4 + 3 <= 10
    assert len(first.handles) == 3 and used() == 7 * BLOCK  # a block of its own moved down to disk for it
    routed = reserve(res, prompt(SMALL, 2, seed=3)[2])  # Route's, with no limit: 9 used now
    _, _, more = prompt(SMALL, 2, seed=4)
    with pytest.raises(errors.FillLimitReached, match=f"past the {10 * BLOCK} B"):
        res.reserve(SMALL.model_id, more, [BLOCK] * 2, ["none"] * 2, **limited)  # 9 + 2 > 10
    assert res.open_count() == 2 and used() == 9 * BLOCK and pool.num_leading(own) == 4
    res.abort(routed.reservation_id, True)
    # a chain whose leading blocks are held counts only what it adds: 7 + 1, not 7 + 5
    _, _, longer = prompt(SMALL, 5, seed=1)
    r = res.reserve(SMALL.model_id, longer, [BLOCK] * 5, ["none"] * 5, **limited)
    assert (r.num_present, len(r.handles)) == (4, 1)


@pytest.mark.parametrize("ttl", [float("inf"), float("nan")])
def test_a_reservation_ttl_is_finite_and_capped(ttl):
    pool, res, clock = make()
    _, _, hashes = prompt(SMALL, 2)
    with pytest.raises(errors.InvalidArgument, match="ttl_seconds"):
        res.reserve(SMALL.model_id, hashes, [BLOCK] * 2, ["none"] * 2, ttl_seconds=ttl)
    r = res.reserve(SMALL.model_id, hashes, [BLOCK] * 2, ["none"] * 2, ttl_seconds=1e9)
    assert r.expires_monotonic - clock.now <= 600


def test_an_abort_never_frees_pages_a_writer_is_attached_to():
    pool, res, _ = make()
    _, kv, hashes = prompt(SMALL, 3)
    r = reserve(res, hashes)
    writer = res.attach_writer(r.reservation_id)
    assert res.abort(r.reservation_id, quiesced=True)  # the sender says no write is in flight...
    assert res.quarantined_pages() == 3  # ...but a push stream is still writing: quarantine
    res.detach_writer(writer)
    with pytest.raises(ReservationError, match="not open"):
        res.attach_writer(r.reservation_id)  # a stream arriving after the abort writes nothing
    r2 = reserve(res, hashes)
    assert res.abort(r2.reservation_id, quiesced=True) and res.quarantined_pages() == 3  # freed at once


def test_commit_reuses_a_block_stored_meanwhile():
    pool, res, _ = make()
    _, kv, hashes = prompt(SMALL, 3)
    r = reserve(res, hashes)
    sums = fill(res, r, kv)
    pool.insert_chain(SMALL.model_id, hashes[:1], lambda i: kv[i])  # the engine stored block 0 itself
    res.commit(r.reservation_id, 0, sums)
    assert pool.num_leading(hashes) == 3 and pool.top.used_bytes == 3 * BLOCK


@given(
    st.lists(st.integers(1, 50), min_size=1, max_size=8),
    st.lists(st.integers(1, 50), min_size=1, max_size=8),
)
def test_pair_runs_maps_every_byte_once(src_lens, dst_lens):
    total = min(sum(src_lens), sum(dst_lens))
    src_lens = _trim(src_lens, total)
    dst_lens = _trim(dst_lens, total)
    src, pos = [], 0
    for n in src_lens:
        src.append((1000 + pos * 3, n))  # gaps between runs
        pos += n
    dst, pos = [], 0
    for n in dst_lens:
        dst.append((90000 + pos * 2, n))
        pos += n
    pieces = pair_runs(src, dst)
    assert sum(n for _, _, n in pieces) == total

    def flat(runs):
        return [a + k for a, n in runs for k in range(n)]

    assert [s + k for s, _, n in pieces for k in range(n)] == flat(src)
    assert [d + k for _, d, n in pieces for k in range(n)] == flat(dst)


@given(st.lists(st.integers(1, 40), max_size=30), st.integers(1, 100))
def test_engine_batches_cover_every_block_once_in_order(sizes, batch):
    batches = batches_of(sizes, batch)
    assert [i for b in batches for i in b] == list(range(len(sizes)))
    assert all(b for b in batches)
    # each batch but the last closes once it reaches the batch size, not before
    assert all(sum(sizes[i] for i in b[:-1]) < batch <= sum(sizes[i] for i in b) for b in batches[:-1])


def land(groups: LandedGroups, batch_bytes: list[int], pending=lambda k: 0):
    """Each batch (one block each, numbered from 0) landing in order: the verifies sent
    (first block, number of blocks, bytes) and what the last Commit carries."""
    verifies, last = [], None
    for k, n in enumerate(batch_bytes):
        out = groups.landed(k, k, [k], n, num_pending=pending(k))
        if out is not None and k < len(batch_bytes) - 1:
            verifies.append((out[0], len(out[1]), out[2]))
        elif out is not None:
            last = (out[0], len(out[1]), out[2])
    return verifies, last


@given(st.integers(1, 80), st.integers(1, 8), st.integers(1, 40), st.booleans(), st.lists(st.booleans(), max_size=80))
def test_landed_batches_are_each_verified_once_in_order(n, window, group, while_sending, busy):
    """Every batch is in exactly one verify or the last Commit, in order; the last Commit
    carries the last window when verifies answer in time (else what could not go)."""
    groups = LandedGroups(n, window, group, while_sending)
    verifies, last = land(groups, [1] * n, lambda k: 2 * (k < len(busy) and busy[k]))
    assert last is not None
    covered = [b for first, count, _ in verifies for b in range(first, first + count)]
    covered += list(range(last[0], last[0] + last[1]))
    assert covered == list(range(n))
    if not while_sending:
        assert verifies == [] and last == (0, n, n)
    elif not any(busy):
        assert last[1] == min(window, n)  # the last window only
        assert all(
            count >= group for _, count, _ in verifies[:-1]
        )  # groups reach the size, but the one closing before the last window


def test_the_group_size_caps_a_verify_and_pending_verifies_grow_the_next():
    # 10 batches of 4 MiB, two on the wire at once, groups of 6 MiB: batches 0-1, 2-3,
    # 4-5, 6-7 (the one before the last window), then the last window 8-9 with the Commit
    mib = 1 << 20
    verifies, last = land(LandedGroups(10, 2, 6 * mib), [4 * mib] * 10)
    assert verifies == [(0, 2, 8 * mib), (2, 2, 8 * mib), (4, 2, 8 * mib), (6, 2, 8 * mib)]
    assert last == (8, 2, 8 * mib)
    # one verify unanswered: the next may go; two (the most) unanswered when batches 2-5
    # land: they wait and go as one
    verifies, last = land(LandedGroups(10, 2, 6 * mib), [4 * mib] * 10, lambda k: 1)
    assert verifies == [(0, 2, 8 * mib), (2, 2, 8 * mib), (4, 2, 8 * mib), (6, 2, 8 * mib)]
    verifies, last = land(LandedGroups(10, 2, 6 * mib), [4 * mib] * 10, lambda k: 2 if 2 <= k <= 4 else 0)
    assert verifies == [(0, 2, 8 * mib), (2, 4, 16 * mib), (6, 2, 8 * mib)] and last == (8, 2, 8 * mib)
    # verifies pending through the batch before the last window: the rest goes with the Commit
    verifies, last = land(LandedGroups(10, 2, 6 * mib, max_pending=1), [4 * mib] * 10, lambda k: int(k >= 2))
    assert verifies == [(0, 2, 8 * mib)] and last == (2, 8, 32 * mib)
    # 5 batches in a window of 4 (33-40 MiB of 8 MiB batches): the first alone, the rest with the Commit
    verifies, last = land(LandedGroups(5, 4, 10 * mib), [8 * mib] * 5)
    assert verifies == [(0, 1, 8 * mib)] and last == (1, 4, 32 * mib)
    # everything on the wire at once (a 16 MiB handoff): no verify, one Commit
    assert land(LandedGroups(2, 4, 8 * mib), [8 * mib] * 2) == ([], (0, 2, 16 * mib))


def _trim(lens, total):
    out, left = [], total
    for n in lens:
        if left <= 0:
            break
        out.append(min(n, left))
        left -= out[-1]
    return out


def test_link_concurrency_queues_and_bandwidth_paces():
    t = [0.0]
    link = Link("peer", max_concurrent=1, bytes_per_second=1000, clock=lambda: t[0])
    assert link.acquire(deadline_monotonic=1.0)
    assert not link.acquire(deadline_monotonic=0.0)  # the one slot is taken: queued, then the deadline
    link.release()
    assert link.pace(500, 10.0)  # within the burst allowance, then in debt
    assert not link.pace(500, deadline_monotonic=0.1)  # paying off 400 B of debt takes 0.4 s: past it
    link.record(True, 1 << 20, 0.5, "engine")
    link.record(True, 1 << 20, 1.0, "engine")
    assert 1.3e6 < link.throughput_bytes_per_second < 2.1e6


def test_a_large_batch_is_hashed_on_several_threads_to_the_same_sums(monkeypatch):
    import os
    import threading

    import torch

    from agent.core import handoff

    monkeypatch.setattr(handoff, "VERIFY_THREADS", 3)
    g = torch.Generator().manual_seed(5)
    blocks = [[torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=g)] for _ in range(6)]
    blocks[2] = [blocks[2][0][: 1 << 19], blocks[2][0][1 << 19 :]]  # a block in two runs of the slab
    assert handoff.checksums_of(blocks) == [handoff.checksum(b) for b in blocks]
    assert handoff._verify_pools.get(False) is not None  # 6 MiB: over the bar, hashed side by side
    here = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    there = handoff._pool(False).submit(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())).result()
    assert there == here  # the foreground threads hash at the caller's priority


def test_a_foreground_hash_runs_its_first_share_on_the_caller_and_the_rest_on_the_pool(monkeypatch):
    """The last Commit's hash: the calling thread hashes the first run of blocks itself
    (no pool thread to wake for it), the pool the others, one task a run; the sums come
    back in block order."""
    import threading

    import torch

    from agent.core import handoff

    monkeypatch.setattr(handoff, "VERIFY_THREADS", 2)
    threads: list[tuple[int, int]] = []  # (thread, first byte of the block hashed)
    real = handoff.checksum

    def watched(segments):
        threads.append((threading.get_ident(), int(segments[0][0])))
        return real(segments)

    monkeypatch.setattr(handoff, "checksum", watched)
    blocks = [[torch.full((1 << 20,), k, dtype=torch.uint8)] for k in range(6)]
    assert handoff.checksums_of(blocks) == [real(b) for b in blocks]
    here = threading.get_ident()
    assert sorted(k for t, k in threads if t == here) == [0, 1, 2]
    assert len({t for t, k in threads if k in (3, 4, 5)} - {here}) == 1  # one pool thread, for the second run


@given(st.lists(st.integers(1, 64), min_size=1, max_size=40), st.integers(1, 6))
def test_shares_are_consecutive_runs_of_about_equal_bytes(sizes, num_shares):
    from agent.core.handoff import _shares

    blocks = [[bytes(n)] for n in sizes]
    shares = _shares(blocks, num_shares)
    assert [b for share in shares for b in share] == blocks  # every block once, in order
    assert 1 <= len(shares) <= num_shares and all(shares)
    per_share = sum(sizes) / num_shares
    for share in shares[:-1]:  # a run closes once it holds its part (a block more at most)
        assert sum(len(b[0]) for b in share) < per_share + max(sizes) + 1


def test_a_same_host_senders_groups_hash_at_once(monkeypatch):
    """A verify for a same-host (shm) sender hashes at the caller's priority, while the
    group's bytes are still in cache (an engine handoff's verify: in the background)."""
    import os

    calls = watch_hashing(monkeypatch)
    pool, res, _ = make()
    _, kv, hashes = prompt(SMALL, 2, seed=9)
    shm = res.reserve(SMALL.model_id, hashes, [BLOCK] * 2, ["none"] * 2, ttl_seconds=5, writer=(os.getpid(), 1))
    sums = fill(res, shm, kv)
    res.verify(shm.reservation_id, 0, sums[:1])
    res.commit(shm.reservation_id, 0, sums)
    assert calls == [(1, False), (1, False)] and pool.num_leading(hashes) == 2


def test_a_background_verify_hashes_the_same_on_threads_of_lower_priority():
    """A verify while the rest of a handoff is still on the wire runs at a higher
    niceness (the cycles the transfer leaves); its sums are the same."""
    import os
    import threading

    import torch

    from agent.core import handoff

    g = torch.Generator().manual_seed(6)
    blocks = [[torch.randint(0, 256, (1 << 16,), dtype=torch.uint8, generator=g)] for _ in range(3)]
    assert handoff.checksums_of(blocks, background=True) == [handoff.checksum(b) for b in blocks]
    assert handoff.checksums_of([], background=True) == []
    here = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    there = handoff._pool(True).submit(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())).result()
    assert there == max(here, handoff.BACKGROUND_VERIFY_NICE)


def test_pages_a_same_host_writer_copies_into_wait_for_it_not_for_a_timer():
    # a shared-memory sender stopped in the middle of a copy (SIGSTOP, a long pause)
    # finishes that copy when it runs again, however late: its expired reservation's pages
    # must not go to other blocks before it is gone or says its copy ended
    alive = {(4242, 7): True, (4243, 9): True}
    pool, res, clock = make(
        quarantine_seconds=2, writer_alive=lambda pid, start: alive[(pid, start)], writer_hold_max_seconds=600
    )
    _, _, hashes = prompt(SMALL, 8)
    stalled = res.reserve(SMALL.model_id, hashes[:3], [BLOCK] * 3, ["none"] * 3, ttl_seconds=1, writer=(4242, 7))
    dead = res.reserve(SMALL.model_id, hashes[3:5], [BLOCK] * 2, ["none"] * 2, ttl_seconds=1, writer=(4243, 9))
    timed = res.reserve(SMALL.model_id, hashes[5:], [BLOCK] * 3, ["none"] * 3, ttl_seconds=1)  # engine/grpc
    clock.now += 1
    assert res.run_once() == 3 and res.quarantined_pages() == 8
    clock.now += 2  # the quarantine is over: only the pages no live writer may still copy into go
    alive[(4243, 9)] = False  # that sender died (or its pid now names another process)
    res.run_once()
    assert res.quarantined_pages() == 3 and res.held_for_writers() == 1 and pool.top.used_bytes == 3 * BLOCK
    clock.now += 60
    res.run_once()
    assert res.quarantined_pages() == 3  # still running (stopped counts): still held
    assert not res.abort(stalled.reservation_id, quiesced=False)  # a word that is not "my copy ended"
    assert res.quarantined_pages() == 3
    assert not res.abort(stalled.reservation_id, quiesced=True)  # its copy ended: free now
    assert res.quarantined_pages() == 0 and pool.top.used_bytes == 0
    assert {dead.reservation_id, timed.reservation_id}.isdisjoint(res._open)


def test_a_writer_that_never_says_is_held_at_most_the_longest_hold():
    pool, res, clock = make(quarantine_seconds=2, writer_alive=lambda pid, start: True, writer_hold_max_seconds=30)
    _, _, hashes = prompt(SMALL, 2)
    res.reserve(SMALL.model_id, hashes, [BLOCK] * 2, ["none"] * 2, ttl_seconds=1, writer=(1, 1))
    clock.now += 1
    res.run_once()
    clock.now += 29.5
    res.run_once()
    assert res.quarantined_pages() == 2
    clock.now += 1
    res.run_once()
    assert res.quarantined_pages() == 0 and pool.top.used_bytes == 0


def test_a_stopped_process_is_alive_and_a_dead_or_reused_pid_is_not():
    import os
    import signal
    import subprocess
    import time

    from agent.store.shm import process_alive, process_start_ticks

    child = subprocess.Popen(["sleep", "30"])
    try:
        start = process_start_ticks(child.pid)
        os.kill(child.pid, signal.SIGSTOP)
        assert process_alive(child.pid, start) and not process_alive(child.pid, start + 1)
    finally:
        child.kill()
    deadline = time.monotonic() + 5
    while process_alive(child.pid, start) and time.monotonic() < deadline:  # a zombie copies nothing
        time.sleep(0.01)
    assert not process_alive(child.pid, start)
    child.wait()


def test_a_link_is_fitted_as_a_fixed_cost_plus_its_capacity_shared_by_transfers_at_once():
    # RPC round trips cost 10 ms a transfer; the link moves 1 GB/s, split among those on it
    link = Link("dec", max_concurrent=4)
    sizes = [64 << 10, 16 << 20, 1 << 20, 256 << 20, 4 << 20, 64 << 20] * 3
    for k, n in enumerate(sizes):
        sharing = 1 + k % 2  # every other one ran beside another transfer
        for _ in range(sharing):
            assert link.acquire(deadline_monotonic=1.0)
        link.record(True, n, 0.010 + n * sharing / 1e9, "shm")
        for _ in range(sharing):
            link.release()
    assert link.latency_seconds == pytest.approx(0.010, rel=1e-6)
    assert link.throughput_bytes_per_second == pytest.approx(1e9, rel=1e-6)
    # bytes over seconds would have said: for the 64 KiB ones, 6.5 MB/s
    same = Link("dec")
    for _ in range(3):
        same.record(True, 1 << 20, 0.011, "engine")  # one size only, as fast as a fixed cost: the rate is unknown
    assert same.throughput_bytes_per_second == 0 and same.latency_seconds == pytest.approx(0.011)
    slow = Link("dec")
    for _ in range(3):
        slow.record(True, 1 << 20, 0.5, "engine")  # one size, far slower than any fixed cost: its bytes
    assert slow.latency_seconds == 0 and slow.throughput_bytes_per_second == pytest.approx((1 << 20) / 0.5)
    # 128 KiB-1 MiB transfers on a 4 GB/s link with 4 ms of round trips: their time is the
    # fixed cost, and a little jitter hides the slope; all of it as rate said 0.1 GB/s in 6
    # of 20 runs (a review), and Route refused splits that cost a thirtieth of that
    import random

    for seed in range(20):
        rng = random.Random(seed)
        jittered = Link("dec")
        for _ in range(12):
            n = rng.randint(128 << 10, 1 << 20)
            jittered.record(True, n, 0.004 + n / 4e9 + rng.uniform(-0.0005, 0.0005), "shm")
        rate = jittered.throughput_bytes_per_second
        assert rate == 0 or rate > 4e8, (seed, rate)  # unknown (the router's default), or near the truth
    small = Link("dec")
    for _ in range(3):
        small.record(True, 4096, 0.004, "shm")  # tiny ones: the fixed cost, not the link's speed
    assert small.throughput_bytes_per_second == 0 and small.latency_seconds == pytest.approx(0.004)


def test_a_writer_that_said_its_copy_ended_while_its_reservation_closed_is_not_waited_for():
    # the writer's quiesced Abort lands between the reservation leaving the open set (its
    # commit failing, its expiry) and its pages reaching quarantine: it must still count
    pool, res, clock = make(quarantine_seconds=2, writer_alive=lambda pid, start: True)
    _, _, hashes = prompt(SMALL, 2)
    rid = "sender-chosen-0001"
    r = res.reserve(SMALL.model_id, hashes, [BLOCK] * 2, ["none"] * 2, ttl_seconds=1, writer=(7, 7), reservation_id=rid)
    assert r.reservation_id == rid
    with res._lock:  # as commit() and run_once() take it out of the open set
        res._open.pop(rid)
    assert not res.abort(rid, quiesced=True)
    res._release(r, quiesced=False)
    clock.now += 2
    res.run_once()
    assert res.quarantined_pages() == 0 and pool.top.used_bytes == 0


def test_a_sender_chooses_the_reservation_id_and_may_abort_before_its_reserve_lands():
    pool, res, _ = make(writer_alive=lambda pid, start: True)
    _, _, hashes = prompt(SMALL, 2)

    def reserve(rid):
        return res.reserve(SMALL.model_id, hashes, [BLOCK] * 2, ["none"] * 2, writer=(7, 7), reservation_id=rid)

    with pytest.raises(errors.InvalidArgument, match="reservation_id"):
        reserve("short")
    assert reserve("a" * 16).reservation_id == "a" * 16
    with pytest.raises(errors.AlreadyExists, match="in use"):
        reserve("a" * 16)
    assert not res.abort("b" * 16, quiesced=True)  # its Reserve got no answer: the sender aborts it
    with pytest.raises(errors.FailedPrecondition, match="aborted by its sender"):
        reserve("b" * 16)  # arriving late, it is refused, so nothing is held for it
    assert pool.top.used_bytes == 2 * BLOCK  # the first one's pages only


def test_a_link_grants_its_slot_first_come_first_served():
    """A transfer that came while others waited could take the freed slot first (on an
    overloaded link, one was overtaken by nine later ones: a review)."""
    import threading

    link = Link("peer", max_concurrent=1)
    assert link.acquire(deadline_monotonic=time.monotonic() + 5)
    order: list[int] = []

    def wait_for_the_link(k: int) -> None:
        assert link.acquire(deadline_monotonic=time.monotonic() + 10)
        order.append(k)
        time.sleep(0.01)
        link.release()

    threads = []
    for k in range(6):
        threads.append(threading.Thread(target=wait_for_the_link, args=(k,)))
        threads[-1].start()
        while link.queued < k + 1:  # each queued before the next comes
            time.sleep(0.001)
    link.release()
    assert link.acquire(deadline_monotonic=time.monotonic() + 10)  # a newcomer, just as the slot frees
    order.append(6)
    link.release()
    for t in threads:
        t.join(10)
    assert order == list(range(7))  # it queued behind the six


@pytest.mark.parametrize("fails_with", [PoolFull, RuntimeError])
def test_an_abort_during_a_reserve_that_fails_leaves_no_mark(monkeypatch, fails_with):
    """An Abort that came while its Reserve was finding pages is noted for that Reserve;
    one that then failed (no room, an error) took the note with it, else each such Abort
    stayed in memory for good."""
    pool, res, _ = make()
    _, _, hashes = prompt(SMALL, 2)
    rid = "c" * 16

    def aborted_then_fails(*args):
        assert res.abort(rid, quiesced=True)  # the sender gave up on the Reserve meanwhile
        raise fails_with("no room")

    monkeypatch.setattr(pool, "reserve_chain", aborted_then_fails)
    with pytest.raises((errors.FailedPrecondition, RuntimeError)):
        res.reserve(SMALL.model_id, hashes, [BLOCK] * 2, ["none"] * 2, reservation_id=rid)
    assert res.open_count() == 0 and not res._aborted_while_reserving
