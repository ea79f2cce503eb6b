"""The code paths taken when CUDA is present, checked on a CPU-only machine: a review of
them (2026-12-07) found each of these defects, and each test failed before its fix.

CUDA is simulated where the product only asks `cuda_available()` (monkeypatched) and a
"GPU" slab is a `meta` tensor whose tier claims a CUDA device: no CUDA call runs here."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from agent.core.block_pool import BlockPool
from agent.core.handoff import Reservations
from agent.store import memory_tier as mt
from protos.tier import Tier


# ---- the private pinned CPU slab comes from the caching host allocator ------------------
def test_a_pinned_cpu_slab_pins_exactly_its_capacity(monkeypatch):
    """With CUDA, a CPU slab that is not shared (--no-shm-handoff, or no memfd) is made by
    torch.empty(pin_memory=True): torch's CachingHostAllocator rounds every pinned request
    up to a power of two (PowerOf2Ceil; torch 2.13 default), so a 65 GiB --cpu-capacity
    page-locks 128 GiB. It must be pinned at exactly its size (cudaHostRegister of a plain
    allocation, as the shared slab already is)."""
    pinned: list[int] = []

    def pin(t: torch.Tensor) -> str:
        pinned.append(t.numel() * t.element_size())
        return ""

    monkeypatch.setattr(mt, "cuda_available", lambda: True)
    monkeypatch.setattr(mt, "_pin_in_place", pin)
    real_empty = torch.empty

    def no_caching_pinned(*args, **kwargs):
        if kwargs.get("pin_memory"):
            raise AssertionError("the slab went to the caching host allocator (rounds up to a power of two)")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", no_caching_pinned)
    capacity = 5 << 20  # pinned as 8 MiB by the caching host allocator
    tier = mt.MemoryTier(Tier.CPU, capacity, 4096, shared=False)
    assert pinned == [capacity]
    assert tier.slab.numel() == capacity


# ---- CUDA present but pinning impossible: the agent dies at start ---------------------
@pytest.mark.parametrize("shared", [False, True])
def test_a_cpu_slab_that_cannot_be_pinned_is_kept_unpinned(shared, monkeypatch, caplog):
    """CUDA is present but page-locking fails (no CUDA context can be made on the current
    device - GPU 0 full, exclusive-process compute mode - or the host has no room to lock
    the slab): the agent must run with an unpinned CPU slab (copies to a GPU are then
    synchronous, still correct), not die in MemoryTier.__init__ even with --gpu-capacity 0."""
    monkeypatch.setattr(mt, "cuda_available", lambda: True)
    monkeypatch.setattr(mt, "_pin_in_place", lambda t: "cudaErrorMemoryAllocation: out of memory")
    real_empty = torch.empty

    def pinned_fails(*args, **kwargs):
        if kwargs.get("pin_memory"):
            raise RuntimeError("CUDA error: out of memory")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", pinned_fails)
    with caplog.at_level(logging.WARNING):
        tier = mt.MemoryTier(Tier.CPU, 1 << 20, 4096, shared=shared)
    h = tier.allocate(10_000)
    data = torch.arange(10_000, dtype=torch.int32).to(torch.uint8)
    tier.write(h, data)
    assert torch.equal(tier.read(h, 10_000), data)
    tier.close()


# ---- a GPU tier the GPU cannot hold: a raw OutOfMemoryError at start ---------------
def test_an_agent_whose_gpu_tier_does_not_fit_says_so_or_runs_without_it(monkeypatch):
    """--gpu-capacity larger than the GPU's free memory (the engine took 90 % of it):
    MemoryTier's torch.empty raises torch.OutOfMemoryError out of Agent.__init__, a
    traceback instead of either a start without the (never required) GPU tier or an error
    naming --gpu-capacity."""
    import agent.server as server
    from agent.server import Agent, AgentConfig

    real = server.MemoryTier

    def tier(t, capacity, page, *args, **kwargs):
        if t == Tier.GPU:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1024.00 GiB (test)")
        return real(t, capacity, page, *args, **kwargs)

    monkeypatch.setattr(server, "cuda_available", lambda: True)
    monkeypatch.setattr(server, "MemoryTier", tier)
    config = AgentConfig(
        agent_id="gpu-oom", gpu_capacity_bytes=1 << 40, cpu_capacity_bytes=8 << 20, transfer_engine="none"
    )
    try:
        agent = Agent(config)
    except torch.OutOfMemoryError as exc:
        pytest.fail(f"a raw CUDA OutOfMemoryError escaped Agent.__init__: {exc}")
    except ValueError as exc:  # a clear refusal is fine too
        assert "gpu" in str(exc).lower() and "capacity" in str(exc).lower()
        return
    assert Tier.GPU not in agent.pool.store_of


# ---- no device index: every agent of a host takes GPU 0 -----------------------------
def test_an_agents_gpu_tier_is_on_an_explicit_device(monkeypatch):
    """`kvcp-agent` runs one agent per GPU, but the GPU tier is made with device "cuda"
    (whatever device is current: 0 in every process and in every new thread), and no flag
    or config names the GPU: eight agents of a host all put their tiers (and CUDA
    contexts) on GPU 0. The tier must be given an explicit device, cuda:N."""
    import agent.server as server
    from agent.server import Agent, AgentConfig

    real = server.MemoryTier
    devices: list = []

    def tier(t, capacity, page, device=None, shared=False):
        if t == Tier.GPU:
            devices.append(device)
            return real(t, capacity, page, device="cpu")  # stands in for the CUDA slab
        return real(t, capacity, page, device=device, shared=shared)

    monkeypatch.setattr(server, "cuda_available", lambda: True)
    monkeypatch.setattr(server, "MemoryTier", tier)
    Agent(
        AgentConfig(agent_id="gpu-dev", gpu_capacity_bytes=8 << 20, cpu_capacity_bytes=8 << 20, transfer_engine="none")
    )
    assert len(devices) == 1
    assert devices[0] is not None and re.fullmatch(r"cuda:\d+", str(devices[0])), devices


# ---- synchronize() waits for the current device, not the tier's ---------------------
def test_a_gpu_tier_write_waits_for_the_tiers_own_device(monkeypatch):
    """MemoryTier.write_many queues its copies non_blocking and then calls
    torch.cuda.synchronize() with no device: that waits for the *current* device (0 in
    every thread that did not set one), so for a tier on cuda:1 it returns while the
    copies are still running - the caller reuses the source, the block is readable before
    its bytes landed (silent wrong KV). Same in block_moves._copy_many and gpu_quiet, and
    torch.cuda.Event().record() in _copy_between_slabs records on the current device's
    stream. Here a meta slab stands in for the cuda:1 one."""
    tier = mt.MemoryTier(Tier.GPU, 1 << 16, 4096, device="meta")
    tier.device = "cuda:1"
    waited: list = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append(device))
    handle = tier.allocate(5000)
    tier.write_many([(handle, torch.zeros(5000, dtype=torch.uint8), None)])
    assert waited, "no wait at all"
    assert all(
        d is not None and torch.device(d if not isinstance(d, int) else f"cuda:{d}") == torch.device("cuda:1")
        for d in waited
    ), f"waited for {waited}, not cuda:1"


# ---- handoffs would land in (and register) a GPU slab -------------------------------
def test_handoff_reservations_refuse_a_gpu_slab():
    """Reservations accepts any memory slab (is_slab), and DataPlane takes the top tier
    when there is no CPU one: a GPU slab would be registered with the transfer engine as
    host memory, published as the shm/engine buffer, and its views hashed with .numpy()
    (TypeError on CUDA). It must refuse a slab that is not in host memory."""
    from agent.server import DEMO_MODEL

    gpu = mt.MemoryTier(Tier.GPU, 1 << 20, 4096, device="meta")
    pool = BlockPool([gpu], [DEMO_MODEL])
    with pytest.raises(ValueError):
        Reservations(pool, Tier.GPU)


# ---- after a GPU batch runs out of memory, the "one by one" path is the GPU again ------
@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_a_demotion_whose_gpu_encode_runs_out_of_memory_encodes_on_the_host(codec, monkeypatch):
    """A lossy demotion of raw GPU blocks whose batch fails for want of GPU memory goes
    "one by one" (_one_by_one) - but each block is encoded on the GPU again
    (_reencode -> codecs.encode of the block in the GPU slab: fp32 copies of it and more),
    and a torch.OutOfMemoryError there escapes move_blocks (_move_recoded re-raises it as
    unexpected): the Mover's op, or the engine Store whose room it was making, fails. The
    host encodes the same bytes (the C loops): it must fall back there. The GPU tier is a
    CPU slab whose tier claims cuda:0; whatever encodes a block still in it runs out of
    GPU memory."""
    from agent.core import codecs
    from agent.core.model_spec import ModelSpec

    spec = ModelSpec("gpu-model", block_size=16, num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16")
    n = 4
    gpu = mt.MemoryTier(Tier.GPU, n * spec.block_bytes, spec.block_bytes // 4, device="cpu")
    gpu.device = "cuda:0"  # routed as a GPU tier (batched GPU encodes); its bytes stay on the host
    cpu = mt.MemoryTier(Tier.CPU, n * spec.block_bytes, spec.block_bytes // 4)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    pool = BlockPool([gpu, cpu], [spec])
    data = (torch.randn((n, *spec.block_shape), generator=torch.Generator().manual_seed(3)) * 4).to(torch.float16)
    hashes = [bytes([i + 1]) * 16 for i in range(n)]
    for i, h in enumerate(hashes):
        assert pool.insert_chain(spec.model_id, [h], lambda _i, i=i: data[i]) == (1, 0)

    lo, hi = gpu.slab.data_ptr(), gpu.slab.data_ptr() + gpu.slab.numel()

    def oom(*_a, **_k):
        raise torch.OutOfMemoryError("CUDA out of memory (test)")

    real_encode = codecs.encode

    def encode(name, block):
        if lo <= block.data_ptr() < hi:  # still in GPU memory: encoded there, out of memory
            oom()
        return real_encode(name, block)

    monkeypatch.setattr(codecs, "encode_batch", oom)
    monkeypatch.setattr(codecs, "encode", encode)
    outcomes = pool.move_blocks(hashes, Tier.CPU, codec)
    assert all(o.ok for o in outcomes), outcomes
    assert pool.gpu_codec_blocks_total.get(("encode", "one_by_one")) == n
    for i, h in enumerate(hashes):
        meta = pool.blocks[h]
        assert meta.tier is Tier.CPU and meta.codec == codec
        assert torch.equal(cpu.read(meta.handle, meta.stored_bytes), real_encode(codec, data[i])), f"block {i}"
