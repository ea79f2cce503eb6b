"""kvctl cordon / uncordon: an agent taken out of rotation (a rolling upgrade, a failing
GPU) gets no new work - Lookup and Route leave it out, no transfer goes to it - while it
keeps its blocks and can still be a transfer's source; the cordon is durable (the policy
key cordon.<agent_id> in etcd) across a control-plane restart."""

from __future__ import annotations

import pytest

from agent.server import DEMO_MODEL
from cli.client import ClientError, ControlPlaneClient
from tests.helpers import wait_for

M = DEMO_MODEL


def tokens(n_blocks: int, start: int = 0) -> list[int]:
    return list(range(start, start + n_blocks * M.block_size))


def test_a_cordoned_agent_gets_no_new_work_keeps_its_blocks_and_stays_cordoned_across_a_restart(etcd, make_agent):
    import torch

    from controlplane.server import ControlPlane, ControlPlaneConfig

    prompt = tokens(3, start=70_000)
    cp = ControlPlane(ControlPlaneConfig(listen="127.0.0.1:0", etcd=etcd, election_ttl_seconds=2)).start()
    port = cp.port
    try:
        old = make_agent("c-old", lease_ttl_seconds=3)
        make_agent("c-new", lease_ttl_seconds=3)
        old.engine.store(M.model_id, prompt, torch.ones((3, *M.block_shape), dtype=torch.float16))
        with ControlPlaneClient(cp.address) as c:
            wait_for(lambda: c.lookup(M.model_id, token_ids=prompt).best_agent_id == "c-old", what="indexed")
            # Route takes only agents on a stream: c-new's first may come later on a busy machine
            wait_for(lambda: cp.cluster.stream_of("c-new"), what="c-new on a stream")
            assert c.cordon("c-old", "kernel upgrade") == "kernel upgrade"
            assert {a.agent_id: a.cordon_reason for a in c.list_agents()} == {"c-old": "kernel upgrade", "c-new": ""}
            assert c.lookup(M.model_id, token_ids=prompt).agents == []
            for role in ("prefill", "decode"):
                route = c.route(M.model_id, token_ids=prompt, role=role)
                assert route.agent_id == "c-new" and "c-old" not in {x.agent_id for x in route.candidates}, route
            with pytest.raises(ClientError, match="cordoned"):
                c.transfer(M.model_id, "c-new", "c-old", token_ids=prompt)
            # the cordoned agent is emptied into one in rotation: it is still a source
            op = c.wait_operation(c.transfer(M.model_id, "c-old", "c-new", token_ids=prompt).op_id, 30)
            assert op.state == "SUCCEEDED", op
            with pytest.raises(ClientError, match="no agent 'c-typo'"):
                c.cordon("c-typo", "a typo would cordon nothing")
            with pytest.raises(ClientError, match="reason"):
                c.cordon("c-new", "two\nlines")
    finally:
        cp.stop()
    cp2 = ControlPlane(ControlPlaneConfig(listen=f"127.0.0.1:{port}", etcd=etcd, election_ttl_seconds=2)).start()
    try:
        with ControlPlaneClient(cp2.address) as c:
            wait_for(
                lambda: {a.agent_id: a.cordon_reason for a in c.list_agents()}.get("c-old") == "kernel upgrade",
                15,
                what="the cordon loaded by the next control plane",
            )
            wait_for(lambda: c.lookup(M.model_id, token_ids=prompt).best_agent_id == "c-new", 15, what="c-new synced")
            assert [m.agent_id for m in c.lookup(M.model_id, token_ids=prompt).agents] == ["c-new"]
            assert c.uncordon("c-old") is True
            assert c.uncordon("c-old") is False
            assert {m.agent_id for m in c.lookup(M.model_id, token_ids=prompt).agents} == {"c-old", "c-new"}
            assert all(not a.cordon_reason for a in c.list_agents())
    finally:
        cp2.stop()


def test_a_follower_knows_the_cordons_before_it_takes_over(etcd, make_agent):
    """Cordons reach a replica's lookups with its policy. A new leader loads the policy at
    its first reconcile pass, and answers lookups from memory before that: a follower
    that had not read the policy would route to a cordoned agent meanwhile (a review).
    Followers read the stored policy every resync."""
    from controlplane.server import ControlPlane, ControlPlaneConfig

    config = ControlPlaneConfig(listen="127.0.0.1:0", etcd=etcd, election_ttl_seconds=2)
    leader = ControlPlane(config).start()
    follower = None
    try:
        with ControlPlaneClient(leader.address) as c:
            wait_for(lambda: c.stats().leader_address == leader.address, 10, what="the first replica leads")
        follower = ControlPlane(config).start()
        make_agent("c-f", lease_ttl_seconds=3)
        with ControlPlaneClient(leader.address) as c:
            wait_for(lambda: "c-f" in {a.agent_id for a in c.list_agents()}, what="registered")
            c.cordon("c-f", "kernel upgrade")
            wait_for(lambda: follower.cluster.cordon_reason("c-f") == "kernel upgrade", 10, what="the follower knows")
            c.uncordon("c-f")
            wait_for(lambda: follower.cluster.cordon_reason("c-f") == "", 10, what="the follower knows it lifted")
    finally:
        if follower is not None:
            follower.stop()
        leader.stop()


def test_an_engine_handoff_to_a_cordoned_agent_is_refused_at_its_source(controlplane, make_agent):
    """An engine that names a cordoned agent in its own Handoff (a router's stale choice)
    is refused by the source agent, as the control plane's Transfer is: the source reads
    the cordons from etcd's policy with the peer's record. Nothing is written there, and
    once uncordoned the same handoff goes through."""
    import grpc
    import torch

    from agent.client import EngineClient
    from agent.dataplane import PEER_CACHE_SECONDS

    src = make_agent("h-src")
    dst = make_agent("h-dst")
    prompt = tokens(2, start=90_000)
    src.engine.store(M.model_id, prompt, torch.ones((2, *M.block_shape), dtype=torch.float16))
    engine = EngineClient(src.address)
    with ControlPlaneClient(controlplane.address) as c:
        wait_for(lambda: "h-dst" in {a.agent_id for a in c.list_agents()}, what="registered")
        c.cordon("h-dst", "GPU Xid 79")
        # the source reads it with the peer's record, at most PEER_CACHE_SECONDS old: read now
        assert src.dataplane.peer("h-dst", refresh=True).cordoned == "GPU Xid 79"
        with pytest.raises(grpc.RpcError) as refused:
            engine.handoff(M.model_id, "h-dst", token_ids=prompt, deadline_seconds=5)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION, refused.value
        assert "h-dst is cordoned (GPU Xid 79)" in refused.value.details(), refused.value.details()
        assert "kvctl uncordon h-dst" in refused.value.details()
        assert dst.engine.load(M.model_id, prompt).num_cached_tokens == 0
        # the control plane's transfer from the source is refused as well (its own check)
        with pytest.raises(ClientError, match="cordoned"):
            c.transfer(M.model_id, "h-src", "h-dst", token_ids=prompt)
        c.uncordon("h-dst")
        wait_for(
            lambda: (
                engine.handoff(M.model_id, "h-dst", token_ids=prompt, deadline_seconds=5).outcome
                in ("transferred", "present")
            ),
            PEER_CACHE_SECONDS + 10,
            what="handed off once uncordoned",
        )
    assert dst.engine.load(M.model_id, prompt).num_cached_tokens == len(prompt)
