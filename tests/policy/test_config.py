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
    check_quota([old, live], new, quota_bytes=200)  # 50 + 100 <= 200: the expired 900 B are gone
    with pytest.raises(errors.ResourceExhausted, match="quota"):
        check_quota([old, live], new, quota_bytes=120)


def test_a_namespace_pin_counts_what_its_namespace_holds_now():
    """Made on an empty namespace (0 B), it pins every block stored there since: the quota
    charges it the namespace's size at the next pin, not 0."""
    from controlplane.core.pins import Pin, check_quota

    whole = Pin("ns", "kb", "", b"", Tier.CPU, 0.0, 1e12, pinned_bytes=0)
    new = Pin("new", "kb", "m", b"\x03" * 16, Tier.CPU, 100.0, 1e12, pinned_bytes=100)
    check_quota([whole], new, quota_bytes=1000, namespace_bytes=0)
    with pytest.raises(errors.ResourceExhausted, match="quota"):
        check_quota([whole], new, quota_bytes=1000, namespace_bytes=960)  # 960 + 100 > 1000
    other = Pin("other", "legal", "m", b"\x04" * 16, Tier.CPU, 100.0, 1e12, pinned_bytes=100)
    check_quota([whole], other, quota_bytes=1000, namespace_bytes=0)  # another namespace's pin: not charged
