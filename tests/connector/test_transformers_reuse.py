"""The engine connector on a real transformer (Hugging Face Llama built from a config
with random weights and a fixed seed; no downloads): generation that reuses a prefix
cached by the agent, from the CPU tier and from the disk tier, produces exactly the
tokens of generation without reuse, and logits within 1e-4. Lossy codecs are measured
(next-token agreement, KV reconstruction error) against the uncompressed cache."""

from __future__ import annotations

import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")

from agent.connector import KVConnector  # noqa: E402
from agent.core.block_pool import BlockPool  # noqa: E402
from agent.core.engine_api import KVEngineAPI  # noqa: E402
from agent.core.model_spec import ModelSpec  # noqa: E402
from agent.core.mover import Mover  # noqa: E402
from agent.store.disk_tier import DiskTier  # noqa: E402
from agent.store.memory_tier import MemoryTier  # noqa: E402
from protos.block_hash import hash_prefix, split_hashes  # noqa: E402
from protos.tier import Tier  # noqa: E402

BLOCK = 16


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=1000,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=512,
    )
    return transformers.LlamaForCausalLM(cfg).eval()


def spec_of(model) -> ModelSpec:
    c = model.config
    return ModelSpec(
        "tiny-llama",
        BLOCK,
        c.num_hidden_layers,
        c.num_key_value_heads,
        c.hidden_size // c.num_attention_heads,
        "float32",
    )


def cache_kwarg(model) -> str:
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def forward(model, ids, cache):
    kwargs = {cache_kwarg(model): cache} if cache is not None else {}
    with torch.no_grad():
        return model(ids, use_cache=True, **kwargs)


def greedy(model, prompt: torch.Tensor, steps: int, cache=None, cached_tokens: int = 0):
    """Greedy decode; returns (tokens, logits of the first generated position)."""
    out = forward(model, prompt[:, cached_tokens:], cache)
    first_logits = out.logits[0, -1].clone()
    cache = out.past_key_values
    tokens = []
    nxt = out.logits[0, -1].argmax()
    for _ in range(steps):
        tokens.append(int(nxt))
        out = forward(model, nxt.view(1, 1), cache)
        cache = out.past_key_values
        nxt = out.logits[0, -1].argmax()
    return tokens, first_logits


def layer_kv(cache):
    return [(layer.keys, layer.values) for layer in cache.layers]


def make_cache(kv):
    cache = transformers.DynamicCache()
    for i, (k, v) in enumerate(kv):
        cache.update(k, v, i)
    return cache


@pytest.fixture
def connector(model, tmp_path):
    spec = spec_of(model)
    cpu = MemoryTier(Tier.CPU, 64 * spec.block_bytes, spec.block_bytes // 4)
    disk = DiskTier(tmp_path / "disk", 1 << 26)
    pool = BlockPool([cpu, disk], [spec])
    mover = Mover(pool)
    return KVConnector(spec, KVEngineAPI(pool, [spec], mover)), pool, mover


def test_reuse_from_cpu_and_disk_is_exact(model, connector):
    conn, pool, mover = connector
    torch.manual_seed(1)
    prompt = torch.randint(0, 1000, (1, 5 * BLOCK + 7))
    want_tokens, want_logits = greedy(model, prompt, 12)

    prefill = forward(model, prompt, None)
    assert conn.store(prompt[0].tolist(), layer_kv(prefill.past_key_values)) == 5
    assert conn.lookup(prompt[0].tolist()) == 5 * BLOCK

    for tier in (Tier.CPU, Tier.DISK):
        hashes = split_hashes(hash_prefix("tiny-llama", prompt[0].tolist(), BLOCK))
        for h in hashes:
            assert pool.move_block(h, tier).ok
        assert all(pool.tier_of(h) == tier for h in hashes)
        n, kv = conn.load(prompt[0].tolist())
        assert n == 5 * BLOCK
        got_tokens, got_logits = greedy(model, prompt, 12, make_cache(kv), n)
        assert got_tokens == want_tokens, f"tokens differ after reuse from {tier.label}"
        assert (got_logits - want_logits).abs().max().item() <= 1e-4
        while mover.run_once(0.01):  # a load from disk promoted the blocks; let it finish
            pass


@pytest.mark.parametrize("codec, max_rel_error", [("int8", 0.02), ("fp8", 0.1), ("int4", 0.25)])
def test_lossy_codecs_are_measured(model, connector, codec, max_rel_error):
    conn, pool, _ = connector
    torch.manual_seed(2)
    prompt = torch.randint(0, 1000, (1, 6 * BLOCK + 3))
    want_tokens, want_logits = greedy(model, prompt, 16)
    prefill = forward(model, prompt, None)
    exact = layer_kv(prefill.past_key_values)
    conn.store(prompt[0].tolist(), exact)
    for h in split_hashes(hash_prefix("tiny-llama", prompt[0].tolist(), BLOCK)):
        assert pool.move_block(h, Tier.CPU, codec).ok
    n, kv = conn.load(prompt[0].tolist())
    assert n == 6 * BLOCK
    rel = max(
        ((k - ek[:, :, :n]).norm() / ek[:, :, :n].norm()).item() for (k, _), (ek, _) in zip(kv, exact, strict=True)
    )
    assert rel <= max_rel_error, f"{codec}: relative KV error {rel:.4f}"
    # teacher forcing: the same continuation through both caches, argmax compared per position
    full = torch.cat([prompt, torch.tensor([want_tokens])], dim=1)
    ref = forward(model, full, None).logits[0, n - 1 :]
    got = forward(model, full[:, n:], make_cache(kv)).logits[0]
    agreement = (ref[1:].argmax(-1) == got.argmax(-1)).float().mean().item()
    print(f"{codec}: next-token agreement {agreement:.3f} over {got.shape[0]} positions, relative KV error {rel:.4f}")
    assert agreement >= {"int8": 0.95, "fp8": 0.9, "int4": 0.6}[codec]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_reuse_on_cuda_from_gpu_cpu_and_disk_is_exact(model, tmp_path):
    """The same model on the GPU, its KV cached in the agent's GPU tier (a CUDA slab), its
    pinned CPU tier and its disk tier: reuse from each gives the tokens of generation
    without reuse and logits within 1e-4, loaded straight onto the GPU."""
    spec = spec_of(model)
    gpu_model = transformers.LlamaForCausalLM(model.config).eval()
    gpu_model.load_state_dict(model.state_dict())
    gpu_model = gpu_model.cuda()
    gpu = MemoryTier(Tier.GPU, 16 * spec.block_bytes, spec.block_bytes // 4)
    cpu = MemoryTier(Tier.CPU, 16 * spec.block_bytes, spec.block_bytes // 4)
    assert gpu.slab.is_cuda and cpu.slab.is_pinned()
    pool = BlockPool([gpu, cpu, DiskTier(tmp_path / "disk", 1 << 26)], [spec])
    mover = Mover(pool)
    conn = KVConnector(spec, KVEngineAPI(pool, [spec], mover))
    torch.manual_seed(3)
    prompt = torch.randint(0, 1000, (1, 4 * BLOCK + 5)).cuda()
    want_tokens, want_logits = greedy(gpu_model, prompt, 12)
    assert conn.store(prompt[0].tolist(), layer_kv(forward(gpu_model, prompt, None).past_key_values)) == 4
    hashes = split_hashes(hash_prefix("tiny-llama", prompt[0].tolist(), BLOCK))
    for tier in (Tier.GPU, Tier.CPU, Tier.DISK, Tier.GPU):
        for h in hashes:
            assert pool.move_block(h, tier).ok
        n, kv = conn.load(prompt[0].tolist(), device="cuda")
        assert n == 4 * BLOCK and kv[0][0].is_cuda
        got_tokens, got_logits = greedy(gpu_model, prompt, 12, make_cache(kv), n)
        assert got_tokens == want_tokens, f"tokens differ after reuse from {tier.label}"
        assert (got_logits - want_logits).abs().max().item() <= 1e-4
        while mover.run_once(0.01):
            pass
