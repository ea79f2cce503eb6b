"""End to end: the real `kvctl dashboard` console script in a real terminal (tmux, on
its own server socket), against the demo cluster (scripts/demo.py: etcd, control plane,
two agents and the workload, on free ports). Keys go in with send-keys; what a person
would see comes back with capture-pane."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid

import pytest

from tests.helpers import REPO, free_port, popen_for_ctrl_c, script

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (scripts/bootstrap.sh)")


def wait_for_screen(tmux, *texts: str, timeout_seconds: float = 20.0) -> str:
    deadline = time.monotonic() + timeout_seconds
    screen = ""
    while time.monotonic() < deadline:
        proc = subprocess.run([*tmux, "capture-pane", "-p", "-t", "dash"], capture_output=True, text=True)
        screen = proc.stdout
        if proc.returncode == 0 and all(t in screen for t in texts):
            return screen
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {texts} on the terminal; it shows:\n{screen}")


@pytest.fixture
def demo(tmp_path):
    port = free_port()
    argv = [
        sys.executable,
        str(REPO / "scripts" / "demo.py"),
        "--run-dir",
        str(tmp_path / "run"),
        "--etcd-port",
        str(free_port()),
        "--controlplane-port",
        str(port),
        "--agent-ports",
        str(free_port()),
        str(free_port()),
        "--controlplane-metrics-port",
        str(free_port()),
        "--agent-metrics-ports",
        str(free_port()),
        str(free_port()),
        "--duration",
        "90",
        "--rate",
        "5",  # a living cluster, without the workload competing for the two cores
    ]
    log = open(tmp_path / "demo.log", "w")  # noqa: SIM115 - closed below
    proc = popen_for_ctrl_c(argv, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while "kvcp demo cluster is up" not in (tmp_path / "demo.log").read_text():
            assert proc.poll() is None, (tmp_path / "demo.log").read_text()
            assert time.monotonic() < deadline, "the demo did not come up in 60 s"
            time.sleep(0.2)
        yield f"127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)  # the demo stops everything it started (its children die with it too)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def test_kvctl_dashboard_in_tmux_shows_the_demo_cluster(demo):
    tmux = ["tmux", "-L", f"kvcp-test-{uuid.uuid4().hex[:8]}"]
    command = f"{script('kvctl')} dashboard --endpoint {demo}"
    env = {**os.environ, "TERM": "xterm-256color"}
    subprocess.run([*tmux, "new-session", "-d", "-s", "dash", "-x", "100", "-y", "30", command], check=True, env=env)
    try:
        screen = wait_for_screen(tmux, "connected", "agent-1", "agent-2", "ready")
        assert demo in screen and "leader" in screen
        subprocess.run([*tmux, "send-keys", "-t", "dash", "e"], check=True)
        wait_for_screen(tmux, "Events", "agent_joined", "agent-1 joined")
        subprocess.run([*tmux, "send-keys", "-t", "dash", "q"], check=True)
        deadline = time.monotonic() + 10
        while subprocess.run([*tmux, "has-session", "-t", "dash"], capture_output=True).returncode == 0:
            assert time.monotonic() < deadline, "the dashboard did not exit on q"
            time.sleep(0.2)
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)
