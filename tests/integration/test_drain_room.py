"""The room a drain is given while another drain into the same destination runs: what the
destination's reports show free (below the line where its policy would drop blocks), less
what the drains under way hold there. Real etcd and control planes; stand-in agents whose
usage reports and drain progress the test sends, so each stands where the test leaves it
(a real drain's blocks land at the pace of its link, its destination's reports come every
second)."""

from __future__ import annotations

import queue

import pytest

from cli.client import ControlPlaneClient
from controlplane.core.cluster import AgentRecord, ModelInfo, TierUsage
from controlplane.core.policy import drop_line_bytes
from controlplane.server import ControlPlane, ControlPlaneConfig
from protos import etcd_keys
from protos.tier import Tier
from tests.helpers import wait_for

KB = 1000
CAPACITY_BYTES = 1000 * KB  # each stand-in's CPU tier, its only one
BLOCK_BYTES = 8 * KB


def start_cp(endpoint: str) -> ControlPlane:
    return ControlPlane(
        ControlPlaneConfig(
            listen="127.0.0.1:0", etcd=endpoint, election_ttl_seconds=3, metrics_listen="", policy_enabled=False
        )
    ).start()


def leading(cp: ControlPlane) -> ControlPlane:
    wait_for(lambda: cp.election.is_leader, 15, 0.02, "leadership")
    return cp


class StandIn:
    """An agent registered straight into a control plane's cluster (its key in etcd under a
    lease that outlives the test): its commands land in a queue, its usage reports and its
    drain's progress are what the test sends."""

    def __init__(self, cp: ControlPlane, agent_id: str, used_bytes: int = 0) -> None:
        self.agent_id, self.used_bytes = agent_id, used_bytes
        client = etcd_keys.connect(cp.config.etcd)
        client.put(etcd_keys.agent_key(agent_id), b"{}", client.lease(60))
        client.close()
        self.join(cp)

    def usage(self) -> list[TierUsage]:
        return [TierUsage(Tier.CPU, CAPACITY_BYTES, self.used_bytes, self.used_bytes // BLOCK_BYTES)]

    def join(self, cp: ControlPlane) -> None:
        """Register with `cp` (a new leader: as the agent does when it finds one), with its usage now."""
        self.cp = cp
        cp.cluster.register(
            AgentRecord(self.agent_id, "127.0.0.1:1", [ModelInfo("m", 16, 2, 2, 8, "float16")], self.usage())
        )
        cp.cluster.hello(self.agent_id, "s1")
        assert cp.cluster.apply_inventory_chunk(self.agent_id, 0, 0, True, []) is None
        cp.cluster.attach_outbox(self.agent_id, "s1", queue.Queue())

    def report(self, used_bytes: int) -> None:
        """A usage report (the agent's stats, every second by default)."""
        self.used_bytes = used_bytes
        self.cp.cluster.update_stats(self.agent_id, self.usage(), 0, 0, 0)

    def drained(self, op_id: str, taken_bytes: int) -> None:
        """Its drain's progress: what its blocks take at its one destination so far."""
        n = taken_bytes // BLOCK_BYTES
        self.cp.manager.on_op_update(
            self.agent_id, op_id, "RUNNING", n, 100, 0, taken_bytes, "", peer_taken_bytes=[taken_bytes]
        )


@pytest.fixture
def cp(etcd):
    cp = leading(start_cp(etcd))
    yield cp
    cp.stop()


def free_below_line(cp: ControlPlane, used_bytes: int) -> int:
    """What a destination holding `used_bytes` reports free below its drop line."""
    usage = [TierUsage(Tier.CPU, CAPACITY_BYTES, used_bytes, 0)]
    return drop_line_bytes(usage, cp.manager.tier_policy()) - used_bytes


def test_a_drain_under_way_holds_only_the_room_its_destinations_reports_do_not_show_taken(cp):
    """Review: a drain under way held the whole room it was given at each destination,
    though the blocks it had landed there showed in that destination's reports too: a
    second drain started meanwhile saw that room counted twice (less room than there is,
    or a wrong "no room"). It holds the room it was given less what it landed there by a
    point the destination has reported twice since (one report may have been on its way)."""
    s1, _s2 = StandIn(cp, "r-s1"), StandIn(cp, "r-s2")
    dst = StandIn(cp, "r-dst", used_bytes=400 * KB)
    with ControlPlaneClient(cp.address) as c:
        first = c.drain("r-s1", to_agent_ids=["r-dst"])
        given = free_below_line(cp, 400 * KB)
        assert first.params["room"] == str(given), first.params
        # the destination's own 400 KB dropped (a cleanup), 300 KB of the drain landed there
        s1.drained(first.op_id, 300 * KB)
        dst.report(300 * KB)
        dst.report(300 * KB)
        second = c.drain("r-s2", to_agent_ids=["r-dst"])
        # what its reports show free, less what the first may still send there
        held = given - 300 * KB
        assert second.params["room"] == str(free_below_line(cp, 300 * KB) - held), (second.params, given)
        assert int(second.params["room"]) == 400 * KB  # (before: 100 KB, the landed 300 KB counted twice)


def test_a_drain_under_way_holds_the_room_of_what_landed_until_the_destination_reported_it_twice(cp):
    """The destination's first report after the control plane heard the blocks landed may
    have left before they did: until a second one, the drain holds the whole room it was
    given there (what it may still send and what landed alike), never less."""
    s1, _s2 = StandIn(cp, "n-s1"), StandIn(cp, "n-s2")
    dst = StandIn(cp, "n-dst", used_bytes=400 * KB)
    with ControlPlaneClient(cp.address) as c:
        first = c.drain("n-s1", to_agent_ids=["n-dst"])
        given = int(first.params["room"])
        s1.drained(first.op_id, 300 * KB)
        dst.report(300 * KB)  # one report: the own 400 KB dropped; the 300 KB landed, or not yet
        second = c.drain("n-s2", to_agent_ids=["n-dst"])
        assert second.params["room"] == str(free_below_line(cp, 300 * KB) - given), second.params  # 100 KB


def test_a_new_leader_holds_a_drains_whole_room_until_its_own_reports_show_what_landed(etcd):
    """The destination's report counts are each control plane's own (a new leader's start
    at 0), and what an agent reported to the leader before says nothing of the figures the
    new one holds: a drain under way holds the whole room it was given there until the
    destination has reported twice to the new leader since it heard the drain's progress."""
    a = leading(start_cp(etcd))
    b = None
    try:
        s1, s2, s3 = StandIn(a, "l-s1"), StandIn(a, "l-s2"), StandIn(a, "l-s3")
        dst = StandIn(a, "l-dst", used_bytes=400 * KB)
        with ControlPlaneClient(a.address) as c:
            first = c.drain("l-s1", to_agent_ids=["l-dst"])
        given = int(first.params["room"])
        s1.drained(first.op_id, 300 * KB)
        dst.report(300 * KB)
        dst.report(300 * KB)  # the old leader would count the landed 300 KB once: 250 KB held
        b = start_cp(etcd)
        a.stop()
        a = None
        leading(b)
        for agent in (s1, s2, s3, dst):
            agent.join(b)
        with ControlPlaneClient(b.address) as c:
            second = c.drain("l-s2", to_agent_ids=["l-dst"])
            assert second.params["room"] == str(free_below_line(b, 300 * KB) - given), second.params  # 100 KB
            s1.drained(first.op_id, 300 * KB)  # the drain's next progress, to the new leader
            dst.report(300 * KB)
            dst.report(300 * KB)
            third = c.drain("l-s3", to_agent_ids=["l-dst"])
            # the first holds what it may still send there; the second, all it was given
            room = free_below_line(b, 300 * KB) - (given - 300 * KB) - int(second.params["room"])
            assert third.params["room"] == str(room), (third.params, second.params, given)
            assert room == 300 * KB
    finally:
        for x in (a, b):
            if x is not None:
                x.stop()
