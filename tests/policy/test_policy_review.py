"""The tier policy and its pass, as a review found them wanting: a block two agents hold
dropped by both in one pass, a pinned child promoted above its parent, a command answered
before it was recorded, live changes the tuner missed, a stored policy's one bad key
taking valid watermarks with it, values rounded, and two clocks mixed."""

from __future__ import annotations

import queue

from controlplane.core.access_stats import AccessStats
from controlplane.core.cluster import AgentRecord, BlockGroup, Cluster, TierUsage
from controlplane.core.policy import Evict, Pins, Policy, TierPolicy, decide
from controlplane.manager import Manager
from controlplane.manager_policy import validate_policy
from protos.block_hash import ROOT_PARENT_HASH
from protos.tier import Tier
from tests.policy.support import FakeAgent, h, view
from tests.policy.test_policy_pass import MODEL, chain, parents_of

FULL = TierPolicy(low_watermark=1.0, high_watermark=1.0)
EXACT = Policy(gpu=FULL, cpu=FULL, disk=FULL)
BLOCK_BYTES = 2 * 2 * 16 * 2 * 128 * 2


class Clock:
    def __init__(self):
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def add_agent(cluster: Cluster, agent_id: str, tiers, outbox: queue.Queue | None = None) -> queue.Queue:
    usage = [
        TierUsage(t, cap * BLOCK_BYTES, sum(map(len, chains)) * BLOCK_BYTES, sum(map(len, chains)))
        for t, (cap, chains) in tiers.items()
    ]
    cluster.register(AgentRecord(agent_id, f"{agent_id}:1", [MODEL], usage))
    cluster.hello(agent_id, "s")
    groups = [BlockGroup("m", t, b"".join(c), parents_of(c)) for t, (_, chains) in tiers.items() for c in chains]
    assert cluster.apply_inventory_chunk(agent_id, 0, 0, True, groups) is None
    outbox = outbox if outbox is not None else queue.Queue()
    cluster.attach_outbox(agent_id, "s", outbox)
    return outbox


def drained(q: queue.Queue) -> list:
    out = []
    while not q.empty():
        out.append(q.get())
    return out


def evicted(q: queue.Queue) -> set[bytes]:
    return {
        c.block_hashes[i : i + 16] for c in drained(q) if c.kind == "evict" for i in range(0, len(c.block_hashes), 16)
    }


def test_a_block_two_agents_hold_is_not_dropped_by_both_in_one_pass():
    """Each discounted the newest block as held elsewhere and dropped it: every copy gone."""
    stats = AccessStats()
    stats.record_lookup([h(1)], 1.0)
    stats.record_lookup([h(2)], 1.0)
    stats.record_lookup([h(0)], 5.0)  # shared, the newest
    agents = {
        "a": {Tier.GPU: (1, {h(0): ROOT_PARENT_HASH, h(1): ROOT_PARENT_HASH})},
        "b": {Tier.GPU: (1, {h(0): ROOT_PARENT_HASH, h(2): ROOT_PARENT_HASH})},
    }
    actions = decide(view(agents, stats, turnover_seconds=10.0), EXACT, now=6.0)
    dropped = {(a.agent_id, b) for a in actions if isinstance(a, Evict) for b in a.block_hashes}
    assert ("a", h(0)) in dropped  # the first holder still prefers the replicated copy ...
    assert ("b", h(0)) not in dropped and ("b", h(2)) in dropped  # ... the last keeps it


def test_the_pass_keeps_one_copy_of_a_shared_prefix_when_every_holder_is_over():
    clock = Clock()
    cluster = Cluster(clock=clock)
    manager = Manager(cluster, durable=None, election=None, clock=clock)
    cluster.on_lookup = manager.note_lookup
    shared, a_own, b_own = chain(9, 4), chain(1, 4), chain(2, 4)
    out = {a: add_agent(cluster, a, {Tier.CPU: (8, [shared, own])}) for a, own in (("a", a_own), ("b", b_own))}
    cluster.lookup("m", block_hashes=b"".join(a_own))
    cluster.lookup("m", block_hashes=b"".join(b_own))
    clock.now += 60
    cluster.lookup("m", block_hashes=b"".join(shared))  # the newest
    clock.now += 1
    manager.policy_pass(clock())
    dropped = {a: evicted(q) for a, q in out.items()}
    assert not (dropped["a"] & dropped["b"] & set(shared)), dropped


def test_a_pinned_block_goes_up_with_its_ancestors_never_above_its_parent():
    """Only the pinned tail went up: its parent, left below, was no tail and could
    never leave its tier again."""
    stats = AccessStats()
    stats.record_lookup([h(0), h(1)], 1.0)
    pins = Pins(blocks={h(1): Tier.GPU})
    tiers = {
        Tier.GPU: (4, {}),
        Tier.CPU: (4, {h(0): ROOT_PARENT_HASH, h(1): h(0)}),
        Tier.DISK: (8, {}),
    }
    v = view({"a": tiers}, stats, pins)
    agent = FakeAgent(v.agents[0], pins)
    for action in decide(v, EXACT, now=2.0):
        agent.apply(action)
    assert agent.tier_of[h(1)] == Tier.GPU and agent.tier_of[h(0)] == Tier.GPU


class AnsweringOutbox(queue.Queue):
    """An agent that answers a command the moment it is queued."""

    def __init__(self, manager: Manager, agent_id: str):
        super().__init__()
        self.manager, self.agent_id = manager, agent_id

    def put(self, item, block=True, timeout=None):
        super().put(item, block, timeout)
        self.manager.on_op_update(self.agent_id, item.op_id, "SUCCEEDED", 1, 1, 0, 0, "")


def test_a_command_answered_before_it_was_recorded_does_not_shut_its_agent_out():
    clock = Clock()
    cluster = Cluster(clock=clock)
    manager = Manager(cluster, durable=None, election=None, clock=clock)
    outbox = AnsweringOutbox(manager, "a")
    add_agent(cluster, "a", {Tier.CPU: (16, [chain(1, 8), chain(2, 8)])}, outbox)
    manager.policy_pass(clock())
    assert len(drained(outbox)) == 1 and not manager._policy_inflight.get("a")
    clock.now += 10
    manager.policy_pass(clock())  # still over (nothing moved): decided for again
    assert len(drained(outbox)) == 1


def test_live_policy_changes_reach_the_credit_tuner():
    clock = Clock()
    cluster = Cluster(clock=clock)
    manager = Manager(cluster, durable=None, election=None, clock=clock, policy_validator=validate_policy)
    cluster.on_lookup = manager.note_lookup
    add_agent(cluster, "a", {Tier.CPU: (16, [chain(1, 8), chain(2, 8)])})
    manager.policy = validate_policy({})
    manager.policy_pass(clock())
    assert manager.tuner is not None and (manager.tuner.max_reuse_credits, manager.tuner.default) == (3, 2.0)
    manager.policy = validate_policy({"max_reuse_credits": "0", "reuse_credit_turnovers": "1"})
    manager._policy_inflight.clear()
    clock.now += 5
    manager.policy_pass(clock())
    assert (manager.tuner.max_reuse_credits, manager.tuner.default) == (0, 1.0)


def test_one_bad_stored_key_leaves_the_valid_watermarks_as_set():
    """Checked one by one against the defaults, a lowered high watermark (0.5, valid with
    its low 0.4) was refused and the tier ran to 0.95."""
    m = Manager(Cluster(clock=Clock()), durable=None, election=None, clock=Clock(), policy_validator=validate_policy)
    stored = validate_policy({"gpu.high_watermark": "0.5", "gpu.low_watermark": "0.4"})
    loaded = m._valid_stored_policy(dict(sorted({**stored, "gpu.high_watermak": "0.6"}.items())))
    assert (loaded["gpu.high_watermark"], loaded["gpu.low_watermark"]) == ("0.5", "0.4")
    assert "gpu.high_watermak" not in loaded


def test_a_policy_value_is_kept_as_given_not_rounded():
    out = validate_policy({"gpu.high_watermark": "0.9999999", "reuse_credit_turnovers": "123.4567"})
    assert (out["gpu.high_watermark"], out["reuse_credit_turnovers"]) == ("0.9999999", "123.4567")
    assert validate_policy({"gpu.high_watermark": "0.9"})["gpu.high_watermark"] == "0.9"


def test_lookups_store_stamps_and_the_pass_read_one_clock(controlplane):
    """The cluster stamped lookups with the host's clock and the pass used a steady one:
    after a step of the host's clock back, the blocks in use ranked as the oldest."""
    assert controlplane.cluster._clock is controlplane.manager.clock is controlplane.clock
