"""`make demo` stops what a killed earlier demo left running, found by its pid files,
and nothing else: a pid the kernel has given to another program since is left alone."""

from __future__ import annotations

import importlib.util
import subprocess
import time
from pathlib import Path

import pytest

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
