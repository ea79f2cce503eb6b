"""Moving blocks between the CPU and disk tiers: bytes kept exactly (or within a lossy
codec's bound), failed moves leave the source, readers during moves never see wrong
data, pins hold, and the Mover's operations (progress, cancel, promote on load)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from agent.core import codecs
from agent.core import mover as mover_module
from agent.core.mover import CANCELLED, FAILED, PENDING, RUNNING, SUCCEEDED, Mover
from protos.tier import Tier
from tests.tiers.support import (
    BLOCK_BYTES,
    BS,
    SPEC,
    block_on_disk,
    blocks_on_disk,
    check_pool,
    decoded,
    disk_of,
    error_bound,
    hashes,
    kv,
    make_engine,
    make_pool,
    tokens,
)


def stored(tmp_path, n: int = 3, cpu_blocks: int = 8, **kwargs):
    """A pool (CPU + disk) holding one n-block chain in the CPU tier."""
    pool = make_pool(tmp_path / "disk", cpu_blocks=cpu_blocks, **kwargs)
    engine = make_engine(pool)
    toks, data = tokens(n), kv(n)
    assert engine.store(SPEC.model_id, toks, data).num_stored_blocks == n
    return pool, engine, toks, data, hashes(engine, toks)


# ---- moves keep the bytes -----------------------------------------------------------
@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_cpu_disk_cpu_keeps_the_bytes_exactly(tmp_path, codec):
    pool, engine, toks, data, hs = stored(tmp_path)
    for h in hs:
        out = pool.move_block(h, Tier.DISK, codec)
        assert out.ok and out.moved_bytes == pool.blocks[h].stored_bytes
        assert pool.tier_of(h) is Tier.DISK and pool.blocks[h].codec == codec
        assert block_on_disk(pool, h).offset in blocks_on_disk(disk_of(pool))
    check_pool(pool)
    res = engine.load(SPEC.model_id, toks)
    assert torch.equal(res.kv, data) and res.tiers == (Tier.DISK,) * 3
    for h in hs:
        assert pool.move_block(h, Tier.CPU).ok
        assert pool.blocks[h].codec == codec  # an encoded block stays encoded unless told
    res = engine.load(SPEC.model_id, toks)
    assert torch.equal(res.kv, data) and res.tiers == (Tier.CPU,) * 3
    for h in hs:  # decode in place
        assert pool.move_block(h, Tier.CPU, "none").ok
        assert pool.blocks[h].codec == "none" and pool.blocks[h].stored_bytes == BLOCK_BYTES
    assert torch.equal(engine.load(SPEC.model_id, toks).kv, data)
    assert pool.promotions_total == 3
    assert pool.moved_bytes_total[(Tier.CPU, Tier.DISK)] > 0 and pool.moved_bytes_total[(Tier.DISK, Tier.CPU)] > 0
    check_pool(pool)


def test_moving_to_where_a_block_is_is_a_no_op(tmp_path):
    pool, engine, toks, data, hs = stored(tmp_path, n=1)
    out = pool.move_block(hs[0], Tier.CPU)
    assert out.ok and out.moved_bytes == 0
    assert pool.move_block(b"\x07" * 16, Tier.DISK).reason == "not held"
    check_pool(pool)


def test_moving_to_a_tier_the_agent_lacks_fails(tmp_path):
    pool, engine, toks, data, hs = stored(tmp_path, n=1)
    out = pool.move_block(hs[0], Tier.GPU)
    assert not out.ok and "no gpu tier" in out.reason
    assert pool.tier_of(hs[0]) is Tier.CPU


def test_unknown_codec_fails_the_move_and_keeps_the_block(tmp_path):
    pool, engine, toks, data, hs = stored(tmp_path, n=1)
    out = pool.move_block(hs[0], Tier.DISK, "lz4")
    assert not out.ok and "lz4" in out.reason and "zstd" in out.reason
    assert pool.tier_of(hs[0]) is Tier.CPU and torch.equal(engine.load(SPEC.model_id, toks).kv, data)


@pytest.mark.parametrize("to_tier", [Tier.DISK, Tier.CPU], ids=["to disk", "in place"])
@pytest.mark.parametrize("codec", ["int8", "int4", "fp8"])
def test_lossy_codec_loads_within_its_bound(tmp_path, codec, to_tier):
    if codec not in codecs.available_codecs():
        pytest.skip(f"{codec} unavailable in this torch build")
    pool, engine, toks, data, hs = stored(tmp_path)
    for h in hs:
        assert pool.move_block(h, to_tier, codec).ok
        assert pool.blocks[h].codec == codec and pool.blocks[h].stored_bytes < BLOCK_BYTES
    u = {x.tier: x for x in pool.usage()}[to_tier]
    assert u.uncompressed_bytes == 3 * BLOCK_BYTES and u.stored_bytes < u.uncompressed_bytes
    res = engine.load(SPEC.model_id, toks)
    assert res.num_cached_tokens == 3 * BS and res.kv.dtype == data.dtype
    for i in range(3):
        err = (res.kv[i].float() - data[i].float()).abs()
        assert torch.all(err <= error_bound(codec, data[i]))
    assert not torch.equal(res.kv, data)  # it really was quantized
    # re-encoding a lossy block again does not compound: back to none keeps the same values
    before = res.kv.clone()
    for h in hs:
        assert pool.move_block(h, Tier.CPU, "none").ok
    assert torch.equal(engine.load(SPEC.model_id, toks).kv, before)
    check_pool(pool)


@pytest.mark.parametrize("one_by_one", [False, True])
def test_compressing_a_tier_full_of_pinned_blocks_compresses_them_where_they_are(tmp_path, one_by_one):
    """Compressing is how an operator gets room back in a tier that pins filled: each
    block's compressed copy took a free page first, and with none (every block pinned,
    none could move down) nothing was compressed (a stress review's driver: 15 compress
    operations failed with PoolFull). They are rewritten in their own pages now."""
    pool, engine, toks, data, hs = stored(tmp_path, n=4, cpu_blocks=4)
    assert [pool.tier_of(h) for h in hs] == [Tier.CPU] * 4
    pool.set_pin(hs, Tier.CPU)
    full = {u.tier: u for u in pool.usage()}[Tier.CPU].used_bytes
    if one_by_one:
        outcomes = [pool.move_block(h, Tier.CPU, "int8") for h in hs]
    else:
        outcomes = pool.move_blocks(hs, None, "int8")
    assert all(o.ok for o in outcomes), outcomes
    assert all(pool.blocks[h].codec == "int8" and pool.tier_of(h) is Tier.CPU for h in hs)
    assert {u.tier: u for u in pool.usage()}[Tier.CPU].used_bytes < full / 1.5  # int8 of fp16: about half
    res = engine.load(SPEC.model_id, toks)
    assert res.num_cached_tokens == 4 * BS
    for i in range(4):
        assert torch.all((res.kv[i].float() - data[i].float()).abs() <= error_bound("int8", data[i]))
    check_pool(pool)


def test_a_block_compressed_in_its_own_pages_waits_for_its_readers(tmp_path):
    pool, engine, toks, data, hs = stored(tmp_path, n=2, cpu_blocks=2)
    pool.set_pin(hs, Tier.CPU)
    with pool.lock:
        pool.blocks[hs[1]].ref_count += 1  # a reader (a load, a handoff) has its pages
    out = pool.move_blocks(hs, None, "int8", reader_wait_seconds=0.2)
    assert out[0].ok and not out[1].ok and "readers held the block" in out[1].reason
    assert pool.blocks[hs[1]].codec == "none" and torch.equal(decoded(pool, hs[1]), data[1])
    with pool.lock:
        pool.blocks[hs[1]].ref_count -= 1
    assert pool.move_block(hs[1], Tier.CPU, "int8").ok
    check_pool(pool)


def test_tier_codec_applies_to_raw_blocks_entering_the_tier(tmp_path):
    pool, engine, toks, data, hs = stored(tmp_path, tier_codecs={Tier.DISK: "int8"})
    assert pool.move_block(hs[0], Tier.DISK).ok
    assert pool.blocks[hs[0]].codec == "int8"
    assert pool.move_block(hs[1], Tier.DISK, "none").ok  # an explicit codec wins
    assert pool.blocks[hs[1]].codec == "none"


# ---- failed moves -------------------------------------------------------------------
def test_promotion_into_a_cpu_tier_full_of_pinned_blocks_fails_and_keeps_the_source(tmp_path):
    pool, engine, toks, data, hs = stored(tmp_path, n=3, cpu_blocks=2)
    assert [pool.tier_of(h) for h in hs] == [Tier.DISK, Tier.CPU, Tier.CPU]
    pool.set_pin(hs[1:], Tier.CPU)
    out = pool.move_block(hs[0], Tier.CPU)
    assert not out.ok and "PoolFull" in out.reason
    assert pool.tier_of(hs[0]) is Tier.DISK and pool.move_failures_total == 1
    assert torch.equal(engine.load(SPEC.model_id, toks).kv, data)
    check_pool(pool)


def test_a_failed_copy_frees_the_destination(tmp_path, monkeypatch):
    pool, engine, toks, data, hs = stored(tmp_path, n=1)
    disk = pool.store_of[Tier.DISK]

    def broken_write(handle, data, meta):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(disk, "write", broken_write)
    out = pool.move_block(hs[0], Tier.DISK)
    assert not out.ok and "No space left" in out.reason
    assert disk.used_bytes == 0 and pool.tier_of(hs[0]) is Tier.CPU
    assert [n.kind for n in pool.drain_notices()] == ["write_error"]
    assert torch.equal(engine.load(SPEC.model_id, toks).kv, data)


# ---- readers during moves -----------------------------------------------------------
def test_reads_during_moves_never_see_wrong_data(tmp_path):
    pool, engine, toks, data, hs = stored(tmp_path, n=4)
    stop = threading.Event()
    errors: list[BaseException] = []
    reads = {"full": 0, "partial": 0}

    def reader(use_engine: bool) -> None:
        try:
            while not stop.is_set():
                if use_engine:
                    res = engine.load(SPEC.model_id, toks)
                    blocks = list(res.kv)
                else:
                    blocks, _ = pool.read_chain(hs)
                for i, b in enumerate(blocks):
                    assert torch.equal(b, data[i]), f"block {i} read wrong data"
                reads["full" if len(blocks) == len(hs) else "partial"] += 1
                time.sleep(0)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    readers = [threading.Thread(target=reader, args=(e,), daemon=True) for e in (False, True)]
    for t in readers:
        t.start()
    outcomes = []
    deadline = time.monotonic() + 8
    try:
        for rnd in range(60):
            to = Tier.DISK if rnd % 2 == 0 else Tier.CPU
            codec = "zstd" if rnd % 4 == 0 else ("none" if rnd % 4 == 3 else None)
            for h in hs if rnd % 3 else reversed(hs):
                outcomes.append(pool.move_block(h, to, codec, wait_seconds=2.0))
            if time.monotonic() > deadline:
                break
    finally:
        stop.set()
        for t in readers:
            t.join(5)
    assert not errors, errors[0]
    assert sum(o.ok for o in outcomes) >= len(outcomes) // 2, [o.reason for o in outcomes if not o.ok][:3]
    assert all(o.ok or "TimeoutError" in o.reason for o in outcomes)
    assert reads["full"] > 10
    assert reads["partial"] == 0  # nothing was evicted: every read saw the whole chain
    assert pool.corrupt_blocks_total == 0  # no read ever met a block freed or rewritten under it
    assert set(pool.blocks) == set(hs)
    assert torch.equal(engine.load(SPEC.model_id, toks).kv, data)
    check_pool(pool)


def test_a_move_that_ended_leaves_the_next_moves_mark_alone(tmp_path, monkeypatch):
    """move_block let go of its block at the switch (the lock released): a move that took
    the block then keeps it marked moving. The first move's cleanup cleared that mark, so
    a third move took the block too, and both switched it: its old place freed twice and
    another block's bytes served under its hash."""
    pool, engine, toks, data, hs = stored(tmp_path, n=2)
    h = hs[1]
    disk = pool.store_of[Tier.DISK]
    gate, reading = threading.Event(), threading.Event()
    read_many = disk.read_many

    def held_read_many(items):  # the second move waits in its disk read
        if threading.current_thread().name == "second-move":
            reading.set()
            assert gate.wait(10)
        return read_many(items)

    monkeypatch.setattr(disk, "read_many", held_read_many)
    second: list = []
    switch = pool._switch_when_unread

    def switch_then_another_move(*args, **kwargs):
        outcome = switch(*args, **kwargs)
        t = threading.Thread(
            target=lambda: second.extend(pool.move_blocks([h], Tier.CPU)), name="second-move", daemon=True
        )
        t.start()
        assert reading.wait(10)  # the second move has the block (marked moving) before the first one returns
        second.append(t)
        return outcome

    monkeypatch.setattr(pool, "_switch_when_unread", switch_then_another_move)
    try:
        assert pool.move_block(h, Tier.DISK).ok
        monkeypatch.setattr(pool, "_switch_when_unread", switch)
        assert pool.blocks[h].moving, "the second move's mark was cleared by the first move"
        third = pool.move_block(h, Tier.CPU)
        assert not third.ok and third.reason == "already moving"
    finally:
        gate.set()
        for t in [x for x in second if isinstance(x, threading.Thread)]:
            t.join(10)
    assert [o.ok for o in second if not isinstance(o, threading.Thread)] == [True]
    assert pool.tier_of(h) is Tier.CPU
    check_pool(pool)
    assert torch.equal(engine.load(SPEC.model_id, toks).kv, data)


# ---- pins ---------------------------------------------------------------------------
def test_move_below_the_pin_tier_is_refused(tmp_path):
    pool, engine, toks, data, hs = stored(tmp_path, n=2)
    pool.set_pin(hs, Tier.CPU)
    out = pool.move_block(hs[1], Tier.DISK)
    assert not out.ok and "pinned at tier cpu" in out.reason
    assert pool.tier_of(hs[1]) is Tier.CPU
    assert pool.move_block(hs[1], Tier.CPU, "zstd").ok  # compressing in place is fine
    pool.set_pin(hs, Tier.DISK)
    assert pool.move_block(hs[1], Tier.DISK).ok


def test_safety_net_demotes_unpinned_blocks_and_keeps_pinned_ones(tmp_path):
    pool, engine, toks, data, hs = stored(tmp_path, n=2, cpu_blocks=3)
    pool.set_pin(hs, Tier.CPU)  # and it is the least recently used chain from here on
    for i in range(4):
        engine.store(SPEC.model_id, tokens(1, start=100 * (i + 1)), kv(1, seed=i + 1))
        assert [pool.tier_of(h) for h in hs] == [Tier.CPU, Tier.CPU]
    assert pool.demotions_total[Tier.CPU] == 3
    disk_blocks = [h for h in pool.blocks if pool.tier_of(h) is Tier.DISK]
    assert len(disk_blocks) == 3 and not set(disk_blocks) & set(hs)
    check_pool(pool)


# ---- the Mover ----------------------------------------------------------------------
def recorder(mover: Mover) -> list[tuple[str, str, int, int]]:
    seen: list[tuple[str, str, int, int]] = []
    mover.on_update = lambda op: seen.append((op.op_id, op.state, op.num_done_blocks, op.num_failed_blocks))
    return seen


def test_mover_op_runs_to_succeeded_with_progress(tmp_path):
    pool, engine, toks, data, hs = stored(tmp_path, n=3)
    mover = Mover(pool)
    seen = recorder(mover)
    op = mover.submit(hs, Tier.DISK, op_id="op-1")
    assert op.state == PENDING and op.num_total_blocks == 3 and mover.get("op-1") is op
    assert mover.run_once() is op
    assert (op.state, op.num_done_blocks, op.num_failed_blocks, op.error) == (SUCCEEDED, 3, 0, "")
    assert op.moved_bytes == 3 * BLOCK_BYTES and op.finished_unix_seconds >= op.created_unix_seconds
    assert seen[0] == ("op-1", RUNNING, 0, 0) and seen[-1] == ("op-1", SUCCEEDED, 3, 0)
    assert all(pool.tier_of(h) is Tier.DISK for h in hs)
    assert mover.run_once(timeout_seconds=0.01) is None  # nothing queued
    assert torch.equal(engine.load(SPEC.model_id, toks).kv, data)


def test_mover_reports_progress_of_a_long_op(tmp_path, monkeypatch):
    pool, engine, toks, data, hs = stored(tmp_path, n=4)
    real = pool.move_blocks

    def slow(*args, **kwargs):
        time.sleep(0.11)
        return real(*args, **kwargs)

    monkeypatch.setattr(mover_module, "BATCH_BLOCKS", 1)  # a batch a block: progress between them
    monkeypatch.setattr(pool, "move_blocks", slow)
    mover = Mover(pool)
    seen = recorder(mover)
    op = mover.run_op(mover.submit(hs, Tier.DISK))
    assert op.state == SUCCEEDED
    running = [done for _, state, done, _ in seen if state == RUNNING]
    assert any(0 < d < 4 for d in running), seen  # an update while under way


def test_mover_cancel_before_and_during_an_op(tmp_path, monkeypatch):
    pool, engine, toks, data, hs = stored(tmp_path, n=3)
    mover = Mover(pool)
    op = mover.submit(hs, Tier.DISK)
    assert mover.cancel(op.op_id) is True
    mover.run_once()
    assert op.state == CANCELLED and op.num_done_blocks == 0
    assert all(pool.tier_of(h) is Tier.CPU for h in hs)
    assert mover.cancel(op.op_id) is False  # finished
    assert mover.cancel("no-such-op") is False

    real = pool.move_blocks
    op2 = mover.submit(hs, Tier.DISK)

    def cancel_after_first(*args, **kwargs):
        out = real(*args, **kwargs)
        mover.cancel(op2.op_id)
        return out

    monkeypatch.setattr(mover_module, "BATCH_BLOCKS", 1)  # cancellation goes by batch
    monkeypatch.setattr(pool, "move_blocks", cancel_after_first)
    mover.run_once()
    assert op2.state == CANCELLED and op2.num_done_blocks == 1
    assert [pool.tier_of(h) for h in hs] == [Tier.DISK, Tier.CPU, Tier.CPU]
    check_pool(pool)


def test_mover_failures(tmp_path):
    pool, engine, toks, data, hs = stored(tmp_path, n=2)
    mover = Mover(pool)
    missing = [b"\x01" * 16, b"\x02" * 16]
    op = mover.run_op(mover.submit(missing, Tier.DISK))
    assert (op.state, op.num_done_blocks, op.num_failed_blocks, op.num_gone_blocks) == (
        SUCCEEDED,
        0,
        0,
        2,
    )  # nothing held: nothing to do
    assert "2 block(s) no longer held" in op.error
    op = mover.run_op(mover.submit([hs[0], missing[0]], Tier.DISK))
    assert (op.state, op.num_done_blocks, op.num_failed_blocks, op.num_gone_blocks) == (SUCCEEDED, 1, 0, 1)
    op = mover.run_op(mover.submit(hs, Tier.GPU))  # no GPU tier here: every block fails
    assert (op.state, op.num_done_blocks, op.num_failed_blocks) == (FAILED, 0, 2)
    op = mover.run_op(mover.submit([hs[1]], Tier.DISK, codec="lz4"))
    assert op.state == FAILED and "lz4" in op.error
    op = mover.run_op(mover.submit([hs[1]], Tier.DISK))  # the mover is still fine
    assert op.state == SUCCEEDED and pool.tier_of(hs[1]) is Tier.DISK


def test_mover_compress_op_keeps_the_tier(tmp_path):
    pool, engine, toks, data, hs = stored(tmp_path, n=2)
    mover = Mover(pool)
    op = mover.run_op(mover.submit(hs, None, codec="int8", kind="compress"))
    assert op.state == SUCCEEDED and op.num_done_blocks == 2
    assert all(pool.tier_of(h) is Tier.CPU and pool.blocks[h].codec == "int8" for h in hs)


@pytest.mark.parametrize("kind, to_tier, codec", [("move", Tier.DISK, None), ("compress", None, "int8")])
def test_an_operations_block_another_move_has_is_tried_again(tmp_path, kind, to_tier, codec):
    """A block the agent's own background work was moving (a store making room, the
    disk's compaction) failed an operator's move or compress as "already moving" (a
    stress review's driver: about 1 operation in 100). It is tried again once free."""
    pool, engine, toks, data, hs = stored(tmp_path, n=2)
    mover = Mover(pool)
    with pool.lock:
        pool.blocks[hs[1]].moving = True  # as a background move marks it

    def background_move_ends():
        time.sleep(0.3)
        with pool.lock:
            pool.blocks[hs[1]].moving = False

    t = threading.Thread(target=background_move_ends)
    t.start()
    op = mover.run_op(mover.submit(hs, to_tier, codec=codec, kind=kind))
    t.join()
    assert op.state == SUCCEEDED and op.num_done_blocks == 2, op.error
    assert all(pool.tier_of(h) is (to_tier or Tier.CPU) for h in hs)
    assert all(pool.blocks[h].codec == (codec or "none") for h in hs)


def test_an_operation_gives_up_on_a_block_moving_past_the_retry(tmp_path, monkeypatch):
    monkeypatch.setattr(mover_module, "BUSY_RETRY_SECONDS", 0.2)
    pool, engine, toks, data, hs = stored(tmp_path, n=2)
    mover = Mover(pool)
    with pool.lock:
        pool.blocks[hs[1]].moving = True
    op = mover.run_op(mover.submit(hs, Tier.DISK))
    assert op.state == FAILED and op.num_done_blocks == 1 and op.error == "already moving"
    assert pool.tier_of(hs[1]) is Tier.CPU


def test_a_block_tried_again_does_not_push_out_the_ones_its_batch_moved(tmp_path):
    """While an operation's busy block is tried again, the blocks its batch already put in
    the tier were not referenced yet: the room made for the busy block (or by anyone
    meanwhile) pushed out the least recently used of them, and the move failed as
    "pushed out again by later ones" though the tier had another block to give up."""
    pool = make_pool(tmp_path / "disk", cpu_blocks=2)
    engine = make_engine(pool)
    chains = [tokens(1, start=100 * i) for i in range(3)]
    for i, toks in enumerate(chains[:2]):
        assert engine.store(SPEC.model_id, toks, kv(1, seed=i)).num_stored_blocks == 1
    a, b, c = (hashes(engine, toks)[0] for toks in chains)
    assert pool.move_block(a, Tier.DISK).ok and pool.move_block(b, Tier.DISK).ok
    assert engine.store(SPEC.model_id, chains[2], kv(1, seed=2)).num_stored_blocks == 1  # c: used last
    mover = Mover(pool)
    with pool.lock:
        pool.blocks[b].moving = True  # as a background move marks it

    def background_move_ends():
        time.sleep(0.2)
        with pool.lock:
            pool.blocks[b].moving = False

    t = threading.Thread(target=background_move_ends)
    t.start()
    op = mover.run_op(mover.submit([a, b], Tier.CPU))
    t.join()
    assert op.state == SUCCEEDED and op.num_done_blocks == 2, op.error
    assert pool.tier_of(a) is Tier.CPU and pool.tier_of(b) is Tier.CPU and pool.tier_of(c) is Tier.DISK
    check_pool(pool)


def test_mover_forgets_old_finished_ops(tmp_path):
    pool, engine, toks, data, hs = stored(tmp_path, n=1)
    mover = Mover(pool, keep_finished=3)
    ops = [mover.run_op(mover.submit(hs, Tier.CPU)) for _ in range(5)]
    mover.submit(hs, Tier.CPU)
    assert len(mover.ops()) <= 4 and mover.get(ops[0].op_id) is None
    assert mover.get(ops[-1].op_id) is ops[-1]


def test_load_from_disk_promotes_in_the_background(tmp_path):
    pool, engine, toks, data, hs = stored(tmp_path, n=3)
    engine = make_engine(pool, with_mover=True)
    for h in hs[1:]:
        assert pool.move_block(h, Tier.DISK).ok
    res = engine.load(SPEC.model_id, toks)
    assert torch.equal(res.kv, data) and res.tiers == (Tier.CPU, Tier.DISK, Tier.DISK)
    pending = [op for op in engine.mover.ops() if op.kind == "promote"]
    assert len(pending) == 1 and pending[0].block_hashes == hs[1:] and pending[0].state == PENDING
    engine.load(SPEC.model_id, toks)  # the same blocks are not promoted twice
    assert len(engine.mover.ops()) == 1
    op = engine.mover.run_once()
    assert op.state == SUCCEEDED and op.num_done_blocks == 2
    assert [pool.tier_of(h) for h in hs] == [Tier.CPU] * 3
    res = engine.load(SPEC.model_id, toks)
    assert torch.equal(res.kv, data) and res.tiers == (Tier.CPU,) * 3
    assert len(engine.mover.ops()) == 1  # nothing left to promote
    assert pool.promotions_total == 2
    check_pool(pool)


def test_loads_stop_promoting_for_a_while_once_the_top_tier_had_no_room(tmp_path, monkeypatch):
    """A CPU tier held whole by pins: every load of a block on disk started a promotion
    that failed (the demo's namespace pin: thousands of failures, each a search of the
    tier under the pool's lock). After one finds no room, loads promote nothing for a
    second; then they try again."""
    import agent.core.mover as mover_module

    pool, engine, toks, data, hs = stored(tmp_path, n=3, cpu_blocks=2)
    engine = make_engine(pool, with_mover=True)
    pool.set_pin(hs[1:], Tier.CPU)  # the CPU tier's two blocks
    assert pool.tier_of(hs[0]) is Tier.DISK
    assert torch.equal(engine.load(SPEC.model_id, toks[:BS]).kv, data[:1])
    op = engine.mover.run_once()
    assert op.kind == "promote" and op.state == FAILED and "PoolFull" in op.error
    for _ in range(3):  # within the backoff: read, not promoted again
        assert torch.equal(engine.load(SPEC.model_id, toks[:BS]).kv, data[:1])
    assert engine.mover.run_once(timeout_seconds=0.01) is None and pool.move_failures_total == 1
    monkeypatch.setattr(mover_module, "PROMOTE_BACKOFF_SECONDS", 0.0)
    engine.mover._no_room_until = 0.0  # the backoff is over
    pool.set_pin(hs[1:], None)
    engine.load(SPEC.model_id, toks[:BS])
    assert engine.mover.run_once().state == SUCCEEDED and pool.tier_of(hs[0]) is Tier.CPU
    check_pool(pool)


def test_background_mover_thread_promotes(tmp_path):
    pool, engine, toks, data, hs = stored(tmp_path, n=2)
    engine = make_engine(pool, with_mover=True)
    for h in hs:
        assert pool.move_block(h, Tier.DISK).ok
    stop = threading.Event()
    t = threading.Thread(target=engine.mover.run_forever, args=(stop,), daemon=True)
    t.start()
    try:
        engine.load(SPEC.model_id, toks)
        deadline = time.monotonic() + 5
        while any(pool.tier_of(h) is not Tier.CPU for h in hs) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [pool.tier_of(h) for h in hs] == [Tier.CPU] * 2
    finally:
        stop.set()
        t.join(2)
    assert torch.equal(engine.load(SPEC.model_id, toks).kv, data)


def test_decoded_matches_what_load_returns(tmp_path):
    pool, engine, toks, data, hs = stored(tmp_path, n=2)
    assert pool.move_block(hs[1], Tier.DISK, "int4").ok
    assert torch.equal(engine.load(SPEC.model_id, toks).kv[1], decoded(pool, hs[1]))


def test_a_store_no_tier_has_room_for_is_counted_and_said(tmp_path):
    """Every tier full of pinned blocks: an engine's store kept nothing and said nothing
    (OK, 0 stored, no metric, no log: a review). Now counted (store_refused_blocks_total,
    kvcp_store_refused_blocks_total) and said in a no_room notice, once per 10 s."""
    from agent.store.disk_tier import DiskTier
    from tests.tiers.support import BLOCK_BYTES, make_engine, make_pool

    probe = DiskTier(tmp_path / "probe", 1 << 20)
    footprint = probe.footprint(BLOCK_BYTES)
    probe.close()
    pool = make_pool(tmp_path / "disk", cpu_blocks=2, disk_bytes=4 * footprint)  # 2 + 4 blocks in all
    engine = make_engine(pool)
    first = tokens(6)
    engine.store(SPEC.model_id, first, kv(6))
    held = [h for h in hashes(engine, first) if pool.tier_of(h) is not None]
    assert len(held) == 6
    pool.set_pin(held, Tier.DISK)
    pool.drain_notices()
    other = tokens(3, start=50_000)
    for _ in range(3):
        assert engine.store(SPEC.model_id, other, kv(3, seed=1)).num_stored_blocks == 0
    assert pool.store_refused_blocks_total == 9
    said = [n for n in pool.drain_notices() if n.kind == "no_room"]
    assert len(said) == 1 and "kept 0 of its 3 blocks" in said[0].message  # the repeats held back
    check_pool(pool)
