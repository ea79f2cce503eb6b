"""Cluster: registration, the Sync protocol (hello, inventory chunks, event batches with
sequence numbers) and lookups, driven directly with a fake clock."""

from __future__ import annotations

import pytest

from controlplane.core.cluster import (
    AgentCommand,
    AgentRecord,
    AgentState,
    BlockGroup,
    Cluster,
    ModelInfo,
    TierUsage,
)
from protos import errors
from protos.block_hash import hash_prefix
from protos.tier import Tier

BS = 4


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def record(agent_id: str, *models: ModelInfo) -> AgentRecord:
    return AgentRecord(
        agent_id=agent_id, address=f"{agent_id}:1", models=list(models) or [ModelInfo("m", BS)], tiers=[]
    )


def packed(n_blocks: int, start: int = 0, model_id: str = "m", extra: tuple[str, ...] = ()) -> bytes:
    return hash_prefix(model_id, range(start, start + n_blocks * BS), BS, extra)


def block(p: bytes, i: int) -> bytes:
    return p[16 * i : 16 * (i + 1)]


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def cluster(clock):
    return Cluster(clock=clock)


def ready_agent(cluster: Cluster, agent_id: str, groups: list[BlockGroup], seq: int = 0, session: str = "s1") -> None:
    cluster.register(record(agent_id))
    cluster.hello(agent_id, session)
    assert cluster.apply_inventory_chunk(agent_id, seq, 0, True, groups) is None


# ---- registration ------------------------------------------------------------------
def test_register_and_agent(cluster, clock):
    cluster.register(record("a"))
    rec = cluster.agent("a")
    assert rec.state is AgentState.SYNCING
    assert rec.registered_at_unix_seconds == clock.now
    assert cluster.model("m").block_size == BS
    assert [r.agent_id for r, _ in cluster.agents()] == ["a"]


def test_unknown_agent_is_not_found(cluster):
    with pytest.raises(errors.NotFound, match="'ghost'"):
        cluster.agent("ghost")
    with pytest.raises(errors.NotFound):
        cluster.apply_events("ghost", 1, True, [])


def test_register_rejects_empty_agent_id(cluster):
    with pytest.raises(errors.InvalidArgument) as info:
        cluster.register(record(""))
    assert info.value.field == "agent.agent_id"


@pytest.mark.parametrize("block_size", [0, -16])
def test_register_rejects_bad_block_size(cluster, block_size):
    with pytest.raises(errors.InvalidArgument) as info:
        cluster.register(record("a", ModelInfo("m", block_size)))
    assert info.value.field == "agent.models.block_size"
    assert "block_size" in str(info.value)
    with pytest.raises(errors.NotFound):
        cluster.agent("a")


def test_register_rejects_conflicting_block_size_across_agents(cluster):
    cluster.register(record("a", ModelInfo("m", 16)))
    with pytest.raises(errors.InvalidArgument) as info:
        cluster.register(record("b", ModelInfo("m", 32)))
    assert info.value.field == "agent.models.block_size"
    assert "'m'" in str(info.value) and "16" in str(info.value) and "32" in str(info.value)
    with pytest.raises(errors.NotFound):
        cluster.agent("b")
    cluster.register(record("c", ModelInfo("m", 16), ModelInfo("other", 32)))  # same size is fine
    assert cluster.model("other").block_size == 32


def test_register_rejects_conflicting_block_size_within_one_agent(cluster):
    # BUG: the check only compares against models registered earlier, so one record that
    # names the same model twice with different block sizes is accepted (first one wins).
    with pytest.raises(errors.InvalidArgument):
        cluster.register(record("a", ModelInfo("m", 16), ModelInfo("m", 32)))


def test_model_block_size_can_change_once_no_agent_serves_it(cluster):
    # BUG: `_models` is never pruned, so a model keeps its first block_size for the life
    # of the control plane even after every agent that served it is gone; the error then
    # speaks of "other agents" that do not exist.
    cluster.register(record("a", ModelInfo("m", 16)))
    cluster.remove_agent("a")
    cluster.register(record("b", ModelInfo("m", 32)))
    assert cluster.model("m").block_size == 32


def test_reregister_keeps_sync_position_and_counters(cluster, clock):
    ready_agent(cluster, "a", [BlockGroup("m", Tier.CPU, packed(2))], seq=7)
    cluster.update_stats("a", [], lookups=3, lookup_tokens=30, hit_tokens=12)
    clock.now += 5
    cluster.register(record("a"))
    rec = cluster.agent("a")
    assert (rec.session_id, rec.last_seq, rec.awaiting_inventory) == ("s1", 7, False)
    assert (rec.lookups_total, rec.lookup_tokens_total, rec.lookup_hit_tokens_total) == (3, 30, 12)
    assert rec.registered_at_unix_seconds == clock.now
    assert cluster.apply_events("a", 8, True, [BlockGroup("m", Tier.CPU, packed(3))]) is None


# ---- sync: inventory ---------------------------------------------------------------
def test_multi_chunk_inventory_swaps_in_at_the_last_chunk(cluster):
    p = packed(5)
    ready_agent(cluster, "a", [BlockGroup("m", Tier.DISK, packed(1, start=1000))])
    cluster.hello("a", "s2")
    assert cluster.agent("a").state is AgentState.SYNCING
    assert cluster.apply_inventory_chunk("a", 3, 0, False, [BlockGroup("m", Tier.GPU, p[:32])]) is None
    assert cluster.apply_inventory_chunk("a", 3, 1, False, [BlockGroup("m", Tier.CPU, p[32:48])]) is None
    # until the last chunk the old inventory is what lookups see
    assert cluster.index.agent_blocks("a") == {packed(1, start=1000): int(Tier.DISK)}
    assert cluster.lookup("m", block_hashes=p).matches == []
    last = [BlockGroup("m", Tier.DISK, p[48:]), BlockGroup("m2", Tier.CPU, b"")]
    assert cluster.apply_inventory_chunk("a", 3, 2, True, last) is None
    rec = cluster.agent("a")
    assert rec.state is AgentState.READY
    assert rec.last_seq == 3 and not rec.awaiting_inventory
    assert cluster.index.num_agent_blocks("a") == 5
    (m,) = cluster.lookup("m", block_hashes=p).matches
    assert m.tier_list() == [Tier.GPU, Tier.GPU, Tier.CPU, Tier.DISK, Tier.DISK]


def test_inventory_chunk_out_of_order_returns_a_reason(cluster):
    cluster.register(record("a"))
    cluster.hello("a", "s1")
    p = packed(3)
    assert cluster.apply_inventory_chunk("a", 0, 0, False, [BlockGroup("m", Tier.CPU, p[:16])]) is None
    reason = cluster.apply_inventory_chunk("a", 0, 2, True, [BlockGroup("m", Tier.CPU, p[16:])])
    assert reason is not None and "chunk 2" in reason and "expected 1" in reason
    assert cluster.resyncs_total == 1
    assert cluster.index.num_agent_blocks("a") == 0
    assert cluster.agent("a").awaiting_inventory
    # a fresh inventory from chunk 0 is accepted
    assert cluster.apply_inventory_chunk("a", 0, 0, True, [BlockGroup("m", Tier.CPU, p)]) is None
    assert cluster.index.num_agent_blocks("a") == 3


def test_a_ready_agent_given_a_chunk_out_of_order_is_syncing_until_its_next_inventory(cluster):
    """The out-of-order branch waited for an inventory (its events ignored meanwhile) but
    left the agent READY: lookups were not marked possibly stale, as they are after a gap
    in its events (a review)."""
    ready_agent(cluster, "a", [BlockGroup("m", Tier.CPU, packed(2))], seq=4)
    cluster.reconcile_membership({"a"}, 0.0)  # its key in etcd: an agent expected back
    assert not cluster.rebuilding()
    assert cluster.apply_inventory_chunk("a", 5, 3, True, [BlockGroup("m", Tier.CPU, packed(3))]) is not None
    assert cluster.agent("a").state is AgentState.SYNCING
    assert cluster.rebuilding()
    assert cluster.apply_inventory_chunk("a", 5, 0, True, [BlockGroup("m", Tier.CPU, packed(3))]) is None
    assert cluster.agent("a").state is AgentState.READY


def test_hello_discards_a_half_received_inventory(cluster):
    cluster.register(record("a"))
    cluster.hello("a", "s1")
    cluster.apply_inventory_chunk("a", 0, 0, False, [BlockGroup("m", Tier.CPU, packed(2))])
    cluster.hello("a", "s2")
    assert cluster.apply_inventory_chunk("a", 0, 0, True, [BlockGroup("m", Tier.CPU, packed(1, start=500))]) is None
    assert cluster.index.agent_blocks("a") == {packed(1, start=500): int(Tier.CPU)}


# ---- sync: events ------------------------------------------------------------------
def test_consecutive_event_batches_are_applied(cluster):
    p = packed(4)
    ready_agent(cluster, "a", [BlockGroup("m", Tier.GPU, p[:16])], seq=10)
    assert cluster.apply_events("a", 11, True, [BlockGroup("m", Tier.GPU, p[16:48])]) is None
    assert (
        cluster.apply_events("a", 12, True, [BlockGroup("m", Tier.CPU, p[:16]), BlockGroup("m", Tier.GPU, p[48:])])
        is None
    )
    (m,) = cluster.lookup("m", block_hashes=p).matches
    assert m.tier_list() == [Tier.CPU, Tier.GPU, Tier.GPU, Tier.GPU]
    assert cluster.apply_events("a", 13, False, [BlockGroup("m", Tier.GPU, p[32:])]) is None
    assert cluster.lookup("m", block_hashes=p).matches[0].num_hit_blocks == 2
    assert cluster.agent("a").last_seq == 13
    assert cluster.events_total == 2 + 2 + 2


def test_events_before_the_inventory_are_ignored(cluster):
    cluster.register(record("a"))
    cluster.hello("a", "s1")
    assert cluster.apply_events("a", 1, True, [BlockGroup("m", Tier.CPU, packed(1))]) is None
    assert cluster.index.num_agent_blocks("a") == 0


def test_seq_gap_asks_for_resync_and_ignores_batches_until_inventory(cluster):
    p = packed(4)
    ready_agent(cluster, "a", [], seq=0)
    assert cluster.apply_events("a", 1, True, [BlockGroup("m", Tier.CPU, p[:16])]) is None
    reason = cluster.apply_events("a", 3, True, [BlockGroup("m", Tier.CPU, p[16:32])])
    assert reason is not None and "seq 3" in reason and "expected 2" in reason
    rec = cluster.agent("a")
    assert rec.state is AgentState.SYNCING and rec.awaiting_inventory
    assert cluster.resyncs_total == 1
    # later batches are ignored, even ones that look consecutive, and ask nothing more
    assert cluster.apply_events("a", 2, True, [BlockGroup("m", Tier.CPU, p[16:32])]) is None
    assert cluster.apply_events("a", 4, True, [BlockGroup("m", Tier.CPU, p[32:48])]) is None
    assert cluster.index.num_agent_blocks("a") == 1
    assert cluster.resyncs_total == 1
    # the fresh inventory resets the sequence
    assert cluster.apply_inventory_chunk("a", 9, 0, True, [BlockGroup("m", Tier.CPU, p[:32])]) is None
    assert cluster.agent("a").state is AgentState.READY
    assert cluster.apply_events("a", 10, True, [BlockGroup("m", Tier.CPU, p[32:])]) is None
    assert cluster.lookup("m", block_hashes=p).matches[0].num_hit_blocks == 4


# ---- lookup ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"model_id": "", "token_ids": [1, 2, 3, 4]}, "model_id"),
        ({"model_id": "m"}, "token_ids"),
        ({"model_id": "m", "token_ids": []}, "token_ids"),
        ({"model_id": "m", "token_ids": [1, 2, 3, 4], "block_hashes": b"\x00" * 16}, "token_ids"),
        ({"model_id": "m", "block_hashes": b"\x00" * 17}, "block_hashes"),
        ({"model_id": "m", "token_ids": [1, -2, 3, 4]}, "token_ids"),
        ({"model_id": "m", "token_ids": [1, 2**32, 3, 4]}, "token_ids"),
    ],
)
def test_lookup_invalid_arguments(cluster, kwargs, field):
    cluster.register(record("a"))
    with pytest.raises(errors.InvalidArgument) as info:
        cluster.lookup(**kwargs)
    assert info.value.field == field
    assert cluster.lookups_total == 0


def test_lookup_unknown_model(cluster):
    cluster.register(record("a"))
    with pytest.raises(errors.NotFound, match="unknown model 'nope'.*known: m"):
        cluster.lookup("nope", token_ids=[1, 2, 3, 4])
    with pytest.raises(errors.NotFound, match="none yet"):
        Cluster().lookup("m", token_ids=[1])


def test_lookup_by_tokens_and_by_hashes_agree(cluster):
    p = packed(3)
    ready_agent(cluster, "a", [BlockGroup("m", Tier.GPU, p[:32])])
    ready_agent(cluster, "b", [BlockGroup("m", Tier.CPU, p)], session="s9")
    tokens = list(range(3 * BS + 2))
    by_tokens = cluster.lookup("m", token_ids=tokens)
    assert (by_tokens.num_tokens, by_tokens.num_blocks, by_tokens.block_size) == (3 * BS + 2, 3, BS)
    assert [(m.agent_id, m.num_hit_blocks) for m in by_tokens.matches] == [("b", 3), ("a", 2)]
    assert by_tokens.best_agent_id == "b"
    by_hashes = cluster.lookup("m", block_hashes=p)
    assert by_hashes.matches == by_tokens.matches
    assert by_hashes.num_tokens == 3 * BS


def test_lookup_extra_keys_are_another_namespace(cluster):
    ready_agent(cluster, "a", [BlockGroup("m", Tier.GPU, packed(2, extra=("lora",)))])
    tokens = list(range(2 * BS))
    assert cluster.lookup("m", token_ids=tokens).matches == []
    assert cluster.lookup("m", token_ids=tokens, extra_keys=("lora",)).best_agent_id == "a"


def test_lookup_shorter_than_a_block(cluster):
    ready_agent(cluster, "a", [BlockGroup("m", Tier.GPU, packed(1))])
    res = cluster.lookup("m", token_ids=[0, 1])
    assert (res.num_blocks, res.matches, res.best_agent_id) == (0, [], "")


def test_lookup_counters(cluster):
    ready_agent(cluster, "a", [BlockGroup("m", Tier.GPU, packed(2))])
    cluster.lookup("m", token_ids=list(range(3 * BS + 1)))  # 2 of 3 blocks hit
    cluster.lookup("m", token_ids=list(range(100, 100 + BS)))  # miss
    cluster.lookup("m", block_hashes=packed(1))  # 1 block hit
    assert cluster.lookups_total == 3
    assert cluster.lookup_tokens_total == (3 * BS + 1) + BS + BS
    assert cluster.lookup_hit_tokens_total == 2 * BS + 0 + BS
    stats = cluster.stats()
    assert (stats.lookups_total, stats.lookup_tokens_total, stats.lookup_hit_tokens_total) == (3, 5 * BS + 1, 3 * BS)


# ---- membership --------------------------------------------------------------------
def test_remove_agent_drops_its_blocks(cluster):
    p = packed(3)
    ready_agent(cluster, "a", [BlockGroup("m", Tier.GPU, p)])
    ready_agent(cluster, "b", [BlockGroup("m", Tier.GPU, p[:16])])
    assert cluster.remove_agent("a") == 3
    assert cluster.index.num_blocks == 1
    assert [m.agent_id for m in cluster.lookup("m", block_hashes=p).matches] == ["b"]
    with pytest.raises(errors.NotFound):
        cluster.agent("a")
    assert cluster.remove_agent("a") == 0


def test_reconcile_membership_keeps_agents_registered_after_the_listing(cluster, clock):
    ready_agent(cluster, "live", [BlockGroup("m", Tier.GPU, packed(1))])
    ready_agent(cluster, "dead", [BlockGroup("m", Tier.GPU, packed(2))])
    listed_at = clock.now
    clock.now += 1
    ready_agent(cluster, "new", [BlockGroup("m", Tier.GPU, packed(1, start=77))])
    gone = cluster.reconcile_membership({"live"}, listed_at)
    assert gone == ["dead"]
    assert [r.agent_id for r, _ in cluster.agents()] == ["live", "new"]
    assert cluster.index.num_agent_blocks("dead") == 0
    assert cluster.index.num_blocks == 2
    # a later listing without "new" drops it too
    assert cluster.reconcile_membership({"live"}, clock.now + 1) == ["new"]


def test_stream_closed_marks_disconnected_and_keeps_blocks(cluster):
    p = packed(2)
    ready_agent(cluster, "a", [BlockGroup("m", Tier.GPU, p)], session="s1")
    cluster.stream_closed("a", "old-session")  # a stale stream closing changes nothing
    assert cluster.agent("a").state is AgentState.READY
    cluster.stream_closed("a", "s1")
    assert cluster.agent("a").state is AgentState.DISCONNECTED
    assert cluster.lookup("m", block_hashes=p).matches[0].num_hit_blocks == 2
    cluster.stream_closed("ghost", "s1")  # unknown agents are ignored


def test_stats(cluster):
    ready_agent(cluster, "a", [BlockGroup("m", Tier.GPU, packed(2))])
    ready_agent(cluster, "b", [BlockGroup("m", Tier.GPU, packed(1))])
    gpu_a = TierUsage(Tier.GPU, 100, 40, 2, blocks_used_bytes=30)  # 10 B reserved for a handoff arriving
    cluster.update_stats("a", [gpu_a, TierUsage(Tier.CPU, 1000, 0, 0)], 0, 0, 0)
    cluster.update_stats("b", [TierUsage(Tier.GPU, 100, 20, 1, blocks_used_bytes=20)], 0, 0, 0)
    s = cluster.stats()
    assert (s.num_agents, s.num_blocks, s.num_block_replicas) == (2, 2, 3)
    assert s.tiers == [TierUsage(Tier.GPU, 200, 60, 3, blocks_used_bytes=50), TierUsage(Tier.CPU, 1000, 0, 0)]
    assert [m.model_id for m in s.models] == ["m"]


def test_a_superseded_stream_cannot_touch_the_new_session(cluster):
    p = packed(2)
    ready_agent(cluster, "a", [BlockGroup("m", Tier.CPU, p)], seq=5, session="old")
    cluster.hello("a", "new")
    assert cluster.apply_inventory_chunk("a", 9, 0, True, [BlockGroup("m", Tier.CPU, p)], session_id="new") is None
    with pytest.raises(errors.FailedPrecondition):
        cluster.apply_events("a", 6, True, [], session_id="old")
    assert cluster.apply_events("a", 10, False, [BlockGroup("m", Tier.CPU, p)], session_id="new") is None
    assert cluster.lookup("m", block_hashes=p).matches == []


def test_token_lookup_over_the_block_cap_names_token_ids(clock):
    c = Cluster(clock=clock)
    c.register(record("a", ModelInfo("tiny", 1)))
    with pytest.raises(errors.InvalidArgument, match="token_ids"):
        c.lookup("tiny", token_ids=list(range(70_000)))


def test_an_agent_that_leaves_has_its_stream_ended_and_its_data_plane_state_forgotten(cluster):
    import queue

    ready_agent(cluster, "a", [BlockGroup("m", Tier.CPU, packed(1))], seq=1, session="s")
    outbox: queue.Queue = queue.Queue()
    cluster.attach_outbox("a", "s", outbox)
    cluster.dataplane.register("a", "decode")
    cluster.remove_agent("a")
    ended = outbox.get_nowait()
    assert isinstance(ended, errors.NotFound) and "register again" in str(ended)
    assert cluster.dataplane.role("a") != "decode"


def test_a_command_is_tied_to_the_stream_it_went_down(cluster):
    """send_on_stream names the session of the stream a command went into: one queued there
    when that stream closed is lost with it, and the agent's next stream has another."""
    import queue

    ready_agent(cluster, "a", [BlockGroup("m", Tier.CPU, packed(1))], seq=1, session="s1")
    cmd = AgentCommand("move-1", "move", tier=int(Tier.DISK))
    assert cluster.send_on_stream("a", cmd) == "" and cluster.stream_of("a") == ""  # no stream yet
    old: queue.Queue = queue.Queue()
    cluster.attach_outbox("a", "s1", old)
    assert cluster.send_on_stream("a", cmd) == "s1" == cluster.stream_of("a")
    assert old.get_nowait() is cmd
    cluster.hello("a", "s2")  # a new stream says Hello; until its outbox is attached, commands go to the old one
    assert cluster.send_on_stream("a", cmd) == "s1"
    new: queue.Queue = queue.Queue()
    cluster.attach_outbox("a", "s2", new)
    cluster.stream_closed("a", "s1")  # the old stream's late teardown leaves the new one
    assert cluster.stream_of("a") == "s2" and cluster.send_on_stream("a", cmd) == "s2"
    cluster.stream_closed("a", "s2")
    assert cluster.stream_of("a") == "" and not cluster.send("a", cmd)


def test_a_lookup_names_only_agents_serving_its_model():
    """The index keys blocks by hash alone, and engines' own hashes (vLLM's) need not tell
    models apart: the same hash from two engines serving different models must not make an
    agent serving the other model a holder."""
    from controlplane.core.cluster import AgentRecord, BlockGroup, Cluster, ModelInfo
    from protos.block_hash import external_block_hash
    from protos.tier import Tier

    c = Cluster()
    c.register(AgentRecord("llama-agent", "x:1", [ModelInfo("llama", 16)], []))
    c.register(AgentRecord("qwen-agent", "x:2", [ModelInfo("qwen", 16)], []))
    h = external_block_hash(0x1234)
    for agent_id, model in (("llama-agent", "llama"), ("qwen-agent", "qwen")):
        c.hello(agent_id, "s")
        c.apply_inventory_chunk(agent_id, 0, 0, True, [BlockGroup(model, Tier.GPU, h)], "s")
    assert [(m.agent_id, m.num_hit_blocks) for m in c.lookup("llama", block_hashes=h).matches] == [("llama-agent", 1)]
    assert [m.agent_id for m in c.lookup("qwen", block_hashes=h).matches] == ["qwen-agent"]


def test_lookups_say_possibly_stale_until_every_agent_in_etcd_has_synced():
    """A new leader (or one whose agents are resyncing) answers from an index still being
    rebuilt: an answer that may miss what an unsynced agent holds says so, and a model no
    synced agent serves yet is UNAVAILABLE (retry), not NOT_FOUND."""
    import time as _time

    from controlplane.api.admin_service import AdminServicer
    from controlplane.core.cluster import AgentRecord, BlockGroup, Cluster, ModelInfo
    from protos import errors
    from protos.block_hash import hash_prefix
    from protos.kvcp.v1 import admin_pb2
    from protos.tier import Tier

    class Leading:
        is_leader, serving_from_memory, epoch, leader_address = True, False, 1, ""

    c = Cluster()
    servicer = AdminServicer(c, Leading())
    c.reconcile_membership({"a", "b"}, _time.time())  # both have keys in etcd
    with pytest.raises(errors.Unavailable, match="synced"):
        servicer.Lookup(admin_pb2.LookupRequest(model_id="m", token_ids=list(range(16))), None)
    c.register(AgentRecord("a", "x:1", [ModelInfo("m", 16)], []))
    c.hello("a", "s")
    c.apply_inventory_chunk("a", 0, 0, True, [BlockGroup("m", Tier.CPU, hash_prefix("m", range(16), 16))], "s")
    _time.sleep(0.11)
    r = servicer.Lookup(admin_pb2.LookupRequest(model_id="m", token_ids=list(range(16))), None)
    assert r.best_agent_id == "a" and r.possibly_stale  # "b" may hold more: not synced yet
    c.register(AgentRecord("b", "x:2", [ModelInfo("m", 16)], []))
    c.hello("b", "s")
    c.apply_inventory_chunk("b", 0, 0, True, [], "s")
    _time.sleep(0.11)
    assert not servicer.Lookup(admin_pb2.LookupRequest(model_id="m", token_ids=list(range(16))), None).possibly_stale
    with pytest.raises(errors.NotFound):  # every agent synced: an unknown model is unknown
        servicer.Lookup(admin_pb2.LookupRequest(model_id="nope", token_ids=[1]), None)


def test_a_model_whose_agents_are_all_away_is_still_a_model(cluster):
    """Every agent of a model gone for a moment (restarts, a lease lapse): a router's
    lookup finds nothing cached rather than NOT_FOUND 'unknown model', which it could
    take for a misconfiguration. A model never served stays unknown."""
    ready_agent(cluster, "a", [BlockGroup("m", Tier.CPU, packed(2))])
    assert cluster.lookup("m", block_hashes=packed(2)).best_agent_id == "a"
    cluster.remove_agent("a")
    r = cluster.lookup("m", block_hashes=packed(2))
    assert r.matches == [] and not r.best_agent_id
    assert cluster.model("m").block_size == BS
    with pytest.raises(errors.NotFound, match="unknown model 'nope'"):
        cluster.lookup("nope", block_hashes=packed(1))


def test_an_agent_registering_again_keeps_its_report_counts():
    """A new stream starts with Register: the record it replaces carried how many stats
    reports the agent made (the policy's urgent pass compares them) and what it moved
    between tiers (the dashboard's rate): a reset read as silence, then a spike."""
    cluster = Cluster()
    cluster.register(record("a"))
    for _ in range(3):
        cluster.update_stats("a", [], 0, 0, 0, tier_moved_bytes=5000)
    cluster.register(record("a"))
    assert cluster.stats_reports("a") == 3 and cluster.stats().tier_moved_bytes_total == 5000


def test_a_lookup_at_the_block_cap_may_end_in_a_partial_block(cluster):
    """The cap counts full blocks: a prompt of the most blocks plus a few tokens is looked
    up (its partial block ignored, as everywhere); one more full block is refused."""
    from controlplane.core.cluster import MAX_LOOKUP_BLOCKS, MAX_LOOKUP_TOKENS

    bs = 16  # where the caps meet: 65,536 blocks of 16 are 1,048,576 tokens
    cluster.register(record("a", ModelInfo("m16", bs)))
    most = min(MAX_LOOKUP_BLOCKS, MAX_LOOKUP_TOKENS // bs)
    res = cluster.lookup("m16", token_ids=[7] * (most * bs + bs - 1))
    assert res.num_blocks == most
    with pytest.raises(errors.InvalidArgument, match=f"at most {most} blocks"):
        cluster.lookup("m16", token_ids=[7] * ((most + 1) * bs))
