"""GPU tier (CUDA only; marked `gpu`, skipped here): a CUDA page slab above the CPU tier,
moves both ways keep the bytes, a full GPU tier demotes to the CPU tier, and a load from
the GPU tier returns exactly what was stored."""

from __future__ import annotations

import pytest
import torch

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
