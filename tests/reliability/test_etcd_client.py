"""A slow or restarted etcd, with real processes: an etcd paused (SIGSTOP) just long
enough for one call of a kvcp etcd client to time out, then resumed; or restarted.

pyetcd's client (`protos.etcd_keys.connect`) then refuses every call for a second (a
circuit breaker that keeps a paused etcd from costing a timeout per call). Changes a person
asks for in that second are asked again by the client facade (kvctl, dashboard) instead of
failing; a watch opened before goes on; and the control plane's membership watch, ended by
an etcd restart, is made again."""

from __future__ import annotations

import contextlib
import queue
import signal
import threading
import time
import urllib.request

import pytest

from cli.client import ControlPlaneClient
from protos import etcd_keys
from tests.helpers import EtcdServer, wait_for


@pytest.fixture
def pausable_etcd():
    server = EtcdServer().start()
    try:
        yield server
    finally:
        if server.proc.poll() is None:
            server.proc.send_signal(signal.SIGCONT)
        server.stop()
        server.cleanup()


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def _one_call_times_out(server: EtcdServer, client) -> None:
    server.proc.send_signal(signal.SIGSTOP)
    wait_for(lambda: _stopped(server.proc.pid), 5, 0.01, "etcd stopped")
    try:
        with pytest.raises(Exception) as info:
            client.get("/kvcp-test/probe")
        assert "Timeout" in type(info.value).__name__, repr(info.value)
    finally:
        server.proc.send_signal(signal.SIGCONT)


def test_a_watch_keeps_delivering_after_another_call_timed_out(pausable_etcd):
    client = etcd_keys.connect(pausable_etcd.endpoint, timeout_seconds=0.5)
    got: queue.Queue = queue.Queue()
    try:
        client.add_watch_prefix_callback("/kvcp-test/w/", got.put)
        _one_call_times_out(pausable_etcd, client)
        with pytest.raises(ValueError, match="failed node"):  # the breaker: refused for a second
            client.put("/kvcp-test/w/a", b"0")
        time.sleep(1.5)  # past the breaker
        client.put("/kvcp-test/w/a", b"1")
        response = got.get(timeout=10)
        assert response is not None and not isinstance(response, Exception), response
        assert [e.key for e in response.events] == [b"/kvcp-test/w/a"]
    finally:
        client.close()


def test_changes_asked_right_after_a_slow_etcd_answer_go_through(pausable_etcd):
    from agent.server import Agent, AgentConfig
    from controlplane.server import ControlPlane, ControlPlaneConfig
    from controlplane.store.locks import EtcdLock

    cfg = ControlPlaneConfig(
        listen="127.0.0.1:0",
        etcd=pausable_etcd.endpoint,
        etcd_timeout_seconds=0.5,
        election_ttl_seconds=10,  # a 0.5 s pause does not put the leadership at risk
        metrics_listen="",
    )
    cp = ControlPlane(cfg).start()
    agent = Agent(AgentConfig("hiccup-agent", listen="127.0.0.1:0", etcd=pausable_etcd.endpoint, metrics_listen=""))
    agent.start()
    holder = EtcdLock(etcd_keys.connect(pausable_etcd.endpoint), "cleanup/hiccup", "someone-else")
    try:
        assert holder.try_acquire()
        with ControlPlaneClient(cp.address) as client:
            wait_for(lambda: client.list_agents(), 10, 0.1, "the agent registered")
            op = client.cleanup(0, namespace="hiccup")  # waits for the lock: PENDING
            pin = client.pin(namespace="hiccup", ttl_seconds=600)
            _one_call_times_out(pausable_etcd, cp.etcd)  # the control plane's own client
            assert client.cancel_operation(op.op_id).state in ("CANCELLED", "PENDING")
            assert client.unpin(pin.pin_id).pin_id == pin.pin_id
            _one_call_times_out(pausable_etcd, cp.etcd)
            assert client.set_policy({"gpu.high_watermark": "0.93"})["gpu.high_watermark"] == "0.93"
            wait_for(lambda: client.get_operation(op.op_id).state == "CANCELLED", 10, 0.1, "cancelled")
            assert client.list_pins(namespace="hiccup") == []
    finally:
        holder.release()
        agent.stop()
        cp.stop()


def test_the_membership_watch_comes_back_after_an_etcd_restart(pausable_etcd):
    """A restarted etcd ends every watch stream; the control plane's membership watch is
    made again at its next resync, so an agent whose key goes is seen at once, not at the
    next full listing."""
    import threading

    from controlplane.core.cluster import AgentRecord, Cluster
    from controlplane.store.membership import MembershipWatcher

    client = etcd_keys.connect(pausable_etcd.endpoint, timeout_seconds=2.0)
    cluster = Cluster()
    cluster.register(AgentRecord("m-a", "127.0.0.1:1", [], []))
    client.put(etcd_keys.AGENTS_PREFIX + "m-a", b"{}")
    watcher = MembershipWatcher(client, cluster, resync_seconds=0.3)
    stop = threading.Event()
    loop = threading.Thread(target=watcher.run_forever, args=(stop,), daemon=True)
    loop.start()
    try:
        wait_for(lambda: watcher._watch_id is not None, 10, 0.05, "the membership watch")
        pausable_etcd.stop()
        pausable_etcd.start()
        time.sleep(2.0)  # a few resyncs against the etcd that is back
        watcher.resync_seconds = 60.0  # from here on only the watch can tell
        time.sleep(0.5)
        client.delete(etcd_keys.AGENTS_PREFIX + "m-a")
        wait_for(lambda: "m-a" not in {r.agent_id for r, _ in cluster.agents()}, 10, 0.1, "the agent dropped")
    finally:
        stop.set()
        client.close()


def test_a_client_is_back_within_a_second_or_two_of_an_etcd_back_from_a_long_outage(pausable_etcd):
    """gRPC's default reconnect backoff grows with the outage (1 s, x1.6 a try): after
    18 s down the control plane's client got etcd back 6-8 s after it answered again,
    refusing writes and losing its leadership meanwhile. Reconnects are at most 1 s
    apart: here it is back within 2 s of the restarted etcd answering a fresh client."""
    client = etcd_keys.connect(pausable_etcd.endpoint, timeout_seconds=2.0)
    try:
        client.put("/kvcp-test/x", b"1")
        pausable_etcd.stop()
        down_until = time.monotonic() + 18.0
        while time.monotonic() < down_until:  # calls keep failing, as a control plane's would
            with contextlib.suppress(Exception):  # etcd is down: any failure will do
                client.get("/kvcp-test/x")
            time.sleep(0.2)
        healthy: list[float] = []

        def watch_health() -> None:  # when etcd answers, as seen by HTTP, not by a gRPC client
            url = f"http://{pausable_etcd.endpoint}/health"
            while not healthy:
                try:
                    with urllib.request.urlopen(url, timeout=1) as r:
                        if b'"true"' in r.read():
                            healthy.append(time.monotonic())
                except OSError:
                    time.sleep(0.05)

        probe = threading.Thread(target=watch_health, daemon=True)
        probe.start()
        pausable_etcd.start()
        probe.join(30)
        answered = healthy[0]

        def back() -> bool:
            try:
                return client.get("/kvcp-test/x")[0] == b"1"
            except Exception:  # noqa: BLE001 - not yet
                return False

        wait_for(back, 30, 0.05, "the old client back")
        assert time.monotonic() - answered < 2.0
    finally:
        client.close()
