"""Integration: a real etcd, an in-process control plane and agents on port 0, talking
real gRPC. Agents register under leases, stream inventories and events; lookups find
the longest prefix per agent; a gap forces a resync; leases expiring drop agents."""

from __future__ import annotations

import grpc
import pytest
import torch

from agent.server import DEMO_MODEL
from cli.client import ClientError, ControlPlaneClient
from protos import etcd_keys
from protos.block_hash import hash_prefix
from protos.kvcp.v1 import admin_pb2, admin_pb2_grpc
from tests.helpers import wait_for

M = DEMO_MODEL
BS = M.block_size


def kv(n_blocks: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n_blocks, *M.block_shape), generator=g).to(torch.float16)


def tokens(n_blocks: int, start: int = 0) -> list[int]:
    return list(range(start, start + n_blocks * BS))


def indexed(client: ControlPlaneClient, agent_id: str) -> int:
    return {a.agent_id: a.num_blocks for a in client.list_agents()}.get(agent_id, -1)


def test_two_agents_longest_prefix_per_agent(controlplane, make_agent):
    a1, a2 = make_agent("a1"), make_agent("a2")
    prompt = tokens(12)
    a1.engine.store(M.model_id, prompt, kv(12))
    a2.engine.store(M.model_id, prompt[: 5 * BS], kv(5))
    other = tokens(3, start=10_000)
    a2.engine.store(M.model_id, other, kv(3, seed=1))
    with ControlPlaneClient(controlplane.address) as c:
        wait_for(lambda: indexed(c, "a1") == 12 and indexed(c, "a2") == 8, what="both inventories indexed")
        res = c.lookup(M.model_id, prompt + [7, 7, 7])
        assert res.best_agent_id == "a1"
        assert res.num_blocks == 12 and res.num_tokens == 12 * BS + 3
        by_agent = {m.agent_id: m for m in res.agents}
        assert by_agent["a1"].num_hit_blocks == 12 and by_agent["a1"].num_hit_tokens == 12 * BS
        assert by_agent["a2"].num_hit_blocks == 5
        assert by_agent["a1"].tiers == ["cpu"] * 12
        # by packed hashes gives the same answer
        packed = hash_prefix(M.model_id, prompt, BS)
        assert c.lookup(M.model_id, block_hashes=packed).agents == res.agents
        # a prompt that diverges after block 2 matches 2 blocks on both
        diverged = prompt[: 2 * BS] + tokens(4, start=50_000)
        res2 = c.lookup(M.model_id, diverged)
        assert {m.agent_id: m.num_hit_blocks for m in res2.agents} == {"a1": 2, "a2": 2}
        stats = c.stats()
        assert stats.num_agents == 2 and stats.num_blocks == 15 and stats.num_block_replicas == 20
        assert stats.lookups_total == 3 and stats.is_leader and stats.epoch > 0
        assert stats.lookup_hit_tokens_total == 12 * BS * 2 + 2 * BS


def test_evictions_reach_the_index(controlplane, make_agent):
    # the agent's own evictions, checked alone: 6 of 6 blocks is over the tier's high
    # watermark (0.95), and a policy pass rightly dropped one more (the old prefix's last
    # block, its least recent) once the index had counted 6; a loaded machine's lookup
    # below came after that pass (1 block hit, not 2)
    controlplane.manager.policy_enabled = False
    cap = 6 * M.block_bytes
    a = make_agent("small", cpu_capacity_bytes=cap)
    a.engine.store(M.model_id, tokens(4), kv(4))
    with ControlPlaneClient(controlplane.address) as c:

        def hits(token_ids: list[int]) -> int:
            found = c.lookup(M.model_id, token_ids).agents
            return found[0].num_hit_blocks if found else 0

        # indexed first, so the evictions travel as events (not in the agent's first inventory)
        wait_for(lambda: hits(tokens(4)) == 4, what="indexed")
        a.engine.store(M.model_id, tokens(4, start=90_000), kv(4, seed=2))  # evicts 2 old leaves
        # (the count passes 6 on the way too: 4 old + 2 new before the first eviction)
        wait_for(lambda: hits(tokens(4, start=90_000)) == 4 and hits(tokens(4)) == 2, what="evictions indexed")
        assert indexed(c, "small") == 6
        assert a.engine.lookup(M.model_id, tokens(4)) == 2 * BS


def test_sequence_gap_forces_resync(controlplane, make_agent):
    a = make_agent("gappy")
    a.engine.store(M.model_id, tokens(2), kv(2))
    with ControlPlaneClient(controlplane.address) as c:
        wait_for(lambda: indexed(c, "gappy") == 2, what="first blocks")
        with a.pool.lock:
            a.pool.journal.last_seq += 5  # lose a few batches on the wire
        a.engine.store(M.model_id, tokens(5), kv(5))
        wait_for(lambda: c.stats().resyncs_total == 1, what="a resync")
        wait_for(lambda: indexed(c, "gappy") == 5, what="index repaired by the inventory")
        assert a.link.resyncs_total == 1


def test_agent_leaves_index_when_lease_expires(controlplane, make_agent, etcd):
    make_agent("survivor", lease_ttl_seconds=10)
    a = make_agent("mortal", lease_ttl_seconds=2)
    a.engine.store(M.model_id, tokens(3), kv(3))
    with ControlPlaneClient(controlplane.address) as c:
        wait_for(lambda: indexed(c, "mortal") == 3, what="indexed")
        a.stop(deregister=False)  # no revoke: only the lease TTL removes it
        wait_for(lambda: indexed(c, "mortal") == -1, timeout_seconds=2 + 2 + 1, what="agent gone")
        assert c.lookup(M.model_id, tokens(3)).agents == []


def test_stream_blip_keeps_blocks(controlplane, make_agent):
    a = make_agent("blip", lease_ttl_seconds=5)
    a.engine.store(M.model_id, tokens(3), kv(3))
    with ControlPlaneClient(controlplane.address) as c:
        wait_for(lambda: indexed(c, "blip") == 3, what="indexed")
        a.link.request_reconnect()  # the stream drops; the lease stays
        wait_for(lambda: a.link.connections_total >= 2, what="reconnected")
        assert indexed(c, "blip") == 3
        assert c.stats().num_block_replicas == 3


def test_admin_errors_have_status_codes(controlplane, make_agent):
    make_agent("x")
    channel = grpc.insecure_channel(controlplane.address)
    stub = admin_pb2_grpc.AdminServiceStub(channel)
    cases = [
        (admin_pb2.LookupRequest(model_id="", token_ids=[1]), grpc.StatusCode.INVALID_ARGUMENT, "model_id"),
        (admin_pb2.LookupRequest(model_id=M.model_id), grpc.StatusCode.INVALID_ARGUMENT, "token_ids"),
        (
            admin_pb2.LookupRequest(model_id=M.model_id, block_hashes=b"x" * 17),
            grpc.StatusCode.INVALID_ARGUMENT,
            "block_hashes",
        ),
        (admin_pb2.LookupRequest(model_id="nope", token_ids=[1]), grpc.StatusCode.NOT_FOUND, "model_id"),
    ]
    wait_for(lambda: stub.GetStats(admin_pb2.GetStatsRequest()).models, what="model known")
    for request, code, field in cases:
        with pytest.raises(grpc.RpcError) as info:
            stub.Lookup(request, timeout=30)
        assert info.value.code() == code
        assert field in info.value.details()
    channel.close()


def test_follower_rejects_with_leader_address_and_client_follows(controlplane, etcd):
    from controlplane.server import ControlPlane, ControlPlaneConfig

    follower = ControlPlane(ControlPlaneConfig(listen="127.0.0.1:0", etcd=etcd, election_ttl_seconds=3)).start()
    try:
        assert not follower.election.is_leader
        assert follower.election.leader_address == controlplane.address
        with ControlPlaneClient(follower.address) as c:
            s = c.stats()  # followed to the leader
            assert s.is_leader and c.endpoint == controlplane.address
    finally:
        follower.stop()


def test_client_without_controlplane_says_where_it_tried():
    from tests.helpers import free_port

    endpoint = f"127.0.0.1:{free_port()}"
    with ControlPlaneClient(endpoint, timeout_seconds=1) as c, pytest.raises(ClientError) as info:
        c.stats()
    assert endpoint in str(info.value) and "kvcp-controlplane" in str(info.value)


def test_agent_key_in_etcd_is_under_a_lease(make_agent, controlplane, etcd):
    a = make_agent("leased")
    client = etcd_keys.connect(etcd)
    value, meta = client.get(etcd_keys.agent_key("leased"))
    assert value is not None and meta.lease_id == a.registration.lease.id
    client.close()


def test_a_workload_run_spends_its_duration_on_requests(controlplane, make_agent, monkeypatch):
    """The demo workload's fill table takes seconds on a busy machine: it is made before a
    run's clock starts. Made inside the first request, it took a 4 s run of the console
    scripts' e2e test to 1 request (it asks for more than 10) under load."""
    import threading
    import time

    from benchmarks import workload

    make_agent("wl")
    with ControlPlaneClient(controlplane.address) as c:
        wait_for(lambda: [a.state for a in c.list_agents()] == ["ready"], what="agent ready")
        wait_for(lambda: c.stats().models, what="model known")
    real = workload._codec_exact_fills
    monkeypatch.setattr(workload, "_FILLS", [])
    monkeypatch.setattr(workload, "_codec_exact_fills", lambda: (time.sleep(2.5), real())[1])
    stats = workload.Workload(controlplane.address, 0).run(threading.Event(), 2.0)
    assert stats.errors_total == 0 and stats.requests_total >= 2, stats
