"""The engine connector against a real agent (gRPC on port 0, a real etcd): KV in a
layout other than the agent's is refused, never cached in the wrong shape, and a prefix
bigger than one gRPC message is stored and loaded in several."""

from __future__ import annotations

import grpc
import pytest
import torch

from agent.client import EngineClient
from agent.connector import KVConnector, layers_to_blocks
from agent.core.engine_api import StoreResult
from agent.core.model_spec import ModelSpec

M = ModelSpec("conn-m", block_size=4, num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16")


def layer_kv(spec: ModelSpec, num_tokens: int, heads: int | None = None, dim: int | None = None, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shape = (1, heads or spec.num_kv_heads, num_tokens, dim or spec.head_dim)
    return [
        (torch.randn(shape, generator=g).half(), torch.randn(shape, generator=g).half()) for _ in range(spec.num_layers)
    ]


@pytest.mark.parametrize(
    "heads, dim, tokens, error",
    [
        (4, 4, 16, "shape \\[1, 4, 16, 4\\], model conn-m wants \\[1, 2, >= 16, 8\\]"),
        (2, 8, 12, "12 tokens, 16 needed"),
    ],
)
def test_kv_in_another_layout_is_refused_by_name(heads, dim, tokens, error):
    with pytest.raises(ValueError, match=error):
        layers_to_blocks(layer_kv(M, tokens, heads, dim), M, 0, 4)


def test_kv_of_another_dtype_is_refused_not_converted():
    """float32 KV went into a float16 model's cache converted, values past 65504 as inf,
    shared by every engine of the model (a review)."""
    kv = [(k.float() * 1e5, v.float()) for k, v in layer_kv(M, 16)]
    with pytest.raises(ValueError, match="dtype float32, model conn-m stores float16"):
        layers_to_blocks(kv, M, 0, 4)


def test_a_batch_of_two_is_refused():
    kv = [(torch.zeros(2, 2, 8, 8, dtype=torch.float16),) * 2 for _ in range(2)]
    with pytest.raises(ValueError, match="shape \\[2, 2, 8, 8\\]"):
        layers_to_blocks(kv, M, 0, 2)


def test_in_process_connector_with_another_layout_is_refused(make_agent):
    agent = make_agent(models=[M])
    other = ModelSpec(M.model_id, block_size=4, num_layers=2, num_kv_heads=4, head_dim=4, dtype="float16")
    with pytest.raises(ValueError, match="num_kv_heads 4 != 2; head_dim 4 != 8"):
        KVConnector(other, agent.engine)


def test_remote_connector_with_another_layout_is_refused_and_caches_nothing(make_agent):
    agent = make_agent(models=[M])
    other = ModelSpec(M.model_id, block_size=4, num_layers=2, num_kv_heads=4, head_dim=4, dtype="float16")
    client = EngineClient(agent.address)
    try:
        tokens = list(range(16))
        with pytest.raises(grpc.RpcError) as e:
            KVConnector(other, client).store(tokens, layer_kv(other, 16))
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "num_kv_heads 4 != 2" in e.value.details()
        assert agent.engine.lookup(M.model_id, tokens) == 0
        with pytest.raises(grpc.RpcError) as e:
            KVConnector(other, client).load(tokens)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        # nor does a lookup promise what the load refuses (it reported the agent's hits)
        KVConnector(M, client).store(tokens, layer_kv(M, 16))
        with pytest.raises(grpc.RpcError) as e:
            KVConnector(other, client).lookup(tokens)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        client.close()


def test_a_spec_of_another_model_is_refused_by_name(make_agent):
    """The spec's model_id was not read: a caller describing another model, in the same
    layout, was taken as describing the request's."""
    from protos.kvcp.v1 import types_pb2

    agent = make_agent(models=[M])
    client = EngineClient(agent.address)
    theirs = types_pb2.ModelSpec(
        model_id="other-model",
        block_size=M.block_size,
        num_layers=M.num_layers,
        num_kv_heads=M.num_kv_heads,
        head_dim=M.head_dim,
        dtype=M.dtype,
    )
    try:
        tokens = list(range(M.block_size))
        kv = bytes(M.block_bytes)
        with pytest.raises(grpc.RpcError) as e:
            client.store(M.model_id, tokens, kv, spec=theirs)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "spec.model_id" in e.value.details() and "other-model" in e.value.details()
        assert agent.engine.lookup(M.model_id, tokens) == 0
        theirs.model_id = M.model_id
        assert client.store(M.model_id, tokens, kv, spec=theirs) == StoreResult(1, 0)
    finally:
        client.close()


def test_a_prefix_bigger_than_one_message_goes_in_several(make_agent, monkeypatch):
    import agent.api.engine_service as engine_service

    monkeypatch.setattr(engine_service, "blocks_per_message", lambda block_bytes: 3)  # a message holds 3 blocks
    agent = make_agent(models=[M], cpu_capacity_bytes=64 * M.block_bytes)
    client = EngineClient(agent.address)
    try:
        connector = KVConnector(M, client)
        connector._blocks_per_message = 3
        tokens = list(range(10 * M.block_size + 2))
        kv = layer_kv(M, len(tokens), seed=3)
        assert connector.store(tokens, kv) == 10  # in 4 Stores of 3, 3, 3, 1 blocks
        one = client.load(M.model_id, tokens)
        assert one.truncated and one.num_cached_tokens == 3 * M.block_size
        n, layers = connector.load(tokens)
        assert n == 10 * M.block_size
        for (k, v), (k0, v0) in zip(layers, kv, strict=True):
            assert torch.equal(k, k0[:, :, :n]) and torch.equal(v, v0[:, :, :n])
        last = client.load(M.model_id, tokens, first_block=9)
        assert not last.truncated and last.num_cached_tokens == 10 * M.block_size and len(last.kv) == M.block_bytes
        # a Load from a block whose prefix is not cached loads nothing
        other = list(range(1000, 1000 + 8 * M.block_size))
        assert client.load(M.model_id, other, first_block=2).num_cached_tokens == 0
    finally:
        client.close()


def test_load_of_a_bad_first_block_is_an_invalid_argument(make_agent):
    agent = make_agent(models=[M])
    client = EngineClient(agent.address)
    try:
        with pytest.raises(grpc.RpcError) as e:
            client.load(M.model_id, list(range(8)), first_block=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "first_block" in e.value.details()
    finally:
        client.close()


def test_store_messages_deep_into_a_long_prompt_carry_fewer_blocks():
    """Each Store carries every token id up to its last block: at 1.5M tokens the ids take
    ~7 MiB, more than the message's fixed headroom, so later messages carry fewer blocks
    (a prompt of 3 full messages' blocks went over the 256 MiB limit on its last one)."""
    from agent.core.engine_api import ENGINE_MESSAGE_BYTES, blocks_in_store_message, blocks_per_message

    bb, bs = M.block_bytes, M.block_size
    full = blocks_per_message(bb)
    for first in (0, full, 2 * full, 8 * full):
        count = blocks_in_store_message(bb, bs, first)
        assert count >= 1
        assert count * bb + 5 * (first + count) * bs + (1 << 20) <= ENGINE_MESSAGE_BYTES, first
    first = 2 * full  # where the old fixed count went over
    assert full * bb + 5 * (first + full) * bs > ENGINE_MESSAGE_BYTES - (1 << 20)
    assert blocks_in_store_message(bb, bs, first) < full
    with pytest.raises(ValueError, match="does not fit"):
        blocks_in_store_message(bb, bs, ENGINE_MESSAGE_BYTES // bs)


# ---- engine-style input (a review, 2026-12-06) --------------------------------------------
@pytest.mark.parametrize("remote", [False, True])
def test_engine_style_token_ids_and_keys_are_one_prompt_or_refused(make_agent, remote):
    """input_ids shaped [1, T] (as Hugging Face gives them) were one token: nothing stored,
    a cached prompt missed; [B, T] rows were hashed as blocks; an int LoRA id failed with
    AttributeError; the string "ab" was the keys "a", "b"; numpy KV was refused as
    "float16 != float16"; an empty prompt was 0 in process and INVALID_ARGUMENT remotely."""
    import numpy as np

    from protos import errors

    agent = make_agent(models=[M])
    client = EngineClient(agent.address) if remote else None
    engine = client if remote else agent.engine
    try:
        flat = list(range(3 * M.block_size))
        conn = KVConnector(M, engine)
        assert conn.store(torch.tensor([flat]), layer_kv(M, len(flat))) == 3
        assert conn.lookup(np.array([flat])) == len(flat) and conn.lookup(torch.tensor(flat)) == len(flat)
        assert conn.load(torch.tensor([flat]))[0] == len(flat)
        refused = (grpc.RpcError, ValueError, errors.InvalidArgument)
        with pytest.raises(refused, match="one prompt"):
            conn.lookup(np.arange(32).reshape(8, 4))
        assert conn.lookup([]) == 0 and conn.load([]) == (0, [])
        lora = KVConnector(M, engine, extra_keys=(7,))  # vLLM's int LoRA id: "7"
        assert lora.lookup(flat) == 0  # another adapter's cache
        assert lora.store(flat, layer_kv(M, len(flat))) == 3
        assert KVConnector(M, engine, extra_keys=("7",)).lookup(flat) == len(flat)
        assert KVConnector(M, engine, extra_keys="ab").extra_keys == ("ab",)
        with pytest.raises(ValueError, match="extra keys must be strings"):
            KVConnector(M, engine, extra_keys=(b"x",))
        with pytest.raises(ValueError, match="got bytes"):  # (its bytes were taken for integer ids)
            KVConnector(M, engine, extra_keys=b"ab")
        assert KVConnector(M, engine, extra_keys=(np.int64(7),)).extra_keys == ("7",)
        numpy_kv = [(k.numpy(), v.numpy()) for k, v in layer_kv(M, len(flat))]
        with pytest.raises(ValueError, match="a torch tensor, not ndarray"):
            KVConnector(M, engine).store(list(range(100, 100 + len(flat))), numpy_kv)
    finally:
        if client is not None:
            client.close()


def test_a_model_id_with_a_colon_parses_and_a_field_twice_is_refused():
    spec = ModelSpec("org:llama", block_size=16, num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16")
    assert ModelSpec.parse(spec.format()) == spec
    with pytest.raises(ValueError, match="block_size given twice"):
        ModelSpec.parse("m:block_size=16,block_size=8,num_layers=2,num_kv_heads=2,head_dim=64")


def test_an_engines_lookup_counts_the_tokens_of_a_nested_prompt(make_agent):
    """[[t0, ..., tN]] is one prompt of N+1 tokens: it was counted as 1 in the lookup
    tokens, and hit tokens could exceed them (a review)."""
    engine = make_agent(models=[M]).engine
    for prompt in ([[1, 2, 3]], [1, 2, 3]):
        before = engine.lookup_tokens_total
        engine.lookup(M.model_id, prompt)
        assert engine.lookup_tokens_total - before == 3
