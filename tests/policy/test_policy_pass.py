"""The control plane's policy pass at scale: parents live in the index (one column, set
from STORED events and inventories), and a pass copies out only the agents that can have
anything to do, within a budget of blocks per pass, longest-waiting first."""

from __future__ import annotations

import queue

import numpy as np
import pytest

from controlplane.core.cluster import AgentCommand, AgentRecord, BlockGroup, Cluster, ModelInfo, TierUsage
from controlplane.core.index import BlockIndex
from controlplane.manager import Manager
from protos import errors
from protos.block_hash import ROOT_PARENT_HASH
from protos.tier import Tier

MODEL = ModelInfo("m", 16, num_layers=2, num_kv_heads=2, head_dim=128, dtype="float16")  # 32 KiB blocks


def chain(agent: int, n: int, start: int = 0) -> list[bytes]:
    rng = np.random.default_rng([agent, start])
    return [rng.bytes(16) for _ in range(n)]


def parents_of(c: list[bytes]) -> bytes:
    return ROOT_PARENT_HASH + b"".join(c[:-1])


def test_a_cordoned_agents_copy_is_no_replica():
    """The policy prefers victims with a replica elsewhere; a copy on a cordoned agent
    (routers are not sent there) must not make the copy in rotation look expendable:
    draining an agent would then evict what the cluster still serves from."""
    from controlplane.core.cluster import AgentRecord, BlockGroup, Cluster, ModelInfo

    cluster = Cluster()
    c = chain(0, 4)
    for agent_id in ("a", "b", "c"):
        cluster.register(AgentRecord(agent_id, f"{agent_id}:1", [ModelInfo("m", 16)], []))
        cluster.hello(agent_id, "s")
    cluster.apply_inventory_chunk("a", 0, 0, True, [BlockGroup("m", Tier.CPU, b"".join(c), parents_of(c))])
    cluster.apply_inventory_chunk("b", 0, 0, True, [BlockGroup("m", Tier.CPU, b"".join(c[:2]), parents_of(c[:2]))])
    cluster.apply_inventory_chunk("c", 0, 0, True, [BlockGroup("m", Tier.CPU, b"".join(c[:1]), parents_of(c[:1]))])

    def replicated(agent_id: str) -> set[bytes]:
        chains = cluster.agent_chains(agent_id)
        return set(chains.keys[chains.replicated].tolist())

    assert replicated("a") == set(c[:2])
    cluster.set_cordoned({"b": "drained"})
    assert replicated("a") == set(c[:1])  # c still holds the first block; b's copies no longer count
    assert replicated("b") == set(c[:2])  # the cordoned agent's own copies have replicas in rotation
    cluster.set_cordoned({"b": "drained", "c": "drained"})
    assert replicated("a") == set()


def test_index_keeps_parents_per_block_and_forgets_them_with_the_block():
    idx = BlockIndex()
    c = chain(0, 5)
    idx.add("a", b"".join(c), Tier.CPU, parents_of(c))
    idx.add("b", b"".join(c[:2]), Tier.GPU)  # no parents told: the known ones stay
    keys, tiers, parents, replicated, _ = idx.agent_chains("a")
    got = dict(zip(keys.tolist(), parents.tolist(), strict=True))
    assert got == dict(zip(c, [ROOT_PARENT_HASH, *c[:-1]], strict=True))
    assert set(tiers.tolist()) == {int(Tier.CPU)}
    assert set(keys[replicated].tolist()) == set(c[:2])
    assert idx.parent_of(c[3]) == c[2] and idx.parent_of(bytes(range(16))) is None
    # a freed entry is reused by another block without its parent
    idx.remove("a", b"".join(c[2:]))
    idx.add("a", b"".join(chain(1, 3)), Tier.CPU)
    assert all(idx.parent_of(h) == ROOT_PARENT_HASH for h in chain(1, 3))
    # parents that do not pair with the blocks change nothing
    with pytest.raises(ValueError, match="parent hashes for"):
        idx.add("a", b"".join(c[2:]), Tier.DISK, parents_of(c))
    with pytest.raises(ValueError):
        idx.replace_agent_packed("a", [(b"".join(c), 2, parents_of(c)[:-16])])
    assert idx.num_agent_blocks("a") == 5 and idx.tiers_held("a", b"".join(c)).tolist() == [2, 2, 0, 0, 0]


def test_cluster_rejects_parents_that_do_not_pair_naming_the_field():
    cl = Cluster(clock=lambda: 0.0)
    cl.register(AgentRecord("a", "a:1", [MODEL], []))
    cl.hello("a", "s")
    assert cl.apply_inventory_chunk("a", 0, 0, True, []) is None
    c = chain(0, 4)
    with pytest.raises(errors.InvalidArgument, match="parent_hashes"):
        cl.apply_events("a", 1, True, [BlockGroup("m", Tier.CPU, b"".join(c), parents_of(c)[16:])])
    assert cl.index.num_replicas == 0
    assert cl.apply_events("a", 1, True, [BlockGroup("m", Tier.CPU, b"".join(c), parents_of(c))]) is None
    assert cl.index.parent_of(c[1]) == c[0]


class Fleet:
    """A Cluster with agents on open (queue) streams and a Manager deciding for them."""

    def __init__(self) -> None:
        self.cluster = Cluster(clock=lambda: 100.0)
        self.manager = Manager(self.cluster, durable=None, election=None, clock=lambda: 100.0)
        self.cluster.on_lookup = self.manager.note_lookup  # as the server wires it
        self.outboxes: dict[str, queue.Queue] = {}
        self.bb = 2 * 2 * 16 * 2 * 128 * 2  # MODEL's block bytes: capacities below are counted in it

    def agent(self, agent_id: str, tiers: dict[Tier, tuple[int, list[list[bytes]]]]) -> None:
        """tiers: tier -> (capacity in blocks, chains held there)."""
        usage = [
            TierUsage(t, cap * self.bb, sum(map(len, ch)) * self.bb, sum(map(len, ch)))
            for t, (cap, ch) in tiers.items()
        ]
        self.cluster.register(AgentRecord(agent_id, f"{agent_id}:1", [MODEL], usage))
        self.cluster.hello(agent_id, "s")
        groups = [(b"".join(c), int(t), parents_of(c)) for t, (_, chs) in tiers.items() for c in chs]
        assert (
            self.cluster.apply_inventory_chunk(
                agent_id, 0, 0, True, [BlockGroup("m", Tier(t), h, p) for h, t, p in groups]
            )
            is None
        )
        self.outboxes[agent_id] = queue.Queue()
        self.cluster.attach_outbox(agent_id, "s", self.outboxes[agent_id])

    def commands(self, agent_id: str) -> list[AgentCommand]:
        out = []
        while not self.outboxes[agent_id].empty():
            out.append(self.outboxes[agent_id].get())
        return out


def test_pass_decides_only_for_agents_that_can_have_something_to_do(monkeypatch):
    f = Fleet()
    copied = []
    real = f.cluster.agent_chains
    monkeypatch.setattr(f.cluster, "agent_chains", lambda a: copied.append(a) or real(a))
    full = [chain(1, 8), chain(2, 8)]  # 16 blocks in a tier of 16: over the 0.95 high watermark
    f.agent("over", {Tier.CPU: (16, full)})
    f.agent("calm", {Tier.CPU: (100, [chain(3, 8)])})
    cold = [chain(4, 6)]
    f.agent("room", {Tier.CPU: (100, []), Tier.DISK: (100, cold)})
    f.manager.policy_pass(100.0)
    assert copied == ["over"]
    (cmd,) = f.commands("over")
    assert cmd.kind == "evict"
    dropped = [cmd.block_hashes[i : i + 16] for i in range(0, len(cmd.block_hashes), 16)]
    # down to the 0.90 low watermark (14 of 16) by tails: the last blocks of chains
    assert len(dropped) == 2 and all(h in (full[0][-2:] + full[1][-2:]) for h in dropped)
    for h in dropped:  # a child before its parent
        for c in full:
            if h in c and c[c.index(h) - 1] in dropped:
                assert dropped.index(h) < dropped.index(c[c.index(h) - 1])
    assert f.commands("room") == []
    # a lookup that finds 'room' holding the prefix on disk (below its fastest tier): the
    # next pass decides for it, promoting what was reused
    for _ in range(2):
        f.cluster.lookup("m", block_hashes=b"".join(cold[0]))
    copied.clear()
    f.manager._policy_inflight.clear()
    f.manager.policy_pass(101.0)
    assert "room" in copied and "calm" not in copied
    (cmd,) = f.commands("room")
    assert cmd.kind == "move" and cmd.tier == int(Tier.CPU)


def test_an_agent_back_on_a_new_stream_is_decided_for_again_at_once():
    """A policy command went to an agent that then restarted before answering: the new
    process never heard of it, so the next pass decides for it again instead of waiting
    for the old command's timeout."""
    f = Fleet()
    f.agent("a", {Tier.CPU: (16, [chain(1, 8), chain(2, 8)])})
    f.manager.policy_pass(100.0)
    assert len(f.commands("a")) == 1
    f.manager.policy_pass(101.0)
    assert f.commands("a") == []  # its command is in flight on that stream
    f.cluster.hello("a", "s2")  # the agent restarted: a new stream
    f.outboxes["a"] = queue.Queue()
    f.cluster.attach_outbox("a", "s2", f.outboxes["a"])
    f.manager.policy_pass(102.0)
    assert len(f.commands("a")) == 1


def test_pass_budget_takes_the_longest_waiting_agents_first():
    f = Fleet()
    for name in ("a", "b", "c"):
        f.agent(name, {Tier.CPU: (16, [chain(hash(name) % 1000, 16)])})
    f.manager.policy_max_blocks_per_pass = 20  # one agent's 16 blocks a pass
    decided = []
    for step in range(3):
        f.manager._policy_inflight.clear()
        f.manager.policy_pass(100.0 + step)
        decided.append(sorted(a for a in "abc" if f.commands(a)))
    assert decided == [["a"], ["b"], ["c"]]


def test_pass_statistics_reach_the_metrics():
    from prometheus_client import CollectorRegistry

    from controlplane.metrics import ControlPlaneMetrics

    f = Fleet()
    f.agent("over", {Tier.CPU: (16, [chain(1, 8), chain(2, 8)])})
    f.agent("calm", {Tier.CPU: (100, [chain(3, 8)])})
    registry = CollectorRegistry()
    metrics = ControlPlaneMetrics(registry, f.cluster, process=False)
    metrics.collector.policy_source = f.manager.policy_stats
    f.manager.policy_pass(100.0)
    v = registry.get_sample_value
    assert v("kvcp_policy_passes_total") == 1
    assert v("kvcp_policy_agents_decided_total") == 1  # 'calm' was not copied out
    assert v("kvcp_policy_actions_total") == 1
    assert v("kvcp_policy_pass_seconds") > 0
    # no lookups seen: the default credit, recency order
    assert v("kvcp_policy_reuse_credit_turnovers") == f.manager.tier_policy().reuse_credit_turnovers
    assert v("kvcp_policy_recent_first") == 0
    # lookups beyond the evidence queue (no pass draining it) are dropped, and counted
    for _ in range(f.manager._lookups.maxlen + 3):
        f.manager.note_lookup(b"\x01" * 16, 100.5)
    assert v("kvcp_policy_lookups_dropped_total") == 3
    # the evidence the policy keeps, for sizing the control plane's memory (a soak test
    # saw it grow for hours toward its caps, with nothing exporting it)
    lookups = [b"".join(chain(10 + i, 4)) for i in range(5)]
    for packed in lookups:
        f.manager.note_lookup(packed, 101.0)
    f.manager.policy_pass(102.0)  # drains them into the history (and the tuner's shadows)
    assert v("kvcp_policy_evidence_blocks", {"kind": "lookup_history"}) == len(f.manager.access) >= 20
    shadows = v("kvcp_policy_evidence_blocks", {"kind": "shadow_caches"})
    assert shadows == (f.manager.tuner.num_blocks() if f.manager.tuner is not None else 0)


@pytest.mark.parametrize("use_kernel", [True, False], ids=["c-loops", "numpy"])
def test_strided_parent_arrays_are_read_as_given(use_kernel):
    # a strided view is copied before the C loops read it: the copy must outlive the call
    idx = BlockIndex(use_kernel=use_kernel)
    rng = np.random.default_rng(5)
    keys = rng.integers(1, 2**63, size=(50_000, 2), dtype=np.uint64)
    wide = rng.integers(1, 2**63, size=(100_000, 2), dtype=np.uint64)
    idx.add("a", keys, Tier.CPU, wide[::2])
    got, _, parents, _, _ = idx.agent_chains("a")
    by_key = dict(zip(got.tolist(), parents.tolist(), strict=True))
    for i in range(0, 50_000, 997):
        assert by_key[keys[i].tobytes()] == wide[2 * i].tobytes()


def test_pass_leaves_alone_tiers_whose_capacity_it_cannot_tell_and_remote_pins():
    f = Fleet()
    # blocks but no bytes reported, and a model without a shape: no block size to count in
    f.cluster.register(AgentRecord("odd", "odd:1", [ModelInfo("m", 16)], [TierUsage(Tier.CPU, 10 << 20, 0, 10)]))
    f.cluster.hello("odd", "s")
    f.cluster.apply_inventory_chunk("odd", 0, 0, True, [BlockGroup("m", Tier.CPU, b"".join(chain(7, 10)))])
    f.outboxes["odd"] = queue.Queue()
    f.cluster.attach_outbox("odd", "s", f.outboxes["odd"])
    # a zero capacity reported (unknown), with blocks held
    f.agent("zero", {Tier.CPU: (0, [chain(8, 4)])})
    f.manager.policy_pass(100.0)
    assert f.commands("odd") == [] and f.commands("zero") == []
    assert f.manager.policy_agents_decided_total == 0


@pytest.mark.parametrize("use_kernel", [True, False], ids=["c-loops", "numpy"])
def test_index_stamps_a_block_when_an_agent_newly_holds_it(use_kernel):
    idx = BlockIndex(use_kernel=use_kernel)
    old, new = chain(0, 3), chain(1, 2)
    idx.add("a", b"".join(old), Tier.CPU)  # before any clock: not known
    assert np.isnan(idx.agent_chains("a").stored_seconds).all()

    def stamps(agent: str) -> dict[bytes, float]:
        got = idx.agent_chains(agent)
        return dict(zip(got.keys.tolist(), np.round(got.stored_seconds, 3).tolist(), strict=True))

    idx.remove("a", b"".join(old))
    idx.set_clock(1000.0)
    idx.add("a", b"".join(old), Tier.CPU)
    idx.set_clock(1005.0)
    idx.add("a", b"".join(new), Tier.CPU)
    idx.add("a", b"".join(old), Tier.DISK)  # a tier change is not a store
    assert stamps("a") == dict.fromkeys(old, 1000.0) | dict.fromkeys(new, 1005.0)
    idx.set_clock(1010.0)
    idx.add("b", old[0], Tier.GPU)  # another agent newly holds it: a use of the block
    assert stamps("a")[old[0]] == 1010.0 and stamps("b") == {old[0]: 1010.0}
    # an inventory keeps the stamps of what the agent held and stamps the rest
    idx.set_clock(1020.0)
    extra = chain(2, 1)
    idx.replace_agent_packed("a", [(b"".join(old[1:] + extra), int(Tier.CPU))])
    assert stamps("a") == dict.fromkeys(old[1:], 1000.0) | {extra[0]: 1020.0}
    # a freed entry reused by another block carries the new block's stamp
    idx.remove("a", b"".join(old[1:]))
    idx.set_clock(1030.0)
    idx.add("a", b"".join(chain(3, 2)), Tier.CPU)
    assert set(stamps("a").values()) == {1020.0, 1030.0}


def test_blocks_no_lookup_named_go_oldest_store_first():
    """A fleet whose engines store without asking kvcp (vLLM KV events only): the pass
    ranks those blocks by when they were stored, not all below everything by hash."""
    now = [100.0]
    f = Fleet()
    f.cluster._clock = lambda: now[0]
    chains = [chain(10 + i, 4) for i in range(4)]
    f.agent("a", {Tier.CPU: (16, [])})
    for seq, c in enumerate(chains, start=1):  # one chain stored every 10 s, none looked up
        now[0] = 100.0 + 10 * seq
        assert f.cluster.apply_events("a", seq, True, [BlockGroup("m", Tier.CPU, b"".join(c), parents_of(c))]) is None
    # the oldest chain is asked for now: it is the most recently used of them all
    now[0] = 160.0
    f.cluster.lookup("m", block_hashes=b"".join(chains[0]))
    f.cluster.agent("a").tiers = [TierUsage(Tier.CPU, 16 * f.bb, 16 * f.bb, 16)]
    f.manager.policy_pass(160.0)
    (cmd,) = f.commands("a")
    dropped = {cmd.block_hashes[i : i + 16] for i in range(0, len(cmd.block_hashes), 16)}
    # 16 -> 14 blocks: the two last blocks of the chain stored longest ago and not asked for since
    assert dropped == set(chains[1][-2:])
    # a stamp the index does not know (NaN) is no evidence
    from controlplane.core.policy import Policy, block_priority

    assert block_priority(None, 0.0, Policy(), False, 10.0, float("nan")) == float("-inf")
    assert block_priority(None, 0.0, Policy(), False, 10.0, 5.0) == 5.0


# ---- pins as the pass reads them -------------------------------------------------------
def _pin(pin_id: str, c: list[bytes], tier: Tier, created: float, agent_id: str = ""):
    from controlplane.core.pins import Pin

    return Pin(pin_id, "default", "m", b"".join(c), tier, created, 1e12, agent_id=agent_id)


def _moves(f: Fleet, agent_id: str) -> list[tuple[str, int, int]]:
    return [(c.kind, c.tier, len(c.block_hashes) // 16) for c in f.commands(agent_id)]


def test_two_pins_on_one_block_bind_at_the_faster_tier():
    f = Fleet()
    c = chain(1, 4)
    f.agent("a", {Tier.GPU: (4, [c]), Tier.CPU: (100, [])})  # GPU full: over its high watermark
    f.manager.pins["gpu"] = _pin("gpu", c, Tier.GPU, 0)
    f.manager.pins["disk"] = _pin("disk", c, Tier.DISK, 1)  # newer, slower: must not loosen the first
    f.manager._apply_pins = lambda now: None
    f.manager.policy_pass(100.0)
    assert _moves(f, "a") == []  # nothing of the GPU-pinned prefix leaves the GPU


def test_a_pin_scoped_to_one_agent_binds_that_agent_only():
    f = Fleet()
    c = chain(2, 4)
    f.agent("a", {Tier.GPU: (100, [c]), Tier.CPU: (100, [])})
    f.agent("b", {Tier.GPU: (100, []), Tier.CPU: (100, [c])})
    f.manager.pins["a-only"] = _pin("a-only", c, Tier.GPU, 0, agent_id="a")
    f.manager._apply_pins = lambda now: None
    f.manager.policy_pass(100.0)
    assert _moves(f, "b") == []  # b's copy is not promoted for a pin that is not b's


class PinsInMemory:
    """The pin part of DurableStore over a dict (etcd's create-if-absent included)."""

    def __init__(self):
        self.kv = {}

    def put(self, key, value, lease=0, replacing=""):
        if replacing:
            self.kv.pop(replacing, None)
        self.kv[key] = value

    def delete_pin(self, pin):  # only the version it names, as DurableStore.delete_pin
        from controlplane.store.durable import pin_from_json, pin_key

        held = self.kv.get(pin_key(pin))
        if held is not None and pin_from_json(held).version == pin.version:
            del self.kv[pin_key(pin)]

    def create(self, key, value, lease=0):
        if key in self.kv:
            return self.kv[key]
        self.kv[key] = value
        return None

    def delete(self, key):
        self.kv.pop(key, None)

    def lease_alive(self, lease):
        return True

    def load_pins(self):
        from controlplane.store.durable import pin_from_json

        return [pin_from_json(v) for v in self.kv.values()]


def test_a_pin_made_while_pins_reload_is_kept():
    from controlplane.core.scope import Scope
    from controlplane.store.durable import pin_from_json

    f = Fleet()
    m = f.manager
    c = chain(3, 4)
    f.agent("a", {Tier.GPU: (100, [c])})
    created = []

    class Durable(PinsInMemory):  # etcd's range read, with a Pin RPC landing on another thread meanwhile
        def load_pins(self):
            snapshot = [pin_from_json(v) for v in self.kv.values()]
            created.append(m.pin(Scope(model_id="m", block_hashes=b"".join(c)), Tier.GPU, 3600))
            return snapshot

    m.durable = Durable()
    m._reload_pins()
    assert created[0].pin_id in m.pins
    m._apply_pins(100.0)
    assert [cmd.kind for cmd in f.commands("a")] == ["pin"]


def test_blocks_an_agent_says_its_pins_hold_are_left_alone_until_a_pin_goes():
    """A namespace pin the control plane cannot map to blocks: the agent refuses the
    evictions and names the blocks; the next pass evicts others instead of asking again."""
    f = Fleet()
    chains = [chain(100 + i, 1) for i in range(100)]
    f.agent("a", {Tier.GPU: (100, chains)})  # 100 of 100: over the high watermark
    m = f.manager
    m.policy_pass(100.0)
    (first,) = f.commands("a")
    refused = [first.block_hashes[i : i + 16] for i in range(0, len(first.block_hashes), 16)]
    assert first.kind == "evict" and refused
    m.on_op_update(
        "a",
        first.op_id,
        "SUCCEEDED",
        0,
        len(refused),
        len(refused),
        0,
        "",
        pinned=[(h, int(Tier.GPU)) for h in refused],
    )
    m.policy_pass(101.0)
    (second,) = f.commands("a")
    again = {second.block_hashes[i : i + 16] for i in range(0, len(second.block_hashes), 16)}
    assert second.kind == "evict" and again and not again & set(refused)
    # any pin going away: what the agent refused may be free now, and is asked for again
    m.on_op_update("a", second.op_id, "SUCCEEDED", 0, len(again), len(again), 0, "")
    m.pins["p"] = _pin("p", chain(999, 1), Tier.GPU, 0)

    class Durable:  # etcd's delete of the pin's key
        def delete(self, key):
            pass

    m.durable = Durable()
    m.unpin("p")
    f.commands("a")  # the unpin sent
    m.policy_pass(102.0)
    (third,) = f.commands("a")
    assert {third.block_hashes[i : i + 16] for i in range(0, len(third.block_hashes), 16)} & set(refused)


def test_policy_command_ids_do_not_repeat_across_leaders():
    """An agent may still run a deposed leader's command when the next leader decides: the
    next leader's ids are its own, so the two are never confused on the agent or in the
    in-flight bookkeeping."""
    f = Fleet()
    f.agent("over", {Tier.CPU: (16, [chain(1, 8), chain(2, 8)])})
    f.manager.policy_pass(100.0)
    (first,) = f.commands("over")
    f.manager = Manager(f.cluster, durable=None, election=None, clock=lambda: 100.0)  # the next leader
    f.manager.policy_pass(100.0)
    (second,) = f.commands("over")
    assert first.op_id.startswith("policy-") and second.op_id.startswith("policy-")
    assert first.op_id != second.op_id


def test_a_step_of_the_host_clock_neither_ends_a_pin_early_nor_keeps_it_late():
    """The manager's clock reads the host's clock once and follows the monotonic clock
    after: a pin of 60 s survives the host clock jumping an hour ahead (NTP step, `date
    -s`), ends 60 s after it was made by the monotonic clock, and the time left an agent
    is told comes from the same clock."""
    from controlplane.api.convert import command_to_pb
    from controlplane.core.clock import SteadyWallClock
    from controlplane.core.scope import Scope

    wall, mono = [1_000_000.0], [50.0]
    f = Fleet()
    m = f.manager
    assert isinstance(Manager(f.cluster, durable=None, election=None).clock, SteadyWallClock)  # the default
    m.clock = SteadyWallClock(lambda: wall[0], lambda: mono[0])
    c = chain(5, 2)
    f.agent("a", {Tier.GPU: (100, [c])})

    m.durable = PinsInMemory()
    pin = m.pin(Scope(model_id="m", block_hashes=b"".join(c)), Tier.GPU, 60)
    assert pin.expires_unix_seconds == 1_000_060.0
    [sent] = [cmd for cmd in f.commands("a") if cmd.kind == "pin"]
    wall[0] += 3600.0  # the host's clock steps an hour ahead
    mono[0] += 30.0
    m._expire_pins(m.clock())
    assert pin.pin_id in m.pins  # 30 s of its 60 have passed, whatever the host clock says
    ttl = command_to_pb(sent, 1, m.clock()).command.ttl_seconds
    assert 29.0 <= ttl <= 30.0, ttl
    mono[0] += 31.0
    m._expire_pins(m.clock())
    assert pin.pin_id not in m.pins and m.pins_expired_total == 1


def test_an_operation_says_its_state_once_not_at_every_progress_report():
    """The Events screen listed a cleanup's `SUCCEEDED` twice: an event went out at every
    change of the operation (progress too), not when its state changed."""
    from controlplane.core import operations as ops

    f = Fleet()
    m = f.manager
    m.durable = PinsInMemory()
    op = ops.new_operation("cleanup", {}, ["a"], now=100.0)
    m._register_op(op)
    for state, done in (("RUNNING", 1), ("RUNNING", 2), ("SUCCEEDED", 3), ("SUCCEEDED", 3)):
        op.state, op.done_blocks = state, done
        m._op_changed(op)
    said = [e.message for e in f.cluster.events.recent(("op_state",))]
    assert said == [f"cleanup {op.op_id}: RUNNING", f"cleanup {op.op_id}: SUCCEEDED"]


def test_a_pin_sent_on_a_stream_replaced_meanwhile_is_sent_again_on_the_new_one():
    """A new stream's Hello (another thread) landing between a pin command's queueing on
    the old stream and its noting: the note must not go to the new stream's record, which
    would then never be sent the pin (and, for an unpin, keep the agent's copy)."""
    f = Fleet()
    c = chain(5, 2)
    f.agent("a", {Tier.CPU: (100, [c])})
    m = f.manager
    m.pins["p"] = _pin("p", c, Tier.CPU, 0)
    new_outbox: queue.Queue = queue.Queue()
    send = f.cluster.send_on_stream

    def send_then_new_stream(agent_id, command):
        out = send(agent_id, command)  # queued on the old stream, lost with it
        f.cluster.hello(agent_id, "s2")  # the agent reconnected: it holds no pin
        f.cluster.attach_outbox(agent_id, "s2", new_outbox)
        f.cluster.send_on_stream = send
        return out

    f.cluster.send_on_stream = send_then_new_stream
    m._apply_pins(100.0)
    assert [cmd.kind for cmd in f.commands("a")] == ["pin"]  # the old stream's
    m._apply_pins(100.0)
    assert [new_outbox.get_nowait().kind for _ in range(new_outbox.qsize())] == ["pin"]
