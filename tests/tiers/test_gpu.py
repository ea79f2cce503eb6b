"""GPU tier (CUDA only; marked `gpu`, skipped here): a CUDA page slab above the CPU tier,
moves both ways keep the bytes, a full GPU tier demotes to the CPU tier, a load from the
GPU tier returns exactly what was stored; lossy codecs quantize GPU blocks on the GPU into
the very payload the host writes; a real agent with a GPU tier is indexed as `gpu` and
moved by a control-plane command."""

from __future__ import annotations

import pytest
import torch

from agent.core import codecs
from agent.core.block_pool import BlockPool
from agent.core.engine_api import KVEngineAPI
from agent.core.model_spec import ModelSpec
from agent.store.memory_tier import MemoryTier
from protos.block_hash import hash_prefix, split_hashes
from protos.tier import Tier

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SPEC = ModelSpec("gpu-model", block_size=16, num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16")


def test_gpu_tier_moves_and_demotes():
    gpu = MemoryTier(Tier.GPU, 4 * SPEC.block_bytes, SPEC.block_bytes // 4)
    cpu = MemoryTier(Tier.CPU, 16 * SPEC.block_bytes, SPEC.block_bytes // 4)
    assert gpu.slab.is_cuda and not cpu.slab.is_cuda
    pool = BlockPool([gpu, cpu], [SPEC])
    engine = KVEngineAPI(pool, [SPEC])
    tokens = list(range(8 * SPEC.block_size))
    kv = torch.randn((8, *SPEC.block_shape)).to(torch.float16)
    assert engine.store(SPEC.model_id, tokens, kv).num_stored_blocks == 8  # spills 4 to CPU
    hashes = split_hashes(hash_prefix(SPEC.model_id, tokens, SPEC.block_size))
    assert sorted(pool.tier_of(h) for h in hashes).count(Tier.GPU) <= 4
    for h in hashes[:2]:
        assert pool.move_block(h, Tier.CPU).ok
    for h in hashes[:2]:
        assert pool.move_block(h, Tier.GPU).ok
    assert torch.equal(engine.load(SPEC.model_id, tokens).kv, kv)


@pytest.mark.parametrize("codec", ["int8", "fp8", "int4"])
@pytest.mark.parametrize("shape", [(2, 2, 16, 2, 64), (3, 2, 300, 1, 130), (1, 2, 7, 3, 5)])
def test_lossy_codecs_on_the_gpu_match_the_cpu_bit_for_bit(codec, shape):
    """A GPU block is quantized on the GPU; its payload is decoded on the host (loads,
    disk), so it must be the very bytes the host's codec writes."""
    if codec == "fp8" and codecs.FP8 is None:
        pytest.skip("no float8_e4m3fn in this torch")
    gen = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=gen) * 3).to(torch.float16)
    x[0, 0, 0, 0, :2] = 0  # a zero run and an outlier: the scale edge cases
    x[-1, 1, -1, -1, -1] = 60000
    on_gpu = codecs.encode(codec, x.cuda())
    assert on_gpu.device.type == "cpu"
    assert torch.equal(on_gpu, codecs.encode(codec, x))
    back = codecs.decode(codec, on_gpu, shape, torch.float16)
    assert torch.equal(back, codecs.decode(codec, codecs.encode(codec, x), shape, torch.float16))


@pytest.mark.parametrize("codec", ["int8", "int4", "zstd"])
def test_gpu_demotion_with_a_codec_stores_the_hosts_payload(codec):
    gpu = MemoryTier(Tier.GPU, 8 * SPEC.block_bytes, SPEC.block_bytes // 4)
    cpu = MemoryTier(Tier.CPU, 8 * SPEC.block_bytes, SPEC.block_bytes // 4)
    pool = BlockPool([gpu, cpu], [SPEC])
    engine = KVEngineAPI(pool, [SPEC])
    tokens = list(range(3 * SPEC.block_size))
    kv = torch.randn((3, *SPEC.block_shape)).to(torch.float16)
    assert engine.store(SPEC.model_id, tokens, kv).num_stored_blocks == 3
    hashes = split_hashes(hash_prefix(SPEC.model_id, tokens, SPEC.block_size))
    assert all(pool.tier_of(h) == Tier.GPU for h in hashes)
    for h in hashes:
        assert pool.move_block(h, Tier.CPU, codec).ok
        assert pool.tier_of(h) == Tier.CPU
    want = torch.stack([codecs.decode(codec, codecs.encode(codec, b), SPEC.block_shape, torch.float16) for b in kv])
    got = engine.load(SPEC.model_id, tokens).kv
    assert torch.equal(got, want)
    # and back up: decoded on the host, raw on the GPU again
    for h in hashes:
        assert pool.move_block(h, Tier.GPU, "none").ok
    assert torch.equal(engine.load(SPEC.model_id, tokens).kv, want)


def test_agent_with_a_gpu_tier_is_indexed_by_tier_and_moved_by_command(controlplane, make_agent):
    """A real agent (gRPC, etcd) whose top tier is a CUDA slab: the control plane's lookup
    answers `gpu` for its blocks, and a move command demotes them to the pinned CPU tier
    with an int8 quantization run on the GPU; the engine still loads the prefix."""
    from cli.client import ControlPlaneClient
    from tests.helpers import wait_for

    agent = make_agent("gpu-agent", models=[SPEC], gpu_capacity_bytes=16 * SPEC.block_bytes)
    assert agent.pool.top.tier == Tier.GPU and agent.pool.store_of[Tier.CPU].slab.is_pinned()
    tokens = list(range(6 * SPEC.block_size))
    kv = torch.randn((6, *SPEC.block_shape)).to(torch.float16)
    assert agent.engine.store(SPEC.model_id, tokens, kv).num_stored_blocks == 6
    with ControlPlaneClient(controlplane.address) as c:
        wait_for(lambda: c.lookup(SPEC.model_id, tokens).num_blocks == 6, what="the agent's blocks indexed")
        assert c.lookup(SPEC.model_id, tokens).agents[0].tiers == ["gpu"] * 6
        op = c.wait_operation(c.move("cpu", SPEC.model_id, tokens, codec="int8").op_id, timeout_seconds=30)
        assert op.state == "SUCCEEDED", op
        wait_for(lambda: c.lookup(SPEC.model_id, tokens).agents[0].tiers == ["cpu"] * 6, what="the move indexed")
    loaded = agent.engine.load(SPEC.model_id, tokens).kv
    want = torch.stack([codecs.decode("int8", codecs.encode("int8", b), SPEC.block_shape, torch.float16) for b in kv])
    assert torch.equal(loaded, want)


def test_a_shared_cpu_slab_is_pinned_in_place():
    """With CUDA the CPU slab is pinned; a shared one (same-host handoff) is pinned where
    it is (cudaHostRegister of its memfd mapping), so it stays shared and DMA-able."""
    tier = MemoryTier(Tier.CPU, 1 << 20, 4096, shared=True)
    assert tier.shared_slab is not None and tier.slab.data_ptr() == tier.shared_slab.tensor.data_ptr()
    assert tier.slab.is_pinned()
    tier.slab[4096:8192] = 7
    on_gpu = tier.slab[4096:8192].to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert int(on_gpu.sum()) == 7 * 4096
    tier.close()


def test_shared_slabs_made_one_after_another_are_each_pinned():
    """A slab's registration goes with it: the next slab, mapped at the same addresses,
    registers again (CUDA said "already mapped" and the tier fell back to private)."""
    for _ in range(4):
        tier = MemoryTier(Tier.CPU, 1 << 20, 4096, shared=True)
        assert tier.shared_slab is not None and tier.slab.is_pinned()
        tier.close()
        del tier


def test_a_slab_that_cannot_be_pinned_leaves_cuda_usable():
    """A failed registration (here: the same memory registered twice) is a warning and a
    private slab; the error is cleared, not raised by the next CUDA call."""
    from agent.store.memory_tier import _pin_in_place

    tier = MemoryTier(Tier.CPU, 1 << 20, 4096, shared=True)
    assert "already" in _pin_in_place(tier.shared_slab.tensor)
    other = torch.empty(1 << 16, dtype=torch.uint8, pin_memory=True)
    assert int(other.fill_(1).cuda().sum()) == 1 << 16
    torch.cuda.synchronize()


@pytest.mark.parametrize("codec", ["int8", "int4", "fp8"])
def test_a_batched_gpu_demotion_writes_each_blocks_host_payload(codec, monkeypatch):
    """move_blocks (the Mover's path) encodes raw GPU blocks in batches on the GPU: every
    block ends in the CPU tier with exactly the payload the host would write, blocks with
    scattered pages included, over more than one batch; a batch that fails on the GPU is
    encoded block by block instead."""
    import agent.core.block_moves as block_moves

    monkeypatch.setattr(block_moves, "GPU_ENCODE_BATCH_BYTES", 3 * SPEC.block_bytes)  # several batches
    n = 10
    gpu = MemoryTier(Tier.GPU, n * SPEC.block_bytes, SPEC.block_bytes // 4)
    gpu._free.reverse()  # descending pages: every block is four one-page runs
    cpu = MemoryTier(Tier.CPU, n * SPEC.block_bytes, SPEC.block_bytes // 4)
    pool = BlockPool([gpu, cpu], [SPEC])
    data = (torch.randn((n, *SPEC.block_shape)) * 4).to(torch.float16)
    hashes = [bytes([i]) * 16 for i in range(n)]
    for i, h in enumerate(hashes):
        assert pool.insert_chain(SPEC.model_id, [h], lambda _i, i=i: data[i]) == (1, 0)
    calls = []
    real = codecs.encode_batch

    def flaky(name, blocks, on_host=True):  # the second batch fails as an out-of-memory would
        calls.append(blocks.shape[0])
        if len(calls) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return real(name, blocks, on_host)

    monkeypatch.setattr(codecs, "encode_batch", flaky)
    outcomes = pool.move_blocks(hashes, Tier.CPU, codec)
    assert all(o.ok for o in outcomes), outcomes
    assert calls == [3, 3, 3, 1]  # the failed batch's three went one by one
    for i, h in enumerate(hashes):
        meta = pool.blocks[h]
        assert meta.tier == Tier.CPU and meta.codec == codec
        stored = cpu.read(meta.handle, meta.stored_bytes)
        assert torch.equal(stored, codecs.encode(codec, data[i])), f"block {i}"
    assert gpu.used_bytes == 0
    # the batches' payloads went from the GPU straight into the pinned slab, unhashed
    assert [pool.blocks[h].checksum for h in hashes[:3]] == [0, 0, 0]


@pytest.mark.parametrize("codec", ["int8", "int4", "fp8"])
def test_a_promotion_into_the_gpu_decodes_there_in_batches(codec, tmp_path, monkeypatch):
    """Compressed blocks in the CPU tier and on the disk promoted raw into the GPU tier
    (move_blocks, the Mover's path): their payloads cross and are decoded on the GPU in
    batches, each into the very block the host's decode gives; a corrupt disk block in a
    batch is removed alone."""
    import os

    import agent.core.block_moves as block_moves
    from agent.store.disk_tier import DiskTier
    from tests.tiers.support import block_on_disk, check_pool, flip_byte

    if codec == "fp8" and codecs.FP8 is None:
        pytest.skip("no float8_e4m3fn in this torch")
    monkeypatch.setattr(block_moves, "GPU_ENCODE_BATCH_BYTES", 4 * SPEC.block_bytes)
    n = 10
    gpu = MemoryTier(Tier.GPU, n * SPEC.block_bytes, SPEC.block_bytes // 4)
    cpu = MemoryTier(Tier.CPU, n * SPEC.block_bytes, SPEC.block_bytes // 4)
    pool = BlockPool([gpu, cpu, DiskTier(tmp_path / "disk", 1 << 20)], [SPEC])
    data = (torch.randn((n, *SPEC.block_shape)) * 4).to(torch.float16)
    hashes = [os.urandom(16) for _ in range(n)]
    for i, h in enumerate(hashes):
        assert pool.insert_chain(SPEC.model_id, [h], lambda _i, i=i: data[i]) == (1, 0)
    assert all(o.ok for o in pool.move_blocks(hashes, Tier.CPU, codec))
    assert all(o.ok for o in pool.move_blocks([hashes[i] for i in (1, 2, 6)], Tier.DISK))
    at = block_on_disk(pool, hashes[6])
    flip_byte(at.path, at.last_payload_byte)
    gpu._free.reverse()  # scattered destination pages
    devices = []
    real = codecs.decode_batch

    def spied(name, payloads, shape, dtype):
        devices.append((payloads.device.type, payloads.shape[0]))
        return real(name, payloads, shape, dtype)

    monkeypatch.setattr(codecs, "decode_batch", spied)
    outcomes = pool.move_blocks(hashes, Tier.GPU, "none")
    assert [o.ok for o in outcomes] == [i != 6 for i in range(n)], outcomes
    assert devices == [("cuda", 4), ("cuda", 4), ("cuda", 2)]
    for i, h in enumerate(hashes):
        if i == 6:
            assert h not in pool.blocks
            continue
        meta = pool.blocks[h]
        assert meta.tier is Tier.GPU and meta.codec == "none"
        want = codecs.decode(codec, codecs.encode(codec, data[i]), SPEC.block_shape, torch.float16)
        got = gpu.read(meta.handle, meta.stored_bytes).view(torch.float16).reshape(SPEC.block_shape)
        assert torch.equal(got, want), f"block {i}"
    check_pool(pool)


def test_a_batch_moves_between_gpu_and_cpu_chunk_by_chunk(monkeypatch):
    """A batch between the GPU and the pinned CPU slab in small chunks: each chunk is
    switched once its CUDA event fires while the later chunks still copy; every block
    keeps its bytes both ways, round after round, and nothing is left moving or leaked."""
    import agent.core.block_moves as block_moves
    from tests.tiers.support import check_pool

    monkeypatch.setattr(block_moves, "COPY_CHUNK_BYTES", 2 * SPEC.block_bytes)
    monkeypatch.setattr(block_moves, "COPY_FIRST_CHUNK_BYTES", SPEC.block_bytes)
    n = 24
    gpu = MemoryTier(Tier.GPU, n * SPEC.block_bytes, SPEC.block_bytes // 4)
    cpu = MemoryTier(Tier.CPU, n * SPEC.block_bytes, SPEC.block_bytes // 4)
    pool = BlockPool([gpu, cpu], [SPEC])
    data = torch.randn((n, *SPEC.block_shape)).to(torch.float16)
    hashes = [bytes([i]) * 16 for i in range(n)]
    for i, h in enumerate(hashes):
        assert pool.insert_chain(SPEC.model_id, [h], lambda _i, i=i: data[i]) == (1, 0)
    events, real_event = [], torch.cuda.Event

    def counted(*args, **kwargs):
        events.append(1)
        return real_event(*args, **kwargs)

    monkeypatch.setattr(torch.cuda, "Event", counted)
    for _ in range(3):
        for tier, store in ((Tier.CPU, cpu), (Tier.GPU, gpu)):
            events.clear()
            assert all(o.ok for o in pool.move_blocks(hashes, tier))
            assert len(events) >= 8, events  # chunk by chunk, each behind its own event
            for i, h in enumerate(hashes):
                meta = pool.blocks[h]
                got = store.read(meta.handle, meta.stored_bytes).view(torch.float16).reshape(SPEC.block_shape)
                assert meta.tier is tier and torch.equal(got, data[i]), f"block {i}"
    check_pool(pool)


@pytest.mark.parametrize("disk", [False, True])
def test_a_promotion_into_a_full_gpu_demotes_in_one_batch(disk, tmp_path, monkeypatch):
    """Cold CPU blocks promoted into a GPU full of hot ones: the room is made at once, the
    hot blocks going down to the CPU slab as one chunked batch (no device-wide synchronize
    per block under the lock), or, with the CPU full of nothing but the batch's sources
    (no disk), by switching the chunks in flight first; every block keeps its bytes."""
    import agent.core.block_moves as block_moves
    from agent.store.disk_tier import DiskTier
    from tests.tiers.support import check_pool

    monkeypatch.setattr(block_moves, "COPY_CHUNK_BYTES", 2 * SPEC.block_bytes)
    monkeypatch.setattr(block_moves, "COPY_FIRST_CHUNK_BYTES", SPEC.block_bytes)
    n = 8
    gpu = MemoryTier(Tier.GPU, n * SPEC.block_bytes, SPEC.block_bytes // 4)
    cpu = MemoryTier(Tier.CPU, (2 * n if disk else n) * SPEC.block_bytes, SPEC.block_bytes // 4)
    lower = [DiskTier(tmp_path / "disk", 1 << 22)] if disk else []
    pool = BlockPool([gpu, cpu, *lower], [SPEC])
    data = torch.randn((2 * n, *SPEC.block_shape)).to(torch.float16)
    hashes = [bytes([i]) * 16 for i in range(2 * n)]
    for i, h in enumerate(hashes):  # the first n spill to the CPU slab
        assert pool.insert_chain(SPEC.model_id, [h], lambda _i, i=i: data[i]) == (1, 0)
    cold, hot = hashes[:n], hashes[n:]
    syncs, real_sync = [], torch.cuda.synchronize

    def counted(*args, **kwargs):
        syncs.append(1)
        return real_sync(*args, **kwargs)

    monkeypatch.setattr(torch.cuda, "synchronize", counted)
    assert all(o.ok for o in pool.move_blocks(cold, Tier.GPU))
    monkeypatch.undo()
    assert [pool.tier_of(h) for h in cold] == [Tier.GPU] * n
    held = [pool.tier_of(h) for h in hot]
    if disk:
        assert held == [Tier.CPU] * n and len(syncs) < n  # one batch down, not one sync a block
    else:
        assert held.count(None) <= 1 and held.count(Tier.CPU) >= n - 1
    for i, h in enumerate(hashes):
        meta = pool.blocks.get(h)
        if meta is not None:
            store = pool.store_of[meta.tier]
            got = store.read(meta.handle, meta.stored_bytes).view(torch.float16).reshape(SPEC.block_shape)
            assert torch.equal(got.cpu(), data[i]), f"block {i}"
    check_pool(pool)
