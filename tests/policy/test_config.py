"""Policy values: defaults, flat keys as kvctl/etcd carry them, and clear rejections
naming the field."""

from __future__ import annotations

import pytest

from controlplane.core.policy import Policy, TierPolicy
from protos import errors
from protos.tier import Tier


def test_defaults_validate_and_round_trip():
    p = Policy().validate()
    values = p.to_mapping()
    assert set(values) == set(Policy.keys())
    assert values["gpu.high_watermark"] == "0.95"
    assert values["promote_hot"] == "true"
    assert Policy.from_mapping(values) == p


def test_from_mapping_parses_strings_over_a_base():
    p = Policy.from_mapping(
        {
            "gpu.high_watermark": "0.8",
            "gpu.low_watermark": " 0.7 ",
            "disk.codec": "ZSTD",
            "promote_hot": "off",
            "max_reuse_credits": "5",
            "reuse_credit_turnovers": 1.5,
        }
    )
    assert p.tier(Tier.GPU) == TierPolicy(0.7, 0.8, "none")
    assert p.tier(Tier.DISK).codec == "zstd"
    assert p.promote_hot is False and p.max_reuse_credits == 5 and p.reuse_credit_turnovers == 1.5
    q = Policy.from_mapping({"cpu.codec": "int8"}, base=p)
    assert q.tier(Tier.CPU).codec == "int8" and q.max_reuse_credits == 5
    assert p.tier(Tier.REMOTE) == TierPolicy()


@pytest.mark.parametrize(
    "values, field, words",
    [
        ({"gpu.high_watermark": "1.5"}, "values[gpu.high_watermark]", "(0, 1]"),
        ({"cpu.low_watermark": "0"}, "values[cpu.low_watermark]", "(0, 1]"),
        ({"disk.low_watermark": "nan"}, "values[disk.low_watermark]", "(0, 1]"),
        ({"gpu.low_watermark": "0.99"}, "values[gpu.low_watermark]", "must not exceed gpu.high_watermark"),
        ({"gpu.high_watermark": "high"}, "values[gpu.high_watermark]", "must be a number"),
        ({"disk.codec": "lz4"}, "values[disk.codec]", "unknown codec"),
        ({"promote_hot": "maybe"}, "values[promote_hot]", "true or false"),
        ({"max_reuse_credits": "2.5"}, "values[max_reuse_credits]", "integer"),
        ({"max_reuse_credits": "-1"}, "values[max_reuse_credits]", "integer in [0"),
        ({"reuse_credit_turnovers": "-2"}, "values[reuse_credit_turnovers]", "number in [0"),
        ({"gpu.size": "1"}, "values[gpu.size]", "unknown policy key"),
    ],
)
def test_bad_values_name_the_field(values, field, words):
    with pytest.raises(errors.InvalidArgument) as exc:
        Policy.from_mapping(values)
    assert exc.value.field == field
    assert words in str(exc.value)


def test_validate_names_dataclass_fields():
    with pytest.raises(errors.InvalidArgument) as exc:
        Policy(cpu=TierPolicy(low_watermark=0.9, high_watermark=0.5)).validate()
    assert exc.value.field == "policy.cpu.low_watermark"
    with pytest.raises(errors.InvalidArgument) as exc:
        Policy.from_mapping({"gpu.codec": "x"}, field="--set")
    assert exc.value.field == "--set[gpu.codec]"


def test_a_pin_past_its_ttl_counts_for_nothing_against_the_quota():
    from controlplane.core.pins import Pin, check_quota

    old = Pin("old", "kb", "m", b"\x01" * 16, Tier.CPU, 0.0, 50.0, pinned_bytes=900)  # expired at 50
    live = Pin("live", "kb", "m", b"\x02" * 16, Tier.CPU, 0.0, 1e12, pinned_bytes=50)
    new = Pin("new", "kb", "m", b"\x03" * 16, Tier.CPU, 100.0, 1e12, pinned_bytes=100)
    nothing = lambda agent_id: 0  # noqa: E731
    check_quota([old, live], new, 200, nothing)  # 50 + 100 <= 200: the expired 900 B are gone
    with pytest.raises(errors.ResourceExhausted, match="quota"):
        check_quota([old, live], new, 120, nothing)


def test_a_namespace_pin_counts_what_its_namespace_holds_now():
    """Made on an empty namespace (0 B), it pins every block stored there since: the quota
    charges it the namespace's size (on the agents it applies to) at the next pin, not 0."""
    from controlplane.core.pins import Pin, check_quota

    whole = Pin("ns", "kb", "", b"", Tier.CPU, 0.0, 1e12, agent_id="agent-1", pinned_bytes=0)
    new = Pin("new", "kb", "m", b"\x03" * 16, Tier.CPU, 100.0, 1e12, pinned_bytes=100)
    check_quota([whole], new, 1000, lambda agent_id: 0)
    held = {"agent-1": 960, "agent-2": 40, "": 1000}
    with pytest.raises(errors.ResourceExhausted, match="960 B pinned"):
        check_quota([whole], new, 1000, held.get)  # agent-1's 960 + 100 > 1000
    other = Pin("other", "legal", "m", b"\x04" * 16, Tier.CPU, 100.0, 1e12, pinned_bytes=100)
    check_quota([whole], other, 1000, lambda agent_id: 0)  # another namespace's pin: not charged


def test_each_pinned_byte_counts_once_against_the_quota():
    """A namespace pinned twice, or on one agent only: its blocks charged once, and an
    agent-scoped namespace pin only what the namespace holds on that agent. A prefix pin
    is charged in full even with its namespace pinned: its blocks need not be stored under
    that namespace (charged nothing, 100 pins of 1 GiB labelled with a 0 B pinned
    namespace went past a 1 MiB quota)."""
    from controlplane.core.pins import Pin, check_quota, pinned_bytes_of

    held = {"agent-1": 0, "agent-2": 600, "": 600}
    everywhere = Pin("all", "chat", "", b"", Tier.CPU, 0.0, 1e12, pinned_bytes=600)
    on_1 = Pin("a1", "chat", "", b"", Tier.CPU, 0.0, 1e12, agent_id="agent-1")
    on_2 = Pin("a2", "chat", "", b"", Tier.CPU, 0.0, 1e12, agent_id="agent-2")
    prefix = Pin("p", "chat", "m", b"\x05" * 16 + b"\x06" * 16, Tier.GPU, 0.0, 1e12, pinned_bytes=64)
    assert pinned_bytes_of([everywhere, on_1, on_2], "chat", 1.0, held.get) == 600
    assert pinned_bytes_of([everywhere, on_1, on_2, prefix], "chat", 1.0, held.get) == 664
    assert pinned_bytes_of([on_1, on_2], "chat", 1.0, held.get) == 600
    assert pinned_bytes_of([on_1], "chat", 1.0, held.get) == 0  # agent-1 holds none of chat
    for again in (on_1, on_2, Pin("all2", "chat", "", b"", Tier.DISK, 5.0, 1e12, pinned_bytes=600)):
        check_quota([everywhere], again, 600, held.get)  # adds nothing: fits a quota of exactly 600
    with pytest.raises(errors.ResourceExhausted, match="600 B pinned \\+ 64 B asked"):
        check_quota([everywhere], prefix, 600, held.get)
    empty = {"": 0}.get
    big = [Pin(f"g{i}", "chat", "m", bytes([i]) * 16, Tier.CPU, 0.0, 1e12, pinned_bytes=1 << 30) for i in range(2)]
    with pytest.raises(errors.ResourceExhausted, match="quota"):
        check_quota([Pin("ns", "chat", "", b"", Tier.CPU, 0.0, 1e12), big[0]], big[1], 1 << 20, empty)


def test_a_prompt_pinned_twice_is_charged_once():
    """Two pins of the same prompt hold the same blocks: the second adds nothing to the
    quota (it was charged again: a third identical pin refused at '65536 B pinned' with 32
    KiB of blocks pinned). A pin on one agent is covered by the same pin everywhere; pins
    of one block on two agents hold two copies."""
    from controlplane.core.pins import Pin, check_quota, pinned_bytes_of

    chain = b"\x07" * 16 + b"\x08" * 16
    first = Pin("p1", "q", "m", chain, Tier.CPU, 0.0, 1e12, pinned_bytes=64)
    again = Pin("p2", "q", "m", chain, Tier.CPU, 1.0, 1e12, pinned_bytes=64)
    longer = Pin("p3", "q", "m", chain + b"\x09" * 16, Tier.CPU, 1.0, 1e12, pinned_bytes=96)
    nothing = {"": 0}.get
    assert pinned_bytes_of([first, again], "q", 2.0, nothing) == 64
    check_quota([first, again], Pin("p4", "q", "m", chain, Tier.DISK, 2.0, 1e12, pinned_bytes=64), 64, nothing)
    assert pinned_bytes_of([first, longer], "q", 2.0, nothing) == 96  # the new block only
    with pytest.raises(errors.ResourceExhausted, match="64 B pinned \\+ 32 B asked"):
        check_quota([first], longer, 64, nothing)
    on_1 = Pin("a1", "q", "m", chain, Tier.CPU, 0.0, 1e12, agent_id="agent-1", pinned_bytes=64)
    on_2 = Pin("a2", "q", "m", chain, Tier.CPU, 0.0, 1e12, agent_id="agent-2", pinned_bytes=64)
    assert pinned_bytes_of([on_1, first], "q", 2.0, nothing) == 64
    assert pinned_bytes_of([on_1, on_2], "q", 2.0, nothing) == 128
    other_model = Pin("o", "q", "m2", chain, Tier.CPU, 0.0, 1e12, pinned_bytes=64)
    assert pinned_bytes_of([first, other_model], "q", 2.0, nothing) == 128
