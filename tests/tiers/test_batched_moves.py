"""Batched moves between the CPU slab and the disk slab (BlockPool.move_blocks, the
Mover's path): the bytes survive both ways, adjacent extents go in one vectored call, a
corrupt block in a batch is removed alone, a failed write leaves every source intact,
and a block being read is switched only once its reader lets go."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from agent.core import codecs
from agent.core.block_pool import BlockPool
from agent.core.engine_api import KVEngineAPI
from agent.core.mover import SUCCEEDED, Mover
from agent.store.disk_tier import DiskTier
from agent.store.memory_tier import MemoryTier
from protos.tier import Tier
from tests.tiers.support import (
    BLOCK_BYTES,
    SPEC,
    block_on_disk,
    blocks_on_disk,
    check_pool,
    decoded,
    disk_of,
    flip_byte,
    kv,
    tokens,
)

N = 12


def independent_blocks(tmp_path, n: int = N) -> tuple[BlockPool, list[bytes], torch.Tensor]:
    """n one-block chains in a CPU slab that holds them all, over a disk tier."""
    cpu = MemoryTier(Tier.CPU, n * SPEC.block_bytes, SPEC.block_bytes // 16, device="cpu")  # an agent's paging
    pool = BlockPool([cpu, DiskTier(tmp_path / "disk", 1 << 20)], [SPEC])
    data = kv(n, seed=5)
    hashes = [os.urandom(16) for _ in range(n)]
    for i, h in enumerate(hashes):
        assert pool.insert_chain(SPEC.model_id, [h], lambda _i, i=i: data[i]) == (1, 0)
    return pool, hashes, data


def test_a_batch_goes_to_disk_and_back_with_its_bytes(tmp_path, monkeypatch):
    pool, hashes, data = independent_blocks(tmp_path)
    calls, real = [0], os.pwritev

    def counted(*args):  # the real call, counted
        calls[0] += 1
        return real(*args)

    monkeypatch.setattr(os, "pwritev", counted)
    outcomes = pool.move_blocks(hashes, Tier.DISK)
    monkeypatch.undo()
    assert all(o.ok and o.moved_bytes == SPEC.block_bytes for o in outcomes)
    assert calls[0] == 1  # twelve adjacent extents, one vectored write
    assert all(pool.tier_of(h) is Tier.DISK for h in hashes)
    assert len(blocks_on_disk(disk_of(pool))) == N
    check_pool(pool)
    for i, h in enumerate(hashes):
        assert torch.equal(decoded(pool, h), data[i])
    outcomes = pool.move_blocks(hashes, Tier.CPU)
    assert all(o.ok for o in outcomes) and all(pool.tier_of(h) is Tier.CPU for h in hashes)
    assert blocks_on_disk(disk_of(pool)) == []
    check_pool(pool)
    for i, h in enumerate(hashes):
        assert torch.equal(decoded(pool, h), data[i])
    assert pool.moved_bytes_total[(Tier.CPU, Tier.DISK)] == N * SPEC.block_bytes


def test_a_corrupt_block_in_a_batch_is_removed_and_the_rest_move(tmp_path):
    pool, hashes, data = independent_blocks(tmp_path)
    assert all(o.ok for o in pool.move_blocks(hashes, Tier.DISK))
    at = block_on_disk(pool, hashes[4])
    flip_byte(at.path, at.last_payload_byte)
    pool.drain_notices()
    outcomes = pool.move_blocks(hashes, Tier.CPU)
    assert [o.ok for o in outcomes] == [i != 4 for i in range(N)]
    assert "unreadable" in outcomes[4].reason and "checksum" in outcomes[4].reason
    assert hashes[4] not in pool.blocks and pool.corrupt_blocks_total == 1
    assert [n.kind for n in pool.drain_notices()] == ["corrupt_block"]
    check_pool(pool)
    for i, h in enumerate(hashes):
        if i != 4:
            assert torch.equal(decoded(pool, h), data[i])


@pytest.mark.parametrize("codec", [None, "int4"], ids=["as_is", "recoded"])
def test_a_failed_batch_write_leaves_every_source_in_place(tmp_path, codec):
    pool, hashes, data = independent_blocks(tmp_path)
    disk_of(pool).path.unlink()  # the slab goes away under the agent
    time.sleep(0.06)
    outcomes = pool.move_blocks(hashes, Tier.DISK, codec=codec)
    assert not any(o.ok for o in outcomes)
    assert all(pool.tier_of(h) is Tier.CPU and pool.blocks[h].codec == "none" for h in hashes)
    assert "write_error" in {n.kind for n in pool.drain_notices()}
    assert disk_of(pool).used_bytes == 0 and pool.move_failures_total == N
    for i, h in enumerate(hashes):
        assert torch.equal(decoded(pool, h), data[i])


@pytest.mark.parametrize("codec", [None, "fp8"], ids=["as_is", "recoded"])
def test_a_block_being_read_switches_when_its_reader_lets_go(tmp_path, codec):
    pool, hashes, data = independent_blocks(tmp_path)
    held = pool.acquire_chain([hashes[3]])
    assert len(held) == 1
    released = []

    def reader():
        time.sleep(0.1)
        released.append(time.monotonic())
        pool.release_chain(held)

    t = threading.Thread(target=reader)
    t.start()
    outcomes = pool.move_blocks(hashes, Tier.DISK, codec=codec)
    done = time.monotonic()
    t.join()
    assert all(o.ok for o in outcomes)
    assert released and done >= released[0]  # not switched under the reader
    check_pool(pool)
    if codec is None:
        assert torch.equal(decoded(pool, hashes[3]), data[3])
    else:
        assert pool.blocks[hashes[3]].codec == codec and pool.tier_of(hashes[3]) is Tier.DISK


def test_mover_operations_move_in_batches(tmp_path):
    pool, hashes, data = independent_blocks(tmp_path)
    mover = Mover(pool)
    op = mover.run_op(mover.submit(hashes, Tier.DISK))
    assert (op.state, op.num_done_blocks, op.num_failed_blocks, op.moved_bytes) == (
        SUCCEEDED,
        N,
        0,
        N * SPEC.block_bytes,
    )
    op = mover.run_op(mover.submit(hashes + [b"\x00" * 16], Tier.CPU))
    assert (op.state, op.num_done_blocks, op.num_failed_blocks, op.num_gone_blocks) == (
        SUCCEEDED,
        N,
        0,
        1,
    )  # one it no longer held: not a failure
    assert op.error == "1 block(s) no longer held here (evicted or dropped meanwhile)"
    check_pool(pool)


def test_a_batch_that_fails_as_a_whole_leaves_every_block_movable(tmp_path, monkeypatch):
    pool, hashes, data = independent_blocks(tmp_path)
    disk = disk_of(pool)

    def broken(items):
        raise RuntimeError("the I/O pool is shutting down")

    monkeypatch.setattr(disk, "write_many", broken)
    with pytest.raises(RuntimeError):
        pool.move_blocks(hashes, Tier.DISK)
    monkeypatch.undo()
    assert not any(pool.blocks[h].moving for h in hashes)
    disk.drain()
    assert disk.used_bytes == 0 and all(pool.tier_of(h) is Tier.CPU for h in hashes)
    assert all(o.ok for o in pool.move_blocks(hashes, Tier.DISK))  # and they move later
    check_pool(pool)


# ---- batches that change codec on the way (BlockPool._move_recoded) --------------------
def roundtrip_int8(x: torch.Tensor) -> torch.Tensor:
    from agent.core import codecs

    return codecs.decode("int8", codecs.encode("int8", x), SPEC.block_shape, x.dtype)


def test_a_recoded_batch_is_written_in_few_calls_and_loads_as_its_codec(tmp_path, monkeypatch):
    pool, hashes, data = independent_blocks(tmp_path)
    calls, real = [0], os.pwritev

    def counted(*args):
        calls[0] += 1
        return real(*args)

    monkeypatch.setattr(os, "pwritev", counted)
    outcomes = pool.move_blocks(hashes, Tier.DISK, codec="int8")
    monkeypatch.undo()
    assert all(o.ok for o in outcomes)
    assert calls[0] == 1  # twelve encoded blocks in adjacent extents, one vectored write
    from agent.core import codecs

    assert [o.moved_bytes for o in outcomes] == [codecs.encode("int8", data[i]).numel() for i in range(N)]
    assert outcomes[0].moved_bytes < SPEC.block_bytes
    assert all(pool.blocks[h].codec == "int8" and pool.tier_of(h) is Tier.DISK for h in hashes)
    check_pool(pool)
    for i, h in enumerate(hashes):  # what load returns is the int8 round trip, bit for bit
        assert torch.equal(decoded(pool, h), roundtrip_int8(data[i]))
    # back to the CPU as raw fp16: decoded on the way, from verified disk reads
    assert all(o.ok for o in pool.move_blocks(hashes, Tier.CPU, codec="none"))
    assert all(pool.blocks[h].codec == "none" and pool.tier_of(h) is Tier.CPU for h in hashes)
    assert disk_of(pool).used_bytes == 0
    check_pool(pool)
    for i, h in enumerate(hashes):
        assert torch.equal(decoded(pool, h), roundtrip_int8(data[i]))


def test_a_tier_codec_recodes_a_batch_too(tmp_path):
    cpu = MemoryTier(Tier.CPU, N * SPEC.block_bytes, SPEC.block_bytes, device="cpu")
    pool = BlockPool([cpu, DiskTier(tmp_path / "disk", 1 << 20)], [SPEC], tier_codecs={Tier.DISK: "zstd"})
    data = kv(N, seed=5)
    hashes = [os.urandom(16) for _ in range(N)]
    for i, h in enumerate(hashes):
        pool.insert_chain(SPEC.model_id, [h], lambda _i, i=i: data[i])
    assert all(o.ok for o in pool.move_blocks(hashes, Tier.DISK))
    assert {pool.blocks[h].codec for h in hashes} == {"zstd"}
    check_pool(pool)
    for i, h in enumerate(hashes):
        assert torch.equal(decoded(pool, h), data[i])


def test_a_corrupt_block_in_a_recoded_batch_is_removed_and_the_rest_move(tmp_path):
    pool, hashes, data = independent_blocks(tmp_path)
    assert all(o.ok for o in pool.move_blocks(hashes, Tier.DISK))
    at = block_on_disk(pool, hashes[7])
    flip_byte(at.path, at.last_payload_byte)
    pool.drain_notices()
    outcomes = pool.move_blocks(hashes, Tier.CPU, codec="int8")
    assert [o.ok for o in outcomes] == [i != 7 for i in range(N)]
    assert "unreadable" in outcomes[7].reason
    assert hashes[7] not in pool.blocks and pool.corrupt_blocks_total == 1
    assert [n.kind for n in pool.drain_notices()] == ["corrupt_block"]
    check_pool(pool)
    for i, h in enumerate(hashes):
        if i != 7:
            assert pool.blocks[h].codec == "int8"
            assert torch.equal(decoded(pool, h), roundtrip_int8(data[i]))


def test_a_codec_that_fails_on_one_block_fails_that_move_alone(tmp_path, monkeypatch):
    from agent.core import codecs

    pool, hashes, data = independent_blocks(tmp_path)
    real, bad = codecs.encode, data[5]

    def picky(name, block):
        if name == "int8" and torch.equal(block, bad):
            raise codecs.CodecError("this block does not encode")
        return real(name, block)

    monkeypatch.setattr(codecs, "encode", picky)
    outcomes = pool.move_blocks(hashes, Tier.DISK, codec="int8")
    assert [o.ok for o in outcomes] == [i != 5 for i in range(N)]
    assert "does not encode" in outcomes[5].reason
    assert pool.tier_of(hashes[5]) is Tier.CPU and not pool.blocks[hashes[5]].moving
    check_pool(pool)
    assert torch.equal(decoded(pool, hashes[5]), data[5])


def test_an_unexpected_codec_error_leaves_every_block_movable(tmp_path, monkeypatch):
    from agent.core import codecs

    pool, hashes, data = independent_blocks(tmp_path)
    real, seen = codecs.encode, []

    def breaks(name, block):
        seen.append(1)
        if len(seen) == 3:
            raise RuntimeError("out of something")
        return real(name, block)

    monkeypatch.setattr(codecs, "encode", breaks)
    with pytest.raises(RuntimeError):
        pool.move_blocks(hashes, Tier.DISK, codec="int8")
    monkeypatch.undo()
    assert not any(pool.blocks[h].moving for h in hashes)
    assert all(pool.tier_of(h) is Tier.CPU for h in hashes)
    disk_of(pool).drain()
    assert disk_of(pool).used_bytes == 0
    assert all(o.ok for o in pool.move_blocks(hashes, Tier.DISK, codec="int8"))
    check_pool(pool)


def test_compress_in_place_goes_in_batches(tmp_path):
    pool, hashes, data = independent_blocks(tmp_path)
    assert all(o.ok for o in pool.move_blocks(hashes[:6], Tier.DISK))
    mover = Mover(pool)
    op = mover.run_op(mover.submit(hashes, None, codec="int8", kind="compress"))
    assert (op.state, op.num_done_blocks, op.num_failed_blocks) == (SUCCEEDED, N, 0)
    assert [pool.tier_of(h) for h in hashes] == [Tier.DISK] * 6 + [Tier.CPU] * 6
    # in the CPU slab's pages int8 frees half of each block; on disk a block this small
    # takes two 512 B granules (header and payload) either way: kept as it is, and said
    assert [pool.blocks[h].codec for h in hashes] == ["none"] * 6 + ["int8"] * 6
    assert op.error == "6 block(s) kept in their codec: int8 would free none of their room"
    check_pool(pool)
    for i, h in enumerate(hashes):
        assert torch.equal(decoded(pool, h), data[i] if i < 6 else roundtrip_int8(data[i]))


def test_a_corrupt_parent_in_a_recoded_batch_goes_with_its_children(tmp_path):
    cpu = MemoryTier(Tier.CPU, 8 * SPEC.block_bytes, SPEC.block_bytes, device="cpu")
    pool = BlockPool([cpu, DiskTier(tmp_path / "disk", 1 << 20)], [SPEC])
    data = kv(4, seed=1)
    chain = [os.urandom(16) for _ in range(4)]
    assert pool.insert_chain(SPEC.model_id, chain, lambda i: data[i]) == (4, 0)
    assert all(o.ok for o in pool.move_blocks(chain, Tier.DISK, codec="int8"))
    at = block_on_disk(pool, chain[1])
    flip_byte(at.path, at.last_payload_byte)
    outcomes = pool.move_blocks(chain, Tier.CPU, codec="none")
    assert outcomes[0].ok and not outcomes[1].ok and "unreadable" in outcomes[1].reason
    # the children moved with the batch, then left with their corrupt parent: no block is
    # held behind a hole
    assert chain[0] in pool.blocks and all(h not in pool.blocks for h in chain[1:])
    assert pool.corrupt_blocks_total == 1
    check_pool(pool)
    assert torch.equal(decoded(pool, chain[0]), roundtrip_int8(data[0]))


def test_a_compress_in_a_full_tier_makes_room_one_block_at_a_time(tmp_path):
    """A tier full of the blocks being compressed: the first one needs room (one block
    goes), every later one fits in the space the ones before gave back."""
    cpu = MemoryTier(Tier.CPU, N * SPEC.block_bytes, SPEC.block_bytes // 4, device="cpu")
    pool = BlockPool([cpu], [SPEC])
    data = kv(N, seed=2)
    hashes = [os.urandom(16) for _ in range(N)]
    for i, h in enumerate(hashes):
        pool.insert_chain(SPEC.model_id, [h], lambda _i, i=i: data[i])
    outcomes = pool.move_blocks(hashes, Tier.CPU, codec="int8")
    kept = [h for h in hashes if h in pool.blocks]
    assert len(kept) >= N - 1 and sum(o.ok for o in outcomes) >= N - 1
    assert all(pool.blocks[h].codec == "int8" and pool.tier_of(h) is Tier.CPU for h in kept)
    check_pool(pool)


def test_a_hash_listed_twice_moves_once_and_both_listings_say_so(tmp_path):
    pool, hashes, data = independent_blocks(tmp_path)
    outcomes = pool.move_blocks([hashes[0], hashes[1], hashes[0]], Tier.DISK, codec="int8")
    assert [o.ok for o in outcomes] == [True, True, True] and outcomes[2] == outcomes[0]
    mover = Mover(pool)
    op = mover.run_op(mover.submit([hashes[2], hashes[2]], None, codec="int8", kind="compress"))
    assert (op.state, op.num_done_blocks, op.num_failed_blocks) == (SUCCEEDED, 2, 0)
    check_pool(pool)


def test_close_lets_the_codec_threads_go_and_moves_still_work(tmp_path):
    pool, hashes, data = independent_blocks(tmp_path)
    assert all(o.ok for o in pool.move_blocks(hashes[:4], Tier.DISK, codec="int8"))
    assert any(t.name.startswith("codec") for t in threading.enumerate())
    pool.close()
    assert pool._codec_pool is None
    assert all(o.ok for o in pool.move_blocks(hashes[4:], Tier.DISK, codec="int8"))  # new threads
    pool.close()
    check_pool(pool)


def test_making_room_for_a_promotion_never_drops_the_block_being_promoted(tmp_path):
    from agent.core.model_spec import ModelSpec

    big = ModelSpec("big", block_size=4, num_layers=2, num_kv_heads=8, head_dim=8, dtype="float16")  # 2048 B
    cpu = MemoryTier(Tier.CPU, 8 * SPEC.block_bytes, SPEC.block_bytes, device="cpu")
    disk = DiskTier(tmp_path / "disk", 2 * 1024 + 2560)  # a0 | c0 | b0, full
    pool = BlockPool([cpu, disk], [SPEC, big])

    def put(spec, tag):
        h = bytes([tag]) * 16
        block = torch.full(spec.block_shape, float(tag), dtype=spec.torch_dtype)
        assert pool.insert_chain(spec.model_id, [h], lambda _i: block) == (1, 0)
        return h

    a0, c0, b0, d0, e0 = put(SPEC, 1), put(SPEC, 2), put(big, 3), put(big, 4), put(big, 5)
    assert [pool.tier_of(h) for h in (a0, c0, b0, d0, e0)] == [Tier.DISK] * 3 + [Tier.CPU] * 2
    pool.touch([c0])  # disk LRU: a0, b0, c0
    # room in the CPU for a0: d0 is demoted, and room on the disk for d0 drops LRU leaves
    [outcome] = pool.move_blocks([a0], Tier.CPU)
    assert outcome.ok and pool.tier_of(a0) is Tier.CPU
    assert torch.equal(decoded(pool, a0), torch.full(SPEC.block_shape, 1.0, dtype=SPEC.torch_dtype))
    check_pool(pool)
    starts = [s for s, _ in disk._extents.runs()]
    assert len(starts) == len(set(starts)), "an extent freed twice"


def test_a_lossy_tier_codec_leaves_an_int8_kv_model_uncompressed(tmp_path):
    """--disk-codec int8 on an agent that also serves a model whose KV is int8: its blocks
    enter the disk tier as they are (a lossy codec needs floating-point KV), and stores of
    every model go on once the CPU tier is full."""
    from agent.core.model_spec import ModelSpec

    f16 = SPEC
    i8 = ModelSpec("i8", block_size=4, num_layers=2, num_kv_heads=2, head_dim=16, dtype="int8")
    cpu = MemoryTier(Tier.CPU, 4 * BLOCK_BYTES, BLOCK_BYTES, device="cpu")
    pool = BlockPool([cpu, DiskTier(tmp_path, 1 << 20)], [f16, i8], tier_codecs={Tier.DISK: "int8"})
    engine = KVEngineAPI(pool, [f16, i8], Mover(pool))
    i8_kv = torch.arange(4 * BLOCK_BYTES, dtype=torch.int64).remainder(251).to(torch.int8).view(4, *i8.block_shape)
    assert engine.store("i8", tokens(4), i8_kv).num_stored_blocks == 4
    for n in range(3):  # each store demotes the oldest CPU blocks to the int8 disk tier
        assert engine.store(f16.model_id, tokens(2, start=1000 * (n + 1)), kv(2, seed=n)).num_stored_blocks == 2
    on_disk = {m.model_id: m.codec for m in pool.blocks.values() if m.tier == Tier.DISK}
    assert on_disk == {"i8": "none", f16.model_id: "int8"}
    got = engine.load("i8", tokens(4))
    assert got.num_cached_tokens == 16 and torch.equal(got.kv, i8_kv)
    check_pool(pool)


def test_a_batch_between_memory_slabs_keeps_its_bytes_and_mixes_with_disk_reads(tmp_path):
    """Memory slab to memory slab (GPU <-> CPU; here a second host slab stands in for the
    GPU) copies a batch then switches it: the bytes survive both ways, blocks whose pages
    are scattered included, and a batch into the CPU slab may mix memory and disk sources."""
    n = 8
    upper = MemoryTier(Tier.GPU, n * SPEC.block_bytes, SPEC.block_bytes // 4, device="cpu")
    upper._free.reverse()  # its pages come out descending: each block is four one-page runs
    cpu = MemoryTier(Tier.CPU, n * SPEC.block_bytes, SPEC.block_bytes // 4, device="cpu")
    pool = BlockPool([upper, cpu, DiskTier(tmp_path / "disk", 1 << 20)], [SPEC])
    data = kv(n, seed=9)
    hashes = [os.urandom(16) for _ in range(n)]
    for i, h in enumerate(hashes):
        assert pool.insert_chain(SPEC.model_id, [h], lambda _i, i=i: data[i]) == (1, 0)
    assert len(upper.views(pool.blocks[hashes[0]].handle, SPEC.block_bytes)) == 4
    assert all(o.ok for o in pool.move_blocks(hashes[:3], Tier.DISK))
    outcomes = pool.move_blocks(hashes, Tier.CPU)  # three from the disk, five from the upper slab
    assert all(o.ok for o in outcomes) and {pool.tier_of(h) for h in hashes} == {Tier.CPU}
    assert upper.used_bytes == 0
    for i, h in enumerate(hashes):
        assert torch.equal(decoded(pool, h), data[i]), f"block {i}"
    assert all(o.ok for o in pool.move_blocks(hashes[::-1], Tier.GPU))
    for i, h in enumerate(hashes):
        assert pool.tier_of(h) == Tier.GPU and torch.equal(decoded(pool, h), data[i]), f"block {i}"
    check_pool(pool)


def _slab_pair(
    n: int, seed: int = 23, disk_dir=None, scale: float = 1.0, scattered: bool = False
) -> tuple[BlockPool, MemoryTier, MemoryTier, list[bytes], torch.Tensor]:
    """n one-block chains in a host slab standing in for the GPU (`scattered`: each block
    in four one-page runs), over a CPU slab (and a disk tier in `disk_dir`)."""
    upper = MemoryTier(Tier.GPU, n * SPEC.block_bytes, SPEC.block_bytes // 4, device="cpu")
    if scattered:
        upper._free.reverse()  # descending pages
    cpu = MemoryTier(Tier.CPU, n * SPEC.block_bytes, SPEC.block_bytes // 4, device="cpu")
    disk = [DiskTier(disk_dir, 1 << 20)] if disk_dir is not None else []
    pool = BlockPool([upper, cpu, *disk], [SPEC])
    data = (kv(n, seed=seed).float() * scale).to(SPEC.torch_dtype)
    hashes = [os.urandom(16) for _ in range(n)]
    for i, h in enumerate(hashes):
        assert pool.insert_chain(SPEC.model_id, [h], lambda _i, i=i: data[i]) == (1, 0)
    return pool, upper, cpu, hashes, data


def _fail_copy(monkeypatch, nth: int) -> None:
    """From now on the nth tensor copy fails, as a broken GPU copy would."""
    calls, real = [0], torch.Tensor.copy_

    def failing(self, src, *args, **kwargs):
        calls[0] += 1
        if calls[0] == nth:
            raise RuntimeError("CUDA error: an illegal memory access (test)")
        return real(self, src, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "copy_", failing)


def _count_copies(monkeypatch) -> list[int]:
    """The bytes of every tensor copy from now on (the real copies, counted)."""
    copies, real = [], torch.Tensor.copy_

    def counted(self, src, *args, **kwargs):
        copies.append(src.numel())
        return real(self, src, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "copy_", counted)
    return copies


def test_blocks_back_to_back_in_both_slabs_move_in_one_copy(tmp_path, monkeypatch):
    """Each copy between memory slabs is a driver call on a GPU: blocks that sit back to
    back in the source and land back to back in the destination go in one."""
    n = 6
    pool, _, _, hashes, data = _slab_pair(n, seed=11)
    copies = _count_copies(monkeypatch)
    assert all(o.ok for o in pool.move_blocks(hashes, Tier.CPU))
    monkeypatch.undo()
    assert copies == [n * SPEC.block_bytes]
    for i, h in enumerate(hashes):
        assert pool.tier_of(h) == Tier.CPU and torch.equal(decoded(pool, h), data[i])


@pytest.mark.parametrize("codec", ["int8", "int4", "fp8"])
def test_demotion_from_an_off_host_slab_encodes_in_batches(tmp_path, monkeypatch, codec):
    """The GPU demotion's batching, on the host: a second host slab stands in for the GPU
    (its raw blocks encoded many at a time, by the batched codec path). Every block gets
    the payload encode() writes for it alone, over several batches and scattered pages,
    and a batch that fails (out of GPU memory, say) is encoded block by block."""
    import agent.core.block_moves as block_moves
    from agent.core import codecs

    if codec not in codecs.available_codecs():
        pytest.skip(f"{codec} unavailable in this torch build")
    monkeypatch.setattr(block_moves, "_off_host", lambda store: store.tier is Tier.GPU)
    monkeypatch.setattr(block_moves, "GPU_ENCODE_BATCH_BYTES", 3 * SPEC.block_bytes)
    calls = []

    def batched(name, blocks, on_host=True):  # the GPU's path on the host; the second batch fails
        calls.append(blocks.shape[0])
        if len(calls) == 2:
            raise RuntimeError("CUDA out of memory (test)")
        return list(codecs.BATCHED[name](blocks))

    monkeypatch.setattr(codecs, "encode_batch", batched)
    pool, upper, cpu, hashes, data = _slab_pair(10, seed=13, disk_dir=tmp_path / "disk", scale=4, scattered=True)
    outcomes = pool.move_blocks(hashes, Tier.CPU, codec)
    assert all(o.ok for o in outcomes), outcomes
    assert calls == [3, 3, 3, 1]  # the failed batch's three went one by one
    assert pool.gpu_codec_blocks_total == {("encode", "batch"): 7, ("encode", "one_by_one"): 3}
    for i, h in enumerate(hashes):
        meta = pool.blocks[h]
        assert meta.tier is Tier.CPU and meta.codec == codec
        assert torch.equal(cpu.read(meta.handle, meta.stored_bytes), codecs.encode(codec, data[i])), f"block {i}"
    assert upper.used_bytes == 0
    check_pool(pool)
    # a batch's payloads go into the slab unhashed (checksum 0: not known); the disk
    # hashes them on the way down and verifies them on the way back
    assert pool.blocks[hashes[0]].checksum == 0
    assert all(o.ok for o in pool.move_blocks(hashes, Tier.DISK))
    assert all(pool.blocks[h].checksum != 0 for h in hashes)
    assert all(o.ok for o in pool.move_blocks(hashes, Tier.CPU))
    for i, h in enumerate(hashes):
        assert torch.equal(
            decoded(pool, h), codecs.decode(codec, codecs.encode(codec, data[i]), SPEC.block_shape, SPEC.torch_dtype)
        )
    check_pool(pool)


@pytest.mark.parametrize("codec", ["int8", "int4", "fp8"])
def test_promotion_into_an_off_host_slab_decodes_in_batches(tmp_path, monkeypatch, codec):
    """The GPU promotion's batching, on the host: a second host slab stands in for the
    GPU. Compressed blocks from the CPU slab and from the disk cross as payloads and are
    decoded many at a time (codecs.decode_batch) into raw blocks: each the block decode()
    gives it alone, over several batches and scattered pages; a corrupt disk block in a
    batch is removed alone; a batch that fails (out of GPU memory, say) goes block by block."""
    import agent.core.block_moves as block_moves
    from agent.core import codecs

    if codec not in codecs.available_codecs():
        pytest.skip(f"{codec} unavailable in this torch build")
    monkeypatch.setattr(block_moves, "_off_host", lambda store: store.tier is Tier.GPU)
    monkeypatch.setattr(block_moves, "GPU_ENCODE_BATCH_BYTES", 3 * SPEC.block_bytes)
    n = 10
    pool, upper, cpu, hashes, data = _slab_pair(n, seed=17, disk_dir=tmp_path / "disk", scale=4)
    assert all(o.ok for o in pool.move_blocks(hashes, Tier.CPU, codec))
    on_disk = [1, 2, 5, 8]  # mixed sources within a batch
    assert all(o.ok for o in pool.move_blocks([hashes[i] for i in on_disk], Tier.DISK))
    at = block_on_disk(pool, hashes[5])
    flip_byte(at.path, at.last_payload_byte)
    upper._free.reverse()  # descending pages: every promoted block is four one-page runs
    calls = []
    real = codecs.decode_batch

    def flaky(name, payloads, shape, dtype):  # the second batch fails as an out-of-memory would
        calls.append(payloads.shape[0])
        if len(calls) == 2:
            raise RuntimeError("CUDA out of memory (test)")
        return real(name, payloads, shape, dtype)

    monkeypatch.setattr(codecs, "decode_batch", flaky)
    pool.drain_notices()
    outcomes = pool.move_blocks(hashes, Tier.GPU, "none")
    assert [o.ok for o in outcomes] == [i != 5 for i in range(n)], outcomes
    assert "unreadable" in outcomes[5].reason
    assert calls == [3, 3, 3, 1]  # the failed batch's three went one by one
    decoded_on_gpu = {key: n for key, n in pool.gpu_codec_blocks_total.items() if key[0] == "decode"}
    assert decoded_on_gpu == {("decode", "batch"): 7, ("decode", "one_by_one"): 3}  # the corrupt one not counted
    assert hashes[5] not in pool.blocks and [x.kind for x in pool.drain_notices()] == ["corrupt_block"]
    for i, h in enumerate(hashes):
        if i == 5:
            continue
        meta = pool.blocks[h]
        assert meta.tier is Tier.GPU and meta.codec == "none" and meta.stored_bytes == SPEC.block_bytes
        want = codecs.decode(codec, codecs.encode(codec, data[i]), SPEC.block_shape, SPEC.torch_dtype)
        assert torch.equal(decoded(pool, h), want), f"block {i}"
    assert cpu.used_bytes == 0
    check_pool(pool)


def test_blocks_moved_back_and_forth_stay_one_copy_each_way(tmp_path, monkeypatch):
    """A batch moved between two memory slabs and back, again and again: the sources
    are freed highest pages first, so the next batch into a slab gets its pages in
    ascending order and every move is one copy (it was one copy one way and a copy a
    block the other: a DMA per 1 MiB block runs far below a bulk copy on a GPU)."""
    n = 8
    pool, _, _, hashes, data = _slab_pair(n, seed=21)
    copies = _count_copies(monkeypatch)
    for _ in range(3):
        assert all(o.ok for o in pool.move_blocks(hashes, Tier.CPU))
        assert all(o.ok for o in pool.move_blocks(hashes, Tier.GPU))
    monkeypatch.undo()
    assert copies == [n * SPEC.block_bytes] * 6
    for i, h in enumerate(hashes):
        assert torch.equal(decoded(pool, h), data[i])
    check_pool(pool)


def test_a_batch_between_memory_slabs_is_switched_chunk_by_chunk(monkeypatch):
    """A batch between memory slabs is allocated, copied and switched in chunks (on a GPU
    a chunk is allocated and queued while the one before is copied, and switched while
    the next ones are), each chunk's blocks highest source pages first: every block keeps
    its bytes, each chunk is one copy, and the free lists hand the next batch each
    chunk's pages in order (one copy a chunk on the way back too)."""
    import agent.core.block_moves as block_moves

    monkeypatch.setattr(block_moves, "COPY_CHUNK_BYTES", 2 * SPEC.block_bytes)
    pool, upper, cpu, hashes, data = _slab_pair(8)
    switched, real_finish = [], BlockPool._finish_move

    def finish(self, meta, *args, **kwargs):
        switched.append(hashes.index(meta.block_hash))
        return real_finish(self, meta, *args, **kwargs)

    monkeypatch.setattr(BlockPool, "_finish_move", finish)
    copies = _count_copies(monkeypatch)
    for _ in range(2):
        for tier in (Tier.CPU, Tier.GPU):
            copies.clear()
            switched.clear()
            assert all(o.ok for o in pool.move_blocks(hashes, tier))
            assert copies == [2 * SPEC.block_bytes] * 4, tier
            assert switched == [1, 0, 3, 2, 5, 4, 7, 6]  # by chunk, highest source pages first
    monkeypatch.undo()
    for i, h in enumerate(hashes):
        assert pool.tier_of(h) == Tier.GPU and torch.equal(decoded(pool, h), data[i])
    check_pool(pool)


def test_a_copy_that_fails_mid_batch_leaves_the_unswitched_blocks_in_place(monkeypatch):
    """The third chunk's copy fails: the two chunks switched before it stay moved, every
    other block stays where it was with its bytes, no page is lost or held twice, and the
    move can be run again."""
    import agent.core.block_moves as block_moves

    monkeypatch.setattr(block_moves, "COPY_CHUNK_BYTES", 2 * SPEC.block_bytes)
    pool, upper, cpu, hashes, data = _slab_pair(8)
    _fail_copy(monkeypatch, 3)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        pool.move_blocks(hashes, Tier.CPU)
    monkeypatch.undo()
    check_pool(pool)  # no page lost or held twice, nothing left moving
    assert [pool.tier_of(h) for h in hashes] == [Tier.CPU] * 4 + [Tier.GPU] * 4
    for i, h in enumerate(hashes):
        assert torch.equal(decoded(pool, h), data[i])
    assert all(o.ok for o in pool.move_blocks(hashes, Tier.CPU))
    for i, h in enumerate(hashes):
        assert pool.tier_of(h) == Tier.CPU and torch.equal(decoded(pool, h), data[i])
    check_pool(pool)


def test_chunks_grow_from_a_small_first_one_and_shrink_towards_the_end(monkeypatch):
    """The first chunk is small (the copies start early), each next one twice the one
    before up to the largest, and none over half of what is left (the last switch, which
    no copy hides, is small): chunk sizes 1, 2, 4, 4, 3, 1, 1 blocks of 16, one copy
    each, every block moved with its bytes."""
    import agent.core.block_moves as block_moves

    monkeypatch.setattr(block_moves, "COPY_FIRST_CHUNK_BYTES", SPEC.block_bytes)
    monkeypatch.setattr(block_moves, "COPY_CHUNK_BYTES", 4 * SPEC.block_bytes)
    pool, upper, cpu, hashes, data = _slab_pair(16)
    copies = _count_copies(monkeypatch)
    assert all(o.ok for o in pool.move_blocks(hashes, Tier.CPU))
    monkeypatch.undo()
    assert [c // SPEC.block_bytes for c in copies] == [1, 2, 4, 4, 3, 1, 1]
    for i, h in enumerate(hashes):
        assert pool.tier_of(h) == Tier.CPU and torch.equal(decoded(pool, h), data[i])
    check_pool(pool)


def test_a_block_read_during_a_failed_chunked_move_is_left_movable(monkeypatch):
    """A reader holds block 0 when its chunk is copied (its switch waits), then a later
    chunk's copy fails: block 0 stays where it was, movable, and its new space goes
    back (it was left moving, its pages held)."""
    import agent.core.block_moves as block_moves

    monkeypatch.setattr(block_moves, "COPY_CHUNK_BYTES", 2 * SPEC.block_bytes)
    pool, upper, cpu, hashes, data = _slab_pair(8)
    held = pool.acquire_chain(hashes[:1])
    _fail_copy(monkeypatch, 3)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        pool.move_blocks(hashes, Tier.CPU)
    monkeypatch.undo()
    pool.release_chain(held)
    check_pool(pool)
    assert [pool.tier_of(h) for h in hashes] == [Tier.GPU] + [Tier.CPU] * 3 + [Tier.GPU] * 4
    for i, h in enumerate(hashes):
        assert torch.equal(decoded(pool, h), data[i])
    assert all(o.ok for o in pool.move_blocks(hashes, Tier.CPU))


def test_a_failed_disk_read_leaves_the_rest_of_its_batch_movable(tmp_path, monkeypatch):
    """A batch into the CPU slab from a memory slab and from the disk: the memory slab's
    blocks move first, then the disk read fails as a whole (an I/O thread died): the disk
    blocks stay where they were, none is left moving, no page is lost, and the move runs
    again."""
    pool, upper, cpu, hashes, data = _slab_pair(6, disk_dir=tmp_path / "disk")
    assert all(o.ok for o in pool.move_blocks(hashes[:3], Tier.DISK))
    disk = disk_of(pool)

    def boom(items):
        raise RuntimeError("an I/O thread died (test)")

    monkeypatch.setattr(disk, "read_many", boom)
    with pytest.raises(RuntimeError, match="I/O thread died"):
        pool.move_blocks(hashes, Tier.CPU)
    monkeypatch.undo()
    check_pool(pool)
    assert [pool.tier_of(h) for h in hashes] == [Tier.DISK] * 3 + [Tier.CPU] * 3
    assert all(o.ok for o in pool.move_blocks(hashes, Tier.CPU))
    for i, h in enumerate(hashes):
        assert pool.tier_of(h) == Tier.CPU and torch.equal(decoded(pool, h), data[i])


def _cold_under_hot(cpu_blocks: int, seed: int) -> tuple[BlockPool, list[bytes], list[bytes], torch.Tensor]:
    """A host slab standing in for the GPU, full of four blocks (hot), over a CPU slab of
    `cpu_blocks` holding the four stored before them (cold)."""
    upper = MemoryTier(Tier.GPU, 4 * SPEC.block_bytes, SPEC.block_bytes // 4, device="cpu")
    cpu = MemoryTier(Tier.CPU, cpu_blocks * SPEC.block_bytes, SPEC.block_bytes // 4, device="cpu")
    pool = BlockPool([upper, cpu], [SPEC])
    data = kv(8, seed=seed)
    hashes = [os.urandom(16) for _ in range(8)]
    for i, h in enumerate(hashes):  # the first four spill to the CPU slab
        assert pool.insert_chain(SPEC.model_id, [h], lambda _i, i=i: data[i]) == (1, 0)
    assert [pool.tier_of(h) for h in hashes] == [Tier.CPU] * 4 + [Tier.GPU] * 4
    return pool, hashes[:4], hashes[4:], data


def test_a_move_into_a_full_tier_keeps_every_block_it_moved(monkeypatch):
    """Four cold blocks moved into a slab full of four others, a small chunk at a time:
    the room made for the later ones demotes the others, never a block of the batch
    already moved (a block switched early is the least recently used in its new tier)."""
    import agent.core.block_moves as block_moves

    monkeypatch.setattr(block_moves, "COPY_CHUNK_BYTES", SPEC.block_bytes)
    monkeypatch.setattr(block_moves, "COPY_FIRST_CHUNK_BYTES", SPEC.block_bytes)
    pool, cold, hot, data = _cold_under_hot(cpu_blocks=8, seed=3)
    hashes = cold + hot
    outcomes = pool.move_blocks(cold, Tier.GPU)
    assert all(o.ok for o in outcomes), outcomes
    assert [pool.tier_of(h) for h in cold] == [Tier.GPU] * 4
    assert [pool.tier_of(h) for h in hot] == [Tier.CPU] * 4
    for i, h in enumerate(hashes):
        assert torch.equal(decoded(pool, h), data[i])
    check_pool(pool)


def test_an_unexpected_error_in_a_gpu_batch_leaves_its_blocks_movable(tmp_path, monkeypatch):
    """A GPU decode batch that fails with an error no fallback is for (not out of memory,
    not a codec error): the move raises, and every block of the batch stays where it was,
    movable (the batch's blocks were off the queue, out of the move's cleanup)."""
    import agent.core.block_moves as block_moves
    from agent.core import codecs

    monkeypatch.setattr(block_moves, "_off_host", lambda store: store.tier is Tier.GPU)
    pool, upper, cpu, hashes, data = _slab_pair(4, disk_dir=tmp_path / "disk")
    assert all(o.ok for o in pool.move_blocks(hashes, Tier.CPU, "int8"))

    def broken(*args):
        raise ValueError("a bug (test)")

    monkeypatch.setattr(codecs, "decode_batch", broken)
    with pytest.raises(ValueError, match="a bug"):
        pool.move_blocks(hashes, Tier.GPU, "none")
    monkeypatch.undo()
    check_pool(pool)
    assert [pool.tier_of(h) for h in hashes] == [Tier.CPU] * 4
    assert all(o.ok for o in pool.move_blocks(hashes, Tier.GPU, "none"))


def test_an_allocation_that_fails_mid_batch_leaves_the_rest_in_place(monkeypatch):
    """Chunks are allocated as the batch goes: an allocation that fails with an
    unexpected error in the third chunk leaves the two chunks switched before it moved
    and every later block where it was, none left moving, no page lost."""
    import agent.core.block_moves as block_moves

    monkeypatch.setattr(block_moves, "COPY_CHUNK_BYTES", 2 * SPEC.block_bytes)
    pool, upper, cpu, hashes, data = _slab_pair(8)
    calls, real = [0], BlockPool._allocate

    def failing(self, store, num_bytes, block_hash):
        calls[0] += 1
        if calls[0] == 5:
            raise RuntimeError("allocator bug (test)")
        return real(self, store, num_bytes, block_hash)

    monkeypatch.setattr(BlockPool, "_allocate", failing)
    with pytest.raises(RuntimeError, match="allocator bug"):
        pool.move_blocks(hashes, Tier.CPU)
    monkeypatch.undo()
    check_pool(pool)
    assert [pool.tier_of(h) for h in hashes] == [Tier.CPU] * 4 + [Tier.GPU] * 4
    for i, h in enumerate(hashes):
        assert torch.equal(decoded(pool, h), data[i])
    assert all(o.ok for o in pool.move_blocks(hashes, Tier.CPU))


def test_a_mixed_batch_into_a_full_tier_keeps_every_block_it_moved(tmp_path):
    """One batch into a full CPU slab from the disk (read into space allocated up front)
    and from the GPU slab (allocated chunk by chunk, making room as it goes): the room is
    made from the blocks that were there, never from the disk blocks this batch already
    moved (the least recently used there once switched)."""
    B = SPEC.block_bytes
    gpu = MemoryTier(Tier.GPU, 4 * B, B // 4, device="cpu")
    cpu = MemoryTier(Tier.CPU, 4 * B, B // 4, device="cpu")
    pool = BlockPool([gpu, cpu, DiskTier(tmp_path / "disk", 1 << 20)], [SPEC])
    data = kv(8, seed=1)
    hashes = [os.urandom(16) for _ in range(8)]
    for i, h in enumerate(hashes):  # 0-3 spill to the CPU slab, 4-7 stay in the GPU slab
        assert pool.insert_chain(SPEC.model_id, [h], lambda _i, i=i: data[i]) == (1, 0)
    assert all(o.ok for o in pool.move_blocks(hashes[:2], Tier.DISK))
    moved = [hashes[0], hashes[1], hashes[6], hashes[7]]
    assert all(o.ok for o in pool.move_blocks(moved, Tier.CPU))
    assert [pool.tier_of(h) for h in moved] == [Tier.CPU] * 4
    assert [pool.tier_of(h) for h in hashes[2:4]] == [Tier.DISK] * 2  # made room
    for i, h in enumerate(hashes):
        assert torch.equal(decoded(pool, h), data[i])
    check_pool(pool)


def _full_cpu_over_disk(tmp_path, disk_codec: str = "") -> tuple[BlockPool, list[bytes], list[bytes], torch.Tensor]:
    """A CPU slab full of four blocks (hot) over a disk tier holding four others (cold),
    in `disk_codec` if given (encoded as they spill)."""
    cpu = MemoryTier(Tier.CPU, 4 * SPEC.block_bytes, SPEC.block_bytes // 4, device="cpu")
    codecs_of = {Tier.DISK: disk_codec} if disk_codec else None
    pool = BlockPool([cpu, DiskTier(tmp_path / "disk", 1 << 20)], [SPEC], tier_codecs=codecs_of)
    data = kv(8, seed=9)
    hashes = [os.urandom(16) for _ in range(8)]
    for i, h in enumerate(hashes):  # the first four spill to the disk
        assert pool.insert_chain(SPEC.model_id, [h], lambda _i, i=i: data[i]) == (1, 0)
    cold, hot = hashes[:4], hashes[4:]
    assert [pool.tier_of(h) for h in cold] == [Tier.DISK] * 4
    return pool, cold, hot, data


def test_a_recoded_move_into_a_full_tier_keeps_every_block_it_moved(tmp_path):
    """Cold int8 blocks decoded into a full CPU slab (the codec pipeline): the room made
    for the later ones demotes the blocks that were there, never one this move already
    switched (the least recently used there), and every outcome says where it landed."""
    # int8 as they spill (a block this small recoded where it is on disk frees no granule:
    # a compress in place keeps it as it is)
    pool, cold, hot, data = _full_cpu_over_disk(tmp_path, disk_codec="int8")
    assert {pool.blocks[h].codec for h in cold} == {"int8"}
    outcomes = pool.move_blocks(cold, Tier.CPU, "none")
    assert all(o.ok for o in outcomes), outcomes
    assert [pool.tier_of(h) for h in cold] == [Tier.CPU] * 4
    assert [pool.tier_of(h) for h in hot] == [Tier.DISK] * 4
    for i, h in enumerate(cold):
        assert torch.equal(decoded(pool, h), roundtrip_int8(data[i]))
    for i, h in enumerate(hot, start=4):  # demoted to the disk in its codec
        assert torch.equal(decoded(pool, h), roundtrip_int8(data[i]))
    check_pool(pool)


def test_a_move_block_by_block_into_a_full_tier_keeps_every_block_it_moved(tmp_path, monkeypatch):
    """Moves the batch cannot do at once (as the disk into a GPU) go block by block
    (move_block): those too are held until the batch is placed."""
    import agent.core.block_moves as block_moves

    pool, cold, hot, data = _full_cpu_over_disk(tmp_path)
    monkeypatch.setattr(block_moves, "_batchable", lambda src, dst: False)
    outcomes = pool.move_blocks(cold, Tier.CPU)
    assert all(o.ok for o in outcomes), outcomes
    assert [pool.tier_of(h) for h in cold] == [Tier.CPU] * 4
    assert [pool.tier_of(h) for h in hot] == [Tier.DISK] * 4
    for i, h in enumerate(cold + hot):
        assert torch.equal(decoded(pool, h), data[i])
    check_pool(pool)


def test_a_move_larger_than_its_tier_fails_the_blocks_that_do_not_fit(tmp_path):
    """Six cold blocks into a four-block slab: four land, two fail for want of room (the
    batch never pushes out what it moved) and stay where they were, intact."""
    cpu = MemoryTier(Tier.CPU, 4 * SPEC.block_bytes, SPEC.block_bytes // 4, device="cpu")
    pool = BlockPool([cpu, DiskTier(tmp_path / "disk", 1 << 20)], [SPEC])
    data = kv(6, seed=4)
    hashes = [os.urandom(16) for _ in range(6)]
    for i, h in enumerate(hashes):
        assert pool.insert_chain(SPEC.model_id, [h], lambda _i, i=i: data[i]) == (1, 0)
    assert all(o.ok for o in pool.move_blocks(hashes, Tier.DISK))
    outcomes = pool.move_blocks(hashes, Tier.CPU)
    assert [o.ok for o in outcomes] == [True] * 4 + [False] * 2
    assert all("PoolFull" in o.reason for o in outcomes[4:])
    assert [pool.tier_of(h) for h in hashes] == [Tier.CPU] * 4 + [Tier.DISK] * 2
    for i, h in enumerate(hashes):
        assert torch.equal(decoded(pool, h), data[i])
    check_pool(pool)


class _SlowEvent:
    """A CUDA event whose copies never finish on their own (a slow DMA): only a
    synchronize waits for them. The host copies are done by then."""

    def record(self) -> None:
        pass

    def query(self) -> bool:
        return False

    def synchronize(self) -> None:
        pass


def test_a_swap_between_two_full_tiers_demotes_instead_of_dropping(monkeypatch):
    """Four cold CPU blocks promoted into a GPU slab full of four hot ones, with the CPU
    slab full of the cold ones and no disk, the copies slow (not done until waited for):
    the room for each chunk is made by demoting hot blocks into the pages the chunks
    before it freed, so only the first block's room (nothing freed yet) is made by a drop;
    before, every chunk in flight left the CPU full and each hot block it pushed out was
    dropped."""
    import agent.core.block_moves as block_moves

    monkeypatch.setattr(block_moves, "COPY_FIRST_CHUNK_BYTES", SPEC.block_bytes)
    monkeypatch.setattr(block_moves, "COPY_CHUNK_BYTES", 2 * SPEC.block_bytes)
    real_issue = block_moves._issue_copies
    monkeypatch.setattr(block_moves, "_issue_copies", lambda moves: real_issue(moves) or True)
    monkeypatch.setattr(torch.cuda, "Event", _SlowEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)  # the host copies are done
    pool, cold, hot, data = _cold_under_hot(cpu_blocks=4, seed=6)
    hashes = cold + hot
    outcomes = pool.move_blocks(cold, Tier.GPU)
    monkeypatch.undo()
    assert all(o.ok for o in outcomes), outcomes
    assert [pool.tier_of(h) for h in cold] == [Tier.GPU] * 4
    assert [pool.tier_of(h) for h in hot] == [None, Tier.CPU, Tier.CPU, Tier.CPU]
    for i, h in enumerate(hashes):
        if pool.tier_of(h) is not None:
            assert torch.equal(decoded(pool, h), data[i])
    check_pool(pool)


def _watch_disk_writes(pool: BlockPool, monkeypatch) -> tuple[list[int], list[bool]]:
    """From now on, each vectored disk write is counted (its buffers) and, while it runs,
    another thread (an engine's lookup) tries the pool lock: whether it got it."""
    writes, lock_free, real = [], [], os.pwritev

    def watched(fd, buffers, offset):
        writes.append(len(buffers))
        got = []

        def engine():
            if pool.lock.acquire(timeout=2):
                pool.lock.release()
                got.append(True)
            else:
                got.append(False)

        t = threading.Thread(target=engine)
        t.start()
        t.join()
        lock_free.append(got[0])
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "pwritev", watched)
    return writes, lock_free


@pytest.mark.parametrize("codec", [None, "none"])
def test_room_for_a_promotion_is_made_in_one_batch_outside_the_lock(tmp_path, monkeypatch, codec):
    """Cold blocks promoted into a full CPU slab (as they are, or decoded from int8 on the
    way): the hot blocks they push out go down to the disk as one batch, one vectored
    write, while the pool lock is free for the engine's lookups (before, each allocation
    demoted one block with its own write, under the lock)."""
    pool, cold, hot, data = _full_cpu_over_disk(tmp_path)
    if codec is not None:
        assert all(o.ok for o in pool.move_blocks(cold, Tier.DISK, "int8"))
    writes, lock_free = _watch_disk_writes(pool, monkeypatch)
    outcomes = pool.move_blocks(cold, Tier.CPU, codec)
    monkeypatch.undo()
    assert all(o.ok for o in outcomes), outcomes
    assert len(writes) == 1 and lock_free == [True]
    assert [pool.tier_of(h) for h in cold] == [Tier.CPU] * 4
    assert [pool.tier_of(h) for h in hot] == [Tier.DISK] * 4
    assert pool.demotions_total[Tier.CPU] >= 4
    for i, h in enumerate(hot, start=4):
        assert torch.equal(decoded(pool, h), data[i])
    check_pool(pool)


def test_room_in_bulk_never_demotes_below_a_pin_nor_the_batchs_own_blocks(tmp_path):
    """The bulk demotion takes the least recently used blocks that may go: a block pinned
    at the CPU stays, and the room comes from the others; what cannot be made is failed
    by name (PoolFull), each block left where it was."""
    pool, cold, hot, data = _full_cpu_over_disk(tmp_path)
    assert pool.set_pin(hot[:1], Tier.CPU) == 1
    outcomes = pool.move_blocks(cold, Tier.CPU)
    assert [o.ok for o in outcomes] == [True] * 3 + [False]
    assert "PoolFull" in outcomes[3].reason
    assert pool.tier_of(hot[0]) == Tier.CPU and pool.tier_of(cold[3]) == Tier.DISK
    assert [pool.tier_of(h) for h in hot[1:]] == [Tier.DISK] * 3
    for i, h in enumerate(cold + hot):
        assert torch.equal(decoded(pool, h), data[i])
    pool.set_pin(hot[:1], None)
    check_pool(pool)


def test_a_corrupt_parent_found_while_a_batch_holds_its_child_is_removed_after(tmp_path):
    """A reader finds parent P corrupt while a batch holds its child C (switched, the
    batch waiting on another block's reader): P's removal is refused then (C is moving),
    and made once the batch lets C go: no corrupt block stays, nothing dangles."""
    cpu = MemoryTier(Tier.CPU, 8 * SPEC.block_bytes, SPEC.block_bytes // 4, device="cpu")
    pool = BlockPool([cpu, DiskTier(tmp_path / "disk", 1 << 20)], [SPEC])
    data = kv(3, seed=2)
    chain, other = [os.urandom(16), os.urandom(16)], os.urandom(16)
    assert pool.insert_chain(SPEC.model_id, chain, lambda i: data[i]) == (2, 0)
    assert pool.insert_chain(SPEC.model_id, [other], lambda _i: data[2]) == (1, 0)
    assert all(o.ok for o in pool.move_blocks([*chain, other], Tier.DISK))
    at = block_on_disk(pool, chain[0])
    flip_byte(at.path, at.last_payload_byte)
    reader = pool.acquire_chain([other])  # the batch waits for this reader to switch `other`
    seen = []

    def later():
        time.sleep(0.2)  # C is switched and held by now
        got, _ = pool.read_chain(chain)
        seen.append((len(got), chain[0] in pool.blocks))
        pool.release_chain(reader)

    t = threading.Thread(target=later)
    t.start()
    outcomes = pool.move_blocks([chain[1], other], Tier.CPU)
    t.join()
    assert seen == [(0, True)]  # read as a miss; its removal had to wait
    assert all(o.ok for o in outcomes)
    assert chain[0] not in pool.blocks and chain[1] not in pool.blocks  # P with its subtree
    assert pool.tier_of(other) == Tier.CPU and torch.equal(decoded(pool, other), data[2])
    check_pool(pool)


def test_a_copy_that_fails_while_making_room_leaks_no_page(monkeypatch):
    """A swap between two full slabs (copies slow, so the chunks in flight are switched
    before more room is made): a copy failing in any step (the batch's or a demotion's)
    raises, leaves every block where it was or where it went, and no page lost."""
    import agent.core.block_moves as block_moves

    for nth in range(1, 9):
        monkeypatch.setattr(block_moves, "COPY_FIRST_CHUNK_BYTES", SPEC.block_bytes)
        monkeypatch.setattr(block_moves, "COPY_CHUNK_BYTES", 2 * SPEC.block_bytes)
        real_issue = block_moves._issue_copies
        monkeypatch.setattr(block_moves, "_issue_copies", lambda moves, real=real_issue: real(moves) or True)
        monkeypatch.setattr(torch.cuda, "Event", _SlowEvent)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
        monkeypatch.setattr(block_moves, "gpu_quiet", lambda stores, data=(): True)
        pool, cold, hot, data = _cold_under_hot(cpu_blocks=4, seed=6)
        _fail_copy(monkeypatch, nth)
        try:
            pool.move_blocks(cold, Tier.GPU)
        except RuntimeError as exc:
            assert "illegal memory access" in str(exc)
        monkeypatch.undo()
        check_pool(pool)
        for i, h in enumerate(cold + hot):
            if pool.tier_of(h) is not None:
                assert torch.equal(decoded(pool, h), data[i]), (nth, i)


def test_blocks_already_where_asked_are_not_pushed_out_by_the_batch(tmp_path):
    """A batch asks for blocks in a full CPU slab, two already there: the room for the
    others comes from blocks it did not name, never from those two (before, the first
    allocations demoted them, and the batch then brought them back up)."""
    pool, cold, hot, data = _full_cpu_over_disk(tmp_path)
    asked = cold[:2] + hot[:2]  # hot[:2] are the least recently used in the CPU slab
    outcomes = pool.move_blocks(asked, Tier.CPU)
    assert all(o.ok for o in outcomes), outcomes
    assert [o.moved_bytes for o in outcomes[2:]] == [0, 0]  # not sent down and back up
    assert pool.demotions_total[Tier.CPU] - 4 == 2  # (four when the slab first filled)
    assert [pool.tier_of(h) for h in asked] == [Tier.CPU] * 4
    assert [pool.tier_of(h) for h in hot[2:]] == [Tier.DISK] * 2
    for i, h in enumerate(cold + hot):
        assert torch.equal(decoded(pool, h), data[i])
    check_pool(pool)


def test_a_swap_makes_no_more_room_below_than_its_own_sources_free():
    """Cold CPU blocks promoted into a GPU full of hot ones, the CPU full of the cold
    ones and four older blocks (no disk): the hot blocks go down into the pages the cold
    ones free as they switch, so one older block goes (the first block's room), not four
    (room made at once below, not counting the sources' pages, dropped them all)."""
    upper = MemoryTier(Tier.GPU, 4 * SPEC.block_bytes, SPEC.block_bytes // 4, device="cpu")
    cpu = MemoryTier(Tier.CPU, 8 * SPEC.block_bytes, SPEC.block_bytes // 4, device="cpu")
    pool = BlockPool([upper, cpu], [SPEC])
    data = kv(12, seed=1)
    hashes = [os.urandom(16) for _ in range(12)]
    for i, h in enumerate(hashes):
        assert pool.insert_chain(SPEC.model_id, [h], lambda _i, i=i: data[i]) == (1, 0)
    older, cold, hot = hashes[:4], hashes[4:8], hashes[8:]
    assert all(o.ok for o in pool.move_blocks(cold, Tier.GPU))
    assert pool.evictions_total[Tier.CPU] == 1 and pool.move_failures_total == 0
    assert [pool.tier_of(h) for h in cold] == [Tier.GPU] * 4
    assert [pool.tier_of(h) for h in hot] == [Tier.CPU] * 4
    assert [pool.tier_of(h) for h in older] == [None] + [Tier.CPU] * 3
    for i, h in enumerate(hashes[1:], start=1):
        assert torch.equal(decoded(pool, h), data[i])
    check_pool(pool)


def test_room_making_leaves_alone_a_victim_moved_or_read_since_it_was_chosen(tmp_path, monkeypatch):
    """The blocks chosen to make room are moved down after the pool lock is let go: one
    promoted to the GPU meanwhile stays there (not sent from the GPU to the disk), and one
    a reader holds meanwhile is not waited for (the room comes from elsewhere or the
    block fails by name)."""
    upper = MemoryTier(Tier.GPU, 4 * SPEC.block_bytes, SPEC.block_bytes // 4, device="cpu")
    cpu = MemoryTier(Tier.CPU, 4 * SPEC.block_bytes, SPEC.block_bytes // 4, device="cpu")
    pool = BlockPool([upper, cpu, DiskTier(tmp_path / "disk", 1 << 20)], [SPEC])
    data = kv(8, seed=2)
    hashes = [os.urandom(16) for _ in range(8)]
    for i, h in enumerate(hashes):
        assert pool.insert_chain(SPEC.model_id, [h], lambda _i, i=i: data[i]) == (1, 0)
    cold, hot = hashes[:4], hashes[4:]
    assert all(o.ok for o in pool.move_blocks(cold, Tier.DISK))
    assert all(o.ok for o in pool.move_blocks(hot, Tier.CPU))
    real, seen, letting_go = BlockPool.move_blocks, [], []

    def racing(self, block_hashes, to_tier, codec=None, **kwargs):
        if kwargs.get("from_tier") is Tier.CPU and not seen:  # the room-making batch
            seen.append(self.move_block(block_hashes[0], Tier.GPU).ok)
            reader = self.acquire_chain(block_hashes[1:2])
            letting_go.append(threading.Timer(3.0, self.release_chain, [reader]))
            letting_go[0].start()
        return real(self, block_hashes, to_tier, codec, **kwargs)

    monkeypatch.setattr(BlockPool, "move_blocks", racing)
    t0 = time.monotonic()
    outcomes = pool.move_blocks(cold, Tier.CPU)
    took = time.monotonic() - t0
    monkeypatch.undo()
    assert seen == [True] and took < 2.0
    assert pool.tier_of(hot[0]) == Tier.GPU and pool.moved_bytes_total.get((Tier.GPU, Tier.DISK), 0) == 0
    assert pool.tier_of(hot[1]) == Tier.CPU  # read while chosen: left where it was
    assert [o.ok for o in outcomes].count(True) >= 3
    assert all("PoolFull" in o.reason for o in outcomes if not o.ok)
    letting_go[0].join(10)  # the reader lets go (3 s after it took the block)
    assert not letting_go[0].is_alive()
    for i, h in enumerate(hashes):
        assert torch.equal(decoded(pool, h), data[i])
    check_pool(pool)


@pytest.mark.parametrize("gpu", [False, True])
def test_a_compress_in_place_of_full_tiers_loses_nothing_and_moves_one_block_at_most(tmp_path, gpu):
    """Every block of a full CPU slab over a disk (and of a full GPU stand-in above it,
    both full of nothing but the batch) compressed in place: the last block of a tier
    steps down to make room for the first, the others each fit in what the ones before
    gave back, and it comes back compressed at the end: all compressed where they were,
    none lost (before: blocks of the batch sent down and back, or dropped)."""
    n = 6
    upper = [MemoryTier(Tier.GPU, n * SPEC.block_bytes, SPEC.block_bytes // 4, device="cpu")] if gpu else []
    cpu = MemoryTier(Tier.CPU, n * SPEC.block_bytes, SPEC.block_bytes // 4, device="cpu")
    pool = BlockPool([*upper, cpu, DiskTier(tmp_path / "disk", 1 << 20)], [SPEC])
    total = 2 * n if gpu else n
    data = kv(total, seed=1)
    hashes = [os.urandom(16) for _ in range(total)]
    for i, h in enumerate(hashes):
        assert pool.insert_chain(SPEC.model_id, [h], lambda _i, i=i: data[i]) == (1, 0)
    where = [pool.tier_of(h) for h in hashes]
    assert Tier.DISK not in where
    down_before = pool.moved_bytes_total.get((Tier.CPU, Tier.DISK), 0)
    outcomes = pool.move_blocks(hashes, None, "int8")
    assert all(o.ok for o in outcomes), outcomes
    assert [pool.tier_of(h) for h in hashes] == where
    assert all(pool.blocks[h].codec == "int8" for h in hashes)
    assert sum(pool.evictions_total.values()) == 0
    assert pool.moved_bytes_total.get((Tier.CPU, Tier.DISK), 0) - down_before <= SPEC.block_bytes
    for i, h in enumerate(hashes):
        assert torch.equal(decoded(pool, h), roundtrip_int8(data[i]))
    check_pool(pool)


@pytest.mark.parametrize("cpu_room", [True, False])
def test_a_compress_in_place_of_a_full_disk_drops_nothing(tmp_path, cpu_room):
    """The disk (no tier below) full of nothing but the batch: its last block was dropped
    to make room for the first though the CPU tier above had room (a review). It waits
    there instead and comes back compressed; with no room anywhere one block still goes
    (said: "dropped to make room for the others"), as in a single-tier pool."""
    from agent.core.model_spec import ModelSpec

    n = 4
    big = ModelSpec("big", block_size=4, num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16")  # int8 saves pages
    footprint = DiskTier(tmp_path / "probe", 1 << 20).allocate(big.block_bytes).footprint_bytes
    cpu = MemoryTier(Tier.CPU, n * big.block_bytes, big.block_bytes // 16, device="cpu")
    pool = BlockPool([cpu, DiskTier(tmp_path / "disk", n * footprint)], [big])
    data = torch.randn((2 * n, *big.block_shape), generator=torch.Generator().manual_seed(3)).half()
    hashes = [os.urandom(16) for _ in range(2 * n)]
    for i, h in enumerate(hashes):  # the first n are pushed down to the disk by the last n
        assert pool.insert_chain(big.model_id, [h], lambda _i, i=i: data[i]) == (1, 0)
    on_disk, in_cpu = hashes[:n], hashes[n:]
    assert [pool.tier_of(h) for h in hashes] == [Tier.DISK] * n + [Tier.CPU] * n
    if cpu_room:
        assert pool.drop(in_cpu[0])
    outcomes = pool.move_blocks(on_disk, None, "int8")
    kept = [h for h in on_disk if h in pool.blocks]
    assert all(pool.tier_of(h) == Tier.DISK and pool.blocks[h].codec == "int8" for h in kept)
    if cpu_room:
        assert kept == on_disk and all(o.ok for o in outcomes), outcomes  # nothing dropped
        assert sum(pool.evictions_total.values()) == 0
    else:
        assert len(kept) == n - 1 and sum(pool.evictions_total.values()) == 1
        assert [o.reason for o in outcomes if not o.ok] == ["dropped to make room for the others"]
    check_pool(pool)


def test_a_reservation_in_a_full_tier_makes_its_room_in_one_batch_outside_the_lock(tmp_path, monkeypatch):
    """A handoff's reservation on a decode agent whose CPU slab is full: the blocks it
    pushes out go to the disk in one vectored write while the pool lock stays free for the
    engine (before: one write per reserved block, all under the lock)."""
    pool, cold, hot, data = _full_cpu_over_disk(tmp_path)
    writes, lock_free = _watch_disk_writes(pool, monkeypatch)
    incoming = [os.urandom(16) for _ in range(3)]
    num_present, present, handles = pool.reserve_chain(SPEC.model_id, incoming, [SPEC.block_bytes] * 3, Tier.CPU)
    monkeypatch.undo()
    assert (num_present, present, len(handles)) == (0, [], 3)
    assert len(writes) == 1 and lock_free == [True]
    assert [pool.tier_of(h) for h in hot] == [Tier.DISK] * 3 + [Tier.CPU]
    pool.release_reserved(handles, Tier.CPU)
    for i, h in enumerate(cold + hot):
        assert torch.equal(decoded(pool, h), data[i])
    check_pool(pool)


def test_an_engine_store_into_a_full_tier_makes_its_room_in_one_batch_outside_the_lock(tmp_path, monkeypatch):
    """An engine stores a three-block chain into a full CPU slab: the blocks it pushes out
    go to the disk in one vectored write while the pool lock stays free (before: one write
    per stored block, each under the lock); what it pushes out keeps its bytes."""
    pool, cold, hot, data = _full_cpu_over_disk(tmp_path)
    writes, lock_free = _watch_disk_writes(pool, monkeypatch)
    chain, new = [os.urandom(16) for _ in range(3)], kv(3, seed=11)
    assert pool.insert_chain(SPEC.model_id, chain, lambda i: new[i]) == (3, 0)
    monkeypatch.undo()
    assert len(writes) == 1 and lock_free == [True]
    assert [pool.tier_of(h) for h in chain] == [Tier.CPU] * 3
    assert [pool.tier_of(h) for h in hot] == [Tier.DISK] * 3 + [Tier.CPU]
    for i, h in enumerate(cold + hot):
        assert torch.equal(decoded(pool, h), data[i])
    for i, h in enumerate(chain):
        assert torch.equal(decoded(pool, h), new[i])
    check_pool(pool)


def test_a_store_that_stores_nothing_pushes_nothing_out(tmp_path):
    """A store into a full tier whose first new block is not available after all (the
    engine's `block(i)` gives None): no room is made for it, every block stays put."""
    pool, cold, hot, data = _full_cpu_over_disk(tmp_path)
    demoted = dict(pool.demotions_total)
    assert pool.insert_chain(SPEC.model_id, [os.urandom(16) for _ in range(3)], lambda i: None) == (0, 0)
    assert pool.demotions_total == demoted
    assert [pool.tier_of(h) for h in cold + hot] == [Tier.DISK] * 4 + [Tier.CPU] * 4
    check_pool(pool)


@pytest.mark.parametrize("page", [SPEC.block_bytes, 64])
def test_a_compress_that_would_grow_blocks_keeps_them_and_drops_nothing(page):
    """A compress in place never makes a block bigger: zstd of blocks already in int8
    (decoded first: raw fp16 zstd'ed, ~1.6x their int8 bytes here) would grow them; in a
    full CPU tier with no tier below, that found no room and dropped a block of the batch
    "to make room for the others", for nothing (every block then failed PoolFull). Such
    blocks stay as they are, and nothing is dropped."""
    n = 8
    cpu = MemoryTier(Tier.CPU, n * SPEC.block_bytes, page, device="cpu")
    pool = BlockPool([cpu], [SPEC], tier_codecs={Tier.CPU: "int8"})
    data = kv(n, seed=3)
    hashes = [os.urandom(16) for _ in range(n)]
    for i, h in enumerate(hashes):
        assert pool.insert_chain(SPEC.model_id, [h], lambda _i, i=i: data[i]) == (1, 0)
    before = pool.usage()[0]
    outcomes = pool.move_blocks(hashes, None, "zstd")
    assert all(o.ok for o in outcomes), outcomes
    assert all(h in pool.blocks and pool.blocks[h].codec == "int8" for h in hashes)
    assert sum(pool.evictions_total.values()) == 0
    assert pool.usage()[0] == before
    for i, h in enumerate(hashes):
        assert torch.equal(decoded(pool, h), roundtrip_int8(data[i]))
    check_pool(pool)
    # as an operation: it succeeds, and says the blocks stayed in their codec
    mover = Mover(pool)
    op = mover.run_op(mover.submit(hashes, None, codec="zstd", kind="compress"))
    assert op.state == "SUCCEEDED" and op.num_done_blocks == n
    assert op.error == f"{n} block(s) kept in their codec: zstd would free none of their room"


def test_compress_to_zstd_keeps_raw_blocks_zstd_cannot_shrink(tmp_path):
    """zstd of incompressible KV (here random fp16 bytes of a 512 B block: 522 B) is
    bigger than the raw block: a compress in place leaves it raw instead of storing more
    bytes than the block's uncompressed size (and, on the disk, an extra granule)."""
    pool, hashes, data = independent_blocks(tmp_path, 4)
    assert all(o.ok for o in pool.move_blocks(hashes[:2], Tier.DISK))
    assert len(codecs.encode("zstd", data[0])) > SPEC.block_bytes  # incompressible
    outcomes = pool.move_blocks(hashes, None, "zstd")
    assert all(o.ok for o in outcomes), outcomes
    for u in pool.usage():
        assert u.stored_bytes <= u.uncompressed_bytes
    assert {pool.blocks[h].codec for h in hashes} == {"none"}
    for i, h in enumerate(hashes):
        assert torch.equal(decoded(pool, h), data[i])
    check_pool(pool)
