"""AdminService.Watch against a real control plane, etcd and agents: replay, live events,
filtering, and a client that goes away frees its server thread at once."""

from __future__ import annotations

import threading

import pytest

from cli.client import ClientError, ControlPlaneClient
from tests.helpers import wait_for


def _collect(client: ControlPlaneClient, out: list, **kwargs) -> threading.Thread:
    def run():
        try:
            for e in client.watch(**kwargs):
                out.append(e)
        except ClientError as exc:
            out.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_watch_replays_and_streams_membership_events(controlplane, make_agent):
    first = make_agent("agent-w1")
    wait_for(lambda: any(e.kind == "agent_state" for e in controlplane.cluster.events.recent()), what="agent ready")
    client = ControlPlaneClient(controlplane.address)
    got: list = []
    t = _collect(client, got, replay_recent=True)
    wait_for(lambda: any(getattr(e, "kind", "") == "agent_joined" for e in got), what="replayed join")
    assert got[0].seq == 1  # replayed from the first event
    assert any(e.kind == "leader" and "leads (epoch" in e.message for e in got)  # the replica loaded its state
    assert next(e for e in got if e.kind == "agent_joined").agent_id == first.config.agent_id
    make_agent("agent-w2")
    wait_for(
        lambda: any(getattr(e, "agent_id", "") == "agent-w2" and e.message.endswith("blocks)") for e in got),
        what="agent-w2 ready, live",
    )
    seqs = [e.seq for e in got]
    assert seqs == sorted(set(seqs))

    # the client goes: the server's subscription (and worker thread) go with it
    assert controlplane.cluster.events.num_subscribers == 1
    client.close()
    t.join(5)
    assert not t.is_alive()
    wait_for(lambda: controlplane.cluster.events.num_subscribers == 0, timeout_seconds=3, what="subscription closed")


def test_watch_filters_by_kind_and_sees_notices(controlplane, make_agent):
    client = ControlPlaneClient(controlplane.address)
    got: list = []
    _collect(client, got, kinds=("agent_joined", "notice"), replay_recent=False)
    wait_for(lambda: controlplane.cluster.events.num_subscribers == 1, what="subscribed")
    agent = make_agent("agent-n1")
    wait_for(lambda: any(getattr(e, "kind", "") == "agent_joined" for e in got), 30, what="join")
    agent.pool._notice("corrupt_block", "block abc in the cpu tier is unreadable (test); removed")
    wait_for(lambda: any(getattr(e, "kind", "") == "notice" for e in got), what="notice", timeout_seconds=10)
    notice = next(e for e in got if e.kind == "notice")
    assert notice.severity == "warning" and notice.agent_id == "agent-n1" and "corrupt_block" in notice.message
    assert {e.kind for e in got} <= {"agent_joined", "notice"}
    client.close()


def test_watch_ends_when_the_server_stops(controlplane):
    client = ControlPlaneClient(controlplane.address)
    got: list = []
    t = _collect(client, got)
    wait_for(lambda: controlplane.cluster.events.num_subscribers == 1, what="subscribed")
    controlplane.stop(grace_seconds=0.2)
    t.join(5)
    assert not t.is_alive() and isinstance(got[-1], ClientError)
    client.close()


def test_event_streams_past_the_limit_are_refused_not_queued(controlplane, make_agent):
    """Each Watch holds a server thread: past max_watch_streams new ones are refused
    (RESOURCE_EXHAUSTED), so watchers cannot take the threads agents and calls need."""
    import grpc

    from protos.kvcp.v1 import admin_pb2, admin_pb2_grpc

    make_agent("w-cap")  # its joining is an event every stream replays first
    admin = controlplane.admin
    admin.max_watch_streams = 2
    channel = grpc.insecure_channel(controlplane.address)
    stub = admin_pb2_grpc.AdminServiceStub(channel)
    streams = [stub.Watch(admin_pb2.WatchRequest(replay_recent=True)) for _ in range(2)]
    try:
        for s in streams:  # both open: each has its first (replayed) event
            next(iter(s))
        with pytest.raises(grpc.RpcError) as err:
            next(iter(stub.Watch(admin_pb2.WatchRequest(replay_recent=True))))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        with ControlPlaneClient(controlplane.address) as c:  # calls go on meanwhile
            assert c.stats() is not None
        streams[0].cancel()
        wait_for(lambda: admin._watch_streams < 2, 5, 0.05, "a slot freed")
        assert next(iter(stub.Watch(admin_pb2.WatchRequest(replay_recent=True)))) is not None
    finally:
        for s in streams:
            s.cancel()
        channel.close()
