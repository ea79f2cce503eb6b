"""kvctl drain: before maintenance, an agent is cordoned and hands every prefix it holds to
agents in rotation (real etcd, control plane and agents; handoffs over their real paths),
most recently used first, into the room the destinations have free. Checked byte for byte
where the blocks land, with the refusals that change nothing."""

from __future__ import annotations

import time

import pytest
import torch

from agent.core.model_spec import ModelSpec
from agent.server import DEMO_MODEL
from cli.client import ClientError, ControlPlaneClient
from tests.helpers import wait_for

M = DEMO_MODEL


def tokens(n_blocks: int, start: int) -> list[int]:
    return list(range(start, start + n_blocks * M.block_size))


def kv(n_blocks: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n_blocks, *M.block_shape), generator=g).to(torch.float16)


def registered(c: ControlPlaneClient, *agent_ids: str) -> bool:
    ready = {a.agent_id for a in c.list_agents() if a.state == "ready"}
    return set(agent_ids) <= ready


def test_a_drained_agent_hands_every_prefix_to_agents_in_rotation_byte_exact(controlplane, make_agent):
    src = make_agent("d-src")
    agents = {a.config.agent_id: a for a in (make_agent("d-one"), make_agent("d-two"))}
    system = tokens(2, start=100_000)  # a shared system prompt: two prompts continue it
    prompts = {
        "chat-a": system + tokens(2, start=110_000),
        "chat-b": system + tokens(3, start=120_000),
        "doc": tokens(4, start=130_000),
    }
    kvs = {}
    for i, (name, prompt) in enumerate(prompts.items()):
        n = len(prompt) // M.block_size
        kvs[name] = kv(n, seed=i)
        if name == "chat-b":  # the shared prefix is stored once, with the KV chat-a gave it
            kvs[name][:2] = kvs["chat-a"][:2]
        src.engine.store(M.model_id, prompt, kvs[name])
    with ControlPlaneClient(controlplane.address) as c:
        wait_for(lambda: registered(c, "d-src", "d-one", "d-two"), what="agents ready")
        wait_for(
            lambda: all(c.lookup(M.model_id, token_ids=p).best_agent_id == "d-src" for p in prompts.values()),
            what="indexed",
        )
        op = c.drain("d-src", reason="kernel upgrade")
        assert op.kind == "drain" and op.params["agent"] == "d-src", op
        assert set(op.params["to"].split(",")) == {"d-one", "d-two"}
        # cordoned at once: lookups and Route leave it out from now on
        assert {a.agent_id: a.cordon_reason for a in c.list_agents()}["d-src"] == "kernel upgrade"
        op = c.wait_operation(op.op_id, 60)
        assert op.state == "SUCCEEDED", op
        assert (op.num_done_blocks, op.num_total_blocks, op.num_failed_blocks) == (11, 11, 0), op
        assert op.moved_bytes == 11 * M.block_bytes, op  # the shared prefix went once
        holders = {}
        for name, prompt in prompts.items():
            wait_for(lambda p=prompt: c.lookup(M.model_id, token_ids=p).best_agent_id, 10, what=f"{name} indexed")
            best = c.lookup(M.model_id, token_ids=prompt)
            assert best.best_agent_id in ("d-one", "d-two"), best  # the cordoned one is left out
            assert best.agents[0].num_hit_tokens == len(prompt), best
            holders[name] = best.best_agent_id
        # the prompts sharing a root went to one agent (the prefix travels once); the other root elsewhere
        assert holders["chat-a"] == holders["chat-b"] != holders["doc"], holders
    for name, prompt in prompts.items():
        got = agents[holders[name]].engine.load(M.model_id, prompt)
        assert got.num_cached_tokens == len(prompt) and torch.equal(got.kv, kvs[name]), name
        # and the drained agent still holds them (a drain copies; the agent goes down after)
        assert src.engine.load(M.model_id, prompt).num_cached_tokens == len(prompt)


def test_a_drain_fills_only_the_room_a_destination_has_free(controlplane, make_agent):
    """The destination's own blocks are not pushed out: what does not fit is left, said,
    and the drain still succeeds with what it moved, the most recent prefixes first."""
    room_blocks = 4
    src = make_agent("r-src")
    dst = make_agent("r-dst", cpu_capacity_bytes=(room_blocks + 2) * M.block_bytes)
    own = tokens(2, start=200_000)
    dst.engine.store(M.model_id, own, kv(2, seed=9))  # the destination's own: 2 of its 6 blocks
    old, new = tokens(3, start=210_000), tokens(3, start=220_000)
    src.engine.store(M.model_id, old, kv(3, seed=1))
    src.engine.store(M.model_id, new, kv(3, seed=2))  # used last: goes first
    with ControlPlaneClient(controlplane.address) as c:
        wait_for(lambda: registered(c, "r-src", "r-dst"), what="agents ready")
        wait_for(lambda: c.lookup(M.model_id, token_ids=own).best_agent_id == "r-dst", what="indexed")

        def free_reported() -> bool:
            tiers = {a.agent_id: a for a in c.list_agents()}["r-dst"].tiers
            return sum(t.capacity_bytes - t.used_bytes for t in tiers) == room_blocks * M.block_bytes

        wait_for(free_reported, 10, what="the destination's usage reported")
        op = c.wait_operation(c.drain("r-src").op_id, 60)
        assert op.state == "SUCCEEDED", op
        assert (op.num_done_blocks, op.num_total_blocks, op.num_failed_blocks) == (3, 6, 3), op
        assert "3 of 6 blocks not handed off" in op.error and "room" in op.error, op.error
    assert dst.engine.load(M.model_id, new).num_cached_tokens == len(new)
    assert dst.engine.load(M.model_id, old).num_cached_tokens == 0
    assert dst.engine.load(M.model_id, own).num_cached_tokens == len(own)  # nothing of its own pushed out


def test_drain_refusals_name_the_field_and_change_nothing(controlplane, make_agent):
    make_agent("x-src")
    with ControlPlaneClient(controlplane.address) as c:
        wait_for(lambda: registered(c, "x-src"), what="agent ready")
        with pytest.raises(ClientError, match="no ready agent in rotation"):
            c.drain("x-src")  # nowhere to drain to
        make_agent("x-dst")
        wait_for(lambda: registered(c, "x-src", "x-dst"), what="agents ready")
        with pytest.raises(ClientError, match="agent_id: no agent 'x-typo'"):
            c.drain("x-typo")
        with pytest.raises(ClientError, match="to_agent_ids: names x-src"):
            c.drain("x-src", to_agent_ids=["x-src"])
        with pytest.raises(ClientError, match="to_agent_ids: no agent 'x-nope'"):
            c.drain("x-src", to_agent_ids=["x-nope"])
        with pytest.raises(ClientError, match="model_id"):
            c.drain("x-src", model_id="other-model")
        with pytest.raises(ClientError, match="deadline_seconds"):
            c.drain("x-src", deadline_seconds=-1)
        with pytest.raises(ClientError, match="reason"):
            c.drain("x-src", reason="two\nlines")
        c.cordon("x-dst", "maintenance")
        with pytest.raises(ClientError, match="to_agent_ids: agent x-dst is cordoned"):
            c.drain("x-src", to_agent_ids=["x-dst"])
        with pytest.raises(ClientError, match="no ready agent in rotation"):
            c.drain("x-src")  # the only other one is cordoned
        # nothing changed: not cordoned, no operation
        assert {a.agent_id: a.cordon_reason for a in c.list_agents()}["x-src"] == ""
        assert [o for o in c.list_operations() if o.kind == "drain"] == []


def test_a_drain_cancelled_stops_between_two_prefixes(controlplane, make_agent):
    """kvctl cancel: the agent stops before its next prefix and answers CANCELLED with how
    far it got (a paced link makes the drain last long enough to cancel it)."""
    from agent.dataplane import DataPlaneConfig

    paced = DataPlaneConfig(link_bytes_per_second=4 * M.block_bytes)  # about 4 one-block prefixes a second
    src = make_agent("k-src", dataplane=paced)
    make_agent("k-dst")
    for i in range(30):
        src.engine.store(M.model_id, tokens(1, start=300_000 + 100 * i), kv(1, seed=i))
    with ControlPlaneClient(controlplane.address) as c:
        wait_for(lambda: registered(c, "k-src", "k-dst"), what="agents ready")
        wait_for(lambda: {a.agent_id: a.num_blocks for a in c.list_agents()}.get("k-src") == 30, what="indexed")
        op = c.drain("k-src")
        wait_for(lambda: c.get_operation(op.op_id).num_done_blocks >= 1, 20, what="the drain under way")
        # kvctl uncordon while it runs says so: the drain would go on handing the prefixes away
        from click.testing import CliRunner

        from cli.main import main as kvctl_main

        said = CliRunner().invoke(kvctl_main, ["--endpoint", controlplane.address, "uncordon", "k-src"])
        assert said.exit_code == 0, said.output
        assert f"drain {op.op_id} of k-src is still running: kvctl cancel {op.op_id} stops it" in said.output
        c.cancel_operation(op.op_id)
        op = c.wait_operation(op.op_id, 30)
        assert op.state == "CANCELLED", op
        assert 1 <= op.num_done_blocks < 30 and op.num_total_blocks == 30, op
        assert op.num_failed_blocks == 0, op  # the prefixes not tried did not fail (an operator read "N failed")


def test_a_pinned_prefix_drained_is_pinned_where_it_lands(controlplane, make_agent):
    """A prefix pin (no agent named) holds on every agent that holds its blocks: the
    destination of a drain enforces it on the copies it got, so the upgrade does not leave
    the pinned prefix evictable."""
    from protos.block_hash import hash_prefix, split_hashes

    src = make_agent("p-src")
    dst = make_agent("p-dst")
    prompt = tokens(3, start=400_000)
    src.engine.store(M.model_id, prompt, kv(3, seed=4))
    hashes = split_hashes(hash_prefix(M.model_id, prompt, M.block_size))
    with ControlPlaneClient(controlplane.address) as c:
        wait_for(lambda: registered(c, "p-src", "p-dst"), what="agents ready")
        wait_for(lambda: c.lookup(M.model_id, token_ids=prompt).best_agent_id == "p-src", what="indexed")
        c.pin(M.model_id, token_ids=prompt, min_tier="cpu", ttl_seconds=3600)
        wait_for(lambda: all(src.pool.pin_tier_of(h) for h in hashes), 10, what="pinned on the source")
        assert c.wait_operation(c.drain("p-src").op_id, 60).state == "SUCCEEDED"
        wait_for(lambda: all(dst.pool.pin_tier_of(h) for h in hashes), 15, what="pinned where it landed")


def own_blocks_reported(c: ControlPlaneClient, agent_id: str, free_blocks: int) -> bool:
    tiers = {a.agent_id: a for a in c.list_agents()}[agent_id].tiers
    return sum(t.capacity_bytes - t.used_bytes for t in tiers) == free_blocks * M.block_bytes


def test_a_shared_prefix_sent_again_to_a_second_destination_counts_against_its_room(controlplane, make_agent):
    """Review: two prompts share a system prompt; the first chain fills destination X, so
    the second goes to Y, and with it the shared prefix again (Y does not hold it). Y must
    be sent no more than it had free: the room check counted only the bytes no chain had
    sent anywhere yet, and Y's own blocks were pushed out."""
    src = make_agent("s-src")
    make_agent("s-x", cpu_capacity_bytes=5 * M.block_bytes)  # room for the first chain (4.75 blocks)
    y = make_agent("s-y", cpu_capacity_bytes=5 * M.block_bytes)
    own = tokens(2, start=400_000)
    y.engine.store(M.model_id, own, kv(2, seed=40))  # Y: 3 blocks free (2.75 below its high watermark)
    system = tokens(2, start=410_000)
    b, a = system + tokens(2, start=420_000), system + tokens(2, start=430_000)
    src.engine.store(M.model_id, b, kv(4, seed=41))
    src.engine.store(M.model_id, a, kv(4, seed=42))  # used last: its chain goes first (to X, the roomiest)
    with ControlPlaneClient(controlplane.address) as c:
        wait_for(lambda: registered(c, "s-src", "s-x", "s-y"), what="agents ready")
        wait_for(lambda: c.lookup(M.model_id, token_ids=own).best_agent_id == "s-y", what="indexed")
        wait_for(lambda: own_blocks_reported(c, "s-y", 3) and own_blocks_reported(c, "s-x", 5), 10, what="usage")
        op = c.wait_operation(c.drain("s-src").op_id, 60)
        assert op.state == "SUCCEEDED", op
        assert op.params["to"] == "s-x,s-y", op
    assert y.engine.load(M.model_id, own).num_cached_tokens == len(own), "Y's own blocks were pushed out"


OTHER = ModelSpec("other-model", block_size=16, num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16")


def test_a_destination_that_serves_another_model_is_not_given_up_for_its_own(controlplane, make_agent):
    """Review: an agent serving two models is drained to one agent per model. Chains of the
    model a destination does not serve must not make it given up for the rest of the drain
    (its own model's chains were left behind, 'given up')."""
    src = make_agent("mm-src", models=[M, OTHER])
    make_agent("mm-d1", models=[M])
    d2 = make_agent("mm-d2", models=[OTHER])
    other = [tokens(1, start=500_000 + 100 * i) for i in range(2)]
    for i, p in enumerate(other):  # the older: they go last
        src.engine.store(OTHER.model_id, p, kv(1, seed=50 + i))
    for i in range(6):
        src.engine.store(M.model_id, tokens(1, start=510_000 + 100 * i), kv(1, seed=60 + i))
    with ControlPlaneClient(controlplane.address) as c:
        wait_for(lambda: registered(c, "mm-src", "mm-d1", "mm-d2"), what="agents ready")
        wait_for(lambda: {a.agent_id: a.num_blocks for a in c.list_agents()}.get("mm-src") == 8, what="indexed")
        op = c.wait_operation(c.drain("mm-src").op_id, 120)
        assert op.state == "SUCCEEDED", op
        assert (op.num_done_blocks, op.num_total_blocks, op.num_failed_blocks) == (8, 8, 0), op
    for p in other:
        assert d2.engine.load(OTHER.model_id, p).num_cached_tokens == len(p)


def test_two_drains_at_once_share_a_destinations_room(controlplane, make_agent):
    """Review: a rolling upgrade two agents at a time. Each drain was promised the whole
    room the destination reported, so together they sent it twice that and pushed out its
    own blocks. (With the policy on: it sizes blocks by what they take, not by used bytes
    that include the pages reserved for the handoffs arriving.)"""
    from agent.dataplane import DataPlaneConfig

    paced = DataPlaneConfig(link_bytes_per_second=2 * M.block_bytes)  # both drains under way at once
    s1, s2 = make_agent("t-s1", dataplane=paced), make_agent("t-s2", dataplane=paced)
    dst = make_agent("t-dst", cpu_capacity_bytes=10 * M.block_bytes)
    own = tokens(2, start=600_000)
    dst.engine.store(M.model_id, own, kv(2, seed=70))  # 8 blocks free, 7.5 below the high watermark
    for i, s in enumerate((s1, s2)):
        for j in range(5):
            s.engine.store(M.model_id, tokens(1, start=610_000 + 1000 * i + 100 * j), kv(1, seed=71 + 5 * i + j))
    with ControlPlaneClient(controlplane.address) as c:
        wait_for(lambda: registered(c, "t-s1", "t-s2", "t-dst"), what="agents ready")
        wait_for(lambda: c.lookup(M.model_id, token_ids=own).best_agent_id == "t-dst", what="indexed")
        wait_for(lambda: own_blocks_reported(c, "t-dst", 8), 10, what="usage")
        first = c.drain("t-s1", to_agent_ids=["t-dst"])
        try:
            second = c.drain("t-s2", to_agent_ids=["t-dst"])
        except ClientError as exc:  # refused: the room is promised to the first
            assert "no room" in str(exc) and first.op_id in str(exc), exc
            second = None
        assert c.wait_operation(first.op_id, 60).state == "SUCCEEDED"
        if second is not None:
            c.wait_operation(second.op_id, 60)
    assert dst.engine.load(M.model_id, own).num_cached_tokens == len(own), "the destination's own blocks pushed out"


def test_a_second_drain_of_an_agent_being_drained_is_refused(controlplane, make_agent):
    """Review: two drains of one agent would run side by side on it, each with the whole
    room of every destination; the second is refused, naming the first."""
    from agent.dataplane import DataPlaneConfig

    src = make_agent("w-src", dataplane=DataPlaneConfig(link_bytes_per_second=2 * M.block_bytes))
    make_agent("w-dst")
    for j in range(6):
        src.engine.store(M.model_id, tokens(1, start=700_000 + 100 * j), kv(1, seed=80 + j))
    with ControlPlaneClient(controlplane.address) as c:
        wait_for(lambda: registered(c, "w-src", "w-dst"), what="agents ready")
        wait_for(lambda: {a.agent_id: a.num_blocks for a in c.list_agents()}.get("w-src") == 6, what="indexed")
        first = c.drain("w-src")
        with pytest.raises(ClientError, match=f"agent_id: agent w-src is being drained already \\({first.op_id}"):
            c.drain("w-src")
        c.cancel_operation(first.op_id)
        assert c.wait_operation(first.op_id, 30).state in ("CANCELLED", "SUCCEEDED")
        again = c.wait_operation(c.drain("w-src").op_id, 60)  # once it has ended, a drain is taken again
        assert again.state == "SUCCEEDED", again


def test_a_drain_leaves_a_destination_below_the_watermark_where_the_policy_drops(controlplane, make_agent):
    """Review: a destination filled to its last free byte is over its tier's high watermark
    (0.95), and the policy's next pass drops blocks to bring it down (its own, or what the
    drain just sent): the drain fills only the room below it."""
    src = make_agent("h-src")
    dst = make_agent("h-dst", cpu_capacity_bytes=10 * M.block_bytes)
    own = tokens(2, start=800_000)
    dst.engine.store(M.model_id, own, kv(2, seed=90))
    for j in range(8):  # exactly the free room
        src.engine.store(M.model_id, tokens(1, start=810_000 + 100 * j), kv(1, seed=91 + j))
    with ControlPlaneClient(controlplane.address) as c:
        wait_for(lambda: registered(c, "h-src", "h-dst"), what="agents ready")
        wait_for(lambda: own_blocks_reported(c, "h-dst", 8), 10, what="usage")
        op = c.wait_operation(c.drain("h-src").op_id, 60)
        assert op.state == "SUCCEEDED", op
        time.sleep(3)  # the policy's passes (an urgent one follows a report over a high watermark)
        held = sum(u.num_blocks for u in dst.pool.usage())
        assert held == 2 + op.num_done_blocks, (held, op)
    assert dst.engine.load(M.model_id, own).num_cached_tokens == len(own)


def test_a_drain_right_after_another_does_not_count_the_room_the_first_filled(controlplane, make_agent):
    """A rolling upgrade, one agent after the other: the second drain starts as the first
    ends, before the destination has reported the blocks that landed. What the first sent
    stays counted until the destination reported twice since it ended, so the second gets
    only what is left. Neither pushes out the destination's own blocks."""
    s1, s2 = make_agent("q-s1"), make_agent("q-s2")
    dst = make_agent("q-dst", cpu_capacity_bytes=10 * M.block_bytes, stats_interval_seconds=2.0)
    own = tokens(2, start=700_000)
    dst.engine.store(M.model_id, own, kv(2, seed=80))  # 7.5 blocks of room below the high watermark
    for i, s in enumerate((s1, s2)):
        for j in range(5):
            s.engine.store(M.model_id, tokens(1, start=710_000 + 1000 * i + 100 * j), kv(1, seed=81 + 10 * i + j))
    with ControlPlaneClient(controlplane.address) as c:
        wait_for(lambda: registered(c, "q-s1", "q-s2", "q-dst"), what="agents ready")
        wait_for(lambda: own_blocks_reported(c, "q-dst", 8), 10, what="usage")
        first = c.wait_operation(c.drain("q-s1", to_agent_ids=["q-dst"]).op_id, 60)
        assert first.state == "SUCCEEDED" and first.num_done_blocks == 5, first
        # its last report still says 8 blocks free: 5 of them are the first drain's
        second = c.wait_operation(c.drain("q-s2", to_agent_ids=["q-dst"]).op_id, 60)
        assert second.state == "SUCCEEDED" and second.num_done_blocks == 2, second  # 2.5 blocks were left
    assert dst.engine.load(M.model_id, own).num_cached_tokens == len(own)
    assert dst.pool.usage()[0].num_blocks == 2 + 5 + 2


def test_a_drained_block_keeps_its_own_namespace_where_it_lands(controlplane, make_agent):
    """Review: a chain's blocks may belong to several namespaces (tenant B's prompt
    continues a system prompt tenant A stored first: those blocks stay A's). The drain
    handed each chain off under its leaf's namespace, so the shared prefix landed as B's
    and fell out of A's pins, cleanups and quota on the destination; a handoff with no
    namespace keeps each block's own."""
    from protos.block_hash import hash_prefix, split_hashes

    src = make_agent("n-src")
    dst = make_agent("n-dst")
    system = tokens(2, start=1_000_000)
    chat = system + tokens(2, start=1_010_000)
    data = kv(4, seed=100)
    src.engine.store(M.model_id, system, data[:2], namespace="tenant-a")
    src.engine.store(M.model_id, chat, data, namespace="tenant-b")  # its first two blocks are held: A's
    by_namespace = {ns: u.num_blocks for ns, u in src.pool.namespace_usage().items()}
    assert by_namespace == {"tenant-a": 2, "tenant-b": 2}, by_namespace
    shared = split_hashes(hash_prefix(M.model_id, system, M.block_size))
    with ControlPlaneClient(controlplane.address) as c:
        wait_for(lambda: registered(c, "n-src", "n-dst"), what="agents ready")
        wait_for(lambda: c.lookup(M.model_id, token_ids=chat).best_agent_id == "n-src", what="indexed")
        c.pin(namespace="tenant-a", min_tier="cpu", ttl_seconds=3600)  # A's blocks, wherever they are
        wait_for(lambda: all(src.pool.pin_tier_of(h) for h in shared), 10, what="pinned on the source")
        op = c.wait_operation(c.drain("n-src").op_id, 60)
        assert op.state == "SUCCEEDED" and op.num_done_blocks == 4, op
    got = dst.engine.load(M.model_id, chat)
    assert got.num_cached_tokens == len(chat) and torch.equal(got.kv, data)
    by_namespace = {ns: u.num_blocks for ns, u in dst.pool.namespace_usage().items()}
    assert by_namespace == {"tenant-a": 2, "tenant-b": 2}, by_namespace
    wait_for(lambda: all(dst.pool.pin_tier_of(h) for h in shared), 10, what="A's pin holds where they landed")


def a_drain_cut_short_by_a_cleanup(c: ControlPlaneClient, make_agent, name: str, start: int, seed: int):
    """A drain of 30 one-block prefixes over a paced link (4 blocks a second), and a cleanup
    of its agent once the first block went: the blocks not sent by then are dropped there.
    Returns the drain's operation, ended, and the drained agent."""
    from agent.dataplane import DataPlaneConfig

    src = make_agent(f"{name}-src", dataplane=DataPlaneConfig(link_bytes_per_second=4 * M.block_bytes))
    make_agent(f"{name}-dst")
    for i in range(30):
        src.engine.store(M.model_id, tokens(1, start=start + 100 * i), kv(1, seed=seed + i))
    wait_for(lambda: registered(c, f"{name}-src", f"{name}-dst"), what="agents ready")
    wait_for(lambda: {a.agent_id: a.num_blocks for a in c.list_agents()}.get(f"{name}-src") == 30, what="indexed")
    op = c.drain(f"{name}-src")
    wait_for(lambda: c.get_operation(op.op_id).num_done_blocks >= 1, 20, what="the drain under way")
    assert c.wait_operation(c.cleanup(agent_id=f"{name}-src").op_id, 30).state == "SUCCEEDED"
    return c.wait_operation(op.op_id, 60), src


def test_a_drain_says_why_blocks_dropped_here_meanwhile_were_not_handed_off(controlplane, make_agent):
    """Review: blocks the drained agent dropped while the drain ran (a cleanup, its own
    LRU) cannot be sent; the drain left them without a word, its error ending in an empty
    reason ("N of M blocks not handed off: ")."""
    with ControlPlaneClient(controlplane.address) as c:
        op, _src = a_drain_cut_short_by_a_cleanup(c, make_agent, "c", 1_100_000, 200)
        assert op.state == "SUCCEEDED" and 1 <= op.num_done_blocks < 30, op
        left = 30 - op.num_done_blocks
        assert f"{left} of 30 blocks not handed off: " in op.error, op.error
        assert "dropped" in op.error.split("not handed off: ", 1)[1], op.error


def test_blocks_dropped_here_meanwhile_are_not_counted_failed_so_kvctl_drain_wait_does_not_exit_3(
    controlplane, make_agent
):
    """Review: a drain counted the blocks its agent dropped while it ran (a cleanup, its own
    LRU) as failed, and `kvctl drain --wait` exits 3 on any failed block of a SUCCEEDED
    drain ("left N blocks on AGENT; taking it down now loses their hits"): the agent held
    none of them any more, yet `kvctl drain A --wait && restart A` stopped there. The
    failed blocks are those not handed off that the agent still holds; the error still
    says which were not handed off, and why."""
    with ControlPlaneClient(controlplane.address) as c:
        op, src = a_drain_cut_short_by_a_cleanup(c, make_agent, "g", 1_700_000, 900)
        assert op.state == "SUCCEEDED" and 1 <= op.num_done_blocks < 30, op
        # it holds none of the blocks the drain left (the one being sent as the cleanup ran stayed)
        assert sum(u.num_blocks for u in src.pool.usage()) <= 1
        assert op.num_failed_blocks == 0, op  # (before: 30 - done, and kvctl drain --wait exited 3)
        assert f"{30 - op.num_done_blocks} of 30 blocks not handed off: " in op.error, op.error
        assert "dropped" in op.error, op.error


def a_source_of_four_one_block_prefixes(c: ControlPlaneClient, make_agent, name: str, start: int, seed: int):
    """Agents `{name}-src`, holding four one-block prefixes, indexed, and `{name}-dst`.
    Returns the source."""
    src = make_agent(f"{name}-src")
    make_agent(f"{name}-dst")
    for i in range(4):
        src.engine.store(M.model_id, tokens(1, start=start + 100 * i), kv(1, seed=seed + i))
    wait_for(lambda: registered(c, f"{name}-src", f"{name}-dst"), what="agents ready")
    wait_for(lambda: {a.agent_id: a.num_blocks for a in c.list_agents()}.get(f"{name}-src") == 4, what="indexed")
    return src


def test_a_drain_whose_blocks_were_all_dropped_here_before_it_sent_one_succeeds_with_nothing_left(
    controlplane, make_agent
):
    """A drain that handed nothing off because its agent dropped every block before it sent
    the first (a cleanup, its own LRU) ended FAILED ("no block of N handed off") with all N
    counted failed, so `kvctl drain A --wait` exited 1 though restarting A loses no hit: it
    holds none of them. It now ends SUCCEEDED with none failed, and says why nothing went."""
    with ControlPlaneClient(controlplane.address) as c:
        src = a_source_of_four_one_block_prefixes(c, make_agent, "z", 1_900_000, 1_900)
        handoff = src.dataplane.handoff

        def dropped_first(model_id, block_hashes, *args, **kwargs):  # a cleanup just before each send
            for h in block_hashes:
                src.pool.drop(h)
            return handoff(model_id, block_hashes, *args, **kwargs)

        src.dataplane.handoff = dropped_first
        op = c.wait_operation(c.drain("z-src").op_id, 60)
        assert sum(u.num_blocks for u in src.pool.usage()) == 0
        assert op.state == "SUCCEEDED" and op.num_done_blocks == 0 and op.num_failed_blocks == 0, op
        assert "4 of 4 blocks not handed off: " in op.error and "dropped" in op.error, op.error


def test_a_drain_that_handed_nothing_off_counts_failed_only_the_blocks_still_held(controlplane, make_agent):
    """The same when its one destination goes (a cordon, a crash) at the first send, whose
    blocks were dropped here just before: it fails, and counts failed the three blocks it
    still holds, not the one dropped meanwhile."""
    from protos import errors

    with ControlPlaneClient(controlplane.address) as c:
        src = a_source_of_four_one_block_prefixes(c, make_agent, "y", 2_000_000, 2_000)

        def dropped_then_gone(model_id, block_hashes, *args, **kwargs):
            for h in block_hashes:
                src.pool.drop(h)
            raise errors.FailedPrecondition("y-dst: cordoned by the test")

        src.dataplane.handoff = dropped_then_gone
        op = c.wait_operation(c.drain("y-src").op_id, 60)
        assert sum(u.num_blocks for u in src.pool.usage()) == 3
        assert op.state == "FAILED" and op.num_done_blocks == 0, op
        assert op.num_failed_blocks == 3, op  # (before: 4)
        assert "no block of 4 handed off" in op.error, op.error


def test_a_drain_of_compressed_blocks_counts_the_pages_they_take_where_they_land(controlplane, make_agent):
    """Review: a destination's room is charged for what a block takes there, whole pages
    of its slab, not the payload's bytes: an int8 block of the demo model (4,352 B) takes
    5 pages of 1 KiB (5,120 B), 18 % more. Counted by payload, the drain sent 17 blocks
    into the room of 15 and the destination dropped blocks it had just been sent."""
    from protos.tier import Tier

    src = make_agent("f-src", tier_codecs={Tier.CPU: "int8"})
    dst = make_agent("f-dst", cpu_capacity_bytes=10 * M.block_bytes)  # 16 int8 blocks; 15 below 0.95
    for i in range(20):
        src.engine.store(M.model_id, tokens(1, start=1_200_000 + 100 * i), kv(1, seed=300 + i))
    assert {u.stored_bytes for u in src.pool.usage()} == {20 * 4352}
    with ControlPlaneClient(controlplane.address) as c:
        wait_for(lambda: registered(c, "f-src", "f-dst"), what="agents ready")
        wait_for(lambda: own_blocks_reported(c, "f-dst", 10), 10, what="usage")
        wait_for(lambda: {a.agent_id: a.num_blocks for a in c.list_agents()}.get("f-src") == 20, what="indexed")
        op = c.wait_operation(c.drain("f-src").op_id, 60)
        assert op.state == "SUCCEEDED", op
        time.sleep(3)  # the policy's passes (an urgent one follows a report over a high watermark)
        held = sum(u.num_blocks for u in dst.pool.usage())
        assert (held, op.num_done_blocks) == (15, 15), (held, op)


def test_a_drain_of_an_agent_whose_stream_is_down_is_refused_and_cordons_nothing(controlplane, make_agent, monkeypatch):
    """Registered (its lease lives) but not on its Sync stream: it cannot be sent the
    drain, so the drain is refused before the cordon (kvctl cordon does that alone)."""
    import controlplane.manager as manager_module

    # past the grace after a takeover (whose refusal names agents not back yet, and came
    # first when a membership listing had taken y-src in within the control plane's first 15 s)
    monkeypatch.setattr(manager_module, "AGENTS_BACK_GRACE_SECONDS", 0.0)
    make_agent("y-src")
    make_agent("y-dst")
    with ControlPlaneClient(controlplane.address) as c:
        wait_for(lambda: registered(c, "y-src", "y-dst"), what="agents ready")
        cluster = controlplane.cluster
        # the agent's real stream stays open: an inventory still on it (a resync) must not
        # make it ready again before the drain is asked (a loaded CI machine did once)
        monkeypatch.setattr(cluster, "apply_inventory_chunk", lambda *args, **kwargs: None)
        cluster.stream_closed("y-src", cluster._agents["y-src"].session_id)  # as a broken stream does
        with pytest.raises(ClientError, match="agent_id: agent y-src is disconnected, not ready"):
            c.drain("y-src")
        assert {a.agent_id: a.cordon_reason for a in c.list_agents()}["y-src"] == ""
        assert [o for o in c.list_operations() if o.kind == "drain"] == []


def test_a_destination_with_larger_pages_is_charged_its_own_pages(controlplane, make_agent):
    """Review: a destination was charged what a block takes in the SOURCE's slab (pages of
    1 KiB here). One whose slab has pages of 6 KiB (--page-size, or a model of its own that
    sets it) holds a block of the demo model (8 KiB) in 2 pages, 12 KiB, 50 % more: the
    drain sent 14 blocks into the room of 9, and the destination dropped what it was sent.
    Each agent says its handoff page in its record (AgentInfo.handoff_page_bytes)."""
    page = 6 * 1024
    src = make_agent("g-src")
    dst = make_agent("g-dst", cpu_capacity_bytes=20 * page, page_bytes=page)  # 10 blocks; 9 below 0.95
    for i in range(16):
        src.engine.store(M.model_id, tokens(1, start=1_300_000 + 100 * i), kv(1, seed=400 + i))
    with ControlPlaneClient(controlplane.address) as c:
        wait_for(lambda: registered(c, "g-src", "g-dst"), what="agents ready")
        wait_for(lambda: own_blocks_reported(c, "g-dst", 15), 10, what="usage")
        wait_for(lambda: {a.agent_id: a.num_blocks for a in c.list_agents()}.get("g-src") == 16, what="indexed")
        op = c.wait_operation(c.drain("g-src").op_id, 60)
        assert op.state == "SUCCEEDED", op
        time.sleep(3)  # the policy's passes (an urgent one follows a report over a high watermark)
        held = sum(u.num_blocks for u in dst.pool.usage())
        assert (held, op.num_done_blocks) == (9, 9), (held, op)


def test_a_drain_right_after_another_counts_the_pages_the_first_filled(controlplane, make_agent):
    """Review: an ended drain kept against its destination's room only the payload it sent
    (moved_bytes), not the pages those blocks take there, until the destination reported.
    Ten int8 blocks (4,352 B each) take 50 KiB of 1 KiB pages, not 42.5 KiB: the second
    drain, started before the destination reported, was given a block's room too many and
    the destination's policy dropped a block it had been sent. The agent reports what each
    destination was charged (OpUpdate.peer_taken_bytes), and that is what an ended drain keeps."""
    from protos.tier import Tier

    s1 = make_agent("u-s1", tier_codecs={Tier.CPU: "int8"})
    s2 = make_agent("u-s2", tier_codecs={Tier.CPU: "int8"})
    dst = make_agent("u-dst", cpu_capacity_bytes=10 * M.block_bytes, stats_interval_seconds=2.0)  # 16 int8 blocks
    for i, s in enumerate((s1, s2)):
        for j in range(10):
            s.engine.store(M.model_id, tokens(1, start=1_400_000 + 1000 * i + 100 * j), kv(1, seed=500 + 10 * i + j))
    with ControlPlaneClient(controlplane.address) as c:
        wait_for(lambda: registered(c, "u-s1", "u-s2", "u-dst"), what="agents ready")
        wait_for(lambda: own_blocks_reported(c, "u-dst", 10), 10, what="usage")
        for a in ("u-s1", "u-s2"):
            wait_for(lambda a=a: {x.agent_id: x.num_blocks for x in c.list_agents()}.get(a) == 10, what="indexed")
        first = c.wait_operation(c.drain("u-s1", to_agent_ids=["u-dst"]).op_id, 60)
        assert first.state == "SUCCEEDED" and first.num_done_blocks == 10, first
        # its last report still says 76 KiB free below the high watermark: 50 KiB are the first drain's
        second = c.wait_operation(c.drain("u-s2", to_agent_ids=["u-dst"]).op_id, 60)
        assert second.state == "SUCCEEDED" and second.num_done_blocks == 5, second  # 26 KiB were left
        time.sleep(3)  # the policy's passes (an urgent one follows a report over a high watermark)
    assert sum(u.num_blocks for u in dst.pool.usage()) == 15


def test_a_drain_counts_what_route_sent_a_destination_its_reports_do_not_show_yet(controlplane, make_agent):
    """Review: Route sent a decode agent a handoff and a drain into that agent started
    before the agent reported the blocks that landed. The drain was given the room the
    handoff had taken (its last report still showed it free) and the destination dropped
    blocks to take in what it was sent. What Route sent an agent lately is counted as
    taken, as Route itself counts it."""
    from protos.block_hash import hash_prefix, split_hashes

    pre = make_agent("v-pre", role="prefill")
    src = make_agent("v-src", role="prefill")
    dst = make_agent("v-dst", role="decode", cpu_capacity_bytes=10 * M.block_bytes, stats_interval_seconds=3.0)
    own = tokens(2, start=1_500_000)
    dst.engine.store(M.model_id, own, kv(2, seed=600))  # 7.5 blocks of room below the high watermark
    prompt = tokens(4, start=1_510_000)
    pre.engine.store(M.model_id, prompt, kv(4, seed=601))
    for j in range(8):
        src.engine.store(M.model_id, tokens(1, start=1_520_000 + 100 * j), kv(1, seed=610 + j))
    with ControlPlaneClient(controlplane.address) as c:
        wait_for(lambda: registered(c, "v-pre", "v-src", "v-dst"), what="agents ready")
        wait_for(lambda: {a.agent_id: a.num_blocks for a in c.list_agents()}.get("v-src") == 8, what="indexed")
        wait_for(lambda: own_blocks_reported(c, "v-dst", 8), 10, what="usage")
        wait_for(lambda: controlplane.cluster.dataplane.view("v-dst") is not None, 10, what="data plane reported")
        # just after a report of the destination: the next one comes after the drain started
        reports = controlplane.cluster.stats_reports("v-dst")
        wait_for(lambda: controlplane.cluster.stats_reports("v-dst") > reports, 10, 0.01, what="a report")
        routed = c.route(M.model_id, prompt, role="decode", prefill_agent_id="v-pre")
        assert routed.decode_agent_id == "v-dst", routed
        sent = pre.dataplane.handoff(M.model_id, split_hashes(hash_prefix(M.model_id, prompt, M.block_size)), "v-dst")
        assert sent.outcome == "transferred", sent
        op = c.wait_operation(c.drain("v-src", to_agent_ids=["v-dst"]).op_id, 60)
        assert op.state == "SUCCEEDED" and op.num_done_blocks == 3, op  # 3.5 blocks were left
        reports = controlplane.cluster.stats_reports("v-dst")
        wait_for(lambda: controlplane.cluster.stats_reports("v-dst") >= reports + 1, 10, what="usage reported")
        time.sleep(1)  # the policy's pass after it
    assert sum(u.num_blocks for u in dst.pool.usage()) == 2 + 4 + 3
    assert dst.engine.load(M.model_id, own).num_cached_tokens == len(own)
    assert dst.engine.load(M.model_id, prompt).num_cached_tokens == len(prompt)


def route_takes_a_drains_room(c, controlplane, make_agent, n: int, wait_seconds: float):
    """A drain of `n` one-block prefixes of w-src into w-dst (7.5 blocks of room below its
    high watermark, 2 its own), and Route's handoff of 4 blocks from w-pre landing there
    while it runs (in namespace "routed": a cleanup drops them alone). The drain's link is
    paced (2 blocks a second): it runs while Route's handoff lands, and gets 3 blocks in
    before the destination refuses the next past its drop line. Returns the operation
    (running), the source, the destination and the two prompts (its own, Route's)."""
    from agent.dataplane import DataPlaneConfig
    from protos.block_hash import hash_prefix, split_hashes

    pre = make_agent("w-pre", role="prefill")
    paced = DataPlaneConfig(link_bytes_per_second=2 * M.block_bytes, drain_full_wait_seconds=wait_seconds)
    src = make_agent("w-src", role="prefill", dataplane=paced)
    dst = make_agent("w-dst", role="decode", cpu_capacity_bytes=10 * M.block_bytes)
    own = tokens(2, start=1_600_000)
    dst.engine.store(M.model_id, own, kv(2, seed=700))  # 7.5 blocks of room below the high watermark
    prompt = tokens(4, start=1_610_000)
    pre.engine.store(M.model_id, prompt, kv(4, seed=701), namespace="routed")
    for j in range(n):
        src.engine.store(M.model_id, tokens(1, start=1_620_000 + 100 * j), kv(1, seed=710 + j))
    wait_for(lambda: registered(c, "w-pre", "w-src", "w-dst"), what="agents ready")
    wait_for(lambda: {a.agent_id: a.num_blocks for a in c.list_agents()}.get("w-src") == n, what="indexed")
    wait_for(lambda: own_blocks_reported(c, "w-dst", 8), 10, what="usage")
    op = c.drain("w-src", to_agent_ids=["w-dst"])
    assert op.params["room"] == str(7 * M.block_bytes + M.block_bytes // 2), op.params
    wait_for(lambda: c.get_operation(op.op_id).num_done_blocks >= 1, 10, 0.01, what="the drain's first block")
    routed = c.route(M.model_id, prompt, role="decode", prefill_agent_id="w-pre")
    assert routed.decode_agent_id == "w-dst", routed
    sent = pre.dataplane.handoff(M.model_id, split_hashes(hash_prefix(M.model_id, prompt, M.block_size)), "w-dst")
    assert sent.outcome == "transferred", sent
    return op, src, dst, own, prompt


def waiting_for_room(c, op_id: str) -> bool:
    op = c.get_operation(op_id)
    assert op.state == "RUNNING", op  # (before: the drain ended at the destination's first refusal)
    return "waiting for room at w-dst" in op.result


def test_route_handoffs_landing_while_a_drain_runs_take_its_room_not_the_destinations_own_blocks(
    controlplane, make_agent
):
    """Review: a drain was given its destinations' room when it started, and sent all of it
    however long it ran; the handoffs Route sent there meanwhile took part of that room, so
    the destination pushed out its own blocks to take in what the drain still sent (a
    driver with 4 Route threads saw destinations drop 116-136 blocks). The destination
    refuses a drain's blocks past the line where its tier policy would drop blocks, as it
    stands at each Reserve: the drain stops there, and Route's handoffs still land. It
    tries that destination again for a while (drain_full_wait_seconds, 2 s here), and
    ends within it when no room frees, saying the destination stayed full."""
    wait = 2.0
    with ControlPlaneClient(controlplane.address) as c:
        op, _src, dst, own, prompt = route_takes_a_drains_room(c, controlplane, make_agent, 8, wait)
        t0 = time.monotonic()
        wait_for(lambda: waiting_for_room(c, op.op_id), 10, 0.01, what="the drain waiting for room")
        refused_at = time.monotonic()
        op = c.wait_operation(op.op_id, 60)
        ended = time.monotonic()
        # 2 own + 4 Route's leave 3.5 blocks below the line: 3 of the drain's (before: all 7 it was given)
        assert op.state == "SUCCEEDED" and op.num_done_blocks == 3, op
        assert "5 of 8 blocks not handed off: w-dst full: other handoffs took its room" in op.error, op.error
        assert "stayed full through" in op.error, op.error
        # it waited for room, and no longer than it was told (its last retry at the end)
        assert wait - 0.5 <= ended - t0 and ended - refused_at <= wait + 2.0, (ended - t0, ended - refused_at)
        time.sleep(1)  # the policy's passes after the destination's reports
    assert dst.engine.load(M.model_id, own).num_cached_tokens == len(own)  # nothing of its own pushed out
    assert dst.engine.load(M.model_id, prompt).num_cached_tokens == len(prompt)
    assert sum(u.num_blocks for u in dst.pool.usage()) == 2 + 4 + 3


def test_a_drain_refused_by_a_full_destination_finishes_once_room_frees_there(controlplane, make_agent):
    """Review: a destination that refused the drain's blocks past its drop line was sent
    nothing more for the rest of the drain, even once room freed there (a cleanup, the
    policy dropping, decodes ending): the operation ended with chains left behind. The
    drain keeps them and tries that destination again, backing off, while it says
    RUNNING; a cleanup of Route's blocks there frees the room and the drain moves all."""
    with ControlPlaneClient(controlplane.address) as c:
        op, _src, dst, own, prompt = route_takes_a_drains_room(c, controlplane, make_agent, 6, 60.0)
        wait_for(lambda: waiting_for_room(c, op.op_id), 10, 0.01, what="the drain waiting for room")
        assert c.get_operation(op.op_id).num_done_blocks == 3
        assert c.wait_operation(c.cleanup(namespace="routed", agent_id="w-dst").op_id, 30).state == "SUCCEEDED"
        op = c.wait_operation(op.op_id, 30)
        assert op.state == "SUCCEEDED", op
        assert (op.num_done_blocks, op.num_total_blocks, op.num_failed_blocks) == (6, 6, 0), op
        assert op.error == "", op.error
        assert op.params["taken"] == str(6 * M.block_bytes), op.params  # what it was charged there
    assert dst.engine.load(M.model_id, own).num_cached_tokens == len(own)  # nothing of its own pushed out
    assert dst.engine.load(M.model_id, prompt).num_cached_tokens == 0  # the cleanup's
    for j in range(6):
        assert dst.engine.load(M.model_id, tokens(1, start=1_620_000 + 100 * j)).num_cached_tokens == M.block_size
    assert sum(u.num_blocks for u in dst.pool.usage()) == 2 + 6


def test_a_drain_cancelled_while_it_waits_for_room_ends_at_once(controlplane, make_agent):
    """kvctl cancel stops the wait for a full destination at once (not at its next retry,
    nor at the end of the time it would wait), counting as failed only the prefix the
    destination refused."""
    with ControlPlaneClient(controlplane.address) as c:
        op, _src, _dst, _own, _prompt = route_takes_a_drains_room(c, controlplane, make_agent, 6, 60.0)
        wait_for(lambda: waiting_for_room(c, op.op_id), 10, 0.01, what="the drain waiting for room")
        time.sleep(4.0)  # into its 4 s wait between two retries (after those of 0.5, 1 and 2 s)
        t0 = time.monotonic()
        c.cancel_operation(op.op_id)
        op = c.wait_operation(op.op_id, 30)
        took = time.monotonic() - t0
        assert op.state == "CANCELLED", op
        assert (op.num_done_blocks, op.num_total_blocks, op.num_failed_blocks) == (3, 6, 1), op
        assert took < 1.5, took


def test_a_drain_waiting_for_room_ends_at_once_when_its_agent_stops(controlplane, make_agent):
    """The agent going down (its data plane closing) stops the wait for a full destination
    at once: the drain's thread is not left sleeping out its retries."""
    import threading

    with ControlPlaneClient(controlplane.address) as c:
        op, src, _dst, _own, _prompt = route_takes_a_drains_room(c, controlplane, make_agent, 6, 60.0)
        wait_for(lambda: waiting_for_room(c, op.op_id), 10, 0.01, what="the drain waiting for room")
        time.sleep(4.0)  # into its 4 s wait between two retries (after those of 0.5, 1 and 2 s)

        def draining() -> bool:
            return any(t.name == f"drain {op.op_id}" for t in threading.enumerate())

        assert draining()
        src.dataplane.close()
        t0 = time.monotonic()
        wait_for(lambda: not draining(), 5, 0.01, what="the drain's thread to end")
        assert time.monotonic() - t0 < 1.0


def test_counting_the_blocks_a_drain_left_holds_the_pool_lock_a_chunk_at_a_time():
    """Last read: a partial drain counts the blocks it left that the agent still holds
    (DrainRun.held_left) under the pool's lock, which the engine's store, lookup and load
    wait on; it held it for every block left at once (1M blocks: ~0.9 s on a loaded 2-core
    host). It takes the lock a chunk of blocks at a time, and counts the same."""
    import threading
    from types import SimpleNamespace

    from agent.core.blocks import BlockMeta
    from agent.core.drain import DrainChain, DrainPlan
    from agent.drain_run import HELD_LEFT_CHUNK, DrainRun
    from protos.tier import Tier

    class Pool:
        def __init__(self, hashes: list[bytes]) -> None:
            self._lock = threading.RLock()
            self.held, self.gets, self.most = 0, 0, 0
            self.blocks = _CountingDict(self, {h: BlockMeta(h, b"", "m", 1, Tier.CPU, None) for h in hashes})

        @property
        def lock(self):
            pool = self

            class Held:
                def __enter__(self):
                    pool._lock.acquire()
                    pool.held, pool.gets = pool.held + 1, 0

                def __exit__(self, *exc):
                    pool.most = max(pool.most, pool.gets)
                    pool._lock.release()

            return Held()

    class _CountingDict(dict):
        def __init__(self, pool, items) -> None:
            super().__init__(items)
            self.pool = pool

        def get(self, key, default=None):
            self.pool.gets += 1
            return super().get(key, default)

    n = 3 * HELD_LEFT_CHUNK + 5
    hashes = [i.to_bytes(32, "big") for i in range(n)]
    pool = Pool(hashes[: n - 7])  # 7 dropped here meanwhile
    chains = [DrainChain("m", (h,), (1,), 0) for h in hashes]
    run = DrainRun(SimpleNamespace(pool=pool), "op", [], chains, DrainPlan([], []), None, 0.0, None, None)  # type: ignore[arg-type]
    run.done.update(hashes[:3])
    assert run.held_left() == n - 7 - 3
    assert pool.held >= 3 and pool.most <= HELD_LEFT_CHUNK, (pool.held, pool.most)
