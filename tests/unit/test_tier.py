"""The plain-Python Tier must stay equal to the wire enum kvcp.v1.Tier."""

from __future__ import annotations

import pytest

from protos.kvcp.v1 import types_pb2
from protos.tier import Tier


def test_values_equal_the_proto_enum():
    for t in Tier:
        assert types_pb2.Tier.Value(f"TIER_{t.name}") == int(t)
    wire = {name for name in types_pb2.Tier.keys() if name != "TIER_UNSPECIFIED"}
    assert wire == {f"TIER_{t.name}" for t in Tier}


def test_named_constants():
    assert Tier.GPU == types_pb2.TIER_GPU
    assert Tier.CPU == types_pb2.TIER_CPU
    assert Tier.DISK == types_pb2.TIER_DISK
    assert Tier.REMOTE == types_pb2.TIER_REMOTE


def test_fastest_first():
    assert sorted(Tier) == [Tier.GPU, Tier.CPU, Tier.DISK, Tier.REMOTE]


@pytest.mark.parametrize(("text", "tier"), [("gpu", Tier.GPU), ("CPU", Tier.CPU), (" Disk ", Tier.DISK)])
def test_parse_accepts_names_in_any_case(text, tier):
    assert Tier.parse(text) is tier


def test_label_roundtrip():
    for t in Tier:
        if t is Tier.REMOTE:  # reported by the control plane, never asked for
            with pytest.raises(ValueError, match="gpu|cpu|disk"):
                Tier.parse(t.label)
        else:
            assert Tier.parse(t.label) is t


@pytest.mark.parametrize("text", ["ssd", "", "1", "gpu0"])
def test_parse_rejects_unknown_with_the_choices(text):
    with pytest.raises(ValueError) as info:
        Tier.parse(text)
    msg = str(info.value)
    assert repr(text) in msg
    for name in ("gpu", "cpu", "disk"):
        assert name in msg


def test_a_handle_whose_pages_came_back_out_of_order_covers_only_its_own_pages():
    """Pages freed one by one come back from the free list in any order: a handle
    [0, 1, 5, 2, 4] spans 0..5 with the right count but is not the run 0..4 (page 3 is
    another block's)."""
    import torch

    from agent.store.memory_tier import MemoryTier
    from protos.tier import Tier

    pb = 16
    tier = MemoryTier(Tier.CPU, 16 * pb, pb)
    singles = [tier.allocate(pb) for _ in range(6)]  # pages 0..5
    for p in (4, 2, 5, 1, 0):
        tier.free([p])
    handle = tier.allocate(5 * pb)
    assert sorted(handle) == [0, 1, 2, 4, 5] and singles[3] == [3]
    tier.slab[3 * pb : 4 * pb] = 7  # the other block's bytes
    tier.write(handle, torch.arange(5 * pb, dtype=torch.int64).to(torch.uint8))
    assert tier.slab[3 * pb : 4 * pb].tolist() == [7] * pb
    assert torch.equal(torch.cat(tier.views(handle, 5 * pb)), torch.arange(5 * pb, dtype=torch.int64).to(torch.uint8))
    runs = tier.byte_runs(handle, 5 * pb)
    assert [(a - tier.slab.data_ptr()) // pb + k for a, n in runs for k in range(n // pb)] == handle
