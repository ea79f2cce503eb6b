"""`kvcp-bench chaos` as a user runs it: a short run serves no wrong KV, loses no pin,
leaves no tier move or drain it accepted unfinished, loses no pinned block a clean drain
handed off, and Ctrl-C in the middle leaves none of the processes it started behind."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import popen_for_ctrl_c, script, wait_for


def processes_using(endpoint: str) -> list[int]:
    """Pids whose command line names this etcd endpoint (etcd itself, control planes, agents)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if endpoint in cmdline:
                pids.append(int(entry.name))
    return pids


@pytest.mark.slow  # about a minute of load and faults, plus startup
@pytest.mark.timeout(600)
def test_a_short_chaos_run_serves_no_wrong_kv_loses_no_pin_and_ends_every_operation(tmp_path):
    run = subprocess.run(
        [script("kvcp-bench"), "chaos", "--seconds", "40", "-o", "json", "--log-dir", str(tmp_path / "logs")],
        capture_output=True,
        text=True,
        timeout=580,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout)
    assert result["wrong_kv_served"] == 0
    assert result["pins_lost"] == 0
    assert result["requests"] > 0 and result["served"] > 0
    # tier moves across the faults: every one the control plane accepted ended, a failed
    # one with its reason
    assert result["ops_unfinished"] == 0, result["stats"]["ops_unfinished_op_ids"]
    assert result["ops_started"] > 0
    assert result["ops_succeeded"] + result["ops_failed"] == result["ops_started"]
    assert result["ops_refused"] == sum(result["ops_refused_codes"].values())
    assert result["ops_failed"] == sum(result["ops_failed_errors"].values())
    assert not any("(no reason given)" in why for why in result["ops_failed_errors"]), result["ops_failed_errors"]
    # drains across the faults: every one accepted ended, and a clean one lost no pinned marker
    assert result["drains_unfinished"] == 0, result["stats"]["drains_unfinished_op_ids"]
    assert result["drains_succeeded"] + result["drains_failed"] == result["drains_started"]
    assert result["drain_blocks_lost"] == 0, result["stats"]["drains"]
    assert result["stats"]["drains_uncordon_failed"] == 0
    faults = {f["fault"]: f for f in result["faults"]}
    expected = {
        "agent_sigkill",
        "leader_sigkill",
        "leader_sigstop",
        "etcd_sigstop_10s",
        "etcd_sigkill_15s",
        "handoff_kill",
    }
    assert expected <= set(faults)
    endpoint = re.search(r"etcd at (\S+);", run.stderr).group(1)
    assert processes_using(endpoint) == []


@pytest.mark.timeout(300)
def test_ctrl_c_stops_every_process_it_started(tmp_path):
    proc = popen_for_ctrl_c(
        [script("kvcp-bench"), "chaos", "--seconds", "120", "--log-dir", str(tmp_path / "logs")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            lines.append(line)
            if "load started" in line or not line:
                break
        endpoint = re.search(r"etcd at (\S+);", "".join(lines)).group(1)
        assert len(processes_using(endpoint)) == 6, "".join(lines)  # etcd, 2 control planes, 3 agents
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 130
        wait_for(lambda: processes_using(endpoint) == [], 10, 0.2, "no process of the run left")
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
