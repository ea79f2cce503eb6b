"""decide(): deterministic scenarios for rules that only a random property (or nothing)
checked before: a block pinned by a prefix pin and a namespace pin at once, a parent in a
slower tier held in place by a child in a faster one, a parent dropped only once all its
children went, and the high watermark as the trigger (a tier at it is left alone)."""

from __future__ import annotations

from controlplane.core.access_stats import AccessStats
from controlplane.core.policy import Demote, Evict, Pins, Policy, Promote, TierPolicy, decide
from protos.block_hash import ROOT_PARENT_HASH
from protos.tier import Tier
from tests.policy.support import FakeAgent, h, view

ROOT = ROOT_PARENT_HASH
FULL = TierPolicy(low_watermark=1.0, high_watermark=1.0)
EXACT = Policy(gpu=FULL, cpu=FULL, disk=FULL)


def record(stats: AccessStats, ids: list[int], t: float) -> None:
    stats.record_lookup([h(i) for i in ids], t)


def applied(v, actions) -> FakeAgent:
    """The agent after the actions, each step checked (pins, leaves first, prefix closed)."""
    agent = FakeAgent(v.agents[0], v.pins)
    for a in actions:
        agent.apply(a)
    agent.check_prefix_closed()
    return agent


def test_a_block_under_a_prefix_pin_and_a_namespace_pin_is_held_at_the_faster_tier():
    """Where both kinds of pin apply the faster tier wins, whichever kind names it."""
    both = [
        Pins(blocks={h(0): Tier.DISK}, namespaces={"kb": Tier.GPU}, block_namespaces={h(0): "kb"}),
        Pins(blocks={h(0): Tier.GPU}, namespaces={"kb": Tier.DISK}, block_namespaces={h(0): "kb"}),
    ]
    for pins in both:
        assert pins.min_tier(h(0)) is Tier.GPU
        # held in CPU, pinned at GPU by one of its two pins: promoted back
        stats = AccessStats()
        record(stats, [0], 1.0)
        v = view({"a": {Tier.GPU: (4, {}), Tier.CPU: (4, {h(0): ROOT})}}, stats, pins)
        assert decide(v, Policy(promote_hot=False), now=2.0) == [Promote("a", (h(0),), Tier.GPU)]
        # held in a full GPU tier: the other block goes down, never the pinned one
        stats = AccessStats()
        record(stats, [0], 0.2)  # the pinned block is the older one: still kept
        record(stats, [1], 0.5)
        v = view({"a": {Tier.GPU: (1, {h(0): ROOT, h(1): ROOT}), Tier.CPU: (4, {})}}, stats, pins)
        actions = decide(v, EXACT, now=2.0)
        assert actions == [Demote("a", (h(1),), Tier.GPU, Tier.CPU)]
        applied(v, actions)


def test_a_parent_is_not_demoted_below_a_child_held_in_a_faster_tier():
    """CPU is over by one; its oldest block is the parent of a block in GPU, so the
    other one goes down to disk: the parent would sit slower than its child otherwise
    (and could then leave neither tier)."""
    stats = AccessStats()
    record(stats, [0, 1], 1.0)  # the parent (CPU) and its child (GPU): older
    record(stats, [2], 2.0)
    v = view(
        {"a": {Tier.GPU: (1, {h(1): h(0)}), Tier.CPU: (1, {h(0): ROOT, h(2): ROOT}), Tier.DISK: (4, {})}},
        stats,
    )
    actions = decide(v, EXACT, now=3.0)
    assert actions == [Demote("a", (h(2),), Tier.CPU, Tier.DISK)]
    applied(v, actions)


def test_a_parent_is_dropped_only_once_every_child_of_it_went():
    """Two children of one parent, one tier, two blocks to drop. The parent ranks lowest
    once one child went, but the other child still holds it: that child goes instead."""
    stats = AccessStats()
    record(stats, [0, 1], 1.0)  # parent and first child: oldest
    record(stats, [2], 5.0)  # the second child (its lookup alone: the parent stays old)
    v = view({"a": {Tier.GPU: (1, {h(0): ROOT, h(1): h(0), h(2): h(0)})}}, stats)
    actions = decide(v, EXACT, now=6.0)
    assert actions == [Evict("a", (h(1), h(2)))]
    applied(v, actions)


def test_a_tier_at_its_high_watermark_is_left_alone_while_the_pass_runs_for_another():
    """GPU holds exactly its high watermark (19 of 20 at 0.95) while CPU is over: the pass
    runs, and only CPU shrinks (a tier is brought down only when *above* its high mark)."""
    stats = AccessStats()
    gpu = {h(i): ROOT for i in range(19)}
    cpu = {h(i): ROOT for i in range(100, 120)}  # 20 of 20: over 0.95
    for i in range(19):
        record(stats, [i], 10.0 + i)
    for i in range(100, 120):
        record(stats, [i], 1.0 + i / 1000)
    policy = Policy(
        gpu=TierPolicy(0.90, 0.95), cpu=TierPolicy(0.90, 0.95), disk=TierPolicy(0.90, 0.95), promote_hot=False
    )
    v = view({"a": {Tier.GPU: (20, gpu), Tier.CPU: (20, cpu), Tier.DISK: (100, {})}}, stats)
    actions = decide(v, policy, now=100.0)
    assert [(type(a), getattr(a, "from_tier", None)) for a in actions] == [(Demote, Tier.CPU)]
    assert len(actions[0].block_hashes) == 2  # 20 -> 18 (low watermark)
    agent = applied(v, actions)
    assert agent.used(Tier.GPU) == 19
