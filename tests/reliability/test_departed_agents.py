"""Agents that leave for good (pods of a rollout come back under new ids) leave nothing
behind on the agents and the control plane that stay: a soak test (2026-12-07) found
both keeping per-peer state for every agent that ever left."""

from __future__ import annotations

from prometheus_client import generate_latest

from agent.client import EngineClient
from protos import errors
from tests.handoff.support import SMALL, prompt
from tests.helpers import wait_for


def test_links_to_departed_peers_are_forgotten(controlplane, make_agent, monkeypatch):
    """A sender kept each peer's link (fitted throughput, two metric series, a line in
    every stats report) after the peer left etcd and the cluster: +2 series per departed
    peer on every agent that ever handed off to it, until restart."""
    import agent.dataplane as dataplane

    monkeypatch.setattr(dataplane, "LINK_FORGET_IDLE_SECONDS", 0.5)
    monkeypatch.setattr(dataplane, "DEPARTED_CHECK_SECONDS", 0.5)
    sender = make_agent("sender", models=[SMALL])
    stays = make_agent("stays", models=[SMALL])
    client = EngineClient(sender.address)
    gone = []
    try:
        for i, peer_id in enumerate(["pod-0", "pod-1", "stays"]):
            peer = stays if peer_id == "stays" else make_agent(peer_id, models=[SMALL])
            tokens, kv, _ = prompt(SMALL, 4, seed=i + 1)
            sender.engine.store(SMALL.model_id, tokens, kv)
            r = client.handoff(SMALL.model_id, peer_id, token_ids=tokens, deadline_seconds=10)
            assert r.outcome == "transferred", r
            if peer is not stays:
                peer.stop()  # the pod goes for good
                gone.append(peer_id)
    finally:
        client.close()

    def departed(agent_id: str) -> bool:
        try:
            sender.dataplane.peer(agent_id, refresh=True)
        except errors.NotFound:
            return True
        return False

    for agent_id in gone:  # their leases end and etcd forgets them
        wait_for(lambda a=agent_id: departed(a), 20, what=f"{agent_id} gone from etcd")

    def links() -> list[str]:
        return sorted(link.peer_agent_id for link in sender.dataplane.stats().links)

    wait_for(lambda: links() == ["stays"], 10, what="the departed peers' links forgotten")
    series = [
        line
        for line in generate_latest(sender.registry).decode().splitlines()
        if line.startswith("kvcp_link_") and "pod-" in line
    ]
    assert series == [], series
    # the peer that stays keeps its link, measurements and all
    assert [link.transfers_total for link in sender.dataplane.stats().links] == [1]


def test_policy_state_of_departed_agents_is_dropped(controlplane, make_agent):
    """The leader's tier-policy bookkeeping (when it last decided for an agent, its
    report then, whether the pass was idle, its commands in flight) kept an entry for
    every agent id it ever decided for."""
    m = controlplane.manager
    maps = ("_policy_last", "_policy_report_seen", "_policy_idle", "_policy_inflight")
    gone = []
    for i in range(2):
        agent_id = f"pod-{i}"
        # a CPU tier of 8 blocks filled whole: over its high watermark, so a pass decides for it
        a = make_agent(agent_id, models=[SMALL], cpu_capacity_bytes=8 * SMALL.block_bytes)
        tokens, kv, _ = prompt(SMALL, 8, seed=i + 1)
        a.engine.store(SMALL.model_id, tokens, kv)
        wait_for(lambda a=agent_id: a in m._policy_last, 20, what=f"a policy pass decided for {agent_id}")
        a.stop()
        gone.append(agent_id)

    def leftovers() -> dict[str, list[str]]:
        return {name: sorted(k for k in getattr(m, name) if k in gone) for name in maps}

    wait_for(lambda: not m.cluster.connected_agents(), 20, what="the control plane forgot the departed agents")
    wait_for(lambda: not any(leftovers().values()), 10, what="their policy state dropped")


def test_a_stalled_etcd_holds_up_neither_the_reservation_sweep_nor_a_second_check(make_agent, monkeypatch):
    """The check for departed peers reads etcd; it ran on the reservation sweep's thread,
    so an etcd stall held up the sweep that frees expired reservations' pages. It runs
    on the peer-read executor now, one check at a time."""
    import threading

    import agent.dataplane as dataplane

    monkeypatch.setattr(dataplane, "LINK_FORGET_IDLE_SECONDS", 0.0)
    monkeypatch.setattr(dataplane, "DEPARTED_CHECK_SECONDS", 0.0)
    a = make_agent("sweeper", models=[SMALL])
    dp = a.dataplane
    dp.links.get("idle-peer")  # a link idle long enough to be looked up
    release = threading.Event()
    reads = []

    def stalled_etcd(agent_id):
        reads.append(agent_id)
        release.wait(30)
        return object()  # still registered: nothing is forgotten

    sweeps = []
    run_once = dp.reservations.run_once
    monkeypatch.setattr(dp, "_peer_info", stalled_etcd)
    monkeypatch.setattr(dp.reservations, "run_once", lambda: sweeps.append(1) or run_once())
    try:
        wait_for(lambda: reads, 10, what="a departed-peer check reading etcd")
        n = len(sweeps)
        wait_for(lambda: len(sweeps) >= n + 5, 10, what="the sweep going on while etcd stalls")
        assert reads == ["idle-peer"], reads  # no second check piled up behind the first
    finally:
        release.set()
    wait_for(lambda: len(reads) >= 2, 10, what="the next check once etcd answered")
    assert [link.peer_agent_id for link in dp.links.all()] == ["idle-peer"]
