"""The CUDA paths a review (2026-12-07) found wrong, checked where CUDA is: marked `gpu`
as tests/tiers/test_gpu.py is (run by scripts/gpu-check, `-o addopts="" -m gpu`); the
two-device ones skip on a one-GPU machine. Not yet run on a GPU: the machines of that
session had none."""

from __future__ import annotations

import pytest
import torch

from agent.core import codecs
from agent.core.block_pool import BlockPool
from agent.core.model_spec import ModelSpec
from agent.store.memory_tier import MemoryTier
from protos.tier import Tier

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")

SPEC = ModelSpec("gpu-model", block_size=16, num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16")
SLEEP_CYCLES = 2_000_000_000  # about a second of a GPU's stream: copies queued behind it are late


def test_a_private_pinned_cpu_slab_pins_only_its_capacity():
    """torch.empty(pin_memory=True) goes to the CachingHostAllocator, which rounds the
    request up to a power of two: a 96 MiB slab takes a 128 MiB pinned block (a 65 GiB
    --cpu-capacity locks 128 GiB of host memory)."""
    torch.cuda.init()
    stats = torch.cuda.host_memory_stats()
    if "active_bytes.current" not in stats:
        pytest.skip("this torch reports no pinned-allocator statistics")
    before = stats["active_bytes.current"]
    capacity = 96 << 20
    tier = MemoryTier(Tier.CPU, capacity, 1 << 20, shared=False)
    assert tier.slab.is_pinned()
    taken = torch.cuda.host_memory_stats()["active_bytes.current"] - before
    assert taken <= capacity, f"{capacity >> 20} MiB slab took {taken >> 20} MiB of pinned memory"


def test_reading_a_scattered_gpu_block_takes_no_gpu_memory():
    """MemoryTier.read of a block in several page runs does torch.cat on the GPU (a
    temporary the size of the block, outside --gpu-capacity; a torch.OutOfMemoryError
    there fails the engine's load: read_chain catches no RuntimeError)."""
    page = SPEC.block_bytes // 4
    gpu = MemoryTier(Tier.GPU, 8 * SPEC.block_bytes, page)
    gpu._free.reverse()  # descending pages: four one-page runs
    handle = gpu.allocate(SPEC.block_bytes)
    data = torch.randint(0, 255, (SPEC.block_bytes,), dtype=torch.uint8)
    gpu.write(handle, data)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    got = gpu.read(handle, SPEC.block_bytes)
    assert torch.equal(got, data)
    assert torch.cuda.max_memory_allocated() == before


@pytest.mark.parametrize("codec", ["int8", "int4", "fp8"])
def test_a_demotion_out_of_gpu_memory_encodes_on_the_host(codec, monkeypatch):
    """the batched GPU encode fails for want of GPU memory; the blocks go "one by
    one" - on the GPU again, where they fail the same way, and the OutOfMemoryError
    escapes move_blocks. The host encodes the same bytes: every block must still move."""
    if codec == "fp8" and codecs.FP8 is None:
        pytest.skip("no float8_e4m3fn in this torch")
    n = 6
    gpu = MemoryTier(Tier.GPU, n * SPEC.block_bytes, SPEC.block_bytes // 4)
    cpu = MemoryTier(Tier.CPU, n * SPEC.block_bytes, SPEC.block_bytes // 4)
    pool = BlockPool([gpu, cpu], [SPEC])
    data = (torch.randn((n, *SPEC.block_shape)) * 4).to(torch.float16)
    hashes = [bytes([i + 1]) * 16 for i in range(n)]
    for i, h in enumerate(hashes):
        assert pool.insert_chain(SPEC.model_id, [h], lambda _i, i=i: data[i]) == (1, 0)

    def oom_on_cuda(real):
        def quantize(x, *args, **kwargs):
            if x.is_cuda:
                raise torch.OutOfMemoryError("CUDA out of memory (test)")
            return real(x, *args, **kwargs)

        return quantize

    for name in ("int8", "int4", "fp8"):
        patched = oom_on_cuda(getattr(codecs, f"_{name}_batch"))
        monkeypatch.setattr(codecs, f"_{name}_batch", patched)
        monkeypatch.setitem(codecs.BATCHED, name, patched)
    outcomes = pool.move_blocks(hashes, Tier.CPU, codec)
    assert all(o.ok for o in outcomes), outcomes
    for i, h in enumerate(hashes):
        meta = pool.blocks[h]
        assert meta.tier is Tier.CPU and meta.codec == codec
        assert torch.equal(cpu.read(meta.handle, meta.stored_bytes), codecs.encode(codec, data[i].clone()))


@two_gpus
def test_a_write_into_a_tier_on_the_second_gpu_is_done_when_it_returns():
    """write_many promises each block readable and its source reusable on return, but
    waits with torch.cuda.synchronize() - the current device (0) - while the copies run on
    cuda:1: the caller's next use of its source lands in the tier."""
    torch.cuda.set_device(0)
    n = 32 << 20
    tier = MemoryTier(Tier.GPU, n, 1 << 20, device="cuda:1")
    src = torch.ones(n, dtype=torch.uint8).pin_memory()
    handle = tier.allocate(n)
    with torch.cuda.device(1):
        torch.cuda._sleep(SLEEP_CYCLES)  # cuda:1's stream is busy: the copy waits behind it
    tier.write_many([(handle, src, None)])
    src.fill_(2)  # the source reused, as write_many allows
    torch.cuda.synchronize(1)
    assert torch.equal(tier.read(handle, n), torch.ones(n, dtype=torch.uint8)), "the tier holds the reused source"


@two_gpus
def test_a_chunked_move_from_the_second_gpu_switches_after_its_copies():
    """_copy_between_slabs switches each chunk once torch.cuda.Event().record() has
    fired - an event on the current device's (0) stream, while the copies run on cuda:1's:
    blocks are switched to (and readable in) the CPU tier before their bytes landed, and
    their GPU pages freed under the DMA."""
    torch.cuda.set_device(0)
    n = 16
    gpu = MemoryTier(Tier.GPU, n * SPEC.block_bytes, SPEC.block_bytes // 4, device="cuda:1")
    cpu = MemoryTier(Tier.CPU, 2 * n * SPEC.block_bytes, SPEC.block_bytes // 4)
    pool = BlockPool([gpu, cpu], [SPEC])
    data = torch.randn((n, *SPEC.block_shape)).to(torch.float16)
    hashes = [bytes([i + 1]) * 16 for i in range(n)]
    for i, h in enumerate(hashes):
        assert pool.insert_chain(SPEC.model_id, [h], lambda _i, i=i: data[i]) == (1, 0)
    assert all(pool.tier_of(h) is Tier.GPU for h in hashes)
    with torch.cuda.device(1):
        torch.cuda._sleep(SLEEP_CYCLES)
    assert all(o.ok for o in pool.move_blocks(hashes, Tier.CPU))
    for i, h in enumerate(hashes):  # what a load reads now, with no synchronize of its own
        meta = pool.blocks[h]
        got = cpu.read(meta.handle, meta.stored_bytes).view(torch.float16).reshape(SPEC.block_shape)
        assert meta.tier is Tier.CPU and torch.equal(got, data[i]), f"block {i}"


def test_gpu_memory_metric_counts_the_gpu_tier():
    """kvcp_gpu_memory_bytes on a real device: the GPU tier's slab is allocated by this
    process, within what is reserved, within the device's total."""
    from prometheus_client import CollectorRegistry

    from agent.metrics import AgentCollector

    tier = MemoryTier(Tier.GPU, 64 << 20, 1 << 20)
    registry = CollectorRegistry()
    registry.register(AgentCollector("gpu-agent", BlockPool([tier], [SPEC])))

    def v(kind: str) -> float:
        value = registry.get_sample_value(
            "kvcp_gpu_memory_bytes", {"agent_id": "gpu-agent", "device": str(tier.device), "kind": kind}
        )
        assert value is not None, kind
        return value

    assert 64 << 20 <= v("allocated") <= v("reserved") < v("total")
    assert 0 < v("free") < v("total")
