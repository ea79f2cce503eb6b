"""The dashboard driven by Pilot against a real control plane, real agents and a real
etcd: every screen, a pin created from the form and removed with a confirmation, an
operation cancelled, and a control-plane restart seen as "reconnecting" then recovered.

Pins and operations are being built on the control plane; where it still answers
UNIMPLEMENTED those tests skip (checked at run time, against the real server)."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from agent.server import DEMO_MODEL
from cli.client import ClientError, ControlPlaneClient
from dashboard.app import DashboardApp
from dashboard.screens import AgentScreen, ClusterScreen, EventsScreen, HelpScreen, OperationsScreen, PinsScreen
from tests.dashboard.screen import screen_text
from tests.helpers import free_port, wait_for

M = DEMO_MODEL
BS = M.block_size
SIZE = (80, 24)


def kv(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn((n, *M.block_shape), generator=torch.Generator().manual_seed(seed)).to(torch.float16)


def tokens(n_blocks: int, start: int = 0) -> list[int]:
    return list(range(start, start + n_blocks * BS))


async def until(pilot, predicate, what: str, timeout_seconds: float = 30.0) -> None:
    """Let the app run until `predicate()` holds; fail showing the screen."""
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        if predicate():
            return
        await pilot.pause(0.05)
    raise AssertionError(f"timed out after {timeout_seconds}s waiting for {what}; screen:\n{screen_text(pilot.app)}")


def on_screen(pilot, *texts: str):
    return lambda: all(t in screen_text(pilot.app) for t in texts)


def skip_if_unimplemented(call) -> None:
    """Skip when the real server does not serve this call yet (and only then)."""
    try:
        call()
    except ClientError as exc:
        if exc.code == "UNIMPLEMENTED":
            pytest.skip(f"the control plane answers UNIMPLEMENTED: {exc}")
        raise


@pytest.fixture
def controlplane(etcd):
    """As the shared fixture, with leases long enough that a loaded CI machine stalling the
    test process for a few seconds does not hand leadership over mid-scenario (these tests
    are about the screens; failover has its own tests)."""
    from controlplane.server import ControlPlane, ControlPlaneConfig

    cfg = ControlPlaneConfig(listen="127.0.0.1:0", etcd=etcd, election_ttl_seconds=10, membership_resync_seconds=0.5)
    cp = ControlPlane(cfg).start()
    yield cp
    cp.stop()


@pytest.fixture
def cluster(controlplane, make_agent):
    a1 = make_agent("dash-a1", lease_ttl_seconds=10)
    a2 = make_agent("dash-a2", lease_ttl_seconds=10)
    a1.engine.store(M.model_id, tokens(4), kv(4), namespace="dash-kb")
    a2.engine.store(M.model_id, tokens(2, start=5000), kv(2, seed=1))
    with ControlPlaneClient(controlplane.address) as c:
        wait_for(
            lambda: {a.agent_id: a.num_blocks for a in c.list_agents()} == {"dash-a1": 4, "dash-a2": 2},
            30,
            what="both agents indexed",
        )
        c.lookup(M.model_id, tokens(4))
    return controlplane


def test_every_screen_against_a_live_cluster(cluster):
    async def scenario():
        app = DashboardApp(cluster.address, refresh_seconds=0.5)
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, on_screen(pilot, "connected", "dash-a1", "dash-a2", "leader"), "agents on Cluster")
            assert isinstance(app.screen, ClusterScreen)
            assert "etcd ok" in screen_text(app)
            await until(pilot, lambda: len(app.state.samples) >= 2, "two stats samples")

            await pilot.press("enter")  # the first row: dash-a1
            assert isinstance(app.screen, AgentScreen) and app.screen.agent_id == "dash-a1"
            await until(pilot, on_screen(pilot, "Tiers", "cpu", "demo-model", "joined from"), "agent detail")
            await pilot.press("escape")
            assert isinstance(app.screen, ClusterScreen)

            await pilot.press("p")
            assert isinstance(app.screen, PinsScreen)
            await until(pilot, lambda: app.state.pins_feature.available is not None, "pins asked")
            expected = "no pins" if app.state.pins_feature.available else "not available on this control plane"
            await until(pilot, on_screen(pilot, expected), "pins screen")

            await pilot.press("o")
            assert isinstance(app.screen, OperationsScreen)
            await until(pilot, lambda: app.state.operations_feature.available is not None, "operations asked")
            expected = "no operations" if app.state.operations_feature.available else "not available"
            await until(pilot, on_screen(pilot, expected), "operations screen")

            await pilot.press("e")
            assert isinstance(app.screen, EventsScreen)
            await until(pilot, on_screen(pilot, "agent_joined", "dash-a1 joined", "dash-a2 joined"), "event log")
            await pilot.press("slash", *"a2")
            await until(pilot, lambda: "dash-a1 joined" not in screen_text(app), "filter applied")
            assert "dash-a2 joined" in screen_text(app)
            await pilot.press("enter", "escape")  # back to the log, then clear the filter
            await until(pilot, on_screen(pilot, "dash-a1 joined"), "filter cleared")

            await pilot.press("question_mark")
            assert isinstance(app.screen, HelpScreen)
            assert "Screens" in screen_text(app)
            await pilot.press("escape")
            await pilot.press("c")
            assert isinstance(app.screen, ClusterScreen)

    asyncio.run(scenario())


def test_pin_from_the_form_then_unpin_with_confirmation(cluster):
    client = ControlPlaneClient(cluster.address)
    skip_if_unimplemented(client.list_pins)

    async def scenario():
        app = DashboardApp(cluster.address, refresh_seconds=0.5)
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, on_screen(pilot, "dash-a1"), "cluster")
            await pilot.press("p")
            await until(pilot, on_screen(pilot, "no pins"), "empty pins")
            await pilot.press("n")
            await pilot.pause()
            # namespace (typed), model and tokens (empty: the whole namespace), tier select, ttl
            await pilot.press(*"dash-kb", "tab")
            await pilot.press("tab", "tab", "tab", "ctrl+a", "ctrl+k", *"600", "enter")
            await until(pilot, lambda: len(app.state.pins) == 1, "the pin listed")
            await until(pilot, on_screen(pilot, "dash-kb", "namespace", "cpu"), "the pin on screen")
            (pin,) = client.list_pins()
            assert pin.namespace == "dash-kb" and pin.whole_namespace and 590 < pin.ttl_left_seconds(time.time()) <= 600
            # the Watch stream's event may trail the listing
            await until(pilot, lambda: any(e.kind == "pin_created" for e in app.state.events), "pin_created event")

            await pilot.press("d")
            await until(pilot, on_screen(pilot, "Unpin dash-kb/"), "confirmation")
            await pilot.press("y")
            await until(pilot, on_screen(pilot, "no pins"), "pin gone from the screen")
            assert client.list_pins() == []

    try:
        asyncio.run(scenario())
    finally:
        client.close()


def test_cancel_an_operation_with_confirmation(cluster, etcd):
    from controlplane.store.locks import EtcdLock
    from protos import etcd_keys

    client = ControlPlaneClient(cluster.address)
    skip_if_unimplemented(client.list_operations)
    # another cleanup of the namespace holds its lock: ours waits, PENDING, until cancelled
    holder = EtcdLock(etcd_keys.connect(etcd), "cleanup/dash-kb", "someone-else")
    assert holder.try_acquire()
    op = client.cleanup(0, namespace="dash-kb")

    async def scenario():
        app = DashboardApp(cluster.address, refresh_seconds=0.5)
        async with app.run_test(size=SIZE) as pilot:
            await pilot.press("o")
            await until(pilot, on_screen(pilot, "cleanup", "PENDING"), "the pending cleanup")
            await pilot.press("x")
            await until(pilot, on_screen(pilot, f"Cancel cleanup {op.op_id}?"), "confirmation")
            await pilot.press("y")
            await until(pilot, on_screen(pilot, "CANCELLED"), "cancelled on screen")
            assert client.get_operation(op.op_id).state == "CANCELLED"

    try:
        asyncio.run(scenario())
    finally:
        holder.release()
        client.close()


def test_survives_a_controlplane_restart(etcd, make_agent):
    from controlplane.server import ControlPlane, ControlPlaneConfig

    port = free_port()

    def start() -> ControlPlane:
        cfg = ControlPlaneConfig(
            listen=f"127.0.0.1:{port}", etcd=etcd, election_ttl_seconds=3, membership_resync_seconds=0.5
        )
        return ControlPlane(cfg).start()

    cp = start()
    make_agent("dash-r1")
    try:

        async def scenario():
            nonlocal cp
            app = DashboardApp(cp.address, refresh_seconds=0.5)
            async with app.run_test(size=SIZE) as pilot:
                await until(pilot, on_screen(pilot, "connected", "dash-r1", "ready"), "agent on screen")
                cp.stop(grace_seconds=0.2)
                await until(pilot, on_screen(pilot, "reconnecting"), "reconnecting", timeout_seconds=20)
                cp = start()
                await until(pilot, on_screen(pilot, "● connected"), "connected again", timeout_seconds=40)
                # the agent finds the new leader and resyncs; the new stream says so
                await until(
                    pilot,
                    lambda: app.state.agent("dash-r1") is not None and app.state.agent("dash-r1").state == "ready",
                    "agent back",
                    timeout_seconds=40,
                )
                # events of both control planes reach the log (each numbers its own from 1);
                # the new stream's may come after the agent shows ready
                await until(
                    pilot,
                    lambda: [e.seq for e in app.state.events].count(1) >= 2,
                    "events of both control planes",
                    timeout_seconds=20,
                )

        asyncio.run(scenario())
    finally:
        cp.stop()


def test_live_events_through_a_follower_endpoint(cluster, etcd):
    """Given a follower's address, the unary calls follow it to the leader; the event
    stream must too (a follower answers Watch with FAILED_PRECONDITION and the leader)."""
    import threading

    from controlplane.server import ControlPlane, ControlPlaneConfig

    cfg = ControlPlaneConfig(listen="127.0.0.1:0", etcd=etcd, election_ttl_seconds=10)
    follower = ControlPlane(cfg).start()
    try:
        assert not follower.election.is_leader and follower.election.leader_address == cluster.address
        # the facade alone: the first replayed event arrives through the leader
        got: list = []
        client = ControlPlaneClient(follower.address)
        reader = threading.Thread(target=lambda: got.append(next(iter(client.watch()))), daemon=True)
        reader.start()
        reader.join(20)
        client.close()
        assert got and got[0].kind and client.endpoint == cluster.address

        async def scenario():
            app = DashboardApp(follower.address, refresh_seconds=0.5)
            async with app.run_test(size=SIZE) as pilot:
                await until(pilot, on_screen(pilot, "connected", "dash-a1"), "agents through the follower")
                await until(
                    pilot,
                    lambda: any(e.kind == "agent_joined" for e in app.state.events) and app.state.watch_available,
                    "live events through the follower",
                )

        asyncio.run(scenario())
    finally:
        follower.stop()


def test_refresh_and_watch_go_on_after_a_client_cannot_be_made(cluster):
    """Making a client can fail with something other than ClientError (kvctl's factory
    reads the TLS files); the top line says why, and once it works again the refresh and
    the event stream both resume (neither worker may stop for good)."""
    import threading

    failing = threading.Event()
    failing.set()

    def connect() -> ControlPlaneClient:
        if failing.is_set():
            raise ValueError("cannot read /etc/kvcp/ca.pem: No such file or directory")
        return ControlPlaneClient(cluster.address)

    async def scenario():
        app = DashboardApp(cluster.address, refresh_seconds=0.5, connect=connect)
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: "ca.pem" in app.state.connection_detail, "the error on the top line")
            await pilot.pause(1.0)  # a few more failed refreshes and watch attempts
            failing.clear()
            await until(pilot, on_screen(pilot, "● connected", "dash-a1", "dash-a2"), "refreshed again")
            await until(pilot, lambda: any(e.kind == "agent_joined" for e in app.state.events), "live events again")

    asyncio.run(scenario())


def test_a_hung_replica_listed_first_is_left_for_the_next(controlplane):
    """A replica that takes connections and never answers (a SIGSTOPped leader) listed first
    in --endpoint: the client moves on to the next replica after its deadline, and the
    dashboard keeps that move; it used to make each new client start at the hung replica
    again, and said 'reconnecting' for as long as it hung while the next one led."""
    import socket

    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(16)  # accepted by the kernel, never read: no HTTP/2 answer
    endpoint = f"127.0.0.1:{hung.getsockname()[1]},{controlplane.address}"

    async def scenario():
        app = DashboardApp(endpoint, timeout_seconds=1.0, refresh_seconds=0.5)
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, on_screen(pilot, "● connected", "leader"), "the replica that answers", 15)

    try:
        asyncio.run(scenario())
    finally:
        hung.close()
