"""An agent's reconnect while the control plane's applier is busy: the old stream's late
teardown must not detach the new, live stream (each stream is its own session), so
commands keep reaching the agent."""

from __future__ import annotations

import queue
import time

from controlplane.api import agent_service
from controlplane.core.cluster import AgentCommand, AgentState
from tests.helpers import wait_for
from tests.integration.test_cluster import M, kv, tokens


def test_reconnect_under_applier_backlog_keeps_outbox(monkeypatch, etcd, make_agent):
    servicers = []
    orig = agent_service.AgentServicer.__init__

    def init(self, *a, **kw):
        orig(self, *a, **kw)
        servicers.append(self)

    monkeypatch.setattr(agent_service.AgentServicer, "__init__", init)
    hellos = []
    from controlplane.server import ControlPlane, ControlPlaneConfig

    cp = ControlPlane(
        ControlPlaneConfig(listen="127.0.0.1:0", etcd=etcd, election_ttl_seconds=3, membership_resync_seconds=0.5)
    ).start()
    try:
        orig_hello = cp.cluster.hello
        monkeypatch.setattr(
            cp.cluster, "hello", lambda a, s, *rest, **kw: (hellos.append(s), orig_hello(a, s, *rest, **kw))[1]
        )
        a = make_agent("blip", lease_ttl_seconds=5)
        a.engine.store(M.model_id, tokens(3), kv(3))
        wait_for(lambda: cp.cluster.index.num_agent_blocks("blip") == 3 and cp.cluster.agent("blip").outbox is not None)
        # the applier is busy for a moment (another agent's large inventory being swapped in)
        servicers[0]._applier.submit({"outbox": queue.Queue()}, time.sleep, 1.5)
        a.link.request_reconnect()  # the stream drops; the lease stays
        wait_for(lambda: a.link.connections_total >= 2 and a.link.connected.is_set(), what="reconnected")
        time.sleep(2.5)  # everything settled
        rec = cp.cluster.agent("blip")
        assert rec.outbox is not None and rec.state == AgentState.READY
        assert cp.cluster.send("blip", AgentCommand(op_id="x", kind="cancel"))
        assert len(set(hellos)) == len(hellos), "every stream should have its own session id"
    finally:
        cp.stop()
