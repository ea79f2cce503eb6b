"""The fast index and event path at small sizes: the numpy BlockIndex against a dict
reference (table rebuilds, more than 64 agents, packed inputs), and bad input on the
Sync stream: malformed batches, unknown agents, sequence gaps, oversized inventories and
a slow consumer (backpressure through gRPC flow control, not memory). Never a crash or a
corrupted index."""

from __future__ import annotations

import random
import shutil
import threading
import time
import uuid

import grpc
import numpy as np
import pytest

from controlplane.core import cluster as cluster_mod
from controlplane.core.cluster import AgentRecord, BlockGroup, Cluster, ModelInfo
from controlplane.core.index import AgentMatch, BlockIndex
from protos import errors, etcd_keys
from protos.kvcp.v1 import admin_pb2, admin_pb2_grpc, agent_pb2, agent_pb2_grpc, types_pb2
from protos.tier import Tier
from tests.helpers import reference_lookup, wait_for

MODEL = "scale-model"


def keys(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).bytes(16 * n)


def split(raw: bytes) -> list[bytes]:
    return [raw[i : i + 16] for i in range(0, len(raw), 16)]


@pytest.mark.parametrize("use_kernel", [True, False], ids=["c-loops", "numpy"])
def test_index_matches_a_dict_reference_through_rebuilds_and_many_agents(use_kernel):
    rng = random.Random(7)
    pool = split(keys(6000, 1))
    # engine hashes (vLLM ints, zero-padded) share half their bits: the table must still spread them
    pool += [i.to_bytes(8, "big") + bytes(8) for i in range(2000)]
    parent = {h: rng.choice(pool) for h in pool}  # a block's parent is the same wherever it is held
    agents = [f"a{i:03d}" for i in range(130)]  # three mask words
    idx, ref = BlockIndex(use_kernel=use_kernel), {}
    if use_kernel and shutil.which("cc"):
        assert idx._lib is not None, "the C loops did not build (see the log)"
    for a in agents:
        hs = rng.sample(pool, 20)
        idx.add(a, b"".join(hs), Tier.CPU)
        ref[a] = {h: int(Tier.CPU) for h in hs}
    told: set[bytes] = set()  # blocks whose parent the index was told (and still holds)
    for step in range(600):
        a = rng.choice(agents)
        r = rng.random()
        hs = [rng.choice(pool) for _ in range(rng.randint(0, 400))]  # duplicates included
        if r < 0.45:
            t = rng.choice(list(Tier))
            with_parents = rng.random() < 0.5
            idx.add(a, b"".join(hs), t, b"".join(parent[h] for h in hs) if with_parents else b"")
            ref.setdefault(a, {}).update({h: int(t) for h in hs})
            if with_parents:
                told.update(hs)
        elif r < 0.8:
            idx.remove(a, memoryview(b"".join(hs)))
            for h in hs:
                ref.get(a, {}).pop(h, None)
        elif r < 0.9:
            assert idx.drop_agent(a) == len(ref.pop(a, {}))
        else:
            blocks = {rng.choice(pool): int(rng.choice(list(Tier))) for _ in range(rng.randint(0, 600))}
            idx.replace_agent(a, blocks)
            ref[a] = blocks
        held_anywhere = {h for b in ref.values() for h in b}
        told &= held_anywhere  # a block nobody holds is forgotten, parent and all
        if step % 50 == 0:
            for h in rng.sample(sorted(held_anywhere), min(50, len(held_anywhere))):
                assert idx.parent_of(h) == (parent[h] if h in told else bytes(16))
            assert idx.num_replicas == sum(len(b) for b in ref.values())
            assert idx.num_blocks == len({h for b in ref.values() for h in b})
            for a2 in rng.sample(agents, 10):
                assert idx.agent_blocks(a2) == ref.get(a2, {})
                assert idx.num_agent_blocks(a2) == len(ref.get(a2, {}))
            held = [a2 for a2 in ref if ref[a2]]
            if held:
                chain = list(ref[rng.choice(held)])[:30]
                assert idx.lookup(b"".join(chain)) == reference_lookup(ref, chain)
            chain = rng.sample(pool, 8)
            assert idx.lookup(chain) == reference_lookup(ref, chain)


def test_index_bad_input_changes_nothing():
    idx = BlockIndex()
    raw = keys(10, 2)
    idx.add("a", raw, Tier.GPU)
    for bad in (raw[:-1], [raw[:16], b"short"]):
        with pytest.raises(ValueError):
            idx.add("a", bad, Tier.CPU)
    with pytest.raises(ValueError):
        idx.add("a", raw, 9)
    assert idx.num_replicas == 10 and set(idx.agent_blocks("a").values()) == {int(Tier.GPU)}
    idx.remove("nobody", raw)
    assert idx.lookup(b"") == [] and idx.holders(bytes(16)) == {}


def test_resync_of_many_blocks_replaces_packed_groups():
    idx = BlockIndex()
    a, b = keys(50_000, 3), keys(50_000, 4)
    idx.replace_agent_packed("x", [(a, int(Tier.CPU))])
    idx.add("y", a[: 16 * 100], Tier.GPU)
    idx.replace_agent_packed("x", [(b, int(Tier.DISK)), (a[: 16 * 10], int(Tier.GPU))])
    assert idx.num_agent_blocks("x") == 50_010
    assert idx.num_blocks == 50_000 + 100  # a's blocks kept only where y holds them
    assert idx.lookup(a[: 16 * 20])[0] == AgentMatch("y", 20, bytes([Tier.GPU] * 20))
    assert {m.agent_id: m.num_hit_blocks for m in idx.lookup(a[: 16 * 20])} == {"y": 20, "x": 10}


def _cluster_with_agent() -> Cluster:
    c = Cluster(clock=lambda: 0.0)
    c.register(AgentRecord("a", "a:1", [ModelInfo(MODEL, 16)], []))
    c.hello("a", "s")
    assert c.apply_inventory_chunk("a", 0, 0, True, []) is None
    return c


def test_malformed_event_batch_is_rejected_whole():
    c = _cluster_with_agent()
    good, bad = keys(4, 5), keys(4, 6)[:-3]
    with pytest.raises(errors.InvalidArgument):
        c.apply_events("a", 1, True, [BlockGroup(MODEL, Tier.CPU, good), BlockGroup(MODEL, Tier.CPU, bad)])
    assert c.index.num_replicas == 0 and c.events_total == 0
    assert c.apply_events("a", 1, True, [BlockGroup(MODEL, Tier.CPU, good)]) is None  # seq 1 still expected
    assert c.index.num_agent_blocks("a") == 4
    with pytest.raises(errors.NotFound):
        c.apply_events("ghost", 1, True, [BlockGroup(MODEL, Tier.CPU, good)])
    reason = c.apply_events("a", 5, True, [BlockGroup(MODEL, Tier.CPU, keys(2, 7))])
    assert reason and "expected 2" in reason and c.resyncs_total == 1
    assert c.index.num_agent_blocks("a") == 4  # nothing of the gapped batch applied


def test_oversized_inventory_is_rejected(monkeypatch):
    monkeypatch.setattr(cluster_mod, "MAX_INVENTORY_BLOCKS", 100)
    c = Cluster(clock=lambda: 0.0)
    c.register(AgentRecord("a", "a:1", [ModelInfo(MODEL, 16)], []))
    c.hello("a", "s")
    assert c.apply_inventory_chunk("a", 0, 0, False, [BlockGroup(MODEL, Tier.CPU, keys(60, 8))]) is None
    with pytest.raises(errors.InvalidArgument):
        c.apply_inventory_chunk("a", 0, 1, False, [BlockGroup(MODEL, Tier.CPU, keys(60, 9))])
    assert c.agent("a").staging == []


# ---- over gRPC -----------------------------------------------------------------------
def _register_key(etcd_endpoint: str, agent_id: str):
    client = etcd_keys.connect(etcd_endpoint)
    lease = client.lease(30)
    client.put(etcd_keys.agent_key(agent_id), "{}", lease=lease)
    return client


def _info(agent_id: str) -> types_pb2.AgentInfo:
    return types_pb2.AgentInfo(
        agent_id=agent_id, address="test", models=[types_pb2.ModelSpec(model_id=MODEL, block_size=16)]
    )


def _events(seq: int, raw: bytes) -> agent_pb2.AgentMessage:
    return agent_pb2.AgentMessage(
        events=agent_pb2.BlockEventBatch(
            seq=seq,
            kind=agent_pb2.BLOCK_EVENT_KIND_STORED,
            groups=[agent_pb2.BlockGroup(model_id=MODEL, tier=2, block_hashes=raw)],
        )
    )


def _hello(agent_id: str) -> list[agent_pb2.AgentMessage]:
    return [
        agent_pb2.AgentMessage(hello=agent_pb2.Hello(agent_id=agent_id, session_id=uuid.uuid4().hex)),
        agent_pb2.AgentMessage(inventory=agent_pb2.Inventory(seq=0, chunk_index=0, last_chunk=True)),
    ]


def test_sync_bad_input_is_rejected_and_counted(controlplane, etcd):
    etcd_client = _register_key(etcd, "g1")
    with grpc.insecure_channel(controlplane.address) as ch:
        stub = agent_pb2_grpc.AgentServiceStub(ch)
        admin = admin_pb2_grpc.AdminServiceStub(ch)
        # an agent without an etcd key cannot register; one that never registered cannot sync
        with pytest.raises(grpc.RpcError) as exc:
            stub.Register(agent_pb2.RegisterRequest(agent=_info("no-key")), timeout=30)
        assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(grpc.RpcError) as exc:
            list(stub.Sync(iter(_hello("never-registered")), timeout=30))
        assert exc.value.code() == grpc.StatusCode.NOT_FOUND
        stub.Register(agent_pb2.RegisterRequest(agent=_info("g1")), timeout=30)
        # a gap: the control plane asks for a resync and ignores batches until the inventory
        msgs = _hello("g1") + [_events(1, keys(8, 10)), _events(3, keys(8, 11)), _events(4, keys(8, 12))]
        done = threading.Event()

        def stream():
            yield from msgs
            done.wait(10)

        call = stub.Sync(stream(), timeout=10)
        reply = next(call)
        assert reply.WhichOneof("body") == "resync" and "expected 2" in reply.resync.reason
        done.set()
        call.cancel()
        stats = admin.GetStats(admin_pb2.GetStatsRequest(), timeout=30)
        assert stats.resyncs_total == 1 and stats.events_total == 8 and stats.num_block_replicas == 8
        # a malformed batch ends the stream with INVALID_ARGUMENT and changes nothing
        with pytest.raises(grpc.RpcError) as exc:
            list(stub.Sync(iter(_hello("g1") + [_events(1, b"\x01" * 17)]), timeout=30))
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        stats = admin.GetStats(admin_pb2.GetStatsRequest(), timeout=30)
        assert stats.num_block_replicas == 0 and stats.events_total == 8  # the new inventory was empty
        # bad lookups are rejected, the control plane is fine
        with pytest.raises(grpc.RpcError) as exc:
            admin.Lookup(admin_pb2.LookupRequest(model_id=MODEL, block_hashes=b"\x00" * 15), timeout=30)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    etcd_client.close()


def test_slow_consumer_applies_backpressure(controlplane, etcd):
    """While the control plane cannot apply events (its cluster lock is held), a fast agent
    gets only as far as gRPC's flow-control window; nothing piles up unbounded in memory,
    and everything is applied once the consumer catches up."""
    etcd_client = _register_key(etcd, "fast")
    batch_blocks, n_batches = 1024, 600  # 16 KiB per message, ~10 MiB in all
    yielded = [0]
    done = threading.Event()

    def stream():
        yield from _hello("fast")
        time.sleep(0.3)  # the inventory is applied before the consumer stalls
        for seq in range(1, n_batches + 1):
            yielded[0] = seq
            yield _events(seq, np.random.default_rng(seq).bytes(16 * batch_blocks))
        done.wait(30)

    with grpc.insecure_channel(controlplane.address) as ch:
        stub = agent_pb2_grpc.AgentServiceStub(ch)
        stub.Register(agent_pb2.RegisterRequest(agent=_info("fast")), timeout=30)
        wait_for(lambda: "fast" in [r.agent_id for r, _ in controlplane.cluster.agents()], what="registered")
        lock = controlplane.cluster._lock
        lock.acquire()
        try:
            call = stub.Sync(stream(), timeout=60)

            def drain():
                try:
                    for _ in call:
                        pass
                except grpc.RpcError:
                    pass  # cancelled at the end

            reader = threading.Thread(target=drain, daemon=True)
            reader.start()
            time.sleep(2.0)
            stalled_at = yielded[0]
        finally:
            lock.release()
        assert stalled_at < n_batches // 2, f"{stalled_at} of {n_batches} batches left the agent while stalled"
        wait_for(
            lambda: controlplane.cluster.index.num_agent_blocks("fast") == batch_blocks * n_batches,
            timeout_seconds=60,
            what="all events applied after the stall",
        )
        done.set()
        call.cancel()
    etcd_client.close()


def test_bench_controlplane_smoke(tmp_path):
    """`kvcp-bench controlplane` with tiny sizes, as a user runs it."""
    import json
    import subprocess

    from tests.helpers import script

    proc = subprocess.run(
        [
            script("kvcp-bench"),
            "controlplane",
            "--agents", "3",
            "--blocks-per-agent", "2048",
            "--lookup-blocks", "32",
            "--event-batch-blocks", "256",
            "--agent-processes", "2",
            "--lookup-rate", "50",
            "--lookup-seconds", "1",
            "--peer-blocks", "4096",
            "--mooncake-keys", "2048",
            "-o", "json",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(proc.stdout)
    for key in (
        "events_per_second",
        "lookup_p50_ms",
        "lookup_p99_ms",
        "lookup_qps",
        "bytes_per_replica",
        "resync_seconds",
        "agents",
        "blocks_per_agent",
    ):
        assert key in data, key
    assert data["agents"] == 3 and data["blocks_per_agent"] == 2048
    assert data["block_replicas"] == 3 * 2048 and data["events_per_second"] > 0
    assert data["resync_seconds"] is not None and data["lookup_full_hits"] == 1.0
    for name in ("kvcp_index_in_process", "dynamo_radix_tree", "mooncake_master"):
        peer = data["peers"][name]
        assert "unavailable" in peer or peer, name  # measured, or said why not
