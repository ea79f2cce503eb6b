"""Shared fixtures: one real etcd per session (KVCP_TEST_ETCD when CI started one; one
per pytest-xdist worker),
a clean key space per test, and an in-process control plane on port 0; and a check that
every Mooncake transfer engine the tests made was closed."""

from __future__ import annotations

import os
import uuid
import weakref

import pytest

from tests.helpers import EtcdServer, ExternalEtcd, wait_for

# ---- every Mooncake engine is closed -----------------------------------------------------
# An engine left to the garbage collector stalls the whole run: its destructor joins the
# engine's listener thread with the GIL held, in whichever later test the collection falls
# (about 100 s of a full run, before the tests that left engines open stopped their
# agents). A run that otherwise passes fails here, naming the tests that made such engines.
_engines: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # engine -> [test that made it, closed]
_engines_left_open: list[str] = []
_running = ["(collection)"]


def pytest_configure(config):
    import functools

    from agent.store.transfer_engine import MooncakeEngine

    init, close = MooncakeEngine.__init__, MooncakeEngine.close

    def freed(state: list) -> None:
        if not state[1]:
            _engines_left_open.append(f"{state[0]} (freed by the garbage collector in {_running[0]})")

    @functools.wraps(init)
    def tracked_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        _engines[self] = state = [_running[0], False]
        weakref.finalize(self, freed, state)

    @functools.wraps(close)
    def tracked_close(self):
        if self in _engines:
            _engines[self][1] = True
        close(self)

    MooncakeEngine.__init__, MooncakeEngine.close = tracked_init, tracked_close


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    _running[0] = item.nodeid


@pytest.fixture(scope="session", autouse=True)
def _every_engine_closed():
    """Fails the run (an error at the teardown of the session's last test, which reaches
    the report from a pytest-xdist worker too) when any engine was left open."""
    import gc

    yield
    _running[0] = "the final collection"
    gc.collect()
    _engines_left_open.extend(
        f"{made_in} (still open at the end)" for made_in, closed in _engines.values() if not closed
    )
    if _engines_left_open:
        pytest.fail(
            "Mooncake engines never closed: the run fails (stop the agent, or close the engine):\n"
            + "\n".join(_engines_left_open),
            pytrace=False,
        )


@pytest.fixture(scope="session")
def etcd_server():
    # tests share their etcd's key space (each clears it): under pytest-xdist (`make test`
    # runs two workers) the first worker takes the one CI started, the others start their own
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    endpoint = os.environ.get("KVCP_TEST_ETCD") if worker in ("", "gw0") else ""
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

    # a loaded machine's etcd may miss one 5 s call (a full-suite run beside other work
    # once failed a test's setup so): it is waited for, and a dead one said dead
    proc = getattr(etcd_server, "proc", None)
    if proc is not None and proc.poll() is not None:
        pytest.fail(f"the session etcd exited with {proc.returncode}; its log: {etcd_server.log_path}")
    client = connect(etcd_server.endpoint, wait_seconds=30.0, log=lambda *_: None)
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
            stats_interval_seconds=kwargs.pop("stats_interval_seconds", 0.2),
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
