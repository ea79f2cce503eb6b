"""Pins, operations and policy against a real etcd and real gRPC: pins hold on agents,
survive a control-plane restart, are re-applied after an agent restart, expire on time;
move/compress/cleanup run as operations; cleanups of one scope serialize."""

from __future__ import annotations

import contextlib
import time

import pytest
import torch

from agent.server import DEMO_MODEL
from cli.client import ClientError, ControlPlaneClient
from protos import etcd_keys
from protos.block_hash import hash_prefix, split_hashes
from protos.tier import Tier
from protos.units import human_bytes
from tests.helpers import wait_for

M = DEMO_MODEL
BS = M.block_size


def kv(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn((n, *M.block_shape), generator=torch.Generator().manual_seed(seed)).to(torch.float16)


def tokens(n_blocks: int, start: int = 0) -> list[int]:
    return list(range(start, start + n_blocks * BS))


def indexed(c: ControlPlaneClient, agent_id: str) -> int:
    return {a.agent_id: a.num_blocks for a in c.list_agents()}.get(agent_id, -1)


@pytest.fixture
def client(controlplane):
    with ControlPlaneClient(controlplane.address) as c:
        yield c


def pinned_on(agent, token_ids) -> list[int]:
    hashes = split_hashes(hash_prefix(M.model_id, token_ids, BS))
    with agent.pool.lock:
        return [agent.pool.pin_tier(agent.pool.blocks[h]) if h in agent.pool.blocks else -1 for h in hashes]


def test_pin_holds_against_eviction_and_expires(client, make_agent):
    a = make_agent("p1", cpu_capacity_bytes=8 * M.block_bytes)
    a.engine.store(M.model_id, tokens(4), kv(4))
    wait_for(lambda: indexed(client, "p1") == 4, what="indexed")
    pin = client.pin(model_id=M.model_id, token_ids=tokens(4), min_tier="cpu", ttl_seconds=3, owner="test")
    assert pin.num_blocks == 4 and pin.pinned_bytes == 4 * M.block_bytes
    wait_for(lambda: pinned_on(a, tokens(4)) == [int(Tier.CPU)] * 4, what="pin applied on the agent")
    # fill the tier far beyond capacity: the pinned prefix stays
    for i in range(6):
        a.engine.store(M.model_id, tokens(4, start=10_000 * (i + 1)), kv(4, seed=i + 1))
    assert a.engine.lookup(M.model_id, tokens(4)) == 4 * BS
    assert [p.pin_id for p in client.list_pins()] == [pin.pin_id]
    # no pin outlives its TTL: the agent stops honouring it at expiry, the CP drops it
    wait_for(lambda: pinned_on(a, tokens(4)) == [0] * 4, timeout_seconds=4.5, what="pin expired on the agent")
    wait_for(lambda: client.list_pins() == [], timeout_seconds=2, what="pin expired on the control plane")
    assert client.get_policy() is not None


def test_pin_errors_change_nothing(client, make_agent):
    make_agent("p2")
    wait_for(lambda: indexed(client, "p2") == 0, what="agent")
    cases = [
        (dict(model_id=M.model_id, token_ids=[1, 2], ttl_seconds=10), "INVALID_ARGUMENT", "fewer tokens"),
        (dict(namespace="bad ns!", ttl_seconds=10), "INVALID_ARGUMENT", "namespace"),
        (dict(model_id=M.model_id, token_ids=tokens(1)), "INVALID_ARGUMENT", "TTL"),
        (dict(namespace="kb", ttl_seconds=0.2), "INVALID_ARGUMENT", "under the 1s minimum"),
        (dict(model_id="nope", token_ids=tokens(1), ttl_seconds=10), "NOT_FOUND", "unknown model"),
        (dict(model_id=M.model_id, token_ids=tokens(1), ttl_seconds=10, min_tier="ssd"), "INVALID_ARGUMENT", "tier"),
        (dict(namespace="kb", ttl_seconds=10, agent_id="ghost"), "NOT_FOUND", "ghost"),
    ]
    for kwargs, code, needle in cases:
        with pytest.raises(ClientError) as info:
            client.pin(**kwargs)
        assert info.value.code == code and needle in str(info.value), (kwargs, str(info.value))
    with pytest.raises(ClientError) as info:
        client.unpin("does-not-exist")
    assert info.value.code == "NOT_FOUND"
    assert client.list_pins() == []


def test_a_pin_retried_under_its_id_is_made_once(client, make_agent):
    make_agent("p5")
    wait_for(lambda: indexed(client, "p5") == 0, what="agent")
    first = client.pin(namespace="kb", ttl_seconds=60, owner="retry", pin_id="kb-1")
    again = client.pin(namespace="kb", ttl_seconds=60, owner="retry", pin_id="kb-1")
    assert first.pin_id == again.pin_id == "kb-1"
    assert first.expires_unix_seconds == again.expires_unix_seconds  # the first try's pin, not a new one
    for other in (dict(ttl_seconds=120, owner="retry"), dict(ttl_seconds=60, owner="other"), dict(min_tier="gpu")):
        kwargs = dict(namespace="kb", ttl_seconds=60, owner="retry", pin_id="kb-1") | other
        with pytest.raises(ClientError) as info:
            client.pin(**kwargs)
        assert info.value.code == "ALREADY_EXISTS" and "'kb-1'" in str(info.value), other
    with pytest.raises(ClientError) as info:
        client.pin(namespace="kb", ttl_seconds=60, pin_id="-bad")
    assert info.value.code == "INVALID_ARGUMENT" and "pin_id" in str(info.value)
    assert [p.pin_id for p in client.list_pins()] == ["kb-1"]
    # without an id, each call is its own pin
    a, b = client.pin(namespace="kb", ttl_seconds=60), client.pin(namespace="kb", ttl_seconds=60)
    assert a.pin_id != b.pin_id and len(client.list_pins()) == 3


def test_quota_rejects_beyond_it(client, make_agent):
    make_agent("p3")
    wait_for(lambda: indexed(client, "p3") == 0, what="agent")
    client.set_policy({"quota.legal-kb": str(3 * M.block_bytes)})
    client.pin(model_id=M.model_id, token_ids=tokens(2), namespace="legal-kb", ttl_seconds=60)
    with pytest.raises(ClientError) as info:
        client.pin(model_id=M.model_id, token_ids=tokens(2, start=500), namespace="legal-kb", ttl_seconds=60)
    assert info.value.code == "RESOURCE_EXHAUSTED" and "legal-kb" in str(info.value)
    assert len(client.list_pins("legal-kb")) == 1
    with pytest.raises(ClientError) as info:
        client.set_policy({"quota.legal-kb": "lots"})
    assert info.value.code == "INVALID_ARGUMENT" and "quota.legal-kb" in str(info.value)
    # `none` lifts the quota (it was the only way out of one but a huge size)
    effective = client.set_policy({"quota.legal-kb": "none"})
    assert "quota.legal-kb" not in effective
    client.pin(model_id=M.model_id, token_ids=tokens(2, start=500), namespace="legal-kb", ttl_seconds=60)
    assert len(client.list_pins("legal-kb")) == 2


def test_namespace_pins_are_charged_each_byte_once_and_on_their_agent(client, make_agent):
    """Three pins of one namespace (everywhere, agent-1 only, agent-2 only) held it three
    times over against its quota, and a pin on an agent that holds none of it was charged
    the whole namespace."""
    make_agent("q1")
    q2 = make_agent("q2")
    q2.engine.store(M.model_id, tokens(4), kv(4), namespace="cq")
    size = 4 * M.block_bytes
    wait_for(lambda: indexed(client, "q2") == 4, what="indexed")
    client.pin(namespace="cq", ttl_seconds=60, pin_id="cq-probe")  # a retry would return this pin, as it was
    wait_for(lambda: [p.pinned_bytes for p in client.list_pins("cq")] == [size], what="the namespace's size known")
    client.unpin("cq-probe")
    client.set_policy({"quota.cq": str(size)})
    try:
        client.pin(namespace="cq", ttl_seconds=60, pin_id="cq-all")
        client.pin(namespace="cq", ttl_seconds=60, agent_id="q1", pin_id="cq-q1")
        client.pin(namespace="cq", ttl_seconds=60, agent_id="q2", pin_id="cq-q2")
        shown = {p.pin_id: p.pinned_bytes for p in client.list_pins("cq")}
        assert shown == {"cq-all": size, "cq-q1": 0, "cq-q2": size}
        client.unpin("cq-all")
        with pytest.raises(ClientError) as info:  # outside agent-2's pin: it adds its 2 blocks
            client.pin(model_id=M.model_id, token_ids=tokens(2, start=900), namespace="cq", ttl_seconds=60)
        asked = f"{human_bytes(size)} pinned + {human_bytes(2 * M.block_bytes)} asked"
        assert info.value.code == "RESOURCE_EXHAUSTED" and asked in str(info.value)
    finally:
        client.set_policy({"quota.cq": "none"})
        for p in client.list_pins("cq"):
            client.unpin(p.pin_id)


def test_pins_survive_controlplane_restart_and_reapply_to_restarted_agent(etcd, make_agent):
    from controlplane.server import ControlPlane, ControlPlaneConfig

    cp = ControlPlane(ControlPlaneConfig(listen="127.0.0.1:0", etcd=etcd, election_ttl_seconds=2)).start()
    port = cp.port
    try:  # stopped whatever happens: a control plane left running would lead in later tests
        a = make_agent("p4", lease_ttl_seconds=3)
        a.engine.store(M.model_id, tokens(3), kv(3))
        with ControlPlaneClient(cp.address) as c:
            wait_for(lambda: indexed(c, "p4") == 3, what="indexed")
            pin = c.pin(model_id=M.model_id, token_ids=tokens(3), min_tier="cpu", ttl_seconds=120)
            wait_for(lambda: pinned_on(a, tokens(3)) == [int(Tier.CPU)] * 3, what="applied")
    finally:
        cp.stop()
    cp2 = ControlPlane(ControlPlaneConfig(listen=f"127.0.0.1:{port}", etcd=etcd, election_ttl_seconds=2)).start()
    try:
        with ControlPlaneClient(cp2.address) as c:
            wait_for(lambda: [p.pin_id for p in c.list_pins()] == [pin.pin_id], timeout_seconds=10, what="pin reloaded")
            # a restarted agent (new process, same id) gets the pin again
            a.stop(deregister=True)
            b = make_agent("p4", lease_ttl_seconds=3)
            b.engine.store(M.model_id, tokens(3), kv(3))
            wait_for(lambda: pinned_on(b, tokens(3)) == [int(Tier.CPU)] * 3, timeout_seconds=10, what="re-applied")
    finally:
        cp2.stop()


def test_a_pin_gone_while_the_controlplane_was_down_is_lifted_on_the_agent(etcd, make_agent):
    """The pin's owner dies while no control plane runs: etcd drops the pin with the
    owner's lease, the agent still enforces it. The next control plane learns from the
    agent's Hello which pins it holds and lifts the one it no longer has."""
    from controlplane.server import ControlPlane, ControlPlaneConfig

    cp = ControlPlane(ControlPlaneConfig(listen="127.0.0.1:0", etcd=etcd, election_ttl_seconds=2)).start()
    port = cp.port
    owner = etcd_keys.connect(etcd)
    try:
        a = make_agent("p6", lease_ttl_seconds=3)
        a.engine.store(M.model_id, tokens(3, start=9000), kv(3))
        with ControlPlaneClient(cp.address) as c:
            wait_for(lambda: indexed(c, "p6") == 3, what="indexed")
            lease = owner.lease(30)
            c.pin(model_id=M.model_id, token_ids=tokens(3, start=9000), min_tier="cpu", owner_lease_id=lease.id)
            wait_for(lambda: pinned_on(a, tokens(3, start=9000)) == [int(Tier.CPU)] * 3, what="applied")
    finally:
        cp.stop()
    lease.revoke()  # the owner goes while no control plane watches
    cp2 = ControlPlane(ControlPlaneConfig(listen=f"127.0.0.1:{port}", etcd=etcd, election_ttl_seconds=2)).start()
    try:
        with ControlPlaneClient(cp2.address) as c:
            assert c.list_pins() == []
            wait_for(lambda: pinned_on(a, tokens(3, start=9000)) == [0] * 3, timeout_seconds=15, what="pin lifted")
    finally:
        cp2.stop()
        owner.close()


def test_a_pin_made_again_under_its_id_after_it_expired_reaches_the_agent(client, make_agent, controlplane):
    """A client refreshing its pin under a fixed id once `kvctl pins` stops listing it (it
    expired, the sweep has not yet run): the new pin replaces the agent's expired copy."""
    a = make_agent("p7", cpu_capacity_bytes=8 * M.block_bytes)
    a.engine.store(M.model_id, tokens(4, start=7000), kv(4))
    wait_for(lambda: indexed(client, "p7") == 4, what="indexed")
    controlplane.manager._expire_pins = lambda now: None  # the sweep has not run yet, whenever it looks
    first = client.pin(model_id=M.model_id, token_ids=tokens(4, start=7000), ttl_seconds=1.0, pin_id="sys")
    wait_for(lambda: pinned_on(a, tokens(4, start=7000)) == [int(Tier.CPU)] * 4, what="first pin applied")
    wait_for(lambda: client.list_pins() == [], timeout_seconds=3, what="first pin expired")
    assert time.time() >= first.expires_unix_seconds
    client.pin(model_id=M.model_id, token_ids=tokens(4, start=7000), ttl_seconds=60, pin_id="sys")
    wait_for(lambda: pinned_on(a, tokens(4, start=7000)) == [int(Tier.CPU)] * 4, what="the new pin on the agent")
    for i in range(4):  # fill the tier: the pinned prefix stays
        a.engine.store(M.model_id, tokens(4, start=20_000 * (i + 1)), kv(4, seed=i + 1))
    assert a.engine.lookup(M.model_id, tokens(4, start=7000)) == 4 * BS


def test_an_agent_holding_another_pin_under_an_id_gets_the_current_one(etcd, make_agent):
    """The agent was away while its pin was removed and another made under the same id
    (another prefix): its Hello names the id with the old version, and the control plane
    sends the current pin instead of taking the id for it."""
    from agent.core.pins import AgentPin
    from controlplane.server import ControlPlane, ControlPlaneConfig

    cp = ControlPlane(ControlPlaneConfig(listen="127.0.0.1:0", etcd=etcd, election_ttl_seconds=2)).start()
    port = cp.port
    old, new = tokens(2, start=30_000), tokens(2, start=31_000)
    try:
        a = make_agent("p8", lease_ttl_seconds=3)
        a.engine.store(M.model_id, old, kv(2))
        a.engine.store(M.model_id, new, kv(2, seed=1))
        with ControlPlaneClient(cp.address) as c:
            wait_for(lambda: indexed(c, "p8") == 4, what="indexed")
            c.pin(model_id=M.model_id, token_ids=new, ttl_seconds=120, pin_id="tenant-x")
            wait_for(lambda: pinned_on(a, new) == [int(Tier.CPU)] * 2, what="applied")
    finally:
        cp.stop()
    # what the agent held from before: the same id on the old prefix, an older version
    with a.pool.lock:
        held = a.pool.pins.pins["tenant-x"]
        stale = split_hashes(hash_prefix(M.model_id, old, BS))
        a.pool.pins.add(AgentPin("tenant-x", held.tier, held.expires_monotonic_seconds, "", frozenset(stale), "0.0"))
    assert pinned_on(a, old) == [int(Tier.CPU)] * 2 and pinned_on(a, new) == [0, 0]
    cp2 = ControlPlane(ControlPlaneConfig(listen=f"127.0.0.1:{port}", etcd=etcd, election_ttl_seconds=2)).start()
    try:
        wait_for(lambda: pinned_on(a, new) == [int(Tier.CPU)] * 2, timeout_seconds=15, what="the current pin sent")
        assert pinned_on(a, old) == [0, 0]
    finally:
        cp2.stop()


def test_a_restarted_agent_protects_its_pinned_disk_blocks_before_the_controlplane_is_back(etcd, make_agent, tmp_path):
    """Blocks pinned at the disk tier survive an agent restart on disk; the pins must too:
    with no control plane to re-send them, an engine storing into the restarted agent
    would push the pinned blocks out. A pin whose time ran out meanwhile is not restored."""
    from controlplane.server import ControlPlane, ControlPlaneConfig

    cp = ControlPlane(ControlPlaneConfig(listen="127.0.0.1:0", etcd=etcd, election_ttl_seconds=2)).start()
    cfg = dict(
        cpu_capacity_bytes=4 * M.block_bytes,
        disk_dir=str(tmp_path / "disk"),
        disk_capacity_bytes=8 * M.block_bytes + 65536,
        lease_ttl_seconds=3,
    )
    kept, brief = tokens(3, start=40_000), tokens(2, start=41_000)
    try:
        a = make_agent("p9", **cfg)
        a.engine.store(M.model_id, kept, kv(3))
        a.engine.store(M.model_id, brief, kv(2, seed=1))
        with ControlPlaneClient(cp.address) as c:
            wait_for(lambda: indexed(c, "p9") == 5, what="indexed")
            c.wait_operation(c.move("disk", model_id=M.model_id, token_ids=kept).op_id, timeout_seconds=20)
            c.wait_operation(c.move("disk", model_id=M.model_id, token_ids=brief).op_id, timeout_seconds=20)
            c.pin(model_id=M.model_id, token_ids=kept, min_tier="disk", ttl_seconds=600, pin_id="keep")
            c.pin(model_id=M.model_id, token_ids=brief, min_tier="disk", ttl_seconds=1.5, pin_id="brief")
            wait_for(lambda: pinned_on(a, kept) == [int(Tier.DISK)] * 3, what="applied")
            wait_for(lambda: pinned_on(a, brief) == [int(Tier.DISK)] * 2, what="applied")
    finally:
        cp.stop()
    a.stop(deregister=True)
    time.sleep(1.6)  # "brief" runs out while the agent is down
    b = make_agent("p9", **cfg)
    assert pinned_on(b, kept) == [int(Tier.DISK)] * 3 and pinned_on(b, brief) == [0, 0]
    for i in range(12):  # the engine stores at once, far beyond the tiers
        b.engine.store(M.model_id, tokens(2, start=100_000 + 1000 * i), kv(2, seed=10 + i))
    assert b.engine.lookup(M.model_id, kept) == 3 * BS


def test_a_namespace_pin_brings_its_blocks_up_to_its_tier(controlplane, client, make_agent, tmp_path):
    """A pin is a minimum tier: a namespace's blocks already on disk when it is pinned at
    cpu go back up (the control plane repairs prefix pins; a namespace's blocks only the
    agent knows)."""
    a = make_agent("p10", cpu_capacity_bytes=32 * M.block_bytes, disk_dir=str(tmp_path / "disk"))
    kb = tokens(4, start=50_000)
    a.engine.store(M.model_id, kb, kv(4), namespace="kb")
    wait_for(lambda: indexed(client, "p10") == 4, what="indexed")
    client.wait_operation(client.move("disk", namespace="kb").op_id, timeout_seconds=20)
    hs = split_hashes(hash_prefix(M.model_id, kb, BS))
    assert [a.pool.tier_of(h) for h in hs] == [Tier.DISK] * 4
    client.pin(namespace="kb", min_tier="cpu", ttl_seconds=60)
    wait_for(lambda: [a.pool.tier_of(h) for h in hs] == [Tier.CPU] * 4, what="promoted to the pin's tier")
    assert a.engine.lookup(M.model_id, kb) == 4 * BS
    # the pin's size is what its namespace holds now: it grows as the namespace does
    [pin] = client.list_pins("kb")
    assert pin.pinned_bytes == 4 * M.block_bytes
    a.engine.store(M.model_id, tokens(2, start=70_000), kv(2), namespace="kb")
    wait_for(lambda: client.list_pins("kb")[0].pinned_bytes == 6 * M.block_bytes, what="the pin's bytes grew")
    # a namespace pinned twice holds its bytes once in the pinned-bytes metric
    client.pin(namespace="kb", min_tier="disk", ttl_seconds=60)
    assert controlplane._pin_stats().num_pins == 2
    assert controlplane._pin_stats().pinned_bytes == 6 * M.block_bytes


def test_a_move_running_when_the_controlplane_restarts_is_followed_to_its_end(etcd, make_agent, tmp_path, monkeypatch):
    """Its agent runs it to the end whatever happens to the leader: the new leader follows
    it (progress and the final answer the agent sends again on its new stream) instead of
    calling it failed while the blocks go on moving, beyond any cancel."""
    from controlplane.server import ControlPlane, ControlPlaneConfig

    cp = ControlPlane(ControlPlaneConfig(listen="127.0.0.1:0", etcd=etcd, election_ttl_seconds=2)).start()
    port = cp.port
    a = make_agent("p11", cpu_capacity_bytes=128 * M.block_bytes, disk_dir=str(tmp_path / "disk"), lease_ttl_seconds=5)
    real = a.pool.move_blocks
    monkeypatch.setattr(a.pool, "move_blocks", lambda *args, **kw: (time.sleep(1.0), real(*args, **kw))[1])
    prompt = tokens(96, start=60_000)
    try:
        a.engine.store(M.model_id, prompt, kv(96))
        with ControlPlaneClient(cp.address) as c:
            wait_for(lambda: indexed(c, "p11") == 96, what="indexed")
            op = c.move("disk", model_id=M.model_id, token_ids=prompt)
            wait_for(lambda: c.get_operation(op.op_id).state == "RUNNING", what="running")
    finally:
        cp.stop()
    cp2 = ControlPlane(ControlPlaneConfig(listen=f"127.0.0.1:{port}", etcd=etcd, election_ttl_seconds=2)).start()
    try:
        with ControlPlaneClient(cp2.address) as c:
            done = wait_for(lambda: c.get_operation(op.op_id).finished and c.get_operation(op.op_id), 30, 0.2, "done")
            assert done.state == "SUCCEEDED" and done.num_done_blocks == 96, (
                done.state,
                done.error,
                done.num_done_blocks,
            )
        hs = split_hashes(hash_prefix(M.model_id, prompt, BS))
        assert {a.pool.tier_of(h) for h in hs} == {Tier.DISK}
    finally:
        cp2.stop()


def test_pin_tied_to_owner_lease_goes_with_it(controlplane, client, make_agent, etcd):
    """etcd deletes the pin's key with the lease; a watch on the pin keys lifts it at once
    (the periodic resync, turned off here, took up to 2 s more)."""
    a = make_agent("p5")
    wait_for(lambda: indexed(client, "p5") == 0, what="agent")
    owner = etcd_keys.connect(etcd)
    lease = owner.lease(2)
    pin = client.pin(namespace="chat", owner="router-1", owner_lease_id=lease.id)
    assert pin.expires_unix_seconds == 0 and pin.whole_namespace
    wait_for(lambda: pin.pin_id in a.pool.pins.pins, what="pin applied")
    manager = controlplane.manager
    manager.resync_seconds, manager._next_reload = 3600.0, manager.clock() + 3600.0
    lease.revoke()
    wait_for(lambda: client.list_pins() == [], timeout_seconds=5, what="pin released with its owner lease")
    wait_for(lambda: pin.pin_id not in a.pool.pins.pins, timeout_seconds=5, what="and lifted from the agent")
    owner.close()


def test_move_compress_and_cleanup_operations(client, make_agent, tmp_path):
    a = make_agent("o1", disk_dir=str(tmp_path / "disk"), disk_capacity_bytes=1 << 24)
    a.engine.store(M.model_id, tokens(4), kv(4), namespace="legal-kb")
    a.engine.store(M.model_id, tokens(2, start=7000), kv(2, seed=3), namespace="chat")
    wait_for(lambda: indexed(client, "o1") == 6, what="indexed")

    op = client.move("disk", model_id=M.model_id, token_ids=tokens(4))
    op = client.wait_operation(op.op_id, timeout_seconds=20)
    assert op.state == "SUCCEEDED" and op.num_done_blocks == 4 and op.moved_bytes > 0
    wait_for(lambda: client.lookup(M.model_id, tokens(4)).agents[0].tiers == ["disk"] * 4, what="index shows disk")
    assert torch.equal(a.engine.load(M.model_id, tokens(4)).kv, kv(4))

    op = client.wait_operation(client.compress("int8", namespace="chat").op_id, timeout_seconds=20)
    assert op.state == "SUCCEEDED" and op.num_done_blocks == 2
    with a.pool.lock:
        codecs = {m.codec for m in a.pool.blocks.values() if m.namespace == "chat"}
    assert codecs == {"int8"}

    pin = client.pin(namespace="legal-kb", ttl_seconds=60)
    wait_for(lambda: all(t == int(Tier.CPU) for t in pinned_on(a, tokens(4))), what="namespace pin applied")
    dry = client.wait_operation(client.cleanup(0, dry_run=True).op_id, timeout_seconds=20)
    assert dry.state == "SUCCEEDED" and dry.dry_run and dry.num_skipped_pinned_blocks == 4
    assert sum(t.num_blocks for t in dry.freed) == 2
    assert indexed(client, "o1") == 6  # a dry run changes nothing
    real = client.wait_operation(client.cleanup(0).op_id, timeout_seconds=20)
    assert real.state == "SUCCEEDED" and sum(t.num_blocks for t in real.freed) == 2
    wait_for(lambda: indexed(client, "o1") == 4, what="cleanup reached the index")
    client.unpin(pin.pin_id)
    ops = client.list_operations()
    assert [o.kind for o in ops[:5]] == ["cleanup", "cleanup", "compress", "move"][: len(ops[:5])] or len(ops) >= 4


def test_operation_errors(client, make_agent):
    make_agent("o2")
    wait_for(lambda: indexed(client, "o2") == 0, what="agent")
    with pytest.raises(ClientError) as info:
        client.get_operation("nope")
    assert info.value.code == "NOT_FOUND"
    with pytest.raises(ClientError) as info:
        client.move("ssd", namespace="x")
    assert info.value.code == "INVALID_ARGUMENT" and "to_tier" in str(info.value)
    with pytest.raises(ClientError) as info:
        client.compress("lz4", namespace="x")
    assert info.value.code == "INVALID_ARGUMENT" and "codec" in str(info.value)
    with pytest.raises(ClientError) as info:
        client.cleanup(0, agent_id="ghost")
    assert info.value.code == "NOT_FOUND"


def test_concurrent_cleanups_of_one_namespace_serialize(client, make_agent, controlplane, etcd):
    from controlplane.store.locks import EtcdLock

    make_agent("o3")
    wait_for(lambda: indexed(client, "o3") == 0, what="agent")
    holder = EtcdLock(etcd_keys.connect(etcd), "cleanup/kb", "someone-else")
    assert holder.try_acquire()
    op = client.cleanup(0, namespace="kb")
    time.sleep(1.0)
    assert client.get_operation(op.op_id).state == "PENDING"  # waits for the lock
    holder.release()
    done = client.wait_operation(op.op_id, timeout_seconds=10)
    assert done.state == "SUCCEEDED", done.error


def test_a_lock_whose_lease_lapsed_is_taken_again_or_said_lost(etcd, caplog):
    """A holder cut from etcd past its lease TTL loses the key: it takes it again when it
    is free, and says so when another holder got it meanwhile (no silent double holder)."""
    from controlplane.store.locks import EtcdLock

    other = etcd_keys.connect(etcd)
    lock = EtcdLock(etcd_keys.connect(etcd), "cleanup/lapse", "me", ttl_seconds=3)
    assert lock.try_acquire()
    other.revoke_lease(lock._lease.id)  # as etcd does once the TTL passes unrefreshed
    # (not _lapsed: the new lease is the lock's own once the key is back, not just in etcd)
    wait_for(lambda: lock.lost_total == 1 and not lock._lapsed and other.get(lock.key)[0] == b"me", 5, what="retaken")
    assert lock.held

    other.revoke_lease(lock._lease.id)
    rival = EtcdLock(other, "cleanup/lapse", "rival")
    assert rival.try_acquire()
    wait_for(lambda: not lock.held, 5, what="said lost")
    assert lock.lost_total == 2 and other.get(lock.key)[0] == b"rival"
    assert any("rival has taken it" in r.getMessage() for r in caplog.records)
    lock.release()
    assert other.get(lock.key)[0] == b"rival"  # releasing a lost lock leaves the new holder's key
    rival.release()


def test_a_lock_waiter_waits_out_an_etcd_that_does_not_answer(etcd):
    from pyetcd import exceptions as ex

    from controlplane.store.locks import EtcdLock

    class Flaky:  # the first calls find no etcd, as during a short outage
        def __init__(self, client, failures: int):
            self._client, self.failures = client, failures

        def __getattr__(self, name):
            attr = getattr(self._client, name)
            if name not in ("transaction", "lease") or not callable(attr):
                return attr

            def call(*args, **kwargs):
                if self.failures > 0:
                    self.failures -= 1
                    raise ex.ConnectionFailedError("no endpoint answered")
                return attr(*args, **kwargs)

            return call

    flaky = Flaky(etcd_keys.connect(etcd), failures=3)
    lock = EtcdLock(flaky, "cleanup/flaky", "me")
    assert lock.acquire(5.0) and flaky.failures == 0
    lock.release()

    class Broken(Flaky):  # anything but "unreachable" still raises
        def __getattr__(self, name):
            if name == "lease":
                raise RuntimeError("permission denied")
            return super().__getattr__(name)

    with pytest.raises(RuntimeError):
        EtcdLock(Broken(etcd_keys.connect(etcd), 0), "cleanup/broken", "me").acquire(1.0)


def test_queued_cleanup_survives_a_controlplane_restart(etcd, make_agent):
    """A cleanup still waiting for its scope lock has sent nothing: the next leader queues
    it again under the same op id instead of failing it."""
    from controlplane.server import ControlPlane, ControlPlaneConfig
    from controlplane.store.locks import EtcdLock

    def start(port: int = 0) -> ControlPlane:
        # slack for a loaded machine: an etcd that answers slowly for a moment is not gone
        cfg = ControlPlaneConfig(
            listen=f"127.0.0.1:{port}", etcd=etcd, election_ttl_seconds=3, etcd_timeout_seconds=5.0
        )
        return ControlPlane(cfg).start()

    cp = start()
    port = cp.port
    make_agent("o4", lease_ttl_seconds=3)
    holder = EtcdLock(etcd_keys.connect(etcd), "cleanup/kq", "someone-else")
    assert holder.try_acquire()
    try:
        with ControlPlaneClient(cp.address) as c:
            wait_for(lambda: indexed(c, "o4") == 0, what="agent")
            op = c.cleanup(3600.25, namespace="kq")
            time.sleep(0.5)
            assert c.get_operation(op.op_id).state == "PENDING"
        cp.stop()
        cp = start(port)
        with ControlPlaneClient(cp.address) as c:
            wait_for(lambda: c.get_operation(op.op_id).state == "PENDING", timeout_seconds=30, what="reloaded")
            time.sleep(1.0)
            again = c.get_operation(op.op_id)
            assert again.state == "PENDING" and not again.error  # still queued, not failed
            # the agent finds the new leader (a part sent while it is away fails, as for any op)
            ready = lambda: any(a.agent_id == "o4" and a.state == "ready" for a in c.list_agents())  # noqa: E731
            wait_for(ready, timeout_seconds=30, what="agent on the new leader")
            holder.release()
            done = c.wait_operation(op.op_id, timeout_seconds=30)
            assert done.state == "SUCCEEDED", done.error
            assert done.params["older_than_seconds"] == "3600.25"
    finally:
        holder.release()
        cp.stop()


def test_a_cleanup_a_new_leader_adopts_takes_its_scope_lock_again(make_agent, etcd):
    """A cleanup the previous leader sent out still runs on its agents; that leader's
    lease, and with it the scope lock, is gone. The new leader takes the lock again for
    it, so a cleanup of the same namespace queued now waits for it to end."""
    from controlplane.core import operations as ops
    from controlplane.server import ControlPlane, ControlPlaneConfig
    from controlplane.store.durable import op_to_json

    make_agent("o4")
    adopted = ops.new_operation(
        "cleanup", {"older_than_seconds": "0", "namespace": "kb", "agent": "", "model": ""}, ["o4"]
    )
    adopted.commands_sent = True
    adopted.parts["o4"].state = ops.RUNNING
    adopted.state = ops.RUNNING
    client = etcd_keys.connect(etcd)
    client.put(etcd_keys.OPS_PREFIX + adopted.op_id, op_to_json(adopted))
    cp = ControlPlane(ControlPlaneConfig(listen="127.0.0.1:0", etcd=etcd, election_ttl_seconds=3)).start()
    try:
        with ControlPlaneClient(cp.address) as c:
            lock_key = etcd_keys.LOCKS_PREFIX + "cleanup/kb"
            wait_for(lambda: client.get(lock_key)[0] == adopted.op_id.encode(), 15, what="the adopted cleanup's lock")
            wait_for(lambda: indexed(c, "o4") == 0, 15, what="agent back")
            queued = c.cleanup(0, namespace="kb")
            time.sleep(1.0)
            assert c.get_operation(queued.op_id).state == "PENDING"  # behind the adopted one
            # the adopted one ends with its agent's final report (sent again on its new stream)
            cp.manager.on_op_update("o4", adopted.op_id, "SUCCEEDED", 3, 3, 0, 0, "")
            assert c.wait_operation(adopted.op_id, 10).state == "SUCCEEDED"
            done = c.wait_operation(queued.op_id, 30)
            assert done.state == "SUCCEEDED", done.error
    finally:
        cp.stop()
        client.close()


def test_pins_and_unpins_from_many_callers_all_answer_and_all_land(client, make_agent, controlplane):
    """Pin/Unpin calls sent the pins to agents themselves, beside the reconcile loop, and
    the two walked an agent's applied pins while the other changed them: 41 of 3000 unpins
    answered INTERNAL though they were done (an operator's review). Serialized now, and a
    change stored is answered as made whatever sending it to agents does. And the loop's
    reload of pins from etcd, read just before an unpin deleted one, put it back in memory
    (listed, and sent to agents again, until the next reload): fails on the code before."""
    from concurrent.futures import ThreadPoolExecutor

    agent = make_agent("many-pins")
    wait_for(lambda: indexed(client, "many-pins") == 0, what="agent")

    def patiently(call):
        """A loaded machine may make etcd slow and the leader's lease lapse meanwhile:
        "not now" answers are asked again; an INTERNAL one never is (the defect)."""
        deadline = time.monotonic() + 60
        while True:
            try:
                with ControlPlaneClient(controlplane.address, timeout_seconds=15) as c:
                    return call(c)
            except ClientError as exc:
                assert exc.code != "INTERNAL", exc
                if exc.code == "NOT_FOUND" or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def unpin(pin_id):
        with contextlib.suppress(ClientError):  # NOT_FOUND: an earlier try did it
            patiently(lambda c: c.unpin(pin_id))

    pin_ids = [f"many-{i}" for i in range(160)]
    with ThreadPoolExecutor(6) as pool:
        list(
            pool.map(
                lambda i: patiently(lambda c: c.pin(namespace=f"ns-{i}", ttl_seconds=600, pin_id=pin_ids[i])),
                range(160),
            )
        )
        wait_for(lambda: len(agent.pool.pins.pins) == 160, 60, 0.1, "every pin on the agent")
        list(pool.map(unpin, pin_ids))
    left = client.list_pins()
    assert not left, (left, len(set(pin_ids)))
    wait_for(lambda: len(agent.pool.pins.pins) == 0, 60, 0.1, "every pin lifted on the agent")


def test_a_pin_of_the_largest_prefix_fits_etcd(client, make_agent, etcd):
    """A prefix pin of 65,536 blocks was stored as hex (2 MiB) and etcd refused it as too
    large ("etcd is unreachable", said the control plane): past ~45k blocks no pin could be
    made. Past 32,768 blocks stored as base64 now (1.4 MB, under etcd's 1.5 MiB); shorter
    ones stay hex, which older replicas read (a rolling upgrade keeps their pins)."""
    import dataclasses
    import json
    import os

    from controlplane.core.pins import MAX_PIN_BLOCKS
    from controlplane.store.durable import pin_from_json, pin_to_json

    make_agent("big-pin")
    wait_for(lambda: indexed(client, "big-pin") == 0, what="agent")
    packed = os.urandom(16 * MAX_PIN_BLOCKS)
    pin = client.pin(model_id=M.model_id, block_hashes=packed, ttl_seconds=60)
    assert pin.num_blocks == MAX_PIN_BLOCKS
    [listed] = client.list_pins()
    assert listed.pin_id == pin.pin_id and listed.num_blocks == MAX_PIN_BLOCKS
    with pytest.raises(ClientError) as info:  # one more is refused by kvcp, naming the limit
        client.pin(model_id=M.model_id, block_hashes=packed + os.urandom(16), ttl_seconds=60)
    assert info.value.code == "INVALID_ARGUMENT" and f"at most {MAX_PIN_BLOCKS} blocks" in str(info.value)

    [(raw, _)] = list(etcd_keys.connect(etcd).get_prefix(etcd_keys.PINS_PREFIX))
    assert len(raw) < 1_500_000 and pin_from_json(raw).block_hashes == packed
    assert "block_hashes_b64" in json.loads(raw)
    small = dataclasses.replace(pin_from_json(raw), block_hashes=packed[:32])
    assert json.loads(pin_to_json(small))["block_hashes"] == packed[:32].hex()  # as every release reads it
    assert pin_from_json(pin_to_json(small).encode()).block_hashes == packed[:32]


def test_a_burst_of_pins_is_saved_on_the_agent_in_a_few_writes(client, make_agent, controlplane, tmp_path):
    """Each pin command rewrote and fsynced the agent's whole pin file: 3,000 pins kept an
    agent at a full core for minutes, its operations queued behind (a review). Saves are
    coalesced now (at most every 0.2 s); the file ends up with every pin, and a stop
    saves what the last commands changed."""
    from concurrent.futures import ThreadPoolExecutor

    from agent.store.pin_file import PinFile

    agent = make_agent("pin-burst", disk_dir=str(tmp_path / "disk"), disk_capacity_bytes=1 << 24)
    wait_for(lambda: indexed(client, "pin-burst") == 0, what="agent")
    from agent.server import PIN_SAVE_SPACING_SECONDS

    saves = []
    real_save = agent.pin_file.save
    agent.pin_file.save = lambda *a: (saves.append(1), real_save(*a))  # counted, still written

    def pin(i):
        with ControlPlaneClient(controlplane.address, timeout_seconds=15) as c:
            return c.pin(namespace=f"burst-{i}", ttl_seconds=600, pin_id=f"burst-{i}").pin_id

    start = time.monotonic()
    with ThreadPoolExecutor(6) as pool:
        pin_ids = set(pool.map(pin, range(300)))
    wait_for(lambda: len(agent.pool.pins.pins) == 300, 60, 0.1, "every pin on the agent")
    elapsed = time.monotonic() - start
    wait_for(lambda: {p.pin_id for p in PinFile(tmp_path / "disk").load()} == pin_ids, 10, 0.1, "all saved")
    # at most one save per spacing (and the last): one write per command before, 300 in ~3 s
    assert len(saves) <= elapsed / PIN_SAVE_SPACING_SECONDS + 2, (len(saves), elapsed)
    client.unpin(next(iter(pin_ids)))
    wait_for(lambda: len(agent.pool.pins.pins) == 299, 20, 0.05, "unpinned on the agent")
    agent.stop()
    assert len(PinFile(tmp_path / "disk").load()) == 299


def test_a_pin_made_again_under_its_id_during_a_reload_stays_listed(controlplane):
    """Unpin X and pin X again while the loop's reload reads etcd: the reload counted the
    new X as gone (released, lifted from agents) and, remembering X as unpinned, kept it
    out of memory for a minute though etcd held it (a review of this session's change)."""
    from controlplane.core.scope import Scope
    from protos.tier import Tier

    m = controlplane.manager
    m.ensure_loaded()
    m.run_once = lambda now=None: None  # the loop's own reload would take the racing read first
    time.sleep(0.5)  # a pass under way ends
    m.pin(Scope(namespace="ns"), Tier.CPU, 600, pin_id="X")
    real = m.durable.load_pins
    calls = []

    def racing_read():
        if not calls:
            calls.append(1)
            m.unpin("X")  # an Unpin lands while the read is under way...
            out = real()  # (the read sees no X)
            m.pin(Scope(namespace="ns"), Tier.CPU, 600, pin_id="X")  # ...and the pin is made again
            return out
        return real()

    m.durable.load_pins = racing_read
    try:
        m._reload_pins()
    finally:
        m.durable.load_pins = real
    assert "X" in m.pins and [p.pin_id for p in m.list_pins()] == ["X"]
    m._reload_pins()
    assert "X" in m.pins


def test_a_scope_lock_taken_again_says_when_a_sub_scope_started_meanwhile(etcd, caplog):
    """The all-namespaces cleanup lock waits for namespace locks to drain; when its lease
    lapsed, a namespace cleanup could start, and the retake said "taken again" and counted
    as held while both ran (a review of this session's change)."""
    import logging

    from controlplane.store.locks import EtcdLock

    caplog.set_level(logging.WARNING)
    other = etcd_keys.connect(etcd)
    all_key = etcd_keys.LOCKS_PREFIX + "cleanup/_all"
    big = EtcdLock(
        etcd_keys.connect(etcd),
        "cleanup/_all",
        "all-op",
        ttl_seconds=3,
        drain_prefix=etcd_keys.LOCKS_PREFIX + "cleanup/",
    )
    assert big.acquire(5)
    other.revoke_lease(big._lease.id)  # lapsed (etcd away past its TTL)
    ns = EtcdLock(other, "cleanup/ns1", "ns-op", also_absent=(all_key,))
    assert ns.try_acquire()  # the _all key is gone: the namespace cleanup starts
    wait_for(lambda: big.lost_total == 1 and other.get(all_key)[0] == b"all-op", 6, what="retaken")
    wait_for(lambda: not big.held, 3, what="said not exclusive")
    assert any("ns-op started inside its scope" in r.getMessage() for r in caplog.records)
    assert not EtcdLock(other, "cleanup/ns2", "ns2-op", also_absent=(all_key,)).try_acquire()  # no new one
    big.release()
    ns.release()


def test_a_lock_waiter_only_reads_while_the_lock_is_taken(etcd):
    """A waiter looks every 0.1 s: it reads the keys, and grants (then revokes) a lease
    only when it finds them free, not at each look."""
    from controlplane.store.locks import EtcdLock

    class Counting:  # the real client, its lease grants counted
        def __init__(self, client):
            self._client, self.leases = client, 0

        def __getattr__(self, name):
            return getattr(self._client, name)

        def lease(self, *args, **kwargs):
            self.leases += 1
            return self._client.lease(*args, **kwargs)

    holder = EtcdLock(etcd_keys.connect(etcd), "cleanup/reads", "someone-else")
    assert holder.try_acquire()
    counting = Counting(etcd_keys.connect(etcd))
    waiter = EtcdLock(counting, "cleanup/reads", "me")
    try:
        assert not waiter.acquire(1.0)
        assert counting.leases == 0
        assert etcd_keys.connect(etcd).get(waiter.key)[0] == b"someone-else"
        holder.release()
        assert waiter.acquire(5.0) and counting.leases == 1
        assert etcd_keys.connect(etcd).get(waiter.key)[0] == b"me"
    finally:
        waiter.release()
        holder.release()
