"""`make demo` stops what a killed earlier demo left running, found by its pid files,
and nothing else: a pid the kernel has given to another program since is left alone."""

from __future__ import annotations

import importlib.util
import subprocess
import time
from pathlib import Path

import pytest

from benchmarks.etcd import free_ports

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def demo_module():
    spec = importlib.util.spec_from_file_location("kvcp_demo_script", REPO / "scripts" / "demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cleaner(demo_module, run_dir: Path):
    d = demo_module.Demo.__new__(demo_module.Demo)  # only the pid-file part: no cluster
    d.run_dir, d.pids, d.say = run_dir, run_dir / "pids", lambda msg: None
    d.pids.mkdir(parents=True)
    return d


def test_only_the_process_a_pid_file_names_is_stopped(demo_module, tmp_path):
    # a program whose name says etcd and kvcp, on a pid a stale file names
    other = subprocess.Popen(["bash", "-c", "exec -a kvcp-etcd-of-someone-else sleep 60"], start_new_session=True)
    try:
        time.sleep(0.1)
        d = _cleaner(demo_module, tmp_path)
        (d.pids / "etcd.pid").write_text(f"{other.pid} 1")  # started at another time: the pid was reused
        (d.pids / "agent-1.pid").write_text(f"{other.pid}")  # a file that names no start time
        d.clean_stale()
        time.sleep(0.2)
        assert other.poll() is None and not list(d.pids.iterdir())
        (d.pids / "etcd.pid").write_text(f"{other.pid} {demo_module._start_time(other.pid)}")  # that very process
        d.clean_stale()
        assert other.wait(10) is not None and not list(d.pids.iterdir())
    finally:
        other.kill()
        other.wait()


def test_a_taken_etcd_port_is_named_as_given(demo_module):
    """`--etcd-port P` taken: the demo says P is taken (it said 2379 whatever was asked)."""
    import argparse
    import socket

    said: list[str] = []
    d = demo_module.Demo.__new__(demo_module.Demo)  # only the port checks: no cluster
    d.say = said.append
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        cp, a1, a2, m0, m1, m2 = free_ports(6)
        d.args = argparse.Namespace(
            etcd_port=taken,
            controlplane_port=cp,
            agent_ports=[a1, a2],
            controlplane_metrics_port=m0,
            agent_metrics_ports=[m1, m2],
        )
        d.check_ports()
    assert d.args.etcd_port != taken
    assert said == [f"demo: port {taken} is taken, using {d.args.etcd_port} for the demo's etcd"]


def test_a_killed_agent_is_started_again_and_the_demo_serves_on(tmp_path):
    import os
    import signal
    import sys

    from cli.client import ControlPlaneClient
    from tests.helpers import wait_for

    etcd, cp, a1, a2, m0, m1, m2 = free_ports(7)
    run_dir = tmp_path / "run"
    out = open(tmp_path / "demo.out", "w")  # noqa: SIM115 - the demo's output, read below
    demo = subprocess.Popen(
        [sys.executable, str(REPO / "scripts" / "demo.py"), "--run-dir", str(run_dir), "--rate", "0"]
        + ["--etcd-port", str(etcd), "--controlplane-port", str(cp), "--agent-ports", str(a1), str(a2)]
        + ["--controlplane-metrics-port", str(m0), "--agent-metrics-ports", str(m1), str(m2)],
        stdout=out,
        stderr=subprocess.STDOUT,
        cwd=REPO,
    )
    said = lambda: (tmp_path / "demo.out").read_text()  # noqa: E731
    try:
        wait_for(lambda: "demo cluster is up" in said(), timeout_seconds=60, what=f"demo up: {said()}")
        first = int((run_dir / "pids" / "agent-2.pid").read_text().split()[0])
        os.kill(first, signal.SIGKILL)
        wait_for(lambda: "agent-2 killed by signal 9" in said(), timeout_seconds=10, what=f"restart: {said()}")
        assert demo.poll() is None, said()
        with ControlPlaneClient(f"127.0.0.1:{cp}") as c:
            wait_for(
                lambda: sorted(a.agent_id for a in c.list_agents() if a.state == "ready") == ["agent-1", "agent-2"],
                timeout_seconds=30,
                what="agent-2 ready again",
            )
        again = int((run_dir / "pids" / "agent-2.pid").read_text().split()[0])
        assert again != first and demo.poll() is None
    finally:
        demo.send_signal(signal.SIGTERM)
        assert demo.wait(30) == 0, said()
        out.close()
    assert "stopped 4 processes" in said()
