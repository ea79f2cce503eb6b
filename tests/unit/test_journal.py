"""EventJournal: pending block events become sequence-numbered batches."""

from __future__ import annotations

from agent.core.journal import REMOVED, STORED, EventJournal
from controlplane.core.cluster import AgentRecord, BlockGroup, Cluster, ModelInfo
from protos.block_hash import ROOT_PARENT_HASH
from protos.tier import Tier


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def flat(batches):
    """(seq, kind, model, tier, [block ints]) per group, in order."""
    return [
        (
            b.seq,
            b.kind,
            g.model_id,
            g.tier,
            [int.from_bytes(g.block_hashes[k : k + 16], "big") for k in range(0, len(g.block_hashes), 16)],
        )
        for b in batches
        for g in b.groups
    ]


def test_empty_drain_takes_no_seq():
    j = EventJournal()
    assert j.drain() == []
    assert j.last_seq == 0


def test_one_batch_per_run_of_kind():
    j = EventJournal()
    for kind, i in [(STORED, 1), (STORED, 2), (REMOVED, 1), (STORED, 3), (STORED, 4), (REMOVED, 2)]:
        j.record(kind, "m", Tier.GPU, h(i), ROOT_PARENT_HASH)
    batches = j.drain()
    assert [(b.seq, b.kind, b.num_blocks) for b in batches] == [
        (1, STORED, 2),
        (2, REMOVED, 1),
        (3, STORED, 2),
        (4, REMOVED, 1),
    ]
    assert j.num_pending == 0 and not j.wake.is_set()


def test_groups_are_runs_of_model_and_tier_in_order():
    j = EventJournal()
    events = [("m", Tier.GPU, 1), ("m", Tier.GPU, 2), ("m", Tier.CPU, 3), ("x", Tier.CPU, 4), ("m", Tier.GPU, 5)]
    for model, tier, i in events:
        j.record(STORED, model, tier, h(i), h(i - 1))
    (batch,) = j.drain()
    assert flat([batch]) == [
        (1, STORED, "m", Tier.GPU, [1, 2]),
        (1, STORED, "m", Tier.CPU, [3]),
        (1, STORED, "x", Tier.CPU, [4]),
        (1, STORED, "m", Tier.GPU, [5]),  # not merged into the first group: order is kept
    ]
    assert bytes(batch.groups[0].parent_hashes) == h(0) + h(1)
    assert [g.num_blocks for g in batch.groups] == [2, 1, 1, 1]


def test_seq_is_consecutive_across_drains_and_max_blocks():
    j = EventJournal()
    for i in range(5):
        j.record(STORED, "m", Tier.CPU, h(i), ROOT_PARENT_HASH)
    first = j.drain(max_blocks=2)
    assert [b.seq for b in first] == [1] and first[0].num_blocks == 2
    assert j.num_pending == 3 and j.wake.is_set()
    j.record(REMOVED, "m", Tier.CPU, h(0), ROOT_PARENT_HASH)
    rest = j.drain()
    assert [(b.seq, b.kind, b.num_blocks) for b in rest] == [(2, STORED, 3), (3, REMOVED, 1)]
    assert j.last_seq == 3


def test_record_wakes_the_sender():
    j = EventJournal()
    assert not j.wake.is_set()
    j.record(STORED, "m", Tier.CPU, h(1), ROOT_PARENT_HASH)
    assert j.wake.is_set()


def test_reset_returns_last_seq_and_clears_pending():
    j = EventJournal()
    j.record(STORED, "m", Tier.CPU, h(1), ROOT_PARENT_HASH)
    j.drain()
    j.record(STORED, "m", Tier.CPU, h(2), ROOT_PARENT_HASH)
    assert j.reset() == 1
    assert j.num_pending == 0
    assert j.drain() == []
    j.record(REMOVED, "m", Tier.CPU, h(2), ROOT_PARENT_HASH)
    assert [b.seq for b in j.drain()] == [2]


def test_overflow_sets_overflowed_and_caps_pending():
    j = EventJournal(max_pending=3)
    for i in range(3):
        j.record(STORED, "m", Tier.CPU, h(i), ROOT_PARENT_HASH)
    assert not j.overflowed
    j.record(STORED, "m", Tier.CPU, h(3), ROOT_PARENT_HASH)
    assert j.overflowed
    assert j.num_pending <= 3
    j.reset()
    assert not j.overflowed and j.num_pending == 0


def test_events_lost_to_overflow_are_noticed_by_the_control_plane():
    """BUG: on overflow the journal drops pending events but the seq of the next batch is
    still last_seq + 1, and nothing reads `overflowed`; the control plane sees no gap
    and its index silently misses the dropped blocks until some unrelated resync."""
    j = EventJournal(max_pending=2)
    cluster = Cluster(clock=lambda: 0.0)
    cluster.register(AgentRecord("a", "a:1", [ModelInfo("m", 1)], []))
    cluster.hello("a", "s")
    assert cluster.apply_inventory_chunk("a", j.reset(), 0, True, []) is None

    held = set()
    for i in range(1, 4):  # the third event overflows the journal
        j.record(STORED, "m", Tier.CPU, h(i), ROOT_PARENT_HASH)
        held.add(h(i))
    reasons = [
        cluster.apply_events(
            "a", b.seq, b.kind == STORED, [BlockGroup(g.model_id, g.tier, bytes(g.block_hashes)) for g in b.groups]
        )
        for b in j.drain()
    ]
    in_sync = set(cluster.index.agent_blocks("a")) == held
    asked_to_resync = any(r is not None for r in reasons)
    assert in_sync or asked_to_resync, "events were dropped without the control plane noticing"
