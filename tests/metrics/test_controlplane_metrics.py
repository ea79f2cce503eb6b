"""Control-plane metrics read from a real Cluster through an injected registry: exact
values after known registrations, inventories, events, gaps and lookups; the lookup
latency histogram of the AdminService; the hooks of features not built yet."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from prometheus_client import CollectorRegistry

from controlplane.api.admin_service import AdminServicer
from controlplane.core.cluster import AgentRecord, BlockGroup, Cluster, ModelInfo
from controlplane.metrics import ControlPlaneMetrics, PinStats
from protos import errors
from protos.block_hash import hash_prefix
from protos.kvcp.v1 import admin_pb2
from protos.tier import Tier

BS = 4


@dataclass
class Leadership:
    is_leader: bool = True
    epoch: int = 7
    leader_address: str = "127.0.0.1:1"
    serving_from_memory: bool = False


def packed(n_blocks: int, start: int = 0) -> bytes:
    return hash_prefix("m", range(start, start + n_blocks * BS), BS)


def record(agent_id: str) -> AgentRecord:
    return AgentRecord(agent_id=agent_id, address=f"{agent_id}:1", models=[ModelInfo("m", BS)], tiers=[])


@pytest.fixture
def setup():
    registry = CollectorRegistry()
    cluster = Cluster(clock=lambda: 1234.5)
    metrics = ControlPlaneMetrics(registry, cluster, Leadership(), process=False)
    return registry, cluster, metrics


def test_cluster_state_is_read_at_scrape_time(setup):
    registry, cluster, _ = setup
    v = registry.get_sample_value
    assert v("kvcp_agents", {"state": "ready"}) == 0
    assert v("kvcp_lookups_total") == 0
    assert v("kvcp_controlplane_is_leader") == 1 and v("kvcp_controlplane_epoch") == 7

    # a1: inventory of 3 blocks, then one event batch of 2 more, then a gap
    cluster.register(record("a1"))
    cluster.hello("a1", "s1")
    assert cluster.apply_inventory_chunk("a1", 5, 0, True, [BlockGroup("m", Tier.CPU, packed(3))]) is None
    assert cluster.apply_events("a1", 6, True, [BlockGroup("m", Tier.CPU, packed(5)[3 * 16 :])]) is None
    assert cluster.apply_events("a1", 9, True, [BlockGroup("m", Tier.CPU, packed(1, start=900))]) is not None
    # a2: ready with the first 2 blocks; a3: registered, never synced
    cluster.register(record("a2"))
    cluster.hello("a2", "s2")
    cluster.apply_inventory_chunk("a2", 0, 0, True, [BlockGroup("m", Tier.CPU, packed(2))])
    cluster.register(record("a3"))
    cluster.hello("a3", "s3")
    cluster.stream_closed("a3", "s3")

    tokens = list(range(5 * BS + 2))
    cluster.lookup("m", tokens)  # a1 holds all 5 blocks
    cluster.lookup("m", list(range(1000, 1000 + 2 * BS)))  # miss

    assert v("kvcp_agents", {"state": "ready"}) == 1  # a2 (a1 is resyncing)
    assert v("kvcp_agents", {"state": "syncing"}) == 1
    assert v("kvcp_agents", {"state": "disconnected"}) == 1
    assert v("kvcp_agent_state", {"agent_id": "a1", "state": "syncing"}) == 1
    assert v("kvcp_agent_state", {"agent_id": "a1", "state": "ready"}) == 0
    assert v("kvcp_agent_indexed_blocks", {"agent_id": "a1"}) == 5
    assert v("kvcp_agent_indexed_blocks", {"agent_id": "a2"}) == 2
    assert v("kvcp_agent_indexed_blocks", {"agent_id": "a3"}) == 0
    assert v("kvcp_agent_last_seen_timestamp_seconds", {"agent_id": "a2"}) == 1234.5
    assert v("kvcp_index_blocks") == 5
    assert v("kvcp_index_block_replicas") == 7
    assert v("kvcp_block_events_total") == 2  # the batch after the gap is not applied
    assert v("kvcp_resyncs_total") == 1
    assert v("kvcp_lookups_total") == 2
    assert v("kvcp_lookup_tokens_total") == len(tokens) + 2 * BS
    assert v("kvcp_lookup_hit_tokens_total") == 5 * BS

    cluster.remove_agent("a1")
    assert v("kvcp_agent_indexed_blocks", {"agent_id": "a1"}) is None  # its series is gone with it
    assert v("kvcp_index_blocks") == 2


def test_leadership_and_build_info(setup):
    registry, _, metrics = setup
    v = registry.get_sample_value
    metrics.leadership = Leadership(is_leader=False, epoch=9)
    assert v("kvcp_controlplane_is_leader") == 0 and v("kvcp_controlplane_epoch") == 9
    samples = [s for m in registry.collect() if m.name == "kvcp_build_info" for s in m.samples]
    assert len(samples) == 1 and samples[0].labels["component"] == "controlplane" and samples[0].value == 1


def test_per_agent_series_only_while_leader(setup):
    """A deposed leader keeps its agent records (disconnected) until the agents' leases go;
    it must not export them, or KvcpAgentNotSynced fires after every failover."""
    registry, cluster, metrics = setup
    v = registry.get_sample_value
    cluster.register(record("a1"))
    cluster.hello("a1", "s1")
    cluster.apply_inventory_chunk("a1", 0, 0, True, [BlockGroup("m", Tier.CPU, packed(2))])
    assert v("kvcp_agent_state", {"agent_id": "a1", "state": "ready"}) == 1
    assert v("kvcp_agent_indexed_blocks", {"agent_id": "a1"}) == 2

    metrics.leadership = Leadership(is_leader=False)
    cluster.stream_closed("a1", "s1")  # the agent went over to the new leader
    per_agent = ("kvcp_agent_state", "kvcp_agent_indexed_blocks", "kvcp_agent_last_seen_timestamp_seconds")
    samples = [s for m in registry.collect() if m.name in per_agent for s in m.samples]
    assert samples == []
    assert v("kvcp_controlplane_is_leader") == 0

    metrics.leadership = Leadership(is_leader=True)  # leading again: the series are back
    assert v("kvcp_agent_state", {"agent_id": "a1", "state": "disconnected"}) == 1
    assert v("kvcp_controlplane_serving") == 1

    # cut off from etcd, the leader serves lookups from memory: its view is still the
    # cluster's, so its per-agent series stay (panels and alerts filter on serving == 1)
    metrics.leadership = Leadership(is_leader=False, serving_from_memory=True)
    assert v("kvcp_controlplane_is_leader") == 0 and v("kvcp_controlplane_serving_stale") == 1
    assert v("kvcp_controlplane_serving") == 1
    assert v("kvcp_agent_indexed_blocks", {"agent_id": "a1"}) == 2


def test_lookup_latency_histogram_counts_answered_lookups(setup):
    registry, cluster, metrics = setup
    cluster.register(record("a1"))
    servicer = AdminServicer(cluster, Leadership(), metrics.lookup_duration)
    for n in (1, 2, 3):
        servicer.Lookup(admin_pb2.LookupRequest(model_id="m", token_ids=list(range(n * BS))), None)
    with pytest.raises(errors.NotFound):
        servicer.Lookup(admin_pb2.LookupRequest(model_id="unknown", token_ids=[1]), None)
    with pytest.raises(errors.NotLeader):
        AdminServicer(cluster, Leadership(is_leader=False), metrics.lookup_duration).Lookup(
            admin_pb2.LookupRequest(model_id="m", token_ids=[1]), None
        )
    v = registry.get_sample_value
    assert v("kvcp_lookup_duration_seconds_count") == 3
    assert v("kvcp_lookup_duration_seconds_bucket", {"le": "+Inf"}) == 3
    assert 0 < v("kvcp_lookup_duration_seconds_sum") < 3 * 10.0
    assert v("kvcp_lookups_total") == 3  # the cluster counter agrees


def test_operation_and_pin_hooks(setup):
    registry, _, metrics = setup
    v = registry.get_sample_value
    # before the features exist: every family is there, at zero
    assert v("kvcp_pins") == 0 and v("kvcp_pinned_bytes") == 0
    assert v("kvcp_operations", {"kind": "cleanup", "state": "running"}) == 0
    assert v("kvcp_operation_duration_seconds_count", {"kind": "move", "state": "succeeded"}) == 0
    assert v("kvcp_operations", {"kind": "drain", "state": "running"}) == 0  # (left out when drains came)
    assert v("kvcp_operation_duration_seconds_count", {"kind": "drain", "state": "failed"}) == 0

    metrics.collector.pins_source = lambda: PinStats(num_pins=3, pinned_bytes=3 << 20)
    metrics.collector.operations_source = lambda: {("move", "running"): 2, ("replicate", "pending"): 1}
    metrics.observe_operation("move", "SUCCEEDED", 0.3)
    metrics.observe_operation("move", "succeeded", 7.0)
    metrics.observe_operation("cleanup", "failed", 0.002)

    assert v("kvcp_pins") == 3 and v("kvcp_pinned_bytes") == 3 << 20
    assert v("kvcp_operations", {"kind": "move", "state": "running"}) == 2
    assert v("kvcp_operations", {"kind": "move", "state": "pending"}) == 0
    assert v("kvcp_operations", {"kind": "replicate", "state": "pending"}) == 1  # a kind added later
    move = {"kind": "move", "state": "succeeded"}
    assert v("kvcp_operation_duration_seconds_count", move) == 2
    assert v("kvcp_operation_duration_seconds_sum", move) == pytest.approx(7.3)
    assert v("kvcp_operation_duration_seconds_bucket", {**move, "le": "0.1"}) == 0
    assert v("kvcp_operation_duration_seconds_bucket", {**move, "le": "0.5"}) == 1
    assert v("kvcp_operation_duration_seconds_bucket", {**move, "le": "10.0"}) == 2
    assert v("kvcp_operation_duration_seconds_bucket", {"kind": "cleanup", "state": "failed", "le": "0.01"}) == 1


def test_a_cordoned_agent_is_exported_as_such(setup):
    registry, cluster, _ = setup
    for agent_id in ("a1", "a2"):
        cluster.register(record(agent_id))
    cluster.set_cordoned({"a2": "kernel upgrade"})
    v = registry.get_sample_value
    assert v("kvcp_agent_cordoned", {"agent_id": "a1"}) == 0
    assert v("kvcp_agent_cordoned", {"agent_id": "a2"}) == 1
    cluster.set_cordoned({})
    assert v("kvcp_agent_cordoned", {"agent_id": "a2"}) == 0
