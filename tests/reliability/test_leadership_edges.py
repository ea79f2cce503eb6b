"""Leadership at its edges, as a review found them: one failed keep-alive call of an error
kind etcd's client does not call unreachable cost the leadership (no leader for a TTL,
then a new epoch); a deposed replica's queued command went out stamped with the new
leader's epoch; a leader cut off from etcd alone refused every change through it while
another replica led; etcd user and password without TLS to etcd could never connect."""

from __future__ import annotations

import queue
import threading

import grpc

from controlplane.api.agent_service import AgentServicer
from controlplane.core.cluster import AgentCommand
from controlplane.store.election import LeaderElection
from protos import errors, etcd_keys
from protos.etcd_keys import EtcdAuth
from protos.kvcp.v1 import agent_pb2
from tests.unit.test_sync_streams import Leadership, cluster_of, packed, wait


class _Unknown(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNKNOWN

    def details(self):
        return "No status received"


class _FailsOnce:
    """A lease whose next keep-alive answer is lost; the lease itself is fine."""

    def __init__(self, lease):
        self._lease, self._failed = lease, False

    def __getattr__(self, name):
        return getattr(self._lease, name)

    def refresh(self):
        if not self._failed:
            self._failed = True
            raise _Unknown()
        return self._lease.refresh()


def test_one_failed_keep_alive_call_keeps_the_leadership(etcd):
    ca, cb = etcd_keys.connect(etcd), etcd_keys.connect(etcd)
    a = LeaderElection(ca, "a:1", ttl_seconds=3)
    b = LeaderElection(cb, "b:1", ttl_seconds=3)
    try:
        assert a.run_once()
        epoch = a.epoch
        a._lease = _FailsOnce(a._lease)
        assert a.run_once() and a.leader_address == "a:1"  # the lease has most of its TTL
        assert a.run_once() and a.epoch == epoch  # and the next answer comes
        assert not b.run_once() and b.leader_address == "a:1"
    finally:
        a.resign()
        b.resign()
        ca.close()
        cb.close()


def test_a_deposed_replica_sends_no_queued_command_and_ends_its_agents_streams():
    cluster = cluster_of("a")
    leadership = Leadership(is_leader=True, epoch=7)
    servicer = AgentServicer(cluster, leadership)
    requests_q: queue.Queue = queue.Queue()
    sent: list = []
    ended: list = []

    def requests():
        while (m := requests_q.get()) is not None:
            yield m

    def consume():
        try:
            for msg in servicer.Sync(requests(), None):
                sent.append(msg)
        except errors.KvcpError as exc:
            ended.append(exc)

    threading.Thread(target=consume, daemon=True).start()
    requests_q.put(agent_pb2.AgentMessage(hello=agent_pb2.Hello(agent_id="a", session_id="s1")))
    wait(lambda: cluster.agent("a").outbox is not None, "the hello")
    # deposed: its election now names the new leader, whose epoch a follower knows
    leadership.is_leader, leadership.epoch, leadership.leader_address = False, 9, "b:1"
    assert cluster.send("a", AgentCommand(op_id="policy-7-1", kind="evict", block_hashes=packed(1), tier=2))
    wait(lambda: ended, "the stream's end")
    assert sent == [] and isinstance(ended[0], errors.KvcpError) and "b:1" in str(ended[0])
    requests_q.put(None)


def test_a_change_refused_by_a_replica_cut_off_from_etcd_goes_to_the_next_endpoint():
    """kvctl --endpoint a,b: a leader cut off from etcd alone refused every change
    ('etcd is unreachable', no leader named) and the client stopped there."""
    from concurrent import futures

    from cli.client import ControlPlaneClient
    from protos.grpc_errors import ERROR_KIND_METADATA_KEY
    from protos.kvcp.v1 import admin_pb2, admin_pb2_grpc
    from tests.helpers import free_port

    calls = {"cut-off": 0, "leader": 0}

    class CutOff(admin_pb2_grpc.AdminServiceServicer):
        def SetPolicy(self, request, context):
            calls["cut-off"] += 1
            context.set_trailing_metadata(((ERROR_KIND_METADATA_KEY, "EtcdUnreachable"),))
            context.abort(grpc.StatusCode.UNAVAILABLE, "etcd is unreachable; durable changes are rejected")

    class Leader(admin_pb2_grpc.AdminServiceServicer):
        def SetPolicy(self, request, context):
            calls["leader"] += 1
            return admin_pb2.Policy(values=dict(request.values))

    servers, endpoints = [], []
    for servicer in (CutOff(), Leader()):
        server = grpc.server(futures.ThreadPoolExecutor(2))
        admin_pb2_grpc.add_AdminServiceServicer_to_server(servicer, server)
        port = free_port()
        server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        servers.append(server)
        endpoints.append(f"127.0.0.1:{port}")
    try:
        with ControlPlaneClient(",".join(endpoints), timeout_seconds=5) as client:
            assert client.set_policy({"cpu.high_watermark": "0.9"})["cpu.high_watermark"] == "0.9"
        assert calls == {"cut-off": 1, "leader": 1}
    finally:
        for server in servers:
            server.stop(0)


def test_etcd_user_and_password_without_tls_to_etcd_are_refused_at_start():
    assert "need --etcd-ca" in EtcdAuth(user="root", password="x").problem()
    assert EtcdAuth(user="root", password="x", ca_file="ca.pem").problem() == ""


class _StuckRefresh:
    """A lease whose keep-alive call does not come back until released."""

    def __init__(self, lease, release: threading.Event):
        self._lease, self._release = lease, release
        self.entered = threading.Event()

    def __getattr__(self, name):
        return getattr(self._lease, name)

    def refresh(self):
        self.entered.set()
        self._release.wait(30)
        return self._lease.refresh()


def test_resign_does_not_wait_for_a_step_stuck_in_etcd(etcd):
    """A CI run hung for good in a control plane's stop: its election step sat in a lease
    refresh that never returned (etcd restarting) holding the election lock, and resign()
    waited for that lock. It revokes the lease without the lock after a TTL."""
    import time

    client = etcd_keys.connect(etcd)
    a = LeaderElection(client, "a:1", ttl_seconds=1)
    release = threading.Event()
    try:
        assert a.run_once()
        real = a._lease
        stuck = a._lease = _StuckRefresh(real, release)
        step = threading.Thread(target=a.run_once, daemon=True)
        step.start()
        assert stuck.entered.wait(5)
        started = time.monotonic()
        a.resign()
        assert time.monotonic() - started < 5
        assert not a.is_leader
        value, _ = client.get(etcd_keys.LEADER_KEY)
        assert value is None  # the lease was revoked: another replica may lead at once
        release.set()  # the stuck step comes back: a resigned replica does not stand again
        step.join(10)
        assert not step.is_alive() and not a.is_leader
        assert client.get(etcd_keys.LEADER_KEY)[0] is None
    finally:
        release.set()
        client.close()


def test_a_keep_alive_that_never_returns_is_an_outage_not_a_hang(etcd):
    """The same stuck lease refresh held the election step (and its lock) for good: the
    replica neither led nor stood again. The step gives up on it after a lease's time
    and goes on as in an etcd outage: serving from memory, then standing again."""
    import time

    client = etcd_keys.connect(etcd)
    a = LeaderElection(client, "a:1", ttl_seconds=1)
    release = threading.Event()
    try:
        assert a.run_once()
        a._lease = _StuckRefresh(a._lease, release)
        started = time.monotonic()
        leading = a.run_once()
        assert time.monotonic() - started < 5
        assert not leading and a.serving_from_memory
    finally:
        release.set()
        a.resign()
        client.close()
