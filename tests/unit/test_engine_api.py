"""KVEngineAPI: what an engine's KV connector calls, over a real BlockPool and MemoryTier
holding real (tiny) torch tensors."""

from __future__ import annotations

import pytest
import torch

from agent.core.block_pool import BlockPool
from agent.core.engine_api import KVEngineAPI
from agent.core.model_spec import ModelSpec
from agent.store.memory_tier import MemoryTier
from protos import errors
from protos.tier import Tier

SPEC = ModelSpec("tiny", block_size=4, num_layers=1, num_kv_heads=1, head_dim=4, dtype="float16")
BS = SPEC.block_size


def make_engine(num_blocks: int = 16, *specs: ModelSpec) -> KVEngineAPI:
    """An engine over one CPU slab of `num_blocks` pages, one raw block per page."""
    specs = specs or (SPEC,)
    page = max(s.block_bytes for s in specs)
    pool = BlockPool([MemoryTier(Tier.CPU, num_blocks * page, page, device="cpu")], list(specs))
    return KVEngineAPI(pool, list(specs))


def kv_for(num_blocks: int, seed: int = 0, spec: ModelSpec = SPEC) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((num_blocks, *spec.block_shape), generator=g).to(torch.float16)


def test_store_lookup_load_roundtrip():
    engine = make_engine()
    tokens = list(range(3 * BS))
    kv = kv_for(3)
    assert engine.store("tiny", tokens, kv).num_stored_blocks == 3
    assert engine.lookup("tiny", tokens) == 3 * BS
    res = engine.load("tiny", tokens)
    assert res.num_cached_tokens == 3 * BS
    assert res.kv.dtype == torch.float16 and tuple(res.kv.shape) == (3, *SPEC.block_shape)
    assert torch.equal(res.kv, kv)
    assert res.tiers == (Tier.CPU,) * 3


def test_loaded_kv_is_a_copy_and_stored_kv_is_taken_by_value():
    engine = make_engine()
    tokens = list(range(2 * BS))
    kv = kv_for(2)
    original = kv.clone()
    engine.store("tiny", tokens, kv)
    kv.zero_()  # the engine reuses its buffer
    res = engine.load("tiny", tokens)
    res.kv.fill_(7)  # and writes into what it loaded
    assert torch.equal(engine.load("tiny", tokens).kv, original)


def test_load_returns_exactly_the_cached_prefix():
    engine = make_engine()
    tokens = list(range(5 * BS))
    kv = kv_for(2)
    engine.store("tiny", tokens[: 2 * BS], kv)
    res = engine.load("tiny", tokens)
    assert res.num_cached_tokens == 2 * BS
    assert torch.equal(res.kv, kv)
    # a prompt that diverges in block 1 gets only block 0
    other = tokens[:BS] + [999] + tokens[BS + 1 :]
    res = engine.load("tiny", other)
    assert res.num_cached_tokens == BS
    assert torch.equal(res.kv, kv[:1])


def test_miss_loads_an_empty_tensor_of_the_right_shape():
    engine = make_engine()
    res = engine.load("tiny", list(range(2 * BS)))
    assert res.num_cached_tokens == 0
    assert tuple(res.kv.shape) == (0, *SPEC.block_shape) and res.kv.dtype == torch.float16


def test_partial_trailing_block_is_ignored():
    engine = make_engine()
    tokens = list(range(2 * BS + 3))
    kv = kv_for(2)
    assert engine.store("tiny", tokens, kv).num_stored_blocks == 2
    with pytest.raises(errors.InvalidArgument):
        engine.store("tiny", tokens, kv_for(3))  # the partial block has no kv
    assert engine.lookup("tiny", tokens) == 2 * BS
    assert engine.lookup("tiny", tokens[: 2 * BS]) == 2 * BS
    assert engine.lookup("tiny", tokens[: BS + 1]) == BS


def test_storing_twice_reports_present_blocks():
    engine = make_engine()
    tokens = list(range(3 * BS))
    engine.store("tiny", tokens[: 2 * BS], kv_for(2))
    res = engine.store("tiny", tokens, kv_for(3))
    assert (res.num_stored_blocks, res.num_present_blocks) == (1, 2)


@pytest.mark.parametrize(
    "kv",
    [
        kv_for(1),  # too few blocks
        kv_for(3),  # too many
        torch.zeros((2, 1, 2, 4, 1, 8), dtype=torch.float16),  # wrong block shape
        kv_for(2).to(torch.float32),  # wrong dtype
        kv_for(2).to(torch.bfloat16),
    ],
    ids=["few", "many", "shape", "float32", "bfloat16"],
)
def test_wrong_kv_is_invalid_argument(kv):
    engine = make_engine()
    with pytest.raises(errors.InvalidArgument) as info:
        engine.store("tiny", list(range(2 * BS)), kv)
    assert info.value.field == "kv"
    assert engine.pool.blocks == {}


def test_bad_token_ids_are_invalid_argument():
    engine = make_engine()
    for call in (engine.lookup, engine.load):
        with pytest.raises(errors.InvalidArgument) as info:
            call("tiny", [1, 2, -3, 4])
        assert info.value.field == "token_ids"


def test_a_prompt_past_the_block_cap_is_refused_before_it_is_hashed():
    """A 20M-token lookup was hashed whole (9 s, other engines' calls held up 4 s): the
    agent caps a call at the control plane's lookup cap, its partial block aside."""
    from agent.core.engine_api import MAX_BLOCKS_PER_CALL, MAX_TOKENS_PER_CALL

    engine = make_engine()
    most = min(MAX_BLOCKS_PER_CALL, MAX_TOKENS_PER_CALL // BS)
    assert engine.lookup("tiny", [1] * (most * BS + BS - 1)) == 0
    for call in (engine.lookup, engine.load):
        with pytest.raises(errors.InvalidArgument, match=f"at most {most} blocks") as info:
            call("tiny", [1] * ((most + 1) * BS))
        assert info.value.field == "token_ids"


def test_unknown_model_is_not_found():
    engine = make_engine()
    with pytest.raises(errors.NotFound, match="'nope'.*serves tiny"):
        engine.lookup("nope", list(range(BS)))
    with pytest.raises(errors.NotFound):
        engine.load("nope", list(range(BS)))
    with pytest.raises(errors.NotFound):
        engine.store("nope", list(range(BS)), kv_for(1))


def test_first_block_skips_a_cached_prefix():
    engine = make_engine()
    tokens = list(range(4 * BS))
    kv = kv_for(4)
    engine.store("tiny", tokens[: 2 * BS], kv[:2])
    res = engine.store("tiny", tokens, kv[2:], first_block=2)
    assert (res.num_stored_blocks, res.num_present_blocks) == (2, 2)
    assert torch.equal(engine.load("tiny", tokens).kv, kv)


def test_first_block_is_refused_when_the_prefix_is_not_cached():
    engine = make_engine()
    tokens = list(range(4 * BS))
    kv = kv_for(4)
    engine.store("tiny", tokens[:BS], kv[:1])  # only block 0 of the 2 skipped
    res = engine.store("tiny", tokens, kv[2:], first_block=2)
    assert (res.num_stored_blocks, res.num_present_blocks) == (0, 0)
    assert engine.lookup("tiny", tokens) == BS


@pytest.mark.parametrize("first_block", [-1, 3])
def test_first_block_out_of_range(first_block):
    engine = make_engine()
    with pytest.raises(errors.InvalidArgument) as info:
        engine.store("tiny", list(range(2 * BS)), kv_for(0), first_block=first_block)
    assert info.value.field == "first_block"


def test_first_block_equal_to_the_chain_stores_nothing():
    engine = make_engine()
    tokens = list(range(2 * BS))
    engine.store("tiny", tokens, kv_for(2))
    res = engine.store("tiny", tokens, kv_for(0), first_block=2)
    assert (res.num_stored_blocks, res.num_present_blocks) == (0, 2)


def test_extra_keys_are_separate_namespaces():
    engine = make_engine()
    tokens = list(range(2 * BS))
    base, lora = kv_for(2, seed=1), kv_for(2, seed=2)
    engine.store("tiny", tokens, base)
    assert engine.lookup("tiny", tokens, extra_keys=("lora-a",)) == 0
    engine.store("tiny", tokens, lora, extra_keys=("lora-a",))
    assert torch.equal(engine.load("tiny", tokens).kv, base)
    assert torch.equal(engine.load("tiny", tokens, extra_keys=("lora-a",)).kv, lora)


def test_models_are_separate_namespaces():
    other = ModelSpec("other", block_size=4, num_layers=1, num_kv_heads=1, head_dim=4, dtype="float16")
    engine = make_engine(16, SPEC, other)
    tokens = list(range(BS))
    engine.store("tiny", tokens, kv_for(1))
    assert engine.lookup("other", tokens) == 0


def test_other_dtypes_roundtrip():
    spec = ModelSpec("f32", block_size=2, num_layers=2, num_kv_heads=2, head_dim=2, dtype="float32")
    engine = make_engine(8, spec)
    kv = torch.randn((3, *spec.block_shape), dtype=torch.float32)
    engine.store("f32", list(range(6)), kv)
    assert torch.equal(engine.load("f32", list(range(6))).kv, kv)


def test_non_contiguous_kv_is_stored_by_value():
    engine = make_engine()
    full = kv_for(2)
    kv = full.transpose(-1, -3).contiguous().transpose(-1, -3)  # same values, other strides
    assert not kv.is_contiguous()
    engine.store("tiny", list(range(2 * BS)), kv)
    assert torch.equal(engine.load("tiny", list(range(2 * BS))).kv, full)


def test_counters():
    engine = make_engine()
    tokens = list(range(3 * BS + 1))
    engine.store("tiny", tokens[: 2 * BS], kv_for(2))
    engine.lookup("tiny", tokens)  # 2 blocks hit
    engine.load("tiny", tokens)  # 2 blocks hit
    engine.lookup("tiny", [7] * BS)  # miss
    assert engine.lookups_total == 3
    assert engine.lookup_tokens_total == 2 * len(tokens) + BS
    assert engine.lookup_hit_tokens_total == 4 * BS


def test_eviction_keeps_loads_consistent():
    engine = make_engine(num_blocks=4)
    stored = {}
    for i in range(6):
        tokens = list(range(100 * i, 100 * i + 2 * BS))
        kv = kv_for(2, seed=i)
        engine.store("tiny", tokens, kv)
        stored[i] = (tokens, kv)
    for tokens, kv in stored.values():
        res = engine.load("tiny", tokens)
        n = res.num_cached_tokens // BS
        assert torch.equal(res.kv, kv[:n])
    assert engine.lookup("tiny", stored[5][0]) == 2 * BS
    assert engine.lookup("tiny", stored[0][0]) == 0


def test_two_stores_of_one_prefix_at_once_keep_the_longer_ones_tail(monkeypatch):
    """Engine B stored a prompt two blocks longer while engine A still wrote block 0: B
    stopped there, answered (0, 0), and its tail was never cached (a review)."""
    import threading

    engine = make_engine()
    bs = SPEC.block_size
    tokens, kv = list(range(4 * bs)), kv_for(4)
    writing, release = threading.Event(), threading.Event()
    real_write = MemoryTier.write

    def slow_first_write(self, handle, payload, meta=None):
        if threading.current_thread().name == "engine-a" and not writing.is_set():
            writing.set()
            release.wait(5)  # A's write of block 0 takes a while
        return real_write(self, handle, payload, meta)

    monkeypatch.setattr(MemoryTier, "write", slow_first_write)
    done = {}
    a = threading.Thread(target=lambda: done.setdefault("a", engine.store(SPEC.model_id, tokens[: 2 * bs], kv[:2])))
    a.name = "engine-a"
    a.start()
    assert writing.wait(5)
    threading.Timer(0.2, release.set).start()  # A finishes while B waits for block 0
    b = engine.store(SPEC.model_id, tokens, kv)
    a.join(5)
    # block 1 is A's or B's, whichever came first once block 0 was written; B stored the rest
    assert done["a"].num_stored_blocks in (1, 2) and b.num_present_blocks >= 1
    assert b.num_present_blocks + b.num_stored_blocks == 4  # nothing of B's tail lost
    assert engine.lookup(SPEC.model_id, tokens) == 4 * bs


def test_a_store_that_loses_the_race_to_write_a_block_goes_on_after_the_winner(monkeypatch):
    """Two stores of one prefix both found block 0 absent; A placed it first, while B was
    encoding it outside the lock. B then stopped at block 0, answering (0, 0) with its tail
    never cached (seen in a CI run of the test above: B lost the race for block 1 after both
    waited for block 0). B now waits for A's block and goes on after it."""
    import threading

    engine = make_engine()
    bs = SPEC.block_size
    tokens, kv = list(range(3 * bs)), kv_for(3)
    a_writing, release = threading.Event(), threading.Event()
    real_write, real_encode = MemoryTier.write, BlockPool._encode_for

    def slow_write(self, handle, payload, meta=None):
        if threading.current_thread().name == "engine-a" and not a_writing.is_set():
            a_writing.set()  # A has placed block 0 (not ready yet) and writes it
            release.wait(5)
        return real_write(self, handle, payload, meta)

    def encode_while_a_places_block_0(self, codec, data):
        if threading.current_thread().name == "engine-b" and not a_writing.is_set():
            a.start()  # B found block 0 absent; A places it while B encodes
            assert a_writing.wait(5)
            threading.Timer(0.2, release.set).start()
        return real_encode(self, codec, data)

    monkeypatch.setattr(MemoryTier, "write", slow_write)
    monkeypatch.setattr(BlockPool, "_encode_for", encode_while_a_places_block_0)
    done = {}
    a = threading.Thread(target=lambda: done.setdefault("a", engine.store(SPEC.model_id, tokens[:bs], kv[:1])))
    a.name = "engine-a"
    b = threading.Thread(target=lambda: done.setdefault("b", engine.store(SPEC.model_id, tokens, kv)))
    b.name = "engine-b"
    b.start()
    b.join(10)
    a.join(10)
    assert done["a"].num_stored_blocks == 1
    assert (done["b"].num_present_blocks, done["b"].num_stored_blocks) == (1, 2), done["b"]
    res = engine.load(SPEC.model_id, tokens)
    assert res.num_cached_tokens == 3 * bs and torch.equal(res.kv, kv)
