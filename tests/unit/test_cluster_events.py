"""The Cluster publishes what the dashboard shows: joins, leaves and sync state."""

from __future__ import annotations

from controlplane.core.cluster import AgentRecord, BlockGroup, Cluster
from protos.tier import Tier


def test_cluster_publishes_membership_and_sync_state():
    c = Cluster(clock=lambda: 1000.0)
    sub = c.events.subscribe()
    c.register(AgentRecord("a1", "127.0.0.1:1", [], []))
    c.register(AgentRecord("a1", "127.0.0.1:1", [], []))  # re-register: not a new join
    c.hello("a1", "s1")
    c.apply_inventory_chunk("a1", 1, 0, True, [BlockGroup("m", Tier.CPU, b"\x01" * 16)])
    c.apply_events("a1", 5, True, [])  # gap: resync
    c.stream_closed("a1", "s1")
    c.remove_agent("a1")
    got = [(e.kind, e.severity, e.agent_id) for e in sub.drain()]
    assert got == [
        ("agent_joined", "info", "a1"),
        ("agent_state", "info", "a1"),
        ("agent_state", "info", "a1"),
        ("agent_state", "warning", "a1"),
        ("agent_state", "warning", "a1"),
        ("agent_left", "info", "a1"),
    ]
    assert all(e.unix_seconds == 1000.0 for e in c.events.recent())
    assert "ready (1 blocks)" in c.events.recent()[2].message
