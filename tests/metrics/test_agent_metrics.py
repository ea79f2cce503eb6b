"""Agent metrics through an injected registry: a real agent's block pool and engine
(built, not started), exact values after known stores, evictions and lookups; operation
durations of the mover; transfer counters; how pool counters are normalised."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from prometheus_client import CollectorRegistry

from agent.metrics import AgentCollector, AgentMetrics, _by_tier_reason
from agent.server import DEMO_MODEL, Agent, AgentConfig
from protos.tier import Tier

M = DEMO_MODEL
BS = M.block_size


def kv(n_blocks: int) -> torch.Tensor:
    return torch.ones((n_blocks, *M.block_shape), dtype=torch.float16)


def tokens(n_blocks: int, start: int = 0) -> list[int]:
    return list(range(start, start + n_blocks * BS))


@pytest.fixture
def agent():
    registry = CollectorRegistry()
    a = Agent(AgentConfig(agent_id="m1", cpu_capacity_bytes=6 * M.block_bytes), registry=registry)
    yield a, registry
    a.stop()  # frees its transfer engine now, not in a later test's garbage collection


def test_pool_and_engine_values_are_read_at_scrape_time(agent):
    a, registry = agent
    v = registry.get_sample_value
    cpu = {"agent_id": "m1", "tier": "cpu"}
    assert v("kvcp_tier_capacity_bytes", cpu) == 6 * M.block_bytes
    assert v("kvcp_tier_blocks", cpu) == 0

    a.engine.store(M.model_id, tokens(4), kv(4))
    a.engine.store(M.model_id, tokens(4, start=90_000), kv(4))  # full at 6: drops 2 old leaves
    assert a.engine.lookup(M.model_id, tokens(4)) == 2 * BS
    a.engine.lookup(M.model_id, tokens(1, start=50_000))  # miss

    assert v("kvcp_tier_blocks", cpu) == 6
    assert v("kvcp_tier_used_bytes", cpu) >= 6 * M.block_bytes * 0.9
    assert v("kvcp_evictions_total", {**cpu, "reason": "capacity"}) == 2
    assert v("kvcp_demotions_total", {**cpu, "reason": "capacity"}) == 0  # no slower tier to demote to
    assert v("kvcp_agent_lookups_total", {"agent_id": "m1"}) == 2
    assert v("kvcp_agent_lookup_tokens_total", {"agent_id": "m1"}) == 5 * BS
    assert v("kvcp_agent_lookup_hit_tokens_total", {"agent_id": "m1"}) == 2 * BS
    # families of features that move bytes exist from the start, at zero
    assert v("kvcp_tier_moved_bytes_total", {"agent_id": "m1", "src_tier": "cpu", "dst_tier": "disk"}) == 0
    assert v("kvcp_promotions_total", {"agent_id": "m1"}) == 0
    assert v("kvcp_corrupt_blocks_total", {"agent_id": "m1"}) == 0
    for op in ("encode", "decode"):
        for path in ("batch", "one_by_one"):
            assert v("kvcp_gpu_codec_blocks_total", {"agent_id": "m1", "op": op, "path": path}) == 0
    a.pool.gpu_codec_blocks_total[("decode", "batch")] = 7  # as a promotion into a GPU counts them
    assert v("kvcp_gpu_codec_blocks_total", {"agent_id": "m1", "op": "decode", "path": "batch"}) == 7
    assert v("kvcp_compression_saved_bytes", cpu) == 0
    assert v("kvcp_agent_controlplane_connected", {"agent_id": "m1"}) == 0  # not started
    assert v("kvcp_agent_sync_connections_total", {"agent_id": "m1"}) == 0
    assert v("kvcp_transfers_total", {"agent_id": "m1", "kind": "handoff"}) == 0
    assert v("kvcp_etcd_request_errors_total", {"agent_id": "m1", "op": "lease_refresh"}) == 0
    info = [s for m in registry.collect() if m.name == "kvcp_build_info" for s in m.samples]
    assert [s.labels["agent_id"] for s in info] == ["m1"] and info[0].labels["component"] == "agent"


def test_every_kvcp_series_carries_the_agent_id(agent):
    _, registry = agent
    kvcp = [s for m in registry.collect() if m.name.startswith("kvcp_") for s in m.samples]
    assert kvcp and all(s.labels.get("agent_id") == "m1" for s in kvcp)


def op(op_id, kind, state, created, finished=0.0):
    return SimpleNamespace(
        op_id=op_id, kind=kind, state=state, created_unix_seconds=created, finished_unix_seconds=finished
    )


def test_operations_in_flight_and_durations_observed_once():
    pool = SimpleNamespace(usage=lambda: [SimpleNamespace(tier=Tier.CPU, capacity_bytes=1, used_bytes=0, num_blocks=0)])
    mover = SimpleNamespace(ops=lambda: ops, finish_listeners=[])
    ops = [
        op("1", "move", "SUCCEEDED", 100.0, 100.3),
        op("2", "promote", "RUNNING", 100.0),
        op("3", "move", "PENDING", 100.0),
        op("4", "compress", "FAILED", 100.0, 140.0),
    ]
    registry = CollectorRegistry()
    registry.register(AgentCollector("m1", pool, mover=mover))
    for o in (ops[0], ops[3]):  # the mover tells its listeners once, as each ends
        for listener in mover.finish_listeners:
            listener(o)
    v = registry.get_sample_value
    a = {"agent_id": "m1"}
    for _ in range(2):  # a second scrape does not count the same operation again
        assert v("kvcp_agent_operations", {**a, "kind": "promote", "state": "running"}) == 1
        assert v("kvcp_agent_operations", {**a, "kind": "move", "state": "pending"}) == 1
        assert v("kvcp_agent_operations", {**a, "kind": "compress", "state": "running"}) == 0
        move = {**a, "kind": "move", "state": "succeeded"}
        assert v("kvcp_agent_operation_duration_seconds_count", move) == 1
        assert v("kvcp_agent_operation_duration_seconds_sum", move) == pytest.approx(0.3)
        assert v("kvcp_agent_operation_duration_seconds_bucket", {**move, "le": "0.1"}) == 0
        assert v("kvcp_agent_operation_duration_seconds_bucket", {**move, "le": "0.5"}) == 1
        assert v("kvcp_agent_operation_duration_seconds_bucket", {**move, "le": "+Inf"}) == 1
        failed = {**a, "kind": "compress", "state": "failed"}
        assert v("kvcp_agent_operation_duration_seconds_bucket", {**failed, "le": "30.0"}) == 0
        assert v("kvcp_agent_operation_duration_seconds_bucket", {**failed, "le": "60.0"}) == 1
    ops[1] = op("2", "promote", "SUCCEEDED", 100.0, 102.0)
    mover.finish_listeners[0](ops[1])
    ops.pop(0)  # the mover forgot op 1: it stays counted
    promote = {**a, "kind": "promote", "state": "succeeded"}
    assert v("kvcp_agent_operation_duration_seconds_count", promote) == 1
    assert v("kvcp_agent_operation_duration_seconds_count", {**a, "kind": "move", "state": "succeeded"}) == 1
    assert v("kvcp_agent_operations", {**a, "kind": "promote", "state": "running"}) == 0


def test_transfers():
    registry = CollectorRegistry()
    pool = SimpleNamespace(usage=lambda: [SimpleNamespace(tier=Tier.CPU, capacity_bytes=1, used_bytes=0, num_blocks=0)])
    m = AgentMetrics(registry, "m1", pool, process=False)
    m.record_transfer("handoff", 1000, 0.2, ok=True)
    m.record_transfer("handoff", 500, 1.5, ok=False, fallback="recompute")
    m.record_transfer("handoff", 700, 0.7, ok=False, fallback="secondary_path")
    m.record_transfer("replicate", 300, 0.05, ok=False)
    v = registry.get_sample_value
    h = {"agent_id": "m1", "kind": "handoff"}
    assert v("kvcp_transfers_total", h) == 3
    assert v("kvcp_transfer_failures_total", h) == 2
    assert v("kvcp_transfer_fallbacks_total", {**h, "fallback": "recompute"}) == 1
    assert v("kvcp_transfer_fallbacks_total", {**h, "fallback": "secondary_path"}) == 1
    assert v("kvcp_transfer_bytes_total", h) == 1700  # recomputed bytes never moved
    assert v("kvcp_transfer_duration_seconds_count", h) == 3
    assert v("kvcp_transfer_duration_seconds_sum", h) == pytest.approx(2.4)
    assert v("kvcp_transfer_duration_seconds_bucket", {**h, "le": "1.0"}) == 2
    r = {"agent_id": "m1", "kind": "replicate"}
    assert v("kvcp_transfer_failures_total", r) == 1 and v("kvcp_transfer_bytes_total", r) == 0
    assert v("kvcp_transfer_fallbacks_total", {**r, "fallback": "recompute"}) == 0


def test_pool_counters_of_any_shape():
    assert _by_tier_reason(None, Tier.CPU) == {}
    assert _by_tier_reason(3, Tier.CPU) == {(Tier.CPU, "capacity"): 3}
    assert _by_tier_reason({Tier.GPU: 2, Tier.CPU: 0}, Tier.CPU) == {
        (Tier.GPU, "capacity"): 2,
        (Tier.CPU, "capacity"): 0,
    }
    assert _by_tier_reason({(Tier.DISK, "cleanup"): 5, (2, "policy"): 1}, Tier.CPU) == {
        (Tier.DISK, "cleanup"): 5,
        (Tier.CPU, "policy"): 1,
    }


def test_commanded_moves_compresses_cleanups_and_evicts_are_counted(tmp_path):
    """Not only the room-making ones: an operator's (or the policy's) move to disk is a
    demotion, a compress in place re-encodes without moving between tiers, a cleanup and
    an evict command drop blocks."""
    from protos.block_hash import hash_prefix, split_hashes

    registry = CollectorRegistry()
    a = Agent(
        AgentConfig(
            agent_id="m2",
            cpu_capacity_bytes=16 * M.block_bytes,
            disk_dir=str(tmp_path / "disk"),
            disk_capacity_bytes=32 * M.block_bytes,
        ),
        registry=registry,
    )
    try:
        v = registry.get_sample_value
        first, second = tokens(4), tokens(4, start=7000)
        a.engine.store(M.model_id, first, kv(4))
        a.engine.store(M.model_id, second, kv(4))
        hs1 = split_hashes(hash_prefix(M.model_id, first, BS))
        hs2 = split_hashes(hash_prefix(M.model_id, second, BS))
        assert all(o.ok for o in a.pool.move_blocks(hs1, Tier.DISK))
        assert v("kvcp_demotions_total", {"agent_id": "m2", "tier": "cpu", "reason": "command"}) == 4
        assert v("kvcp_demotions_total", {"agent_id": "m2", "tier": "cpu", "reason": "capacity"}) == 0
        assert v("kvcp_tier_moved_bytes_total", {"agent_id": "m2", "src_tier": "cpu", "dst_tier": "disk"}) > 0
        assert all(o.ok for o in a.pool.move_blocks(hs2, None, "int8"))  # compress in place
        assert v("kvcp_recoded_bytes_total", {"agent_id": "m2"}) > 0
        assert v("kvcp_tier_moved_bytes_total", {"agent_id": "m2", "src_tier": "cpu", "dst_tier": "cpu"}) is None
        assert a.pool.drop(hs2[-1])
        assert v("kvcp_evictions_total", {"agent_id": "m2", "tier": "cpu", "reason": "command"}) == 1
        assert a.pool.cleanup(0).num_blocks == 7
        assert v("kvcp_evictions_total", {"agent_id": "m2", "tier": "disk", "reason": "cleanup"}) == 4
        assert v("kvcp_evictions_total", {"agent_id": "m2", "tier": "cpu", "reason": "cleanup"}) == 3
    finally:
        a.stop()  # closes its disk tier and frees its transfer engine


def test_every_operation_that_ended_between_two_scrapes_is_observed(tmp_path):
    """The mover keeps its latest 256 operations; a busy agent ends more than that between
    two scrapes (every load from a lower tier is a promote): each is observed as it ends."""
    from agent.core.mover import Mover
    from tests.tiers.support import make_pool

    pool = make_pool(str(tmp_path))
    mover = Mover(pool)
    registry = CollectorRegistry()
    AgentMetrics(registry, "m1", pool, mover=mover, process=False)
    move = {"agent_id": "m1", "kind": "move", "state": "succeeded"}
    assert registry.get_sample_value("kvcp_agent_operation_duration_seconds_count", move) == 0
    for _ in range(1000):
        mover.submit([], None, kind="move")  # nothing to move: it ends at once
        mover.run_once(0.01)
    assert len(mover.ops()) == 256
    assert registry.get_sample_value("kvcp_agent_operation_duration_seconds_count", move) == 1000


def test_compression_saved_is_the_room_freed_in_whole_pages(agent):
    # a demo block is 8 KiB in 1 KiB pages: int8 halves it (4 pages freed a block); zstd of
    # random fp16 shrinks it within its last page at best, which frees nothing
    a, registry = agent
    cpu = {"agent_id": "m1", "tier": "cpu"}
    page = a.pool.store_of[Tier.CPU].page_bytes
    data = torch.randn((2, *M.block_shape), generator=torch.Generator().manual_seed(3)).to(torch.float16)
    a.engine.store(M.model_id, tokens(2), data)
    hashes = a.engine.hashes(M, tokens(2))
    assert all(o.ok for o in a.pool.move_blocks(hashes[:1], None, codec="int8"))
    assert all(o.ok for o in a.pool.move_blocks(hashes[1:], None, codec="zstd"))
    metas = [a.pool.blocks[h] for h in hashes]
    assert [m.codec for m in metas] == ["int8", "none"]  # zstd would free no page: kept as it was
    pages = [-(-m.stored_bytes // page) for m in metas]
    freed = sum(M.block_bytes // page - n for n in pages) * page
    assert registry.get_sample_value("kvcp_compression_saved_bytes", cpu) == freed
    payload_saved = sum(M.block_bytes - m.stored_bytes for m in metas if m.codec != "none")
    assert freed < payload_saved  # what the payloads shrank by overstates the room freed


def test_handoff_state_is_exported(agent):
    a, registry = agent
    v = registry.get_sample_value
    aid = {"agent_id": "m1"}
    assert v("kvcp_handoff_reservations", aid) == 0 and v("kvcp_handoff_quarantined_bytes", aid) == 0
    assert v("kvcp_handoff_free_bytes", aid) == 6 * M.block_bytes
    assert v("kvcp_handoffs_outbound", {**aid, "state": "queued"}) == 0
    hashes = a.engine.hashes(M, tokens(2))
    res = a.dataplane.reservations
    r = res.reserve(M.model_id, hashes, [M.block_bytes] * 2, ["none"] * 2, ttl_seconds=5)
    assert v("kvcp_handoff_reservations", aid) == 1 and v("kvcp_handoff_reserved_bytes", aid) == 2 * M.block_bytes
    res.abort(r.reservation_id, quiesced=False)  # a late write may land: its pages are quarantined
    assert v("kvcp_handoff_reservations", aid) == 0
    assert v("kvcp_handoff_reservations_ended_total", {**aid, "outcome": "aborted"}) == 1
    assert v("kvcp_handoff_reservations_ended_total", {**aid, "outcome": "expired"}) == 0
    assert v("kvcp_handoff_quarantined_bytes", aid) == 2 * M.block_bytes
    assert v("kvcp_handoff_aborts_retried_total", aid) == 0
    with a.dataplane._lock:
        a.dataplane.aborts_retried_total += 2  # as _abort_done counts an Abort sent again
    assert v("kvcp_handoff_aborts_retried_total", aid) == 2


def test_gpu_memory_of_the_gpu_tiers_device_and_a_failed_read_costs_only_its_series(monkeypatch, caplog):
    """The GPU's memory (free and total on the device, this agent's reserved and allocated)
    for each device a GPU tier is on; none on an agent without one. CUDA is simulated: a
    meta slab stands in for the cuda:1 tier, and the read is monkeypatched."""
    import logging

    from agent.core.block_pool import BlockPool
    from agent.store import memory_tier as mt

    cpu_only = CollectorRegistry()
    cpu_only.register(AgentCollector("c1", BlockPool([mt.MemoryTier(Tier.CPU, 1 << 20, 4096)], [M])))
    assert not [m for m in cpu_only.collect() if m.name == "kvcp_gpu_memory_bytes"]

    gpu = mt.MemoryTier(Tier.GPU, 1 << 20, 4096, device="meta")
    gpu.device = "cuda:1"
    read = {"free": 30 << 30, "total": 80 << 30, "reserved": 2 << 30, "allocated": 1 << 30}
    asked = []
    monkeypatch.setattr(mt, "gpu_memory_bytes", lambda device: asked.append(device) or dict(read))
    registry = CollectorRegistry()
    registry.register(AgentCollector("g1", BlockPool([gpu, mt.MemoryTier(Tier.CPU, 1 << 20, 4096)], [M])))
    v = registry.get_sample_value
    for kind, n in read.items():
        assert v("kvcp_gpu_memory_bytes", {"agent_id": "g1", "device": "cuda:1", "kind": kind}) == n
    assert set(asked) == {"cuda:1"}

    def cuda_error(device):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(mt, "gpu_memory_bytes", cuda_error)
    with caplog.at_level(logging.WARNING, logger="agent.metrics"):
        for _ in range(2):
            assert v("kvcp_gpu_memory_bytes", {"agent_id": "g1", "device": "cuda:1", "kind": "free"}) is None
            assert v("kvcp_tier_capacity_bytes", {"agent_id": "g1", "tier": "gpu"}) == 1 << 20  # the scrape goes on
    assert len([r for r in caplog.records if "cuda:1" in r.getMessage()]) == 1  # said once
