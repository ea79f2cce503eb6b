"""Shared fixtures: one real etcd per session (KVCP_TEST_ETCD when CI started one),
a clean key space per test, and an in-process control plane on port 0."""

from __future__ import annotations

import os
import uuid

import pytest

from tests.helpers import EtcdServer, ExternalEtcd, wait_for


@pytest.fixture(scope="session")
def etcd_server():
    endpoint = os.environ.get("KVCP_TEST_ETCD")
    server = ExternalEtcd(endpoint) if endpoint else EtcdServer().start()
    yield server
    server.cleanup()


@pytest.fixture(autouse=True)
def _no_control_plane_outlives_its_test():
    """Stop any in-process control plane a test left running (one whose test failed before
    its own stop): it would keep leading the shared etcd in the tests after it."""
    import threading
    import warnings

    yield
    for t in threading.enumerate():
        target = getattr(t, "_target", None)
        cp = getattr(target, "__self__", None)
        if t.name == "election" and t.is_alive() and type(cp).__name__ == "ControlPlane":
            warnings.warn(f"a control plane at {cp.address} outlived its test; stopping it", stacklevel=1)
            cp.stop(grace_seconds=0.2)


@pytest.fixture
def etcd(etcd_server):
    """The session etcd with an empty /kvcp/ key space (tests share one server)."""
    from protos.etcd_keys import ROOT, connect

    client = connect(etcd_server.endpoint)
    client.delete_prefix(ROOT)
    yield etcd_server.endpoint
    client.delete_prefix(ROOT)
    client.close()


@pytest.fixture
def controlplane(etcd):
    from controlplane.server import ControlPlane, ControlPlaneConfig

    cp = ControlPlane(
        ControlPlaneConfig(listen="127.0.0.1:0", etcd=etcd, election_ttl_seconds=3, membership_resync_seconds=0.5)
    ).start()
    yield cp
    cp.stop()


@pytest.fixture
def make_agent(etcd):
    from agent.server import Agent, AgentConfig

    agents = []

    def make(agent_id: str | None = None, **kwargs) -> Agent:
        cfg = AgentConfig(
            agent_id=agent_id or f"agent-{uuid.uuid4().hex[:6]}",
            listen="127.0.0.1:0",
            etcd=etcd,
            lease_ttl_seconds=kwargs.pop("lease_ttl_seconds", 2),
            stats_interval_seconds=0.2,
            **kwargs,
        )
        a = Agent(cfg).start()
        # each agent of the test knows the others' addresses before the test's first handoff:
        # an etcd stall of this machine that lets a lease lapse just then would otherwise
        # make a live peer "not registered" (the agent re-registers a moment later)
        for other in [o for o in agents if not o._stop.is_set() and o.config.agent_id != a.config.agent_id]:
            wait_for(lambda o=other: o.dataplane.peer(a.config.agent_id, refresh=True), 30, what="peer known")
            wait_for(lambda o=other: a.dataplane.peer(o.config.agent_id, refresh=True), 30, what="peer known")
        agents.append(a)
        return a

    yield make
    for a in agents:
        a.stop()
