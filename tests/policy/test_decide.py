"""decide(): scenarios with a fake clock, and hypothesis properties over random forests
of blocks on one or two agents with one to three tiers, random pins, watermarks and
lookup histories. Actions are applied one by one to a FakeAgent that asserts the
prefix and pin invariants at every step."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.core.access_stats import AccessStats
from controlplane.core.policy import Demote, Evict, Pins, Policy, Promote, TierPolicy, decide
from protos.block_hash import ROOT_PARENT_HASH
from protos.tier import Tier
from tests.policy.support import FakeAgent, h, view

ROOT = ROOT_PARENT_HASH
FULL = TierPolicy(low_watermark=1.0, high_watermark=1.0)
EXACT = Policy(gpu=FULL, cpu=FULL, disk=FULL)


def chain(ids: list[int]) -> dict[bytes, bytes]:
    return {h(b): (h(a) if a is not None else ROOT) for a, b in zip([None, *ids[:-1]], ids, strict=True)}


def record(stats: AccessStats, ids: list[int], t: float) -> None:
    stats.record_lookup([h(i) for i in ids], t)


def evicted(actions) -> list[bytes]:
    return [b for a in actions if isinstance(a, Evict) for b in a.block_hashes]


# ---- scenarios ----------------------------------------------------------------------------
def test_nothing_to_do_below_the_watermark():
    stats = AccessStats()
    record(stats, [0, 1], 1.0)
    v = view({"a": {Tier.GPU: (4, chain([0, 1]))}}, stats)
    assert decide(v, Policy(), now=2.0) == []


def test_evicts_tails_of_the_least_recent_chain_down_to_the_low_watermark():
    stats = AccessStats()
    record(stats, [0, 1, 2], 1.0)  # older chain
    record(stats, [3, 4, 5], 2.0)
    blocks = {**chain([0, 1, 2]), **chain([3, 4, 5])}
    policy = Policy(gpu=TierPolicy(low_watermark=0.5, high_watermark=0.8))
    actions = decide(view({"a": {Tier.GPU: (6, blocks)}}, stats, turnover_seconds=10.0), policy, now=3.0)
    # 6 blocks > 0.8 * 6: down to 3, the old chain from its tail
    assert actions == [Evict("a", (h(2), h(1), h(0)))]


def test_a_reused_block_outlives_a_newer_block_seen_once():
    stats = AccessStats()
    record(stats, [0], 1.0)
    record(stats, [0], 2.0)  # reused: one credit of 2 turnovers (2 * 10 s)
    record(stats, [1], 15.0)  # newer, seen once
    blocks = {h(0): ROOT, h(1): ROOT}
    v = view({"a": {Tier.GPU: (1, blocks)}}, stats, turnover_seconds=10.0)
    assert decide(v, EXACT, now=16.0) == [Evict("a", (h(1),))]
    # without the credit recency alone decides
    assert decide(v, Policy(gpu=FULL, reuse_credit_turnovers=0), now=16.0) == [Evict("a", (h(0),))]


def test_recent_first_evicts_the_newest_tails_and_only_when_the_policy_allows():
    """While the tuner sees loops larger than the cache (view.recent_first), the most
    recently used tails go first, credits aside; `scan_resistance=false` ignores it."""
    stats = AccessStats()
    record(stats, [0, 1, 2], 1.0)  # older chain, seen once
    record(stats, [3, 4, 5], 1.8)
    record(stats, [3, 4, 5], 2.0)  # newer chain, reused: a credit
    blocks = {**chain([0, 1, 2]), **chain([3, 4, 5])}
    policy = Policy(gpu=TierPolicy(low_watermark=0.5, high_watermark=0.8))
    v = replace(view({"a": {Tier.GPU: (6, blocks)}}, stats, turnover_seconds=10.0), recent_first=True)
    assert decide(v, policy, now=3.0) == [Evict("a", (h(5), h(4), h(3)))]
    assert decide(v, replace(policy, scan_resistance=False), now=3.0) == [Evict("a", (h(2), h(1), h(0)))]
    assert decide(replace(v, recent_first=False), policy, now=3.0) == [Evict("a", (h(2), h(1), h(0)))]


def test_credits_are_capped_so_a_once_hot_block_ages_out():
    stats = AccessStats()
    for t in range(10):
        record(stats, [0], float(t))  # 9 reuses, capped at 3 credits = 60 s
    record(stats, [1], 100.0)
    blocks = {h(0): ROOT, h(1): ROOT}
    v = view({"a": {Tier.GPU: (1, blocks)}}, stats, turnover_seconds=10.0)
    assert decide(v, EXACT, now=100.0) == [Evict("a", (h(0),))]


def test_demotes_before_dropping_with_the_codec_of_the_tier_it_lands_in():
    stats = AccessStats()
    record(stats, [0, 1, 2, 3], 1.0)
    policy = Policy(gpu=TierPolicy(0.5, 0.75), cpu=TierPolicy(0.9, 1.0, codec="int8"))
    v = view({"a": {Tier.GPU: (4, chain([0, 1, 2, 3])), Tier.CPU: (8, {})}}, stats)
    assert decide(v, policy, now=2.0) == [Demote("a", (h(3), h(2)), Tier.GPU, Tier.CPU, "int8")]


def test_cascade_gpu_to_cpu_to_disk_and_drops_only_from_the_last_tier():
    stats = AccessStats()
    record(stats, [0, 1], 1.0)  # in cpu, oldest
    record(stats, [2, 3], 2.0)  # in disk
    record(stats, [4, 5], 3.0)  # in gpu
    record(stats, [6, 7], 4.0)  # in gpu, newest
    v = view(
        {
            "a": {
                Tier.GPU: (2, {**chain([4, 5]), **chain([6, 7])}),
                Tier.CPU: (2, chain([0, 1])),
                Tier.DISK: (2, chain([2, 3])),
            }
        },
        stats,
    )
    actions = decide(v, EXACT, now=5.0)
    agent = FakeAgent(v.agents[0], v.pins)
    for a in actions:
        agent.apply(a)
    agent.check_prefix_closed()
    assert [agent.used(t) for t in (Tier.GPU, Tier.CPU, Tier.DISK)] == [2, 2, 2]
    assert set(agent.evicted) == {h(0), h(1)}  # the oldest chain leaves the agent
    assert {b: agent.tier_of[b] for b in (h(2), h(3), h(4), h(5))} == {
        h(2): Tier.DISK,
        h(3): Tier.DISK,
        h(4): Tier.CPU,
        h(5): Tier.CPU,
    }
    assert isinstance(actions[0], Evict)  # drops first, so every move has room


def test_pins_are_never_dropped_nor_demoted_below_their_tier():
    stats = AccessStats()
    record(stats, [0, 1], 1.0)
    record(stats, [2, 3], 2.0)
    pins = Pins(blocks={h(0): Tier.DISK, h(1): Tier.DISK})
    v = view({"a": {Tier.GPU: (2, {**chain([0, 1]), **chain([2, 3])})}}, stats, pins)
    assert decide(v, EXACT, now=3.0) == [Evict("a", (h(3), h(2)))]
    pins = Pins(namespaces={"kb": Tier.GPU}, block_namespaces={h(0): "kb", h(1): "kb"})
    v = view({"a": {Tier.GPU: (2, {**chain([0, 1]), **chain([2, 3])}), Tier.CPU: (4, {})}}, stats, pins)
    assert decide(v, EXACT, now=3.0) == [Demote("a", (h(3), h(2)), Tier.GPU, Tier.CPU)]


def test_a_pinned_block_held_too_slow_is_promoted_and_room_made():
    stats = AccessStats()
    record(stats, [0], 1.0)
    record(stats, [1], 2.0)
    pins = Pins(blocks={h(1): Tier.GPU})
    v = view({"a": {Tier.GPU: (1, {h(0): ROOT}), Tier.CPU: (4, {h(1): ROOT})}}, stats, pins)
    actions = decide(v, EXACT, now=3.0)
    assert actions == [Demote("a", (h(0),), Tier.GPU, Tier.CPU), Promote("a", (h(1),), Tier.GPU)]


def test_only_unpinned_victims_are_taken_and_the_rest_stays_over():
    stats = AccessStats()
    record(stats, [0, 1, 2], 1.0)
    pins = Pins(blocks={h(2): Tier.GPU})  # the tail is pinned: its parents are held by it
    v = view({"a": {Tier.GPU: (1, chain([0, 1, 2]))}}, stats, pins)
    assert decide(v, EXACT, now=2.0) == []


def test_prefers_victims_with_a_replica_elsewhere():
    stats = AccessStats()
    record(stats, [0], 1.0)
    record(stats, [1], 1.0)
    agents = {"a": {Tier.GPU: (1, {h(0): ROOT, h(1): ROOT})}, "b": {Tier.GPU: (4, {h(1): ROOT})}}
    assert decide(view(agents, stats, turnover_seconds=10.0), EXACT, now=2.0) == [Evict("a", (h(1),))]
    # with no turnover known yet the replica still breaks the tie
    assert decide(view(agents, stats, turnover_seconds=0.0), EXACT, now=2.0) == [Evict("a", (h(1),))]
    record(stats, [1], 1.5)  # now h(1) is reused: its credit outweighs the replica discount
    policy = Policy(gpu=FULL, replica_discount_credits=0.5)
    assert decide(view(agents, stats, turnover_seconds=10.0), policy, now=2.0) == [Evict("a", (h(0),))]


def test_promotes_hot_blocks_into_room_parents_first():
    stats = AccessStats()
    record(stats, [0, 1], 1.0)
    record(stats, [0, 1], 2.0)  # reused
    record(stats, [2], 2.0)  # seen once: stays
    v = view({"a": {Tier.GPU: (4, {}), Tier.CPU: (4, {**chain([0, 1]), h(2): ROOT})}}, stats)
    assert decide(v, Policy(), now=3.0) == [Promote("a", (h(0), h(1)), Tier.GPU)]
    assert decide(v, Policy(promote_hot=False), now=3.0) == []


def test_a_hot_block_is_never_promoted_above_its_parent():
    """Room for one block, and the child ranks above its parent (a tie: both used as
    often, as recently, and the child's hash the larger): promoting it alone
    would leave its parent below it, which then can be neither demoted nor dropped there,
    and that tier overflows (kvcp-bench replay --tiers gpu=100,cpu=300,disk=286 did)."""
    stats = AccessStats()
    for t in (1.0, 2.0, 3.0, 4.0, 5.0):  # both past the most credits: a tie, broken by hash
        record(stats, [0, 1], t)
    v = view({"a": {Tier.GPU: (4, {h(9): ROOT}), Tier.CPU: (4, chain([0, 1]))}}, stats)
    policy = Policy(gpu=TierPolicy(high_watermark=0.75, low_watermark=0.5))  # room for one block
    actions = decide(v, policy, now=6.0)
    assert actions == [] or actions == [Promote("a", (h(0),), Tier.GPU)]
    for action in actions:
        assert not (isinstance(action, Promote) and h(1) in action.block_hashes and h(0) not in action.block_hashes)


def test_decide_is_pure():
    stats = AccessStats()
    record(stats, [0, 1, 2, 3], 1.0)
    blocks = chain([0, 1, 2, 3])
    v = view({"a": {Tier.GPU: (2, blocks), Tier.CPU: (1, {})}}, stats)
    before = dict(v.agents[0].tiers[0].blocks)
    first = decide(v, EXACT, now=2.0)
    assert decide(v, EXACT, now=2.0) == first
    assert dict(v.agents[0].tiers[0].blocks) == before and len(stats) == 4


# ---- properties -----------------------------------------------------------------------------
TIER_SETS = [(Tier.GPU,), (Tier.CPU,), (Tier.GPU, Tier.CPU), (Tier.CPU, Tier.DISK), (Tier.GPU, Tier.CPU, Tier.DISK)]


@st.composite
def scenarios(draw):
    n = draw(st.integers(1, 24))
    # a global forest: block i's parent is an earlier block or the root
    parents = [None] + [draw(st.one_of(st.none(), st.integers(0, i - 1))) for i in range(1, n)]
    parent_of = {h(i): (h(p) if p is not None else ROOT) for i, p in enumerate(parents)}

    def closed(subset: set[int]) -> set[int]:
        out = set()
        for i in subset:
            while i is not None and i not in out:
                out.add(i)
                i = parents[i]
        return out

    agents = {}
    for a in range(draw(st.integers(1, 2))):
        tiers = draw(st.sampled_from(TIER_SETS))
        held = closed(set(draw(st.lists(st.integers(0, n - 1), max_size=n))))
        placed = {t: {} for t in tiers}
        for i in sorted(held):
            placed[draw(st.sampled_from(tiers))][h(i)] = parent_of[h(i)]
        agents[f"agent-{a}"] = {t: (draw(st.integers(0, n)), placed[t]) for t in tiers}
    stats = AccessStats()
    t = 0.0
    for _ in range(draw(st.integers(0, 12))):
        t += draw(st.floats(0.0, 50.0))
        leaf = draw(st.integers(0, n - 1))
        path = []
        i = leaf
        while i is not None:
            path.append(h(i))
            i = parents[i]
        stats.record_lookup(path[::-1], t)
    pinned = draw(st.dictionaries(st.integers(0, n - 1), st.sampled_from([Tier.GPU, Tier.CPU, Tier.DISK]), max_size=4))
    pins = Pins(blocks={h(i): tier for i, tier in pinned.items()})
    tier_policies = {}
    for label in ("gpu", "cpu", "disk"):
        high = draw(st.sampled_from([0.5, 0.75, 0.9, 1.0]))
        low = draw(st.sampled_from([x for x in (0.25, 0.5, 0.75, 0.9, 1.0) if x <= high]))
        tier_policies[label] = TierPolicy(low, high, draw(st.sampled_from(["none", "int8", "zstd"])))
    policy = Policy(
        **tier_policies,
        promote_hot=draw(st.booleans()),
        reuse_credit_turnovers=draw(st.sampled_from([0.0, 1.0, 2.0])),
    ).validate()
    turnover = draw(st.sampled_from([None, 0.0, 10.0, 100.0]))
    v = replace(view(agents, stats, pins, turnover), recent_first=draw(st.booleans()))  # loops: newest first
    return v, policy, t + 1.0


def eligible_victims(agent: FakeAgent, tier: Tier, slowest: Tier) -> list[bytes]:
    """Blocks the pass could still move out of `tier`: unpinned for this move and with
    no child holding them in place (in a tier as fast or faster; any child when the
    block would be dropped), into a next tier with room left after the pass."""
    out = []
    for b, t in agent.tier_of.items():
        if t is not tier:
            continue
        pin = agent.pins.min_tier(b)
        kids = agent.children(b)
        if tier is slowest:
            if pin is None and not kids:
                out.append(b)
        else:
            nxt = min(x for x in agent.capacity if x > tier)
            room = agent.used(nxt) < agent.capacity[nxt]
            if room and (pin is None or nxt <= pin) and all(agent.tier_of[c] > tier for c in kids):
                out.append(b)
    return out


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_decide_keeps_the_invariants(scenario):
    v, policy, now = scenario
    actions = decide(v, policy, now)
    by_agent = {av.agent_id: FakeAgent(av, v.pins) for av in v.agents}
    for a in actions:
        by_agent[a.agent_id].apply(a)  # asserts pins, leaves-first, demotion order
    for av in v.agents:
        agent = by_agent[av.agent_id]
        agent.check_prefix_closed()
        tiers = sorted(agent.capacity)
        for tv in av.tiers:
            tp = policy.tier(tv.tier)
            high = int(tp.high_watermark * tv.capacity_blocks + 1e-9)
            low = int(tp.low_watermark * tv.capacity_blocks + 1e-9)
            used = agent.used(tv.tier)
            # never over capacity (the agent could not carry the moves out) unless it was before
            assert used <= max(tv.capacity_blocks, len(tv.blocks)), (tv.tier, used, tv.capacity_blocks)
            # never above the high watermark while an unpinned victim is left
            if used > high:
                assert not eligible_victims(agent, tv.tier, tiers[-1]), (tv.tier, used, high)
            # a tier the pass shrank stops at its low watermark: not below it, and above
            # it only when victims ran out (pins, children held in place)
            if tv.tier in agent.shrunk:
                assert used >= low, (tv.tier, used, low)
                if used > low:
                    assert not eligible_victims(agent, tv.tier, tiers[-1]), (tv.tier, used, low)
        # demote before dropping: blocks leave the agent only from the slowest tier's
        # overflow, which is never drained below its low watermark
        if agent.evicted:
            last = tiers[-1]
            assert agent.used(last) >= int(policy.tier(last).low_watermark * agent.capacity[last] + 1e-9)
    for a in actions:
        if isinstance(a, Demote):  # compression on demotion: the codec of the tier it lands in
            assert a.codec == policy.tier(a.to_tier).codec
    # the same view gives the same answer
    assert decide(v, policy, now) == actions


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_child_counts_from_the_agent_give_the_same_answer(scenario):
    v, policy, now = scenario
    agents = []
    for av in v.agents:
        counts: dict[bytes, int] = {}
        for tv in av.tiers:
            for p in tv.blocks.values():
                if p != ROOT:
                    counts[p] = counts.get(p, 0) + 1
        agents.append(replace(av, num_children=counts))
    assert decide(replace(v, agents=tuple(agents)), policy, now) == decide(v, policy, now)


def test_an_unbounded_turnover_never_makes_a_priority_nan():
    """Weeks of lookups that name only known blocks drive the new-block rate to zero and
    the turnover to infinity; priorities stay numbers, and decide stays LRU-like and
    deterministic instead of ordering NaNs by chance."""
    import math

    from controlplane.core.access_stats import AccessStats
    from controlplane.core.policy import AgentView, ClusterView, Policy, TierView, block_priority, decide
    from protos.block_hash import ROOT_PARENT_HASH

    def h(i: int) -> bytes:
        return (i + 1).to_bytes(16, "big")

    stats = AccessStats()
    for i in range(10):
        stats.record_lookup([h(i)], float(i))
    for credits in (0.0, 2.0):
        p = block_priority(stats.get(h(1)), math.inf, Policy(reuse_credit_turnovers=credits), False, 20.0)
        assert not math.isnan(p)
    view = ClusterView(
        (AgentView("a", (TierView(Tier.GPU, 10, {h(i): ROOT_PARENT_HASH for i in range(10)}),)),),
        stats,
        turnover_seconds=math.inf,
    )
    evicted = [b for a in decide(view, Policy(), 20.0) for b in a.block_hashes]
    assert evicted and evicted[0] == h(0)  # the least recently looked up goes first


def test_a_tier_whose_next_tier_is_full_of_pinned_blocks_drops_instead_of_demoting():
    """CPU over its watermark over a disk tier full of pinned blocks: the pass demoted CPU
    tails into the disk anyway, the agent could make no room there, and the same failing
    demotions came back every pass (an idle agent at 100 % of a core, ~400 failed moves a
    second: a review). Only what the tiers below can take goes down; the rest is dropped
    from the tier over its watermark."""
    stats = AccessStats()
    record(stats, [0, 1], 1.0)
    record(stats, [2, 3], 2.0)
    record(stats, [10, 11], 0.5)
    pins = Pins(blocks={h(10): Tier.DISK, h(11): Tier.DISK})
    full_of_pins = {"a": {Tier.CPU: (2, {**chain([0, 1]), **chain([2, 3])}), Tier.DISK: (2, chain([10, 11]))}}
    assert decide(view(full_of_pins, stats, pins), EXACT, now=3.0) == [Evict("a", (h(1), h(0)))]
    # one free block below: one goes down, the other is dropped
    room_for_one = {"a": {Tier.CPU: (2, {**chain([0, 1]), **chain([2, 3])}), Tier.DISK: (3, chain([10, 11]))}}
    actions = decide(view(room_for_one, stats, pins), EXACT, now=3.0)
    assert sorted(evicted(actions)) == [h(0)] or sorted(evicted(actions)) == [h(1)]
    assert sum(len(a.block_hashes) for a in actions if isinstance(a, Demote)) == 1


def test_pinned_blocks_held_too_slow_go_up_only_as_far_as_room_can_be_made():
    """A namespace pinned at cpu whose blocks fill the CPU tier and spill onto disk: the
    pass promoted the disk ones "room or not", into a CPU tier of blocks that cannot
    leave it, and the agent failed the same promotions every pass (a review). They stay
    on disk until room can be made; with room for one, the parent goes first."""
    stats = AccessStats()
    record(stats, [0, 1, 2, 3], 1.0)
    pins = Pins(blocks={h(i): Tier.CPU for i in range(4)})
    spilled = {"a": {Tier.CPU: (2, {h(0): ROOT, h(1): h(0)}), Tier.DISK: (4, {h(2): h(1), h(3): h(2)})}}
    assert decide(view(spilled, stats, pins), EXACT, now=2.0) == []
    roomier = {"a": {Tier.CPU: (3, {h(0): ROOT, h(1): h(0)}), Tier.DISK: (4, {h(2): h(1), h(3): h(2)})}}
    assert decide(view(roomier, stats, pins), EXACT, now=2.0) == [Promote("a", (h(2),), Tier.CPU)]


def test_no_move_goes_into_a_tier_it_would_leave_over_capacity():
    """Moves into a tier full of blocks pinned there (that cannot leave) were sent anyway:
    GPU tails demoted into such a CPU tier, a pinned block promoted into it while the GPU
    shrink filled it; the agent failed them and the same moves came back every pass (a
    review). What cannot fit is left where it was."""
    stats = AccessStats()
    x1, x2, w = h(0), h(1), h(2)
    pins = Pins(blocks={x1: Tier.CPU, x2: Tier.CPU, w: Tier.CPU})
    v = view({"a": {Tier.GPU: (1, {x1: ROOT, x2: ROOT}), Tier.CPU: (1, {w: ROOT}), Tier.DISK: (10, {})}}, stats, pins)
    assert decide(v, EXACT, now=1.0) == []  # GPU stays over: nowhere for its tails to go
    x, z = h(10), h(11)
    pins = Pins(blocks={x: Tier.CPU, z: Tier.GPU, w: Tier.CPU})
    v = view({"a": {Tier.GPU: (1, {x: ROOT}), Tier.CPU: (1, {}), Tier.DISK: (10, {z: ROOT, w: ROOT})}}, stats, pins)
    agent = FakeAgent(v.agents[0], pins)
    for action in decide(v, EXACT, now=1.0):
        agent.apply(action)
    assert all(agent.used(t) <= cap for t, cap in agent.capacity.items())


def test_an_undone_move_frees_the_victim_it_held():
    """The capacity fit undid a promotion into a full GPU tier; the child it put back had
    held its parent in place during the shrink, so the parent stayed over the high
    watermark with room below (found by the property test above). The shrink runs again."""
    stats = AccessStats()
    pins = Pins(blocks={h(2): Tier.GPU, h(13): Tier.GPU})
    tp = TierPolicy(low_watermark=0.25, high_watermark=0.5)
    policy = Policy(gpu=tp, cpu=tp, disk=tp, reuse_credit_turnovers=0.0)
    gpu = {h(1): ROOT, h(2): ROOT, h(3): ROOT, h(4): ROOT}
    v = view({"a": {Tier.GPU: (2, gpu), Tier.CPU: (2, {h(13): h(1)})}}, stats, pins)
    agent = FakeAgent(v.agents[0], pins)
    for action in decide(v, policy, now=1.0):
        agent.apply(action)
    assert agent.used(Tier.GPU) == 1 and agent.tier_of[h(1)] is Tier.CPU  # the parent went down
