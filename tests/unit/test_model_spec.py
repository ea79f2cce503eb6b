"""ModelSpec: the KV layout of a model as `--model NAME:block_size=...` spells it."""

from __future__ import annotations

import pytest
import torch

from agent.core.model_spec import DTYPE_BYTES, ModelSpec


def test_parse():
    spec = ModelSpec.parse("llama:block_size=16,num_layers=2,num_kv_heads=4,head_dim=64,dtype=bfloat16")
    assert spec == ModelSpec("llama", 16, 2, 4, 64, "bfloat16")


def test_parse_defaults_dtype_and_tolerates_spaces():
    spec = ModelSpec.parse(" m : block_size=4, num_layers=1 ,num_kv_heads=1,head_dim=8,")
    assert spec == ModelSpec("m", 4, 1, 1, 8, "float16")


@pytest.mark.parametrize("dtype", sorted(DTYPE_BYTES))
def test_format_parse_roundtrip(dtype):
    spec = ModelSpec("org/model-7b", 16, 32, 8, 128, dtype)
    assert ModelSpec.parse(spec.format()) == spec


def test_block_shape_and_bytes():
    spec = ModelSpec("m", block_size=16, num_layers=2, num_kv_heads=4, head_dim=64, dtype="float16")
    assert spec.block_shape == (2, 2, 16, 4, 64)
    assert spec.block_bytes == 2 * 2 * 16 * 4 * 64 * 2
    assert ModelSpec("m", 4, 1, 1, 4, "float32").block_bytes == 1 * 2 * 4 * 1 * 4 * 4
    assert ModelSpec("m", 4, 1, 1, 4, "int8").block_bytes == 32


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("llama", "must look like NAME:block_size=16"),
        ("m:block_size=16,num_layers=2,num_kv_heads=2", "missing head_dim"),
        ("m:block_size=16", "missing head_dim, num_kv_heads, num_layers"),
        ("m:block_size=16,num_layers=2,num_kv_heads=2,head_dim=64,colour=red", "bad field 'colour=red'"),
        ("m:block_size16,num_layers=2,num_kv_heads=2,head_dim=64", "bad field 'block_size16'"),
        ("m:block_size=0,num_layers=2,num_kv_heads=2,head_dim=64", "block_size must be positive"),
        ("m:block_size=16,num_layers=-1,num_kv_heads=2,head_dim=64", "num_layers must be positive"),
        ("m:block_size=16,num_layers=2,num_kv_heads=2,head_dim=64,dtype=fp4", "dtype 'fp4' not supported"),
        (":block_size=16,num_layers=2,num_kv_heads=2,head_dim=64", "model_id must not be empty"),
    ],
)
def test_bad_specs(text, match):
    with pytest.raises(ValueError, match=match):
        ModelSpec.parse(text)


def test_non_integer_value_names_the_field():
    # A user typing `block_size=sixteen` should be told which field and which spec.
    with pytest.raises(ValueError, match="block_size") as info:
        ModelSpec.parse("m:block_size=sixteen,num_layers=2,num_kv_heads=2,head_dim=64")
    assert "m:block_size=sixteen" in str(info.value)


def test_direct_construction_validates():
    with pytest.raises(ValueError, match="head_dim must be positive"):
        ModelSpec("m", 16, 2, 2, 0)
    with pytest.raises(ValueError, match="one of float16"):
        ModelSpec("m", 16, 2, 2, 64, "float64")


def test_the_agents_codecs_and_dtypes_are_the_wire_contracts():
    """Codec names and dtype sizes were written out in three places each (the manager, the
    policy, routing and the agent): one definition in protos.kv_format now."""
    from agent.core import codecs
    from agent.core.model_spec import TORCH_DTYPES
    from protos import kv_format

    assert {"none", *codecs.CODECS} == set(kv_format.CODECS)
    assert set(TORCH_DTYPES) == set(kv_format.DTYPE_BYTES)
    for name, dtype in TORCH_DTYPES.items():
        assert torch.empty((), dtype=dtype).element_size() == kv_format.DTYPE_BYTES[name]
